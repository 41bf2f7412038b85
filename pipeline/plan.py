"""Which samples each rank and worker reads in an epoch, and in what order.

Everything here works on integer positions, never on data, so it is cheap,
exactly reproducible, and can be replayed to find what an interrupted run had
already consumed. An epoch's global stream is the concatenation of all shards
in a `seed + epoch` permutation (the same on every rank); ranks take equal
contiguous slices of it, workers take contiguous runs of whole batches of their
rank's slice, and a seeded shuffle buffer mixes each worker's run.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

T = TypeVar("T")
EPOCH_RULES = ("pad", "drop", "uneven")


@dataclass(frozen=True)
class Piece:
    """A run of consecutive samples `[start, stop)` of one shard."""

    shard: int  # index into the loader's shard list
    start: int
    stop: int


@dataclass(frozen=True)
class Partition:
    """The shape of one epoch: a pure function of counts and the loader settings."""

    world_size: int
    num_workers: int  # worker slots (1 when the DataLoader runs in-process)
    batch_size: int
    drop_last: bool
    rule: str  # pad | drop | uneven
    shuffle_buffer: int = 1  # 1: no sample shuffle (evaluation)
    shuffle_initial: int = 1


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shard permutation; identical on every rank, new every epoch."""
    order = list(range(num_shards))
    random.Random(f"shards:{seed}:{epoch}").shuffle(order)
    return order


def rank_slice(total: int, part: Partition, rank: int) -> tuple[np.ndarray, int]:
    """Indices into the epoch's remaining positions for `rank`, and the pad count.

    `pad` repeats the first few positions so every rank gets `ceil(total/W)`;
    `drop` gives every rank `floor(total/W)` and leaves the rest for the next
    epoch's shuffle; `uneven` splits exactly (ranks differ by at most one
    sample: right for evaluation, where nothing may be counted twice).
    """
    world = part.world_size
    if part.rule == "pad":
        per_rank = -(-total // world)
        padded = per_rank * world
        index = np.arange(rank * per_rank, (rank + 1) * per_rank) % max(total, 1)
        return (index if total else index[:0]), padded - total
    if part.rule == "drop":
        per_rank = total // world
        return np.arange(rank * per_rank, (rank + 1) * per_rank), 0
    bounds = [total * r // world for r in range(world + 1)]
    return np.arange(bounds[rank], bounds[rank + 1]), 0


def batches_for(samples: int, part: Partition) -> int:
    """Batches a rank yields from `samples` samples."""
    if part.drop_last:
        return samples // part.batch_size
    return -(-samples // part.batch_size)


def worker_slice(rank_samples: int, part: Partition, worker: int) -> tuple[int, int, int]:
    """`(start, stop, batches)` of `worker` within its rank's samples.

    The DataLoader takes batch j from worker `j % num_workers`, so a worker owns
    `len(range(worker, n, num_workers))` batches. Workers read contiguous runs
    (few shard opens); the worker that owns the last, possibly partial batch is
    laid out last so its partial batch is also its final one.
    """
    total_batches = batches_for(rank_samples, part)
    used = min(rank_samples, total_batches * part.batch_size)
    nw = part.num_workers
    counts = [len(range(w, total_batches, nw)) for w in range(nw)]
    last_owner = (total_batches - 1) % nw if total_batches else nw - 1
    layout = [w for w in range(nw) if w != last_owner] + [last_owner]
    start = 0
    for w in layout:
        size = counts[w] * part.batch_size
        if w == last_owner:
            size = used - start
        if w == worker:
            return start, start + size, counts[w]
        start += size
    raise ValueError(f"worker {worker} out of range for {nw} workers")


def positions_to_pieces(positions: np.ndarray, order: list[int], counts: list[int]) -> list[Piece]:
    """Map global stream positions to runs of consecutive samples within shards."""
    ordered_counts = np.asarray([counts[s] for s in order], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(ordered_counts)])
    slot = np.searchsorted(starts, positions, side="right") - 1
    offsets = positions - starts[slot]
    pieces: list[Piece] = []
    run_start = 0
    for i in range(1, len(positions) + 1):
        boundary = (
            i == len(positions) or slot[i] != slot[run_start] or offsets[i] != offsets[i - 1] + 1
        )
        if boundary:
            shard = order[int(slot[run_start])]
            pieces.append(Piece(shard, int(offsets[run_start]), int(offsets[i - 1]) + 1))
            run_start = i
    return pieces


def shuffle_buffer(items: Iterable[T], size: int, initial: int, rng: random.Random) -> Iterator[T]:
    """Mix a stream through a buffer of at most `size` items.

    Starts emitting once `initial` items are held, and grows to `size` while
    emitting (webdataset's scheme), so the first batch comes quickly. The same
    code shuffles samples and, in a replay, plain integers: that is what makes
    consumed samples computable after an interruption.
    """
    if size <= 1:
        yield from items
        return
    initial = max(1, min(initial, size))
    buffer: list[T] = []
    source = iter(items)
    for item in source:
        buffer.append(item)
        if len(buffer) < size:
            extra = next(source, _END)
            if extra is not _END:
                buffer.append(extra)
        if len(buffer) >= initial:
            yield _pick(buffer, rng)
    while buffer:
        yield _pick(buffer, rng)


_END = object()


def _pick(buffer: list, rng: random.Random):
    index = rng.randrange(len(buffer))
    buffer[index], buffer[-1] = buffer[-1], buffer[index]
    return buffer.pop()


def worker_rng(seed: int, epoch: int, rank: int, worker: int) -> random.Random:
    return random.Random(f"buffer:{seed}:{epoch}:{rank}:{worker}")
