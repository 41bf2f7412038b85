"""The driver of `preprocess build-shards`: list, plan, run shard tasks, commit the manifest.

Order of commits: `_build/config.json` first (so a rerun can tell whether it
continues the same build), one marker per finished shard, then `errors.jsonl`,
then `manifest.json` last. A dataset without a manifest is incomplete. The
output is a directory or an object-store URL (`s3://bucket/prefix`).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from preprocess.build import BUILD_DIR, ShardResult, image_field
from preprocess.config import BuildConfig, diff_configs
from preprocess.plan import Plan, ShardTask, build_plan
from preprocess.ray_job import BuildError, iter_inline, iter_ray
from preprocess.sizing import shard_size_for_bytes
from preprocess.sources import Listing, scan_sources
from shards.io import OutputStore, is_remote, open_output_store
from shards.manifest import MANIFEST_NAME, Manifest, SplitInfo

ERRORS_NAME = "errors.jsonl"
CONFIG_NAME = "config.json"


class StoreURL(str):
    """An object-store URL that joins names with `/` as a Path does (`url / "manifest.json"`)."""

    def __truediv__(self, name: str) -> StoreURL:
        return StoreURL(f"{self.rstrip('/')}/{name}")


@dataclass
class BuildSummary:
    """What a build did, for the summary table and for tests."""

    manifest: Manifest
    output: Path | StoreURL  # a Path for a local directory
    seconds: float
    shards_built: int
    shards_reused: int
    images_processed: int  # inputs read this run (excludes reused shards)
    bytes_by_format: dict[str, int] = field(default_factory=dict)
    retried: int = 0  # inputs skipped by an earlier run and tried again by this one
    recovered: int = 0  # of those, the inputs written now
    links_followed: int = 0  # symlinks (files and directories) listed through
    left_out: dict[str, int] = field(default_factory=dict)  # tree entries not inputs, by reason

    @property
    def images_per_s(self) -> float:
        return self.images_processed / self.seconds if self.seconds > 0 else 0.0


def run_build(config: BuildConfig) -> BuildSummary:
    """Build (or finish building) the shards described by `config`.

    Raises:
        BuildError: the output holds a different build, the skip budget was
            exceeded, or a task failed for a reason other than bad data.
    """
    started = time.perf_counter()
    store = open_output_store(config.output)
    listing = scan_sources(config.input, confine=config.confine_to_input)
    shard_size = config.shard_size
    if config.shard_bytes is not None:
        shard_size = shard_size_for_bytes(listing.items, config.shard_bytes, config.image)
    plan = build_plan(listing.items, shard_size, config.val_fraction, config.seed)
    prepare_output(store, config, plan)
    confine_root = listing.root if config.confine_to_input else None
    results = run_tasks(plan, config, store.url, confine_root)
    manifest = assemble_manifest(plan, config, results, listing)
    write_errors(store, results, listing)
    enforce_skip_budget(manifest, config, store)
    store.write_bytes_atomic(MANIFEST_NAME, manifest.to_json().encode("utf-8"))
    built = [r for r in results if not r.reused]
    bytes_by_format: Counter = Counter()
    for result in results:
        for fmt, info in result.info.files.items():
            bytes_by_format[fmt] += info.bytes
    return BuildSummary(
        manifest=manifest,
        output=StoreURL(store.url) if is_remote(store.url) else Path(store.url),
        seconds=time.perf_counter() - started,
        shards_built=len(built),
        shards_reused=len(results) - len(built),
        images_processed=sum(r.info.samples + len(r.skipped) for r in built),
        bytes_by_format=dict(bytes_by_format),
        retried=sum(r.retried for r in results),
        recovered=sum(r.recovered for r in results),
        links_followed=listing.links_followed,
        left_out=listing.left_out_counts(),
    )


def prepare_output(store: OutputStore, config: BuildConfig, plan: Plan) -> None:
    """Create or check the output, and record what this build is."""
    record = {"config": config.output_shaping(), "plan_digest": plan.digest, "inputs": plan.inputs}
    config_name = f"{BUILD_DIR}/{CONFIG_NAME}"
    if config.overwrite:
        clear_build_output(store)
    try:
        previous = json.loads(store.read_bytes(config_name).decode("utf-8"))
    except FileNotFoundError:
        previous = None
    if previous is not None:
        changes = diff_configs(previous["config"], record["config"])
        if previous["plan_digest"] != plan.digest:
            changes.append(
                f"inputs: {previous['inputs']} files -> {plan.inputs} files (or their paths, labels or splits changed)"
            )
        if changes:
            raise BuildError(
                f"{store.url} holds a build with other options:\n  "
                + "\n  ".join(changes)
                + "\nRerun with the original options to resume it, pass --overwrite to rebuild, "
                "or choose another --output."
            )
    elif not store.is_empty():
        raise BuildError(
            f"{store.url} is not empty and holds no shard build; choose an empty --output"
        )
    store.remove_stale_temps()
    if previous is None:
        store.write_bytes_atomic(config_name, json.dumps(record, indent=1, sort_keys=True).encode())


def clear_build_output(store: OutputStore) -> None:
    """Remove what a build writes (and nothing else) before `--overwrite`."""
    names = store.list()
    if MANIFEST_NAME not in names and not any(n.startswith(f"{BUILD_DIR}/") for n in names):
        if not store.is_empty():
            raise BuildError(
                f"{store.url} holds no shard build; refusing to clear it for --overwrite"
            )
        return
    store.remove(MANIFEST_NAME)
    store.remove(ERRORS_NAME)
    store.remove_tree(BUILD_DIR)
    for name in names:
        if "/" not in name and name.endswith((".tar", ".parquet")):
            store.remove(name)


def run_tasks(
    plan: Plan, config: BuildConfig, output: str, confine_root: str | None = None
) -> list[ShardResult]:
    """Run every shard task, writing to `output` (absolute); returns results in plan order.

    `confine_root` is the resolved input root that tasks confine reads to, or None.
    """
    build_kwargs = {
        "output": output,
        "shaping": config.output_shaping(),
        "image": config.image,
        "formats": tuple(config.formats),
        "num_classes": len(plan.classes),
        "row_group_size": config.row_group_size,
        "confine_root": confine_root,
    }
    tasks = dispatch_order(plan.tasks)
    if config.executor == "inline":
        stream = iter_inline(tasks, build_kwargs)
    else:
        stream = iter_ray(tasks, build_kwargs, config.ray_address, config.workers)
    by_name = {}
    with progress_bar(plan.inputs, config.progress) as bar:
        for result in stream:
            by_name[(result.split, result.info.index)] = result
            bar.update(result.info.samples + len(result.skipped))
    return [by_name[(t.split, t.index)] for t in plan.tasks]


def dispatch_order(tasks: list[ShardTask]) -> list[ShardTask]:
    """Largest shards first (plan order among equals), so the small ones fill the end.

    A split's last shard and a small `val` split are shorter than the rest; sent last,
    they keep the other workers busy while the final full shards finish, instead of
    leaving workers idle behind one long task. Results are put back in plan order.
    """
    return sorted(tasks, key=lambda task: -len(task.samples))


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="img", disable=not enabled, smoothing=0.1, desc="build-shards")


def assemble_manifest(
    plan: Plan, config: BuildConfig, results: list[ShardResult], listing: Listing | None = None
) -> Manifest:
    """The manifest: every planned input and every input refused at listing, accounted for.

    Files refused at listing (a name that is not UTF-8) are inputs that were
    skipped; tree entries that are not inputs at all (other suffixes, loops, ...)
    are counted in `config.listing`, with the symlinks followed.
    """
    listing = listing or Listing([])
    splits: dict[str, SplitInfo] = {}
    for name in sorted({r.split for r in results}):
        infos = [r.info for r in results if r.split == name]
        counts = [sum(i.class_counts[c] for i in infos) for c in range(len(plan.classes))]
        splits[name] = SplitInfo(name, sum(i.samples for i in infos), infos, counts)
    skipped = Counter(s.reason for r in results for s in r.skipped)
    skipped.update(entry.reason for entry in listing.refused)
    inputs = plan.inputs + len(listing.refused)
    config_record = {
        **config.output_shaping(),
        "input": config.input,
        "plan_digest": plan.digest,
        "shard_size": plan.shard_size,  # derived when --shard-bytes was given
        "listing": {
            "links_followed": listing.links_followed,
            "left_out": listing.left_out_counts(),
        },
    }
    manifest = Manifest(
        classes=plan.classes,
        image_field=image_field(config.image),
        formats=list(config.formats),
        splits=splits,
        config=config_record,
        inputs=inputs,
        skipped=dict(skipped),
    )
    if manifest.written + sum(skipped.values()) != inputs:
        raise BuildError(
            f"accounting error: {manifest.written} written + {sum(skipped.values())} skipped "
            f"!= {inputs} inputs; please report this as a bug"
        )
    return manifest


def write_errors(
    store: OutputStore, results: list[ShardResult], listing: Listing | None = None
) -> None:
    """`errors.jsonl`: every skipped input with its reason, in shard order.

    Entries left out at listing come first, with `"shard": null`: refused inputs
    and the named tree entries that are not inputs (loops, unreadable directories,
    directory links outside the root, ...).
    """
    lines = []
    for entry in listing.left_out if listing else ():
        record = {"path": entry.path, "reason": entry.reason, "detail": entry.detail}
        record["shard"] = None
        lines.append(json.dumps(record, ensure_ascii=False))
    for result in results:
        for skip in result.skipped:
            record = {"path": skip.path, "reason": skip.reason, "detail": skip.detail}
            record["shard"] = f"{result.split}-{result.info.index:06d}"
            lines.append(json.dumps(record, ensure_ascii=False))
    store.write_bytes_atomic(ERRORS_NAME, ("\n".join(lines) + "\n" if lines else "").encode())


def enforce_skip_budget(manifest: Manifest, config: BuildConfig, store: OutputStore) -> None:
    skipped = sum(manifest.skipped.values())
    if manifest.inputs and skipped / manifest.inputs > config.max_skip_fraction:
        histogram = ", ".join(f"{reason}: {n}" for reason, n in sorted(manifest.skipped.items()))
        raise BuildError(
            f"{skipped} of {manifest.inputs} inputs were skipped ({skipped / manifest.inputs:.1%}), "
            f"over --max-skip-fraction {config.max_skip_fraction:.1%} ({histogram}). "
            f"See {store.location(ERRORS_NAME)}; fix the inputs or raise --max-skip-fraction and rerun "
            "(finished shards are kept)."
        )
