"""`Workers`: the loader's worker processes, local or as Ray actors on a cluster.

Where worker roles run (`placement`) and what each asks of the machine or the cluster;
a settings group of `LoaderOptions` that checks itself where it is made. No torch, no Ray.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from pipeline.worker_start import START_METHODS
from shards.cluster import ray_address_option
from shards.errors import UsageError
from shards.flags import (
    check_at_least,
    check_choice,
    check_flag,
    check_int_at_least,
    option,
    refuse,
)

PLACEMENTS = ("local", "ray")  # where worker roles run (`Workers.placement`)
FALLBACKS = ("error", "local")  # a cluster without room for the remote roles (`Workers.fallback`)
WIRES = ("channel", "object_store")  # how remote roles' image batches travel (`Workers.ray_wire`)


def default_workers() -> int:
    """DataLoader workers by default: one per CPU, up to 8."""
    return min(8, os.cpu_count() or 1)


def parse_resources(text: str) -> dict:
    """`'{"cpu_node": 1}'` -> `{"cpu_node": 1}`: the JSON object of `--ray-resources`
    (what its names and amounts may be is `check_resources`'s)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(
            f"{text!r} is not JSON ({error}); write e.g. '{{\"cpu_node\": 1}}'"
        ) from error
    if not isinstance(value, dict):
        raise UsageError(f"{text!r} is not a JSON object; write e.g. '{{\"cpu_node\": 1}}'")
    return value


@dataclass(frozen=True)
class Workers:
    """The DataLoader's worker processes.

    Attributes:
        count: worker processes (0: read in the main process).
        prefetch_factor: batches each worker builds ahead.
        persistent: workers live across epochs.
        pin_memory: page-locked batches; default (None): when CUDA is available.
        reuse_buffers: workers build batches in a ring of reused shared-memory slots
            (`pipeline.batchring`), `prefetch_factor + 2` batches per worker, instead
            of fresh shared memory per batch (~8% of a worker's time goes to new pages
            otherwise). Safe when batches are held: a slot is reused only once no
            tensor over it is left. Needs persistent workers when `count > 0`.
        start_method: how local workers start: `auto` forks them, unless this process runs
            torch.distributed, Ray or CUDA (their threads can leave a forked worker hung
            as it starts: `pipeline.worker_start`); then they are spawned, which needs the
            dataset (custom transforms and ops included) to pickle. `fork` or `spawn`
            asks for one.
        placement: `local` (worker processes of this machine) or `ray`: `remote` worker
            roles run as Ray actors on the cluster (`pipeline.remote`) and stream their
            uint8 batches here, `prefetch_factor` in flight per role, beside `count` local
            roles (DataLoader workers; 0: only remote ones).
        ray_address: the cluster (default: `RAY_ADDRESS`, else a local Ray).
        remote: worker roles on the cluster (`placement="ray"`).
        ray_cpus: CPUs each role's actor asks of the cluster.
        ray_resources: custom resources each actor asks for, e.g. `{"cpu_node": 1}` to keep
            the roles on nodes started with `--resources='{"cpu_node": 8}'`.
        fallback: when the cluster cannot hold the `remote` roles at start (its CPUs or
            `ray_resources` in all fall short): `error`, one `ClusterError` line, or `local`:
            one warning line naming the cluster and what it lacks, then the same roles run
            as local DataLoader workers (`count + remote` of them, `as_local()`), so the
            epoch, its order and `state_dict()` are those of Ray placement. A node lost
            mid-epoch with no room left is a `ClusterError` either way (LOADER.md says why).
        ray_wire: how a remote role's image batches reach the training process: `channel`,
            one TCP connection from the role's actor, token-checked, straight into the
            batch's buffer (`pipeline.channel`), or `object_store`, Ray's (its raylets
            copy every byte on both nodes: ~0.25 ms of CPU an image at 224 px, against the
            channel's one kernel copy a side). Either way Ray carries the rest of the
            batch and the actor's life; `object_store` where the cluster's nodes cannot
            open connections to each other on free ports.
    """

    count: int = option(
        default_factory=default_workers,
        text="loader worker processes per rank; default: one per CPU, up to 8",
        group="workers",
        flag="workers",
    )
    prefetch_factor: int = option(2, "batches each worker builds ahead", "workers")
    persistent: bool = option(
        True, "loader workers live across epochs", "workers", flag="persistent_workers"
    )
    pin_memory: bool | None = option(
        None, "page-locked batches; default: when CUDA is available", "workers", cli=False
    )
    reuse_buffers: bool = option(
        True, "workers build batches in reused shared-memory slots", "workers"
    )
    start_method: str = option(
        "auto",
        "how loader workers start: auto (fork, or spawn where this process runs "
        "torch.distributed, Ray or CUDA), fork or spawn",
        "workers",
        START_METHODS,
        flag="worker_start",
    )
    placement: str = option(
        "local",
        "where the worker roles run: local (worker processes here) or ray (--remote-workers "
        "roles as Ray actors on the cluster, beside --workers local ones)",
        "workers",
        PLACEMENTS,
        flag="worker_placement",
    )
    ray_address: str | None = ray_address_option(
        "the --worker-placement ray roles run on", "a Ray started on this machine", "workers"
    )
    remote: int = option(
        2,
        "with --worker-placement ray: worker roles on the Ray cluster",
        "workers",
        flag="remote_workers",
    )
    ray_cpus: float = option(
        1.0, "with --worker-placement ray: CPUs each remote role asks of the cluster", "workers"
    )
    ray_resources: dict | None = option(
        None,
        "with --worker-placement ray: custom resources each remote role asks for, as JSON, "
        "e.g. '{\"cpu_node\": 1}' to keep the roles on nodes started with that resource; "
        "default: none",
        "workers",
        parse=parse_resources,
        metavar="JSON",
    )
    fallback: str = option(
        "error",
        "with --worker-placement ray: a cluster without room for the remote roles at start is "
        "one error line (error), or a warning and the same roles as local workers (local)",
        "workers",
        FALLBACKS,
        flag="ray_fallback",
    )
    ray_wire: str = option(
        "channel",
        "with --worker-placement ray: image batches come over one token-checked TCP "
        "connection per role (channel), or through Ray's object store (object_store)",
        "workers",
        WIRES,
    )

    def __post_init__(self) -> None:
        check_int_at_least(self, "count", 0)
        check_int_at_least(self, "prefetch_factor", 1)
        check_flag(self, "persistent")
        check_flag(self, "pin_memory", optional=True)
        check_flag(self, "reuse_buffers")
        check_choice(self, "start_method", START_METHODS)
        check_choice(self, "placement", PLACEMENTS)
        check_int_at_least(self, "remote", 1)
        check_at_least(self, "ray_cpus", 0)
        check_resources(self, "ray_resources")
        check_choice(self, "fallback", FALLBACKS)
        check_choice(self, "ray_wire", WIRES)

    def as_local(self) -> Workers:
        """The same roles, all as local DataLoader workers: `placement="ray"` falling back
        (`fallback="local"`). The plan has `count + remote` roles either way."""
        return replace(self, placement="local", count=self.count + self.remote)


def check_resources(group: object, name: str) -> None:
    """None, or Ray custom resources: names other than CPU and GPU, positive amounts."""
    value = getattr(group, name)
    if value is None:
        return
    if not isinstance(value, dict):
        raise refuse(group, name, f" must be a mapping of resource name to amount, got {value!r}")
    for key, amount in value.items():
        if not isinstance(key, str) or not key or key in ("CPU", "GPU"):
            raise refuse(
                group,
                name,
                f" names custom resources, not CPU or GPU (the CPUs of a role are ray_cpus, "
                f"--ray-cpus), got {key!r}",
            )
        number = isinstance(amount, (int, float)) and not isinstance(amount, bool)
        if not number or amount <= 0:
            raise refuse(group, name, f" amounts must be positive numbers, got {key!r}: {amount!r}")
