"""Mid-epoch resume: turn a loader state into what each worker must skip or still read.

A state records, for the current epoch, the segments it was read in: each
segment is a partition (world size, workers, batch, rules) and the number of
batches every rank consumed under it. With the same partition the resumed run
skips exactly the consumed batches and continues the identical sequence. With
another partition (say 2 ranks -> 1) the consumed samples are recomputed by
replaying the positions through the same seeded shuffle, and the rest of the
epoch is split afresh: no sample lost or doubled within the epoch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from pipeline.plan import Partition, rank_slice, shuffle_buffer, worker_rng, worker_slice


@dataclass(frozen=True)
class Segment:
    """Part of an epoch read under one partition; `consumed` batches per rank."""

    partition: Partition
    consumed: int

    def to_dict(self) -> dict:
        return {**asdict(self.partition), "consumed": self.consumed}

    @classmethod
    def from_dict(cls, data: dict) -> Segment:
        data = dict(data)
        consumed = data.pop("consumed")
        return cls(Partition(**data), consumed)


def roles_consumed(consumed: int, num_workers: int) -> list[int]:
    """Batches each worker slot had delivered after `consumed` batches of a rank."""
    return [len(range(w, consumed, num_workers)) for w in range(num_workers)]


def worker_positions(
    remaining: np.ndarray, part: Partition, rank: int, role: int
) -> tuple[np.ndarray, int]:
    """Positions read by worker slot `role` of `rank`, and its batch count."""
    index, _ = rank_slice(len(remaining), part, rank)
    start, stop, batches = worker_slice(len(index), part, role)
    return remaining[index[start:stop]], batches


def consumed_positions(
    remaining: np.ndarray, segment: Segment, seed: int, epoch: int
) -> np.ndarray:
    """Positions delivered during `segment`, found by replaying every rank's shuffle."""
    part = segment.partition
    done = roles_consumed(segment.consumed, part.num_workers)
    taken = []
    for rank in range(part.world_size):
        for role in range(part.num_workers):
            positions, _ = worker_positions(remaining, part, rank, role)
            count = min(done[role] * part.batch_size, len(positions))
            if count == 0:
                continue
            rng = worker_rng(seed, epoch, rank, role)
            order = shuffle_buffer(
                range(len(positions)), part.shuffle_buffer, part.shuffle_initial, rng
            )
            picked = [next(order) for _ in range(count)]
            taken.append(positions[np.asarray(picked, dtype=np.int64)])
    return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)


def remaining_after(total: int, segments: list[Segment], seed: int, epoch: int) -> np.ndarray:
    """Global positions of the epoch not yet delivered after `segments`, in stream order."""
    remaining = np.arange(total, dtype=np.int64)
    for segment in segments:
        used = consumed_positions(remaining, segment, seed, epoch)
        remaining = remaining[~np.isin(remaining, used)]
    return remaining
