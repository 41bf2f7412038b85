"""A worker's delivery for an epoch, including one resumed mid-epoch (`plan_worker`).

A state records, for the current epoch, the segments it was read in: each
segment is a partition (world size, workers, batch, rules) and the number of
batches every rank consumed under it. With the same partition the resumed run
skips exactly the consumed batches and continues the identical sequence. With
another partition (say 2 ranks -> 1) the consumed samples are recomputed by
replaying the positions through the same seeded shuffle, and the rest of the
epoch is split afresh: no sample lost or doubled within the epoch. Only the
replayed samples are ever held one by one; the rest of the epoch stays `Runs`.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import numpy as np

from pipeline.plan import (
    EpochLayout,
    Partition,
    Pieces,
    Runs,
    shuffle_buffer,
    worker_rng,
    worker_runs,
)


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


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker slot reads in an epoch, before its shuffle buffer.

    Attributes:
        pieces: runs of consecutive samples of shards, in read order.
        samples: how many samples the pieces hold.
        batches: how many batches the worker yields (its last may be partial).
    """

    pieces: Pieces
    samples: int
    batches: int


def plan_worker(
    layout: EpochLayout, segments: list[Segment], part: Partition, rank: int, role: int
) -> WorkerPlan:
    """The one description of a worker's delivery: what slot `role` of `rank` reads.

    O(shards it touches) without earlier segments; with them, plus the samples
    those segments consumed (replayed, see `remaining_runs`).

    Args:
        layout: the epoch's shard order and stream positions (`EpochLayout.build`).
        segments: earlier partitions of this epoch whose deliveries are excluded.
        part: the partition this worker reads under.
    """
    remaining = remaining_runs(layout.total, segments, layout.seed, layout.epoch)
    positions, batches = worker_runs(remaining, part, rank, role)
    return WorkerPlan(layout.pieces(positions), len(positions), batches)


def roles_consumed(consumed: int, num_workers: int) -> list[int]:
    """Batches each worker slot had delivered after `consumed` batches of a rank."""
    return [len(range(w, consumed, num_workers)) for w in range(num_workers)]


def consumed_positions(
    remaining: Runs | np.ndarray, segment: Segment, seed: int, epoch: int
) -> np.ndarray:
    """Positions delivered during `segment`, found by replaying every rank's shuffle.

    Costs O(consumed samples): each worker's shuffle is replayed only as far as it read.

    Args:
        remaining: the positions the segment was read from (sorted), as runs or an array.
    """
    if isinstance(remaining, np.ndarray):
        remaining = Runs.from_positions(remaining)
    part = segment.partition
    done = roles_consumed(segment.consumed, part.num_workers)
    taken = []
    for rank in range(part.world_size):
        for role in range(part.num_workers):
            if done[role] == 0:
                continue
            positions, _ = worker_runs(remaining, part, rank, role)
            count = min(done[role] * part.batch_size, len(positions))
            if count == 0:
                continue
            rng = worker_rng(seed, epoch, rank, role)
            order = shuffle_buffer(
                range(len(positions)), part.shuffle_buffer, part.shuffle_initial, rng
            )
            picked = np.fromiter(itertools.islice(order, count), dtype=np.int64, count=count)
            taken.append(positions.take(picked))
    return np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)


def remaining_runs(total: int, segments: list[Segment], seed: int, epoch: int) -> Runs:
    """Global positions of the epoch not yet delivered after `segments`, sorted.

    One run `[0, total)` without segments; each segment removes what it consumed.
    """
    remaining = Runs.span(0, total)
    for segment in segments:
        used = np.unique(consumed_positions(remaining, segment, seed, epoch))
        remaining = remaining.without(used)
    return remaining


def remaining_after(total: int, segments: list[Segment], seed: int, epoch: int) -> np.ndarray:
    """`remaining_runs` one position at a time: O(samples), for tests and small tools."""
    return remaining_runs(total, segments, seed, epoch).to_array()


def worker_positions(
    remaining: Runs | np.ndarray, part: Partition, rank: int, role: int
) -> tuple[np.ndarray, int]:
    """`worker_runs` one position at a time: O(samples), for tests and small tools."""
    if isinstance(remaining, np.ndarray):
        remaining = Runs.from_positions(remaining)
    positions, batches = worker_runs(remaining, part, rank, role)
    return positions.to_array(), batches
