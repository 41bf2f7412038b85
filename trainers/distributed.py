"""Process group, device and rank-aware logging: what `torchrun` (and Slurm through it) hands us.

`torchrun` sets RANK, WORLD_SIZE and LOCAL_RANK; we rendezvous with `env://`,
NCCL on GPUs and gloo on CPUs. A single process without those variables runs
undistributed, with the same code path (world size 1).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shards.errors import UsageError
from shards.flags import StderrHandler

log = logging.getLogger("trainers")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: rank, world size, and its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class DeviceError(UsageError, RuntimeError):
    """The device asked for is not there, or too small for the job (not a bug in our code)."""


def check_device(name: str) -> None:
    """`--device cuda` needs a CUDA build of torch and a visible GPU; say which is missing."""
    if name != "cuda" or torch.cuda.is_available():
        return
    why = (
        f"torch {torch.__version__} is built without CUDA"
        if torch.version.cuda is None
        else "no GPU is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    )
    raise DeviceError(f"--device cuda, but CUDA is not available: {why}; use --device cpu")


def resolve_device(name: str, local_rank: int) -> torch.device:
    """`auto` picks CUDA when present; under torchrun each rank takes GPU `LOCAL_RANK`."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        check_device(name)
        if local_rank >= torch.cuda.device_count():
            raise DeviceError(
                f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPUs are visible; "
                "start at most one process per GPU (torchrun --nproc-per-node)"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_distributed(device_name: str, timeout_s: int) -> DistInfo:
    """Join the process group when launched by torchrun; otherwise a world of one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method="env://",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank, world_size, local_rank, device)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish_together(info: DistInfo) -> None:
    """A barrier after a successful run, so that no rank tears gloo down while a peer
    still finishes (rank 0 draws the plot): a rank exiting that early was seen to
    abort with "terminate called without an active exception" (cf. pytorch#179291).
    Only on success: after an error a barrier could wait for a rank that is gone.
    """
    if info.distributed:
        dist.barrier()


def all_reduce(values: list[float], info: DistInfo, op: str = "sum") -> list[float]:
    """Sum (or max) a few floats over ranks; a no-op in a world of one."""
    if not info.distributed:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=info.device)
    reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
    dist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def all_reduce_tensor(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """In-place sum of a device tensor over ranks (e.g. eval counts)."""
    if info.distributed:
        dist.all_reduce(tensor)
    return tensor


def broadcast_error(message: str | None, info: DistInfo) -> str | None:
    """Rank 0's error message (or None) on every rank, so all ranks stop together."""
    if not info.distributed:
        return message
    box = [message]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: object, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order (small, trusted, in-job objects only)."""
    if not info.distributed:
        return [obj]
    out: list = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


class RankFilter(logging.Filter):
    """Adds `rank` to records so the format can show it."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(info: DistInfo) -> None:
    """INFO on rank 0, WARNING and up on the other ranks, each line tagged with its rank."""
    handler = StderrHandler()  # the current sys.stderr: main() may run again under another
    handler.addFilter(RankFilter(info.rank))
    tag = "[rank %(rank)d] " if info.distributed else ""
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {tag}%(levelname)s %(message)s", "%H:%M:%S")
    )
    level = logging.INFO if info.is_main else logging.WARNING
    for name in ("trainers", "pipeline"):
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            if any(isinstance(f, RankFilter) for f in old.filters):
                logger.removeHandler(old)  # a second main() in one process: no double lines
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
