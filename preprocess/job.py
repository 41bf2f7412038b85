"""The driver of `preprocess build-shards`: list, plan, run the shard tasks, commit.

`run_build` is the table of contents of a build: check and record the output
(`preprocess.output`), list and plan (`plan_build`, streaming into `_build/plan/`,
see `preprocess.plan`; the driver keeps one small piece per shard, never the
inputs), run one task per shard on an executor (`preprocess.pool`,
`preprocess.ray_job`; body in `preprocess.build`), then commit `errors.jsonl`, the
manifest and the client files (`preprocess.commit`). The plan files are removed
once the manifest is written. The output is a directory or an object-store URL
(`s3://bucket/prefix`). `preprocess.dry_run` lists and plans only.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from preprocess.build import (
    BUILD_DIR,
    ShardJob,
    ShardResult,
    image_field,
    marker_name,
    reusable_result,
    task_digest,
)
from preprocess.commit import assemble_manifest, enforce_skip_budget, write_errors
from preprocess.config import BuildConfig
from preprocess.listing import Listing
from preprocess.output import PLAN_NAME, check_output, prepare_output
from preprocess.plan import Plan, ShardPiece, Spill, load_task, order_spill
from preprocess.pool import ShardExecutor, TailClock, resolve_executor
from preprocess.progress import progress_bar
from preprocess.ray_job import iter_ray, start_ray
from preprocess.sizing import shard_size_for_bytes
from preprocess.sources import stream_sources
from shards.clients import write_client_files
from shards.manifest import LAYOUT_FLAT, MANIFEST_NAME, Manifest, write_manifest
from shards.storage import is_remote
from shards.storage.write import OutputStore, open_output_store


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
    client_files: list[str] = field(default_factory=list)  # `_info.json`, wids indexes, sizes.json
    executor: str = "inline"  # what ran the shard tasks: ray, local or inline
    executor_reason: str = ""  # why (`ShardExecutor.reason`), one line for the summary
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

    A new build puts its shards where `config.layout` says
    (`preprocess.output.DEFAULT_LAYOUT` when None); a build being resumed keeps its own.

    Raises:
        BuildError: the output holds a different build, the skip budget was
            exceeded, a task failed for a reason other than bad data, or
            `config.layout` is not the layout of the build being resumed.
    """
    started = time.perf_counter()
    store = open_output_store(config.output, config.storage_options)
    check_output(store, config)
    executor = choose_executor(config)
    clock = PhaseClock()
    with contextlib.ExitStack() as stack:
        # The plan names the inputs as listed, credentials in their URLs too: it goes
        # however the build ends (after the tasks that read it), and a rerun plans again.
        stack.callback(remove_plan, store)
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
        job = shard_job(config, plan, store.url, confine_root, layout)
        results, tail_idle = run_tasks(plan, config, job, executor)
        clock.lap("encode", executor.wait_s - waited)
        manifest = assemble_manifest(plan, config, results, listing, layout)
        write_errors(store, results, listing)
        enforce_skip_budget(manifest, config, store)
        write_manifest(store, manifest)
        clients = write_client_files(store, manifest)
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
        executor_reason=executor.reason,
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
    executor = ShardExecutor(kind, config.workers, config.ray_address, start_ray, iter_ray)
    if config.executor == "auto":
        executor.auto = kind == "local"  # decided by size once the plan is known
        executor.reason = "auto: a Ray cluster is named (--ray-address or RAY_ADDRESS)"
    return executor


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
        config.input,
        confine=config.confine_to_input,
        columns=config.input_columns(),
        storage_options=config.storage_options,
        input_root=config.input_root,
    )
    with Spill(directory, config.val_fraction, config.seed) as spill:
        for item in items:
            spill.add(item)
    shard_size = config.shard_size
    if config.shard_bytes is not None:
        shard_size = shard_size_for_bytes(
            spill.probe, config.shard_bytes, config.image, config.storage_options
        )
    return listing, order_spill(spill, shard_size)


def remove_plan(store: OutputStore) -> None:
    """Drop the plan files of a local build, however it ended; the next run plans again."""
    if not is_remote(store.url):
        shutil.rmtree(Path(store.url) / PLAN_NAME, ignore_errors=True)


def shard_job(
    config: BuildConfig,
    plan: Plan,
    output: str,
    confine_root: str | None = None,
    layout: str = LAYOUT_FLAT,
) -> ShardJob:
    """What every shard task of this build needs: the one place a `ShardJob` is made.

    `output` is the store's absolute location; `confine_root` the resolved input root
    that tasks confine reads to, or None.
    """
    return ShardJob(
        output=output,
        shaping=config.output_shaping(),
        image=config.image,
        formats=tuple(config.formats),
        class_names=tuple(plan.classes),
        row_group_size=config.row_group_size,
        description=config.description,
        confine_root=confine_root,
        layout=layout,
        members=shard_members(config),
        storage_options=config.storage_options,
    )


def run_tasks(
    plan: Plan, config: BuildConfig, job: ShardJob, executor: ShardExecutor | None = None
) -> tuple[list[ShardResult], float]:
    """Run every shard task of `job`.

    Returns the results in plan order, and the worker-seconds idle at the end
    (`TailClock`). Shards an earlier run committed are checked here first
    (`reuse_committed`), so a rerun with nothing to do waits for no executor at all.
    `executor` defaults to `config.executor`'s, started here if it must run.
    """
    executor = executor or choose_executor(config)
    pieces = dispatch_order(plan.shards)
    by_name = reuse_committed(pieces, job)
    pieces = [piece for piece in pieces if (piece.split, piece.index) not in by_name]
    executor.decide(sum(piece.size for piece in pieces))
    tail_idle = 0.0
    if pieces:
        # A local output's tasks read their pieces from `_build/plan/`; an object store's
        # plan is on this machine only, so each piece is loaded here as its task is sent.
        tasks = map(load_task, pieces) if is_remote(job.output) else pieces
        stream = executor.iter_results(tasks, job)  # started: before the bar
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


def reuse_committed(pieces: list[ShardPiece], job: ShardJob) -> dict:
    """`{(split, index): result}` of the shards kept as an earlier run committed them.

    Checked in dispatch order until the first shard that needs building, or until
    `DRIVER_CHECK_BYTES` have been hashed: from there the executor's tasks check
    (and build) the rest, in parallel. A result is the one the task would return.
    """
    store = job.open_store()
    found: dict = {}
    hashed = 0
    for piece in pieces:
        if hashed >= DRIVER_CHECK_BYTES or store.info(marker_name(piece)) is None:
            break
        task = load_task(piece)
        result = reusable_result(store, task, task_digest(task, job.shaping), job)
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
