"""The driver of `preprocess build-shards`: list, plan, run shard tasks, commit the manifest.

The listing streams into the plan files (`_build/plan/`, see `preprocess.plan`);
the driver keeps one small piece per shard, never the inputs. Order of commits:
`_build/config.json` first (so a rerun can tell whether it continues the same
build), one marker per finished shard, then `errors.jsonl`, then `manifest.json`
(the commit point), then the client index files (`shards.clients`: timm's
`_info.json`, wids indexes), which `rewrite_client_files` can remake from the
manifest alone; the plan files are removed once the manifest is written. A
dataset without a manifest is incomplete. The output is a directory or an
object-store URL (`s3://bucket/prefix`). `run_dry_run` lists and plans only.

Layout: a new build puts its shards where `BuildConfig.layout` says
(`shards.manifest.LAYOUTS`; `DEFAULT_LAYOUT`, by format, when not given); a rerun
without one keeps the layout its build started with, recorded in `_build/config.json`
(a record without one is a flat build).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import shutil
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from preprocess.build import (
    BUILD_DIR,
    ShardResult,
    image_field,
    marker_name,
    reusable_result,
    task_digest,
)
from preprocess.config import BuildConfig, diff_configs
from preprocess.plan import (
    PLAN_VERSION,
    Plan,
    ShardPiece,
    Spill,
    load_task,
    manifest_fields,
    order_spill,
)
from preprocess.pool import ShardExecutor, TailClock, resolve_executor
from preprocess.ray_job import BuildError, iter_ray, start_ray
from preprocess.sizing import Probe, probe_inputs, shard_size_for_bytes
from preprocess.sources import Listing, stream_sources
from shards.clients import is_client_file, write_client_files
from shards.formats import FORMATS, get_format
from shards.io import OutputStore, is_remote, open_output_store
from shards.manifest import (
    LAYOUT_BY_FORMAT,
    LAYOUT_FLAT,
    MANIFEST_NAME,
    Manifest,
    ShardTable,
    SplitInfo,
    write_manifest,
)

ERRORS_NAME = "errors.jsonl"
CONFIG_NAME = "config.json"
PLAN_NAME = f"{BUILD_DIR}/plan"  # the plan files of a local output, while it is built
# The layout of a new build when none is asked for: a directory per format, which
# dataframe tools and HF datasets open by path (see docs/SHARDS.md, "Layout").
DEFAULT_LAYOUT = LAYOUT_BY_FORMAT


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
    # The `other_suffix` files by suffix, and the summary's line for them (with reasons).
    left_out_suffixes: dict[str, int] = field(default_factory=dict)
    left_out_suffixes_line: str = ""
    client_files: list[str] = field(default_factory=list)  # `_info.json`, wids indexes
    executor: str = "inline"  # what ran the shard tasks: ray, local or inline
    # Wall seconds of the build's own phases, in order (see `PHASES`); `start` ran beside
    # `plan`, and `wait` is the part of it the build waited for.
    phases: dict[str, float] = field(default_factory=dict)
    tail_idle_s: float = 0.0  # worker-seconds idle at the end (`preprocess.pool.TailClock`)
    # Inputs of every shard (reused ones included) that the fast backend handed to Pillow.
    pillow_fallbacks: int = 0

    @property
    def images_per_s(self) -> float:
        return self.images_processed / self.seconds if self.seconds > 0 else 0.0


def run_build(config: BuildConfig) -> BuildSummary:
    """Build (or finish building) the shards described by `config`.

    A new build puts its shards where `config.layout` says (`DEFAULT_LAYOUT` when
    None); a build being resumed keeps its own.

    Raises:
        BuildError: the output holds a different build, the skip budget was
            exceeded, a task failed for a reason other than bad data, or
            `config.layout` is not the layout of the build being resumed.
    """
    started = time.perf_counter()
    store = open_output_store(config.output)
    check_output(store, config)
    executor = choose_executor(config)
    clock = PhaseClock()
    with contextlib.ExitStack() as stack:
        stack.callback(executor.close)
        planning = functools.partial(plan_build, config, store, stack)
        # A rerun of a finished build usually has nothing to build: it starts nothing early.
        if store.info(MANIFEST_NAME) is None:
            listing, plan = executor.start_while(planning)
        else:
            listing, plan = planning()
        layout = prepare_output(store, config, plan)
        waited = executor.wait_s
        clock.lap("plan", waited)
        confine_root = listing.root if config.confine_to_input else None
        results, tail_idle = run_tasks(plan, config, store.url, confine_root, layout, executor)
        clock.lap("encode", executor.wait_s - waited)
        manifest = assemble_manifest(plan, config, results, listing, layout)
        write_errors(store, results, listing)
        enforce_skip_budget(manifest, config, store)
        write_manifest(store, manifest)
        clients = write_client_files(store, manifest)
    remove_plan(store)
    clock.lap("commit")
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
        pillow_fallbacks=sum(r.pillow_fallbacks for r in results),
        links_followed=listing.links_followed,
        left_out=listing.left_out_counts(),
        left_out_suffixes=listing.suffix_counts(),
        left_out_suffixes_line=listing.describe_suffixes(),
        client_files=clients,
        executor=executor.kind,
        phases=clock.phases(executor.start_s, executor.wait_s),
        tail_idle_s=tail_idle,
    )


# The build's phases as `BuildSummary.phases` names them: listing + planning (and the
# output's build record), the executor's start, the part of it the build waited for
# after planning, the shard tasks, and errors + manifest + client files.
PHASES = ("plan", "start", "wait", "encode", "commit")


class PhaseClock:
    """Wall seconds of consecutive phases of the driver."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str, less: float = 0.0) -> None:
        """End phase `name` now; `less` of it is counted elsewhere (the executor's wait)."""
        now = time.perf_counter()
        self.laps[name] = max(0.0, now - self.last - less)
        self.last = now

    def phases(self, start_s: float, wait_s: float) -> dict[str, float]:
        """Every phase of `PHASES`, in order."""
        laps = {**self.laps, "start": start_s, "wait": wait_s}
        return {name: laps.get(name, 0.0) for name in PHASES}


def choose_executor(config: BuildConfig) -> ShardExecutor:
    """The executor of `config.executor` (`auto` resolved), not started yet."""
    kind = resolve_executor(config.executor, config.ray_address)
    # The driver's own start_ray and iter_ray, looked up now: a test may refuse them.
    return ShardExecutor(kind, config.workers, config.ray_address, start_ray, iter_ray)


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


def plan_build(
    config: BuildConfig, store: OutputStore, stack: contextlib.ExitStack
) -> tuple[Listing, Plan]:
    """List and plan, streaming; the listing's account is complete on return.

    The plan files go to `_build/plan/` of a local output, where the tasks read
    their pieces; for an object store to a local temporary directory that `stack`
    removes, and the driver ships each task its piece. When planning fails (a bad
    input list) what it wrote is removed, the output directory too if this run
    made it, so a refused input list leaves the output as it was.
    """
    if is_remote(store.url):
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="shardpipe-plan-"))
        return plan_inputs(config, Path(scratch))
    root = Path(store.url)
    created = root
    while not created.parent.exists():
        created = created.parent
    made_root = not root.exists()
    # The plan of an earlier run (a dry run, a killed build) may name splits this one has not.
    shutil.rmtree(root / PLAN_NAME, ignore_errors=True)
    try:
        return plan_inputs(config, root / PLAN_NAME)
    except BaseException:
        shutil.rmtree(created if made_root else root / PLAN_NAME, ignore_errors=True)
        if not made_root:
            with contextlib.suppress(OSError):
                (root / BUILD_DIR).rmdir()  # only if the plan was all it held
        raise


def plan_inputs(config: BuildConfig, directory: Path) -> tuple[Listing, Plan]:
    """Stream the listing into the spill, size the shards, order and cut the plan."""
    listing, items = stream_sources(
        config.input, confine=config.confine_to_input, columns=config.input_columns()
    )
    with Spill(directory, config.val_fraction, config.seed) as spill:
        for item in items:
            spill.add(item)
    shard_size = config.shard_size
    if config.shard_bytes is not None:
        shard_size = shard_size_for_bytes(spill.probe, config.shard_bytes, config.image)
    return listing, order_spill(spill, shard_size)


def remove_plan(store: OutputStore) -> None:
    """Drop the plan files of a finished local build; the next run plans again anyway."""
    if not is_remote(store.url):
        shutil.rmtree(Path(store.url) / PLAN_NAME, ignore_errors=True)


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


def run_tasks(
    plan: Plan,
    config: BuildConfig,
    output: str,
    confine_root: str | None = None,
    layout: str = LAYOUT_FLAT,
    executor: ShardExecutor | None = None,
) -> tuple[list[ShardResult], float]:
    """Run every shard task, writing to `output` (absolute).

    Returns the results in plan order, and the worker-seconds idle at the end
    (`TailClock`). `confine_root` is the resolved input root that tasks confine reads
    to, or None. Shards an earlier run committed are checked here first
    (`reuse_committed`), so a rerun with nothing to do waits for no executor at all.
    `executor` defaults to `config.executor`'s, started here if it must run.
    """
    executor = executor or choose_executor(config)
    build_kwargs = {
        "output": output,
        "shaping": config.output_shaping(),
        "image": config.image,
        "formats": tuple(config.formats),
        "num_classes": len(plan.classes),
        "class_names": tuple(plan.classes),
        "description": config.description,
        "row_group_size": config.row_group_size,
        "confine_root": confine_root,
        "layout": layout,
        "members": shard_members(config),
    }
    pieces = dispatch_order(plan.shards)
    by_name = reuse_committed(pieces, build_kwargs)
    pieces = [piece for piece in pieces if (piece.split, piece.index) not in by_name]
    tail_idle = 0.0
    if pieces:
        # A local output's tasks read their pieces from `_build/plan/`; an object store's
        # plan is on this machine only, so each piece is loaded here as its task is sent.
        tasks = map(load_task, pieces) if is_remote(output) else pieces
        stream = executor.iter_results(tasks, build_kwargs)  # started: before the bar
        tail = TailClock(executor.slots())
        done = sum(r.info.samples + len(r.skipped) for r in by_name.values())
        with progress_bar(plan.inputs, config.progress, done) as bar:
            for result in stream:
                tail.record()
                by_name[(result.split, result.info.index)] = result
                bar.update(result.info.samples + len(result.skipped))
        tail_idle = tail.idle_s()
    return [by_name[(piece.split, piece.index)] for piece in plan.shards], tail_idle


# The driver checks committed shards itself up to this many bytes hashed (about a second):
# enough for a rerun with nothing to do; beyond, the tasks check the rest in parallel.
DRIVER_CHECK_BYTES = 512 * 2**20


def reuse_committed(pieces: list[ShardPiece], build_kwargs: dict) -> dict:
    """`{(split, index): result}` of the shards kept as an earlier run committed them.

    Checked in dispatch order until the first shard that needs building, or until
    `DRIVER_CHECK_BYTES` have been hashed: from there the executor's tasks check
    (and build) the rest, in parallel. A result is the one the task would return.
    """
    store = open_output_store(build_kwargs["output"])
    found: dict = {}
    hashed = 0
    for piece in pieces:
        if hashed >= DRIVER_CHECK_BYTES or store.info(marker_name(piece)) is None:
            break
        task = load_task(piece)
        digest = task_digest(task, build_kwargs["shaping"])
        image, confine_root = build_kwargs["image"], build_kwargs["confine_root"]
        result = reusable_result(store, task, digest, image, confine_root)
        if result is None or not result.reused:
            break
        found[(piece.split, piece.index)] = result
        hashed += sum(file.bytes for file in result.info.files.values())
    return found


def shard_members(config: BuildConfig) -> tuple[str, ...] | None:
    """The members besides the image every sample of a build with extra columns carries.

    None for a plain build, whose writers take them from the first sample as before.
    """
    columns = config.input_columns()
    if columns.plain:
        return None
    field = image_field(config.image)
    return tuple(name for name in columns.members(field) if name != field)


def dispatch_order(tasks: list[ShardPiece]) -> list[ShardPiece]:
    """Largest shards first (plan order among equals), so the small ones fill the end.

    A split's last shard and a small `val` split are shorter than the rest; sent last,
    they keep the other workers busy while the final full shards finish, instead of
    leaving workers idle behind one long task. Results are put back in plan order.
    """
    return sorted(tasks, key=lambda task: -task.size)


# Without a terminal (a log file, CI) a plain line this often instead of a bar.
PROGRESS_EVERY_S = 10.0


class ProgressLine:
    """Progress for a log file: `build-shards: N of M images (P%), R images/s` every few seconds.

    Never a `\r` frame: each report is a line of its own.
    """

    def __init__(self, total: int, initial: int = 0, every_s: float = PROGRESS_EVERY_S) -> None:
        self.total = total
        self.done = initial
        self.every_s = every_s
        self.started = self.last = time.monotonic()
        self.counted = 0  # images of this run, for the rate

    def update(self, count: int) -> None:
        self.done += count
        self.counted += count
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.counted / max(now - self.started, 1e-9)
            share = self.done / self.total if self.total else 1.0
            print(
                f"build-shards: {self.done} of {self.total} images ({share:.0%}), "
                f"{rate:.0f} images/s",
                file=sys.stderr,
                flush=True,
            )


class NoProgress:
    """`--no-progress`: nothing at all."""

    def update(self, count: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool, initial: int = 0, every_s: float = PROGRESS_EVERY_S):
    """A tqdm bar on a terminal (log lines written above it), a `ProgressLine` otherwise."""
    if not enabled:
        yield NoProgress()
        return
    if not sys.stderr.isatty():
        yield ProgressLine(total, initial, every_s)
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    loggers = [logging.getLogger("preprocess"), logging.getLogger("ray"), logging.getLogger()]
    with (
        tqdm(total=total, initial=initial, unit="img", smoothing=0.1, desc="build-shards") as bar,
        logging_redirect_tqdm(loggers=loggers),
    ):
        yield bar


def assemble_manifest(
    plan: Plan,
    config: BuildConfig,
    results: list[ShardResult],
    listing: Listing | None = None,
    layout: str = LAYOUT_FLAT,
) -> Manifest:
    """The manifest: every planned input and every input refused at listing, accounted for.

    Files refused at listing (a name that is not UTF-8) are inputs that were
    skipped; tree entries that are not inputs at all (other suffixes, loops, ...)
    are counted in `config.listing`, with the symlinks followed and the files left
    out for their suffix counted by suffix (`left_out_suffixes`).
    """
    listing = listing or Listing([])
    splits: dict[str, SplitInfo] = {}
    for name in sorted({r.split for r in results}):
        # Columns, not one ShardInfo per shard: ~90 bytes a shard rather than ~1.5 KB.
        infos = [r.info for r in results if r.split == name]
        table = ShardTable.from_infos(name, infos, layout)
        counts = table.class_counts.totals(len(plan.classes)).tolist()
        if not table.class_counts.counted.any():
            counts = []  # multi-label: counted in `fields.label_counts`, not summing to samples
        splits[name] = SplitInfo(name, table.total_samples(), table, counts)
    skipped = Counter(s.reason for r in results for s in r.skipped)
    skipped.update(entry.reason for entry in listing.refused)
    inputs = plan.inputs + len(listing.refused)
    listing_record = {
        "links_followed": listing.links_followed,
        "left_out": listing.left_out_counts(),
    }
    if listing.left_out_suffixes:  # absent when none, as in manifests written before it
        listing_record["left_out_suffixes"] = listing.suffix_counts()
    config_record = {
        **config.output_shaping(),
        "input": config.input,
        "plan_digest": plan.digest,
        "shard_size": plan.shard_size,  # derived when --shard-bytes was given
        "listing": listing_record,
    }
    manifest = Manifest(
        classes=plan.classes,
        image_field=image_field(config.image),
        formats=list(config.formats),
        splits=splits,
        config=config_record,
        inputs=inputs,
        skipped=dict(skipped),
        fields=manifest_fields(
            config.input_columns(),
            image_field(config.image),
            plan,
            {(r.split, r.info.index): {s.path for s in r.skipped} for r in results},
        ),
        layout=layout,
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


@dataclass
class DryRun:
    """What `build-shards --dry-run` found: the plan and what building it would do.

    Attributes:
        plan: the plan, its files kept under `plan_location`.
        listing: the listing's account of entries that are not inputs.
        output: the output's directory or URL.
        plan_location: where the plan files are; None for an object-store output,
            whose plan lived in a temporary directory.
        probe: sizes of the probe's inputs in each format, for the estimate.
        existing: what the output holds: `new`, `resume`, `replace` (--overwrite),
            or the refusal a build would meet.
        committed: shards of an existing build with a marker (checked when built).
    """

    plan: Plan
    listing: Listing
    output: str
    plan_location: str | None
    probe: Probe
    existing: str
    committed: int = 0

    def estimated_bytes(self) -> dict[str, int | None]:
        """Per format, the probe's mean sample size times the inputs (None: nothing readable)."""
        estimate: dict[str, int | None] = {}
        for fmt in self.probe.sizes:
            mean = self.probe.mean_bytes(fmt)
            ends = get_format(fmt).file_overhead_bytes * len(self.plan.shards)
            estimate[fmt] = None if mean is None else round(mean * self.plan.inputs) + ends
        return estimate


def run_dry_run(config: BuildConfig) -> DryRun:
    """List and plan as `run_build` does, and write nothing but the plan files.

    Raises:
        BuildError: the output holds something other than a build.
        InputError: the input list cannot be trusted (nothing is left behind).
    """
    store = open_output_store(config.output)
    check_output(store, config)
    with contextlib.ExitStack() as stack:
        listing, plan = plan_build(config, store, stack)
    probe = probe_inputs(plan.probe, config.image, config.formats)
    location = None if is_remote(store.url) else store.location(PLAN_NAME)
    existing, committed = describe_existing(store, config, plan)
    return DryRun(plan, listing, store.url, location, probe, existing, committed)


def rewrite_client_files(output: str) -> list[str]:
    """(Re)write the client index files of a finished build from its manifest alone.

    For any output whose manifest this version reads (old flat layouts included); no
    shard is opened. Returns the names written (none for an output without tar shards).

    Raises:
        FileNotFoundError: the output has no manifest (the build did not finish).
        ManifestError: the manifest (or a side table it names) is not valid.
    """
    store = open_output_store(output)
    try:
        data = store.read_bytes(MANIFEST_NAME)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no manifest at {store.location(MANIFEST_NAME)}: the build did not finish; rerun "
            "its `preprocess build-shards` command to complete it"
        ) from None
    manifest = Manifest.from_json(
        data, store.location(MANIFEST_NAME), read_table=StoreTableReader(store)
    )
    return write_client_files(store, manifest)


class StoreTableReader:
    """Reads a manifest's side tables from an `OutputStore` (a `TableReader`)."""

    def __init__(self, store: OutputStore) -> None:
        self.store = store

    def __call__(self, name: str, size: int) -> bytes:
        return self.store.read_bytes(name)[: size + 1]


def describe_existing(store: OutputStore, config: BuildConfig, plan: Plan) -> tuple[str, int]:
    """What a build would do with the output: (`new`/`resume`/`replace`/refusal, markers)."""
    previous = read_build_record(store)
    if previous is None:
        return "new", 0
    if config.overwrite:
        return "replace", 0
    changes = record_changes(previous, build_record(config, plan))
    if config.layout is not None and config.layout != record_layout(previous):
        changes.append(f"layout: {record_layout(previous)!r} -> {config.layout!r}")
    if changes:
        return "refused, the output holds a build with other options: " + "; ".join(changes), 0
    markers = [
        name
        for name in store.list()
        if name.startswith(f"{BUILD_DIR}/") and name.count("/") == 1 and "-" in name
    ]
    return "resume", len(markers)
