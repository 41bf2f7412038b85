"""`Workers`: the loader's worker processes, local or as Ray actors on a cluster.

Where worker roles run (`placement`) and what each asks of the machine or the cluster;
a settings group of `LoaderOptions` that checks itself where it is made. No torch, no Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shards.flags import check_at_least, check_choice, check_flag, check_int_at_least, option

PLACEMENTS = ("local", "ray")  # where worker roles run (`Workers.placement`)


def default_workers() -> int:
    """DataLoader workers by default: one per CPU, up to 8."""
    return min(8, os.cpu_count() or 1)


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
        placement: `local` (worker processes of this machine) or `ray`: `remote` worker
            roles run as Ray actors on the cluster (`pipeline.remote`) and stream their
            uint8 batches here, `prefetch_factor` in flight per role, beside `count` local
            roles (DataLoader workers; 0: only remote ones).
        ray_address: the cluster (default: `RAY_ADDRESS`, else a local Ray).
        remote: worker roles on the cluster (`placement="ray"`).
        ray_cpus: CPUs each role's actor asks of the cluster.
        ray_resources: custom resources each actor asks for, e.g. `{"cpu_node": 1}` to keep
            the roles on nodes started with `--resources='{"cpu_node": 8}'`.
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
    placement: str = option("local", "where worker roles run", "workers", PLACEMENTS, cli=False)
    ray_address: str | None = option(None, "the Ray cluster", "workers", cli=False)
    remote: int = option(2, "worker roles on the Ray cluster", "workers", cli=False)
    ray_cpus: float = option(1.0, "CPUs of each remote role", "workers", cli=False)
    ray_resources: dict | None = option(None, "resources of each remote role", "workers", cli=False)

    def __post_init__(self) -> None:
        check_int_at_least(self, "count", 0)
        check_int_at_least(self, "prefetch_factor", 1)
        check_flag(self, "persistent")
        check_flag(self, "pin_memory", optional=True)
        check_flag(self, "reuse_buffers")
        check_choice(self, "placement", PLACEMENTS)
        check_int_at_least(self, "remote", 1)
        check_at_least(self, "ray_cpus", 0)
