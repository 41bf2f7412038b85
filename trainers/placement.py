"""Where the train loader's worker roles run (`--worker-placement`): the settings that go
with each placement, the Ray cluster a run joins for the whole run, and how the log names it.

The loader itself runs the roles (`pipeline.remote`); the trainer's part is what only a
run knows: its ranks share one cluster, and it leaves the cluster it joined when it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator

from pipeline.config import Workers
from shards.cluster import ray_address, start_ray
from shards.errors import UsageError
from shards.flags import flag_name, flag_specs, flag_text
from shards.redact import redact_url

log = logging.getLogger("trainers")

# The `Workers` fields that mean something only under Ray placement.
RAY_SETTINGS = ("ray_address", "remote", "ray_cpus", "ray_resources", "fallback", "ray_wire")


def check_placement_settings(workers: Workers) -> None:
    """A Ray setting given with local placement would be ignored without a word: refuse it.

    Raises:
        UsageError: one line naming the flag, e.g. `--remote-workers 4 is for
            --worker-placement ray ...`.
    """
    if workers.placement != "local":
        return
    flags = {spec.path[-1]: spec.dest for spec in flag_specs(Workers)}
    for field in dataclasses.fields(Workers):
        value = getattr(workers, field.name)
        if field.name in RAY_SETTINGS and value != field.default:
            dest = flags[field.name]
            raise UsageError(
                f"{flag_text(dest, value)} is for --worker-placement ray (worker roles on a "
                f"Ray cluster), but the placement is local: add --worker-placement ray, or "
                f"leave --{flag_name(dest)} out"
            )


@contextlib.contextmanager
def worker_cluster(workers: Workers, world_size: int) -> Iterator[None]:
    """For the whole run under Ray placement: join the cluster (`--ray-address`, else
    `RAY_ADDRESS`, else a Ray started on this machine) and leave it at the end, which ends
    this process's role actors. Under local placement, nothing. One rank with
    `--ray-fallback local` joins when its loader starts its roles instead.

    Every rank runs its own roles as actors of its own, on one cluster they share.

    Raises:
        UsageError: several ranks and no cluster address (each rank would start a Ray
            of its own on its machine).
        ClusterError: no cluster answers at the address, or it cannot hold the roles of
            every rank at once (`remote` actors of `ray_cpus` CPUs and `ray_resources`
            each; with one rank and `--ray-fallback local`, its loader runs them here
            instead), one line.
    """
    if workers.placement != "ray":
        yield
        return
    import ray

    if world_size > 1 and ray_address(workers.ray_address) is None:
        raise UsageError(
            f"--worker-placement ray with {world_size} ranks needs one Ray cluster they "
            "share: pass --ray-address (or set RAY_ADDRESS); without it each rank would "
            "start a Ray of its own"
        )
    joined = not ray.is_initialized()
    # One rank that may fall back to local workers joins through its loader, which leaves
    # the cluster again when it falls back (`pipeline.remote.start_remote_roles`): held
    # here, a Ray started on this machine would idle beside the run to its end.
    if world_size > 1 or workers.fallback == "error":
        start_ray(workers.ray_address, None, "--ray-address", log)
    try:
        if world_size > 1 or workers.fallback == "error":
            check_room(workers, world_size, ray.cluster_resources())
        yield
    finally:
        if joined and ray.is_initialized():
            ray.shutdown()


def check_room(workers: Workers, world_size: int, resources: dict) -> None:
    """The cluster holds every rank's roles at once, said in flags when it does not.

    Each rank's loader checks the cluster for its own roles only (and with
    `--ray-fallback local` runs them here when they do not fit): with several ranks, all
    their roles must fit, or the last ranks' actors would wait for room that never comes.
    """
    from pipeline.remote import check_capacity

    if world_size == 1:
        advice = "ask for fewer --remote-workers, or pass --ray-fallback local"
        check_capacity(workers, resources, advice=advice)
        return
    every_rank = dataclasses.replace(workers, remote=workers.remote * world_size)
    context = f"{world_size} ranks each run --remote-workers {workers.remote} roles, and "
    advice = "ask for fewer --remote-workers (every rank's roles run at once)"
    check_capacity(every_rank, resources, context, advice)


def workers_text(workers: Workers) -> str:
    """Where one rank's worker roles run, for the start-up log: `4 workers per rank`, or
    `2 remote roles per rank on ray://head:10001 (1 CPU each), 0 local workers`."""
    if workers.placement == "local":
        return f"{workers.count} workers per rank"
    address = ray_address(workers.ray_address)
    where = redact_url(address) if address else "a Ray started on this machine"
    asks = f"{workers.ray_cpus:g} CPU each"
    if workers.ray_resources:
        asks += f", resources {json.dumps(workers.ray_resources)}"
    if workers.ray_wire == "object_store":
        asks += ", batches through the object store"
    return (
        f"{workers.remote} remote roles per rank on {where} ({asks}), {workers.count} local workers"
    )


def scaling_flag(workers: Workers) -> tuple[str, int]:
    """The flag that adds worker roles, and its value: what an input-bound run should raise."""
    if workers.placement == "ray":
        return "--remote-workers", workers.remote
    return "--workers", workers.count
