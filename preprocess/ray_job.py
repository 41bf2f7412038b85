"""Run shard tasks on Ray (local or a cluster), or inline for debugging.

One task per shard, exactly one per CPU in flight (taken largest first, so no
shard waits in Ray's queue behind others while a CPU idles at the end) and the
driver's memory stays flat however many shards there are. `start_ray` (`shards.cluster`,
shared with the loader's remote roles) runs in the
main thread while the driver plans in another (`preprocess.pool.ShardExecutor`). Tasks are retried by Ray when a worker or
node dies (`max_retries`); a data error never fails a task (it is a skip) and
an environment error fails the job at once rather than being retried. A task
killed with its node leaves its temp files behind: they are swept once every
task has finished, so the output holds exactly what a fault-free run writes.
A task is a `ShardPiece` (a place in the plan files, which the task reads) or,
for an object-store output, the `ShardTask` the driver loaded from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from preprocess.build import ShardJob, ShardResult, build_shard
from preprocess.plan import ShardPiece, ShardTask, load_task
from shards import cluster
from shards.cluster import ray_slots
from shards.errors import ShardpipeError

TASK_RETRIES = 3

log = logging.getLogger(__name__)


class BuildError(ShardpipeError, RuntimeError):
    """The build cannot go on; the message says what to do."""


def iter_inline(tasks: Iterable[ShardPiece | ShardTask], job: ShardJob) -> Iterator[ShardResult]:
    """Run tasks one after another in this process."""
    for task in tasks:
        yield build_with_options(task, job)


def iter_ray(
    tasks: Iterable[ShardPiece | ShardTask],
    job: ShardJob,
    address: str | None,
    workers: int | None,
) -> Iterator[ShardResult]:
    """Run tasks on Ray and yield results as they complete (not in task order).

    `tasks` is consumed lazily, as slots free up, so a driver that loads pieces
    into tasks holds only those in flight.
    """
    import ray

    start_ray(address, workers)
    remote_build = ray.remote(build_with_options).options(num_cpus=1, max_retries=TASK_RETRIES)
    # The job travels once through the object store; Ray resolves the reference
    # before each task runs.
    job_ref = ray.put(job)
    max_in_flight = ray_slots()
    pending: dict = {}
    queue = iter(tasks)
    try:
        while True:
            while len(pending) < max_in_flight and (task := next(queue, None)) is not None:
                pending[remote_build.remote(task, job_ref)] = task
            if not pending:
                # Each attempt writes temp files of its own name and a retry never
                # reuses them; with every task done no writer is left, so any temp
                # file now is an orphan of an attempt whose worker or node died.
                job.open_store().remove_stale_temps()
                return
            done, _ = ray.wait(list(pending), num_returns=1)
            task = pending.pop(done[0])
            try:
                yield ray.get(done[0])
            except ray.exceptions.RayTaskError as error:
                cause = error.cause if getattr(error, "cause", None) else error
                raise BuildError(f"shard {task.split}-{task.index:06d} failed: {cause}") from error
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


def start_ray(address: str | None, workers: int | None) -> None:
    """Start a local Ray or join the cluster (`shards.cluster.start_ray`), logged as one
    step of the build."""
    cluster.start_ray(address, workers, "--ray-address", log)


def build_with_options(task: ShardPiece | ShardTask, job: ShardJob) -> ShardResult:
    """`build_shard` of a task or of its place in the plan files (the task of every executor)."""
    if isinstance(task, ShardPiece):
        task = load_task(task)
    return build_shard(task, job)
