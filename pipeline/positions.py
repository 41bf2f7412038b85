"""Positions of an epoch's global stream: runs of integers (`Runs`), the shard layout that
maps them to shards (`EpochLayout`) and the pieces a worker reads (`Piece`, `Pieces`).

The arithmetic under `pipeline.plan`: no config, no ranks or workers, only integers, so a
plan, its replay and a mix's per-source layouts (`pipeline.mixing`) share one geometry.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)  # slots: a worker may hold one per shard it reads
class Piece:
    """A run of consecutive samples `[start, stop)` of one shard."""

    shard: int  # index into the loader's shard list
    start: int
    stop: int


class Runs:
    """An ordered sequence of integers stored as runs `[starts[i], stops[i])`.

    The epoch's remaining positions are sorted, disjoint runs (one run `[0, total)`
    without a resume); a rank's or worker's share is a few runs of them, in read
    order (a padded rank wraps around once). Empty runs are dropped.
    """

    __slots__ = ("starts", "stops", "ends")

    def __init__(self, starts: Sequence[int] | np.ndarray, stops: Sequence[int] | np.ndarray):
        starts = np.asarray(starts, dtype=np.int64)
        stops = np.asarray(stops, dtype=np.int64)
        keep = stops > starts
        if not keep.all():
            starts, stops = starts[keep], stops[keep]
        self.starts = starts
        self.stops = stops
        self.ends = np.cumsum(stops - starts)  # sequence index just past each run

    @classmethod
    def span(cls, start: int, stop: int) -> Runs:
        """The integers `start, start + 1, ..., stop - 1`."""
        return cls([start], [stop])

    @classmethod
    def from_positions(cls, positions: Sequence[int] | np.ndarray) -> Runs:
        """The runs of consecutive integers in `positions`, order kept."""
        values = np.asarray(positions, dtype=np.int64)
        if not len(values):
            return cls([], [])
        breaks = np.flatnonzero(np.diff(values) != 1) + 1
        firsts = np.concatenate([[0], breaks])
        lasts = np.concatenate([breaks - 1, [len(values) - 1]])
        return cls(values[firsts], values[lasts] + 1)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __repr__(self) -> str:
        runs = ", ".join(
            f"[{a}, {b})" for a, b in zip(self.starts[:4], self.stops[:4], strict=True)
        )
        more = f", ... {len(self.starts) - 4} more" if len(self.starts) > 4 else ""
        return f"Runs({runs}{more})"

    @property
    def begins(self) -> np.ndarray:
        """Sequence index of each run's first item."""
        return self.ends - (self.stops - self.starts)

    def select(self, start: int, stop: int) -> Runs:
        """Items `start` to `stop - 1` of the sequence (a slice, as runs)."""
        start, stop = max(start, 0), min(stop, len(self))
        if start >= stop:
            return Runs([], [])
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right"))
        starts = self.starts[first : last + 1].copy()
        stops = self.stops[first : last + 1].copy()
        starts[0] += start - self.begin_of(first)
        stops[-1] = self.starts[last] + (stop - self.begin_of(last))
        return Runs(starts, stops)

    def begin_of(self, run: int) -> int:
        """Sequence index of run `run`'s first item."""
        return int(self.ends[run] - (self.stops[run] - self.starts[run]))

    def at(self, index: Runs) -> Runs:
        """The items at the sequence indices listed by `index`, in its order."""
        parts = [
            self.select(int(a), int(b)) for a, b in zip(index.starts, index.stops, strict=True)
        ]
        if not parts:
            return Runs([], [])
        return Runs(
            np.concatenate([p.starts for p in parts]), np.concatenate([p.stops for p in parts])
        )

    def take(self, indices: np.ndarray) -> np.ndarray:
        """The items at the sequence indices `indices` (each below `len(self)`)."""
        indices = np.asarray(indices, dtype=np.int64)
        slot = np.searchsorted(self.ends, indices, side="right")
        return self.starts[slot] + (indices - self.begins[slot])

    def without(self, points: np.ndarray) -> Runs:
        """These sorted disjoint runs less `points` (sorted, unique, each one of the items)."""
        points = np.asarray(points, dtype=np.int64)
        # Each point splits its run [s, e) into [s, p) and [p + 1, e); as runs and points
        # are sorted and disjoint, the k-th start pairs with the k-th stop.
        starts = np.sort(np.concatenate([self.starts, points + 1]))
        stops = np.sort(np.concatenate([points, self.stops]))
        return Runs(starts, stops)

    def to_array(self) -> np.ndarray:
        """Every item, one by one: for small sequences (tests, a replay) only."""
        lengths = self.stops - self.starts
        return np.repeat(self.starts - self.begins, lengths) + np.arange(len(self))


def shard_order(num_shards: int, seed: int, epoch: int) -> list[int]:
    """The epoch's shard permutation; identical on every rank, new every epoch."""
    return shard_permutation(num_shards, seed, epoch).tolist()


def compact_dtype(largest: int) -> type[np.signedinteger]:
    """int32 when every value in `[0, largest]` fits in it, else int64.

    For shard indices and offsets within a shard only: stream positions and sums of
    counts stay int64 (10^9 samples and more), where an overflow would go unnoticed.
    """
    return np.int32 if largest < 2**31 else np.int64


def shard_permutation(num_shards: int, seed: int | str, epoch: int | str) -> np.ndarray:
    """`shard_order` as an array: int32 (4 bytes a shard) below 2**31 shards, else int64.

    `random.shuffle` swaps items of any mutable sequence, so shuffling the array through
    a memoryview gives exactly the permutation of shuffling a list, in place, without a
    Python int object per shard (36 bytes each: 36 MiB per worker at 10^6 shards).
    """
    order = np.arange(num_shards, dtype=compact_dtype(num_shards - 1))
    random.Random(f"shards:{seed}:{epoch}").shuffle(memoryview(order))
    return order


@dataclass(frozen=True)
class EpochLayout:
    """Where each shard's samples sit in an epoch's global stream.

    The stream is the shards in `order`, each slot starting where the counts before it
    end. Those starts are summed in blocks as pieces are cut, never held whole: a
    worker keeps the permutation (4 bytes a shard), not 8 more bytes a shard of starts.

    Attributes:
        order: `order[slot]` is the shard read `slot`-th this epoch (`shard_order`).
        counts: samples per shard, by shard index (int64; the caller's array, not copied).
        total: samples in the epoch.
        seed, epoch: what the order and every worker's shuffle buffer come from.
    """

    order: np.ndarray
    counts: np.ndarray
    total: int
    seed: int | str  # a string keeps one source's order of a mix its own
    epoch: int | str

    @classmethod
    def build(
        cls, counts: Sequence[int] | np.ndarray, seed: int | str, epoch: int | str
    ) -> EpochLayout:
        """The layout of `epoch` for shards of `counts` samples: O(shards)."""
        counts = np.asarray(counts, dtype=np.int64)
        order = shard_permutation(len(counts), seed, epoch)
        return cls(order, counts, int(counts.sum()), seed, epoch)

    def locate(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The slot holding each stream position in `points`, and that slot's first position.

        A point's slot is the last one starting at or before it, so empty shards (which
        start where the next shard does) are never chosen. O(shards) time, summing the
        counts block by block, and O(block + points) memory.

        Raises:
            ValueError: a point is not a position of the epoch (a bug of the caller).
        """
        points = np.asarray(points, dtype=np.int64)
        by_value = np.argsort(points, kind="stable")
        ordered = points[by_value]
        slots = np.empty(len(points), dtype=np.int64)
        bases = np.empty(len(points), dtype=np.int64)
        if len(points) and (ordered[0] < 0 or ordered[-1] >= self.total):
            raise ValueError(
                f"stream positions outside [0, {self.total}) given to the epoch layout; "
                "this is a bug in the caller's plan"
            )
        done, block_start = 0, 0  # points located so far; stream position of slot `begin`
        for begin in range(0, len(self.order), _SLOT_BLOCK):
            if done == len(points):
                break
            counts = self.counts[self.order[begin : begin + _SLOT_BLOCK]]
            starts = np.cumsum(counts)
            block_stop = block_start + int(starts[-1])
            starts += block_start - counts
            upto = int(np.searchsorted(ordered, block_stop, side="left"))
            if upto > done:  # the points in [block_start, block_stop) lie in this block
                inside = np.searchsorted(starts, ordered[done:upto], side="right") - 1
                slots[by_value[done:upto]] = begin + inside
                bases[by_value[done:upto]] = starts[inside]
                done = upto
            block_start = block_stop
        return slots, bases

    def pieces(self, positions: Runs) -> Pieces:
        """Stream positions as runs of consecutive samples within shards, in order.

        Costs O(runs + shards touched) beyond `locate`: each run is cut at the shard
        boundaries it spans. The result is three compact arrays, not one object per piece:
        a worker of a 10^9-sample epoch reads ~5*10^5 pieces, which as Python objects
        cost seconds and ~100 MiB before its first batch.
        """
        if not len(positions.starts):
            return Pieces.empty()
        runs = len(positions.starts)
        slots, bases = self.locate(np.concatenate([positions.starts, positions.stops - 1]))
        first, bases = slots[:runs], bases[:runs]
        spans = slots[runs:] - first + 1
        ends = np.cumsum(spans)  # flat index one past each run's last slot
        begins = ends - spans
        total = int(ends[-1])
        offset_type = compact_dtype(int(self.counts.max()))
        shards = np.empty(total, dtype=self.order.dtype)
        lo_out = np.empty(total, dtype=offset_type)
        hi_out = np.empty(total, dtype=offset_type)
        # A slot's first position is its run's first slot's plus the counts of the run's
        # slots before it: `before` sums counts over flat indices, so a run's slots start
        # at `before + shift[run]`, its shift fixed in the block where the run begins.
        shift = np.empty(runs, dtype=np.int64)
        summed, kept = 0, 0  # counts summed over the flat indices before `begin`
        # Cut in blocks of the flat (run, slot) index: a dozen temporaries the size of a
        # block, not of the worker's ~5*10^5 pieces, so planning peaks at its result.
        for begin in range(0, total, _SLOT_BLOCK):
            stop = min(begin + _SLOT_BLOCK, total)
            flat = np.arange(begin, stop)
            run = np.searchsorted(ends, flat, side="right")
            shard = self.order[first[run] + flat - begins[run]]
            counts = self.counts[shard]
            before = np.cumsum(counts)
            next_summed = summed + int(before[-1])
            before += summed - counts
            new = slice(np.searchsorted(begins, begin), np.searchsorted(begins, stop))
            shift[new] = bases[new] - before[begins[new] - begin]
            base = before + shift[run]
            lo = np.maximum(positions.starts[run], base) - base
            hi = np.minimum(positions.stops[run], base + counts) - base
            keep = hi > lo
            count = int(keep.sum())
            shards[kept : kept + count] = shard[keep]
            lo_out[kept : kept + count] = lo[keep]
            hi_out[kept : kept + count] = hi[keep]
            kept += count
            summed = next_summed
        return (
            Pieces(shards[:kept].copy(), lo_out[:kept].copy(), hi_out[:kept].copy())
            if (kept < total)
            else Pieces(shards, lo_out, hi_out)
        )


class Pieces(Sequence):
    """A worker's pieces as three arrays, read as `Piece`s one at a time.

    Shard indices are int32 below 2**31 shards, and offsets within a shard int32 when
    every shard's count fits (`compact_dtype`): 12 bytes a piece instead of 24.
    """

    def __init__(self, shards: np.ndarray, starts: np.ndarray, stops: np.ndarray) -> None:
        self.shards, self.starts, self.stops = shards, starts, stops

    @classmethod
    def empty(cls) -> Pieces:
        nothing = np.empty(0, dtype=np.int64)
        return cls(nothing, nothing, nothing)

    def __len__(self) -> int:
        return len(self.shards)

    def __getitem__(self, index: int) -> Piece:  # type: ignore[override]
        return Piece(int(self.shards[index]), int(self.starts[index]), int(self.stops[index]))

    def __iter__(self) -> Iterator[Piece]:
        for begin in range(0, len(self.shards), _PIECE_CHUNK):
            end = begin + _PIECE_CHUNK
            yield from map(
                Piece,
                self.shards[begin:end].tolist(),
                self.starts[begin:end].tolist(),
                self.stops[begin:end].tolist(),
            )


_SLOT_BLOCK = 1 << 14  # slots summed (`EpochLayout.locate`) or cut (`.pieces`) at a time
_PIECE_CHUNK = 4096  # pieces made into objects at a time, as the stream reaches them


def positions_to_pieces(
    positions: np.ndarray, order: Sequence[int], counts: Sequence[int]
) -> list[Piece]:
    """Map global stream positions (any order) to runs of consecutive samples within shards."""
    counts, order = np.asarray(counts, dtype=np.int64), np.asarray(order, dtype=np.int64)
    layout = EpochLayout(order, counts, int(counts[order].sum()), seed=0, epoch=0)
    return list(layout.pieces(Runs.from_positions(positions)))
