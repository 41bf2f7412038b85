"""Executors of the build's shard tasks: which one runs, its start in the background, a local pool.

`resolve_executor` turns `--executor auto` into `ray` when a cluster is named, else
`local` (a process pool on this machine) until `ShardExecutor.decide` sees a build of
at least `ray_min_inputs` inputs, which runs on Ray. `BackgroundStart` runs an executor's start-up in a
thread while the driver lists and plans. `LocalPool` and `iter_local` run the
shard tasks in worker processes, exactly `workers` in flight, as `iter_ray` does
on Ray; every executor writes the same bytes (`build_shard` is deterministic).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Generic, TypeVar

from preprocess.build import ShardJob, ShardResult
from preprocess.plan import ShardPiece, ShardTask
from preprocess.ray_job import (
    TASK_RETRIES,
    BuildError,
    build_with_options,
    iter_inline,
)
from shards.cluster import ray_slots
from shards.errors import UsageError
from shards.processes import CLEAN_START, start_context, start_method

# Workers start by `shards.processes.start_method`: forked where the driver runs no other
# thread, Ray, torch.distributed or CUDA, else from a forkserver that imported the image
# stack once (milliseconds a worker).
PRELOAD = ["preprocess.pool", "cv2", "simplejpeg"]  # a module that does not import is skipped
# A worker whose driver died (SIGKILL, a lost terminal) stops within this many seconds, so
# a rerun never meets a writer of the killed build.
ORPHAN_CHECK_S = 0.2

T = TypeVar("T")


def resolve_executor(executor: str, ray_address: str | None) -> str:
    """`ray`, `local` or `inline`: what `--executor` means for this job.

    `auto` is Ray when a cluster is named (`--ray-address`, or `RAY_ADDRESS` as under
    `ray job submit`), else the local pool, which needs no start-up of seconds.
    """
    if executor != "auto":
        return executor
    return "ray" if ray_address or os.environ.get("RAY_ADDRESS") else "local"


# `--executor auto` runs a build on Ray when Ray's start-up is at most RAY_START_SHARE of
# the build's time, i.e. from `ray_min_inputs(cpus)` inputs to build. Both constants were
# measured by `benchmarks/executor_crossover.py` on a quiet 2-CPU machine (2026-12-02):
# a Ray build took 10.8-14.1 s longer than the local pool at 500, 2,000 and 6,000 images
# (`import ray` + `ray.init()` alone 7.6 s; the rest is its workers' and tasks' start),
# and the local pool built 398 images/s (199 per CPU). Rerun it to set them again.
RAY_START_S = 12.0
RAY_START_SHARE = 0.03
IMAGES_PER_CPU_S = 200.0


def ray_min_inputs(cpus: int) -> int:
    """Inputs from which Ray's start-up is at most `RAY_START_SHARE` of a build on `cpus`."""
    return math.ceil(RAY_START_S / RAY_START_SHARE * IMAGES_PER_CPU_S * cpus)


def local_workers(workers: int | None) -> int:
    """Processes of the local pool: `workers`, else the CPUs this process may run on."""
    if workers is not None:
        return workers
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class BackgroundStart(Generic[T]):
    """Runs `start()` in a thread of its own while the driver goes on (listing, planning).

    `result()` waits for it and returns its value, or raises its error, in the caller's
    thread; nothing is logged from the thread, so an error surfaces once, where it is raised.
    """

    def __init__(self, start: Callable[[], T], name: str, since: float | None = None) -> None:
        self.since = time.perf_counter() if since is None else since
        self.seconds = 0.0  # how long the start took, from `since`
        self.waited = 0.0  # how long `result()` blocked on it
        self._start = start
        self._future: Future = Future()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._future.set_result(self._start())
        except BaseException as error:  # handed to the caller's thread, not handled here
            self._future.set_exception(error)
        finally:
            self.seconds = time.perf_counter() - self.since

    def result(self) -> T:
        began = time.perf_counter()
        self._thread.join()
        self.waited += time.perf_counter() - began
        return self._future.result()

    def join(self) -> T | None:
        """Wait for the start; its value, or None when it failed (the error is dropped)."""
        self._thread.join()
        return None if self._future.exception() else self._future.result()


def init_worker() -> None:
    """In each pool worker: the driver alone handles Ctrl-C; exit when the driver is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch = threading.Thread(target=exit_when_orphaned, args=(os.getppid(),), daemon=True)
    watch.start()


def exit_when_orphaned(parent: int) -> None:
    """Stop this worker once its parent has died: the driver, or its forkserver.

    A forkserver exits with its driver. A killed driver leaves no one to collect results,
    and a worker writing on would race the rerun that resumes the build; the temp files
    it leaves are swept by that rerun.
    """
    while os.getppid() == parent:
        time.sleep(ORPHAN_CHECK_S)
    os._exit(1)


def warm_worker() -> int:
    """Import the image stack in a worker before its first shard; returns its pid."""
    import preprocess.images  # noqa: F401 - Pillow, NumPy and the decode policy

    return os.getpid()


class LocalPool:
    """`workers` processes on this machine that run shard tasks (`iter_local`).

    The constructor launches every process (`method`: a start method, see
    `shards.processes.start_method`) and returns; `ready` waits until each has imported
    the image stack.
    A pool broken by a dead worker is replaced by `restart`, never by a fork.
    """

    def __init__(self, workers: int, method: str = CLEAN_START) -> None:
        if workers < 1:
            raise UsageError("--workers must be at least 1")
        self.workers = workers
        self.executor, self.warming = self._launch(method)

    def _launch(self, method: str) -> tuple[ProcessPoolExecutor, list[Future]]:
        context = start_context(method, PRELOAD)
        executor = ProcessPoolExecutor(self.workers, context, initializer=init_worker)
        # One warm-up per worker launches them all now, not as the first shards arrive.
        return executor, [executor.submit(warm_worker) for _ in range(self.workers)]

    def ready(self) -> LocalPool:
        """Wait for every worker's warm-up (an error of one is raised here); returns self."""
        for future in self.warming:
            future.result()
        return self

    def submit(self, task: ShardPiece | ShardTask, job: ShardJob) -> Future:
        return self.executor.submit(build_with_options, task, job)

    def restart(self) -> None:
        """Replace a pool broken by a worker that died (its futures all failed)."""
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.executor, self.warming = self._launch(CLEAN_START)

    def close(self) -> None:
        """Cancel what has not started and wait for the shards in flight (they commit)."""
        self.executor.shutdown(wait=True, cancel_futures=True)


def iter_local(
    tasks: Iterable[ShardPiece | ShardTask], job: ShardJob, pool: LocalPool
) -> Iterator[ShardResult]:
    """Run tasks on `pool` and yield results as they complete (not in task order).

    Exactly `pool.workers` tasks are in flight, taken from `tasks` in its order (largest
    first, see `preprocess.job.dispatch_order`), so none waits behind a queue of others.
    A worker that dies (killed for memory, a crash in a codec) breaks the pool, failing
    every task in flight: those run again one at a time on a new pool, so a death is
    blamed on the one task that caused it, which is tried at most `TASK_RETRIES` more
    times, as Ray retries it. Errors a task raises propagate unchanged.
    """
    queue = iter(tasks)
    pending: dict[Future, ShardPiece | ShardTask] = {}
    suspects: list[ShardPiece | ShardTask] = []  # in flight when a worker died
    deaths: dict[tuple[str, int], int] = {}  # deaths of a task that ran alone
    broken = died = False
    try:
        while True:
            if broken and not pending:
                pool.restart()  # every future of the broken pool has failed: none is lost
                broken = False
            if not broken:
                fill(pool, pending, suspects, queue, job)
            if not pending:
                break
            in_flight = len(pending)
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                task = pending.pop(future)
                try:
                    result = future.result()
                except BrokenProcessPool as error:
                    broken = died = True
                    if in_flight == 1:  # it ran alone: the death was its own
                        count_death(task, deaths, error)
                    suspects.append(task)
                    continue
                yield result
    finally:
        for future in pending:
            future.cancel()
    if died:
        # A dead worker's temp files are orphans; with every task done no writer is left.
        job.open_store().remove_stale_temps()


def fill(
    pool: LocalPool,
    pending: dict[Future, ShardPiece | ShardTask],
    suspects: list[ShardPiece | ShardTask],
    queue: Iterator[ShardPiece | ShardTask],
    job: ShardJob,
) -> None:
    """Submit tasks up to `pool.workers` in flight; a suspect only alone (see `iter_local`)."""
    if suspects:
        if not pending:
            task = suspects.pop(0)
            pending[pool.submit(task, job)] = task
        return
    while len(pending) < pool.workers and (task := next(queue, None)) is not None:
        pending[pool.submit(task, job)] = task


def count_death(
    task: ShardPiece | ShardTask, deaths: dict[tuple[str, int], int], error: BaseException
) -> None:
    """Count one dead worker against `task`; past `TASK_RETRIES` the build stops."""
    name = (task.split, task.index)
    deaths[name] = deaths.get(name, 0) + 1
    if deaths[name] > TASK_RETRIES:
        raise BuildError(
            f"shard {task.split}-{task.index:06d}: a worker process died each of the "
            f"{deaths[name]} times it was built alone ({error}); it was probably killed for "
            "memory, or an image codec crashed on one of its inputs. Finished shards are "
            "kept: rerun the same command to resume, with fewer --workers if memory ran out."
        ) from error


class TailClock:
    """How long workers sat idle at the end of the build: the cost of a straggler shard.

    With exactly `slots` tasks in flight, the last `slots` results each free a worker that
    stays idle until the final one arrives; slots that never got a task idle throughout.
    """

    def __init__(self, slots: int) -> None:
        self.slots = max(1, slots)
        self.started = time.perf_counter()
        self.arrivals: list[float] = []

    def record(self) -> None:
        self.arrivals.append(time.perf_counter())

    def idle_s(self) -> float:
        """Worker-seconds idle after each worker's last task (0 for no task or one slot)."""
        if not self.arrivals:
            return 0.0
        end = self.arrivals[-1]
        used = min(self.slots, len(self.arrivals))
        tail = sum(end - arrival for arrival in self.arrivals[-used:])
        return tail + (self.slots - used) * (end - self.started)


def start_pool(workers: int, method: str) -> LocalPool:
    """A `LocalPool` with every worker warm."""
    return LocalPool(workers, method).ready()


class ShardExecutor:
    """Where this build's shard tasks run: `ray`, `local` or `inline` (`resolve_executor`).

    `start_while` starts it while the driver lists and plans; `iter_results` waits for
    that start (or starts it then) and runs the tasks. `start_ray` and `iter_ray` are the
    driver's (`preprocess.job`), so a test can refuse Ray there.
    """

    def __init__(
        self,
        kind: str,
        workers: int | None,
        ray_address: str | None,
        start_ray: Callable[[str | None, int | None], None],
        iter_ray: Callable[..., Iterator[ShardResult]],
    ) -> None:
        self.kind = kind
        self.workers = workers
        self.ray_address = ray_address
        self.start_ray = start_ray
        self.iter_ray = iter_ray
        self.starting: BackgroundStart | None = None
        self.pool: LocalPool | None = None
        self.ray_s: float | None = None  # how long Ray took to start, once started
        self.ray_done = 0.0
        self.ray_wait_s = 0.0
        self.ray_ours = False  # this build started Ray (or joined the cluster): `close` ends it
        # `--executor auto` without a cluster: local until `decide` sees a large build.
        self.auto = False
        self.reason = f"--executor {kind}"  # why this executor runs, for the summary

    def decide(self, inputs: int) -> None:
        """Under `auto`, pick Ray or the local pool for a build of `inputs` inputs to build."""
        if not self.auto:
            return
        cpus = local_workers(self.workers)
        threshold = ray_min_inputs(cpus)
        if inputs == 0:
            self.reason = "auto: nothing to build"
        elif inputs < threshold:
            self.reason = (
                f"auto: {inputs} inputs to build, under the {threshold} from which Ray's "
                f"start-up (~{RAY_START_S:.0f} s) is {RAY_START_SHARE:.0%} of a build on "
                f"{cpus} CPUs"
            )
        else:
            self.close()  # the local pool started while planning is not needed
            self.kind, self.starting = "ray", None
            self.reason = (
                f"auto: {inputs} inputs to build, at least the {threshold} from which Ray's "
                f"start-up (~{RAY_START_S:.0f} s) is {RAY_START_SHARE:.0%} of a build on "
                f"{cpus} CPUs"
            )

    def start_while(self, plan: Callable[[], T]) -> T:
        """Start the executor while `plan()` runs; returns what `plan()` returns.

        Ray starts in the main thread: it ties the lives of the processes it starts to
        the thread that started them, so a start in a thread that ends kills them. Ray
        starts here while `plan()` runs in a thread; the local pool starts in the
        background while `plan()` runs here. An error of `plan()` wins over the start's.
        """
        if self.kind == "inline":
            return plan()
        if self.kind == "local":
            self.begin_pool()
            return plan()
        planning = BackgroundStart(plan, "plan")
        try:
            self.start_ray_now()
        except BaseException:
            planning.join()  # done writing its files before they are cleaned up
            planning.result()  # a planning error is the one to report
            raise
        result = planning.result()
        self.ray_wait_s = max(0.0, self.ray_done - (planning.since + planning.seconds))
        return result

    def begin_pool(self) -> None:
        """Launch the local pool in the background, once."""
        if self.starting is not None:
            return
        since = time.perf_counter()
        if (method := start_method()) == "fork":
            # Forked here, before the start's thread exists; the warm-ups run meanwhile.
            start: Callable[[], LocalPool] = LocalPool(local_workers(self.workers), method).ready
        else:
            start = partial(start_pool, local_workers(self.workers), method)
        self.starting = BackgroundStart(start, "start local pool", since)

    def start_ray_now(self) -> None:
        """Start Ray in this (the main) thread, once."""
        if self.ray_s is not None:
            return
        began = time.perf_counter()
        ray = sys.modules.get("ray")
        running = ray is not None and ray.is_initialized()
        self.start_ray(self.ray_address, self.workers)
        self.ray_ours = not running
        self.ray_done = time.perf_counter()
        self.ray_s = self.ray_done - began

    def iter_results(
        self, tasks: Iterable[ShardPiece | ShardTask], job: ShardJob
    ) -> Iterator[ShardResult]:
        """Wait for the start (begun now if it was not: its error is raised here), then run."""
        if self.kind == "inline":
            return iter_inline(tasks, job)
        if self.kind == "ray":
            if self.ray_s is None:  # not started while planning: all of it is waited for
                self.start_ray_now()
                self.ray_wait_s = self.ray_s or 0.0
            return self.iter_ray(tasks, job, self.ray_address, self.workers)
        self.begin_pool()
        assert self.starting is not None
        self.pool = self.starting.result()
        return iter_local(tasks, job, self.pool)

    def slots(self) -> int:
        """Tasks run at once, once started."""
        if self.kind == "ray":
            return ray_slots()
        return self.pool.workers if self.pool is not None else 1

    @property
    def start_s(self) -> float:
        """How long the start took (mostly while the driver planned)."""
        if self.kind == "ray":
            return self.ray_s or 0.0
        return self.starting.seconds if self.starting is not None else 0.0

    @property
    def wait_s(self) -> float:
        """How long the driver waited for the start, beyond planning."""
        if self.kind == "ray":
            return self.ray_wait_s
        return self.starting.waited if self.starting is not None else 0.0

    def close(self) -> None:
        """Wait for a start still running and stop the pool (the shards in flight finish);
        end the Ray this build started, or leave the cluster it joined (a caller's own Ray
        stays up). A Ray left running would hold its processes and make every later
        loader in this process spawn its workers (`pipeline.worker_start`).

        A start that failed and was never waited for (planning failed first) is dropped:
        the planning error is the one to report.
        """
        if self.ray_ours:
            import ray

            ray.shutdown()
            self.ray_ours = False
        if self.starting is None:
            return
        pool = self.starting.join()
        if isinstance(pool, LocalPool):
            pool.close()
