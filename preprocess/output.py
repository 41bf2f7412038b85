"""A build's output before any shard is written: what it may hold, and what build it is.

Run first by the driver (`preprocess.job`) and by the dry run: refuse an output that
holds something other than a build, write `_build/config.json` (the record every
rerun is compared with, field by field), clear a build for `--overwrite`.

Layout: a new build puts its shards where `BuildConfig.layout` says
(`shards.manifest.LAYOUTS`; `DEFAULT_LAYOUT`, by format, when not given); a rerun
without one keeps the layout its build started with, recorded in `_build/config.json`
(a record without one is a flat build).
"""

from __future__ import annotations

import json

from preprocess.build import BUILD_DIR
from preprocess.config import BuildConfig, diff_configs
from preprocess.plan import PLAN_VERSION, Plan
from preprocess.ray_job import BuildError
from shards.clients import is_client_file
from shards.formats import FORMATS
from shards.manifest import LAYOUT_BY_FORMAT, LAYOUT_FLAT, MANIFEST_NAME
from shards.storage import is_remote
from shards.storage.write import OutputStore

ERRORS_NAME = "errors.jsonl"
CONFIG_NAME = "config.json"
PLAN_NAME = f"{BUILD_DIR}/plan"  # the plan files of a local output, while it is built
# The layout of a new build when none is asked for: a directory per format, which
# dataframe tools and HF datasets open by path (see docs/SHARDS.md, "Layout").
DEFAULT_LAYOUT = LAYOUT_BY_FORMAT


def check_output(store: OutputStore, config: BuildConfig) -> None:
    """Refuse, before anything is written, an output that holds something other than a build.

    An output holding only plan files (a `--dry-run`, or planning cut short) is free.
    """
    if store.info(f"{BUILD_DIR}/{CONFIG_NAME}") is not None or store.is_empty():
        return
    names = store.list()
    if all(name.startswith(f"{PLAN_NAME}/") for name in names):
        return
    if config.overwrite:
        if MANIFEST_NAME in names or any(n.startswith(f"{BUILD_DIR}/") for n in names):
            return
        raise BuildError(f"{store.url} holds no shard build; refusing to clear it for --overwrite")
    raise BuildError(f"{store.url} is not empty and holds no shard build; choose an empty --output")


def build_record(config: BuildConfig, plan: Plan, layout: str = LAYOUT_FLAT) -> dict:
    """`_build/config.json`: what this build is, compared by every rerun.

    `layout` is kept apart from `config`: records written before it existed are of
    flat builds, and compare equal to a flat build's config.
    """
    return {
        "config": config.output_shaping(),
        "plan_digest": plan.digest,
        "plan_version": PLAN_VERSION,
        "inputs": plan.inputs,
        "layout": layout,
    }


def record_layout(record: dict) -> str:
    """The layout a build record names; flat for records written before layouts."""
    return record.get("layout", LAYOUT_FLAT)


def read_build_record(store: OutputStore) -> dict | None:
    """The record of the build the output holds (`_build/config.json`); None for a new output."""
    try:
        return json.loads(store.read_bytes(f"{BUILD_DIR}/{CONFIG_NAME}").decode("utf-8"))
    except FileNotFoundError:
        return None


def record_changes(previous: dict, record: dict) -> list[str]:
    """What differs between the build in the output and this one, field by field."""
    changes = diff_configs(previous["config"], record["config"])
    # Records without a version are of builds made before the streaming plan.
    version = previous.get("plan_version", 1)
    if version != record["plan_version"]:
        changes.append(
            f"plan version: {version} -> {record['plan_version']} (this version assigns "
            "samples to shards by a keyed hash of their keys, so a build started by an "
            "older version cannot be resumed; rebuild it with --overwrite)"
        )
    elif previous["plan_digest"] != record["plan_digest"]:
        changes.append(
            f"inputs: {previous['inputs']} files -> {record['inputs']} files (or their paths, labels or splits changed)"
        )
    return changes


def prepare_output(store: OutputStore, config: BuildConfig, plan: Plan) -> str:
    """Check the output (see `check_output`), record what this build is; its layout.

    `config.layout` None keeps the layout of the build in the output, else
    `DEFAULT_LAYOUT`.
    """
    layout = config.layout  # checked by `BuildConfig`
    if config.overwrite:
        clear_build_output(store)
    previous = read_build_record(store)
    if previous is not None and layout is not None and record_layout(previous) != layout:
        raise BuildError(
            f"{store.url} holds a {record_layout(previous)} build and this one asks for "
            f"the {layout} layout; rerun without --layout to resume it, pass "
            "--overwrite to rebuild it, or choose another --output"
        )
    if previous is not None:
        layout = record_layout(previous)
    layout = layout or DEFAULT_LAYOUT
    record = build_record(config, plan, layout)
    if previous is not None:
        changes = record_changes(previous, record)
        if changes:
            older = previous.get("plan_version", 1) != PLAN_VERSION
            raise BuildError(
                f"{store.url} holds a build with other options:\n  "
                + "\n  ".join(changes)
                + (
                    "\nIt cannot be resumed by this version: pass --overwrite to rebuild it, "
                    "or choose another --output."
                    if older
                    else "\nRerun with the original options to resume it, pass --overwrite to "
                    "rebuild, or choose another --output."
                )
            )
    store.remove_stale_temps()
    if previous is None:
        data = json.dumps(record, indent=1, sort_keys=True).encode()
        store.write_bytes_atomic(f"{BUILD_DIR}/{CONFIG_NAME}", data)
    return layout


def clear_build_output(store: OutputStore) -> None:
    """Remove what a build writes (and nothing else) before `--overwrite`; keep this plan."""
    names = store.list()
    store.remove(MANIFEST_NAME)
    store.remove(ERRORS_NAME)
    if is_remote(store.url):
        store.remove_tree(BUILD_DIR)  # the plan of an object-store output is not in it
    for name in names:
        inside = name.startswith(f"{BUILD_DIR}/") and not name.startswith(f"{PLAN_NAME}/")
        if inside or is_shard_file(name) or is_client_file(name):
            store.remove(name)


def is_shard_file(name: str) -> bool:
    """A shard file of either layout: `train-000000.tar` or `tar/train-000000.tar`."""
    directory, _, base = name.rpartition("/")
    for fmt in FORMATS.values():
        if base.endswith(fmt.suffix) and directory in ("", fmt.name):
            return True
    return False
