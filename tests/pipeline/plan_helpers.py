"""The epoch plan of one source, asked one piece at a time: what the plan tests compare.

`pipeline.epoch` plans every loader's sources as a mix (one plain source is a mix of
one); these helpers ask it the questions the tests' references answer position by
position, for one unnamed source.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from pipeline.epoch import EpochPlan, Mix, WorkerPlan, remaining_quota, source_rng
from pipeline.plan import Partition, Segment, rank_slice, worker_slice
from pipeline.positions import Pieces, Runs


def remaining_runs(total: int, segments: Sequence[Segment], seed: int, epoch: int) -> Runs:
    """Positions of one source's epoch of `total` samples not delivered by `segments`."""
    return remaining_quota(Mix.one([total]), segments, seed, epoch)[0]


def worker_runs(remaining: Runs, part: Partition, rank: int, role: int) -> tuple[Runs, int]:
    """Positions slot `role` of `rank` reads of `remaining`, in read order, and its batches:
    the rank's slice, then the slot's run of whole batches of it."""
    index, _ = rank_slice(len(remaining), part, rank)
    start, stop, batches = worker_slice(len(index), part, role)
    return remaining.at(index.select(start, stop)), batches


def consumed_positions(
    remaining: np.ndarray, segment: Segment, seed: int, epoch: int
) -> np.ndarray:
    """Positions of `remaining` (one source's) that `segment` delivered, by replay."""
    runs = Runs.from_positions(remaining)
    plan = EpochPlan.unsliced(Mix.one([len(runs)]), segment.partition, seed, epoch, (runs,))
    return plan.consumed(segment.consumed)[0]


def worker_rng(seed: int, epoch: int, rank: int, role: int) -> random.Random:
    """The shuffle buffer of an unnamed source's slot."""
    return source_rng(seed, epoch, rank, role, "")


def slot_pieces(slot: WorkerPlan) -> Pieces:
    """A one-source slot's pieces as one `Pieces` (whole passes laid out), as arrays."""
    pieces = slot.parts[0].pieces
    arrays = []
    for chunk in pieces.chunks:
        if isinstance(chunk, range):
            arrays += [pieces.epoch.whole_pass(repeat) for repeat in chunk]
        else:
            arrays.append(chunk[0])
    if not arrays:
        return Pieces.empty()
    columns = ("shards", "starts", "stops")
    return Pieces(*(np.concatenate([getattr(a, c) for a in arrays]) for c in columns))


def slot_chunk(slot: WorkerPlan) -> Pieces:
    """A one-source slot's pieces as the plan holds them: its one chunk's arrays."""
    (chunk,) = slot.parts[0].pieces.chunks
    return chunk[0]
