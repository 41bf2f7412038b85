"""The epoch plan of a loader's sources: what each rank and worker slot delivers (`plan_epoch`).

A loader reads a `Mix` of sources; one plain source is a mix of one, unnamed, so one
plan serves both and no reader asks which it has. The mixed epoch is one global
sequence that interleaves the sources' quota sequences (`interleave_counts`: closed
form, O(sources) per position asked; one source is its own sequence). Ranks and
workers take contiguous slices of it (`pipeline.plan.rank_slice`, `worker_slice`), so a
worker's slice holds a contiguous run of each source's quota sequence: it reads one
piece stream per source, shuffles each in its own buffer and merges them in the
global order, which is why every batch holds each source's share.

A source's quota sequence is `passes` whole passes, each in a shard order of its own
(repeat `p` of a sample is augmented as repeat `p`), and then `rest` samples of a
fixed shard order, taken at an offset that moves by `rest` each epoch: an
under-sampled source shows a new part of itself each epoch and all of it over
`ceil(size / rest)` epochs, and no sample comes more than `passes + 1` times. One
source read once an epoch is one pass: its shards in the `seed + epoch` order.

Two ways to read one source change what its sequence holds: resampled draws (the
positions are draws with replacement, made as the worker goes) and repeated
augmentation (`pipeline.plan.Repeats`: the positions are copies of the first samples
of the pass).

A resumed epoch keeps, per source, the positions not yet delivered, found by replaying
every worker's per-source shuffle as far as it read (`EpochPlan.consumed`), and
interleaves what is left afresh, on any world size. Positions are held as `Runs`
(intervals), never one by one: a plan costs time and memory in the shards a worker
touches (and the samples a replay covers), not in the samples.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from pipeline.plan import (
    Partition,
    Repeats,
    Segment,
    batches_for,
    check_segment,
    epoch_repeats,
    rank_slice,
    shuffle_buffer,
    worker_slice,
)
from pipeline.positions import EpochLayout, Piece, Pieces, Runs
from shards.errors import UsageError


def source_seed(seed: int, name: str) -> int | str:
    """What a source's shard orders are drawn from: the run's seed and the source's name.
    An unnamed source (a loader's one plain source) is drawn from the seed alone."""
    return f"{seed}:{name}" if name else seed


def source_rng(seed: int, epoch: int, rank: int, worker: int, name: str) -> random.Random:
    """The shuffle buffer of one source in one worker slot of one rank."""
    return random.Random(f"buffer:{seed}:{epoch}:{rank}:{worker}" + (f":{name}" if name else ""))


def draw_rng(
    seed: int, epoch: int, segments: int, rank: int, role: int, name: str
) -> random.Random:
    """Resampled draws of one source in one slot: a resumed epoch is not replayed, a new
    partition (`segments` earlier ones) simply continues drawing, from a source of its own."""
    tail = f":{name}" if name else ""
    return random.Random(f"resample:{seed}:{epoch}:{segments}:{rank}:{role}{tail}")


def interleave_counts(points: np.ndarray, sizes: Sequence[int], unit: int = 1) -> np.ndarray:
    """`[sources, len(points)]`: each source's items before each point of the interleave.

    The interleave of sequences of `sizes` items splits the largest source from the rest
    as evenly as integers allow (`floor((h * size + T // 2) / T)` of the first `h`), then
    the next largest from what is left, and so on: with two sources every stretch of `L`
    positions holds `floor` or `ceil` of `L` times a source's share; each further level
    can add one sample of error (measured: one beyond floor/ceil with 3-4 sources, two
    with 5-8). `unit > 1` interleaves whole runs of `unit` items
    (single-source batches); each source's last partial run comes at the end.
    """
    points = np.asarray(points, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if unit == 1:
        return level_counts(points, sizes)
    runs = sizes // unit
    head = int(runs.sum()) * unit
    inside = np.minimum(points, head)
    block, offset = inside // unit, inside % unit
    before = level_counts(block, runs)
    after = level_counts(np.minimum(block + 1, int(runs.sum())), runs)
    counts = before * unit + (after - before) * offset
    tails = sizes - runs * unit
    tail_starts = np.concatenate([[0], np.cumsum(tails)[:-1]])
    past = np.maximum(points - head, 0)
    counts += np.clip(past[None, :] - tail_starts[:, None], 0, tails[:, None])
    return counts


def level_counts(points: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """`interleave_counts` of single items: the largest source first, then the rest."""
    counts = np.zeros((len(sizes), len(points)), dtype=np.int64)
    order = sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i))
    rest = int(sizes.sum())
    # `left * size` passes int64 (silently) once the epoch passes ~3*10^9: such epochs
    # multiply Python ints instead, exact at any size up to 2**53
    # (`pipeline.mixing.MAX_EPOCH_SAMPLES`).
    left = points.astype(object) if rest * rest >= 2**63 else points.copy()
    for source in order[:-1]:
        if rest == 0:
            break
        taken = (left * int(sizes[source]) + rest // 2) // rest
        counts[source] = taken
        left -= taken
        rest -= int(sizes[source])
    counts[order[-1]] = left
    return counts


def iter_source_order(positions: Runs, sizes: Sequence[int], unit: int) -> Iterator[int]:
    """The source of each interleave position in `positions`, in order, a block at a time."""
    for start, stop in zip(positions.starts.tolist(), positions.stops.tolist(), strict=True):
        for begin in range(start, stop, _ORDER_BLOCK):
            end = min(begin + _ORDER_BLOCK, stop)
            counts = interleave_counts(np.arange(begin, end + 1), sizes, unit)
            yield from np.argmax(np.diff(counts, axis=1), axis=0).tolist()


_ORDER_BLOCK = 4096


def source_runs(positions: Runs, sizes: Sequence[int], unit: int) -> list[Runs]:
    """Per source, the indices into its sequence that the interleave `positions` hold."""
    points = np.concatenate([positions.starts, positions.stops])
    counts = interleave_counts(points, sizes, unit)
    half = len(positions.starts)
    return [Runs(row[:half], row[half:]) for row in counts]


@dataclass(frozen=True, eq=False)  # eq=False: arrays
class Mix:
    """The sources of an epoch as the plan sees them: names, shard counts and quotas.

    Attributes:
        names: each source's name; "" for a loader's one plain source (its keys, seeds
            and state are a plain source's: nothing is prefixed).
        counts: per source, samples per shard (by shard index).
        quotas: per source, samples an epoch (`pipeline.mixing.source_quotas`).
        unit: 1 interleaves samples; the batch size gives single-source batches.
    """

    names: tuple[str, ...]
    counts: tuple[np.ndarray, ...]
    quotas: tuple[int, ...]
    unit: int = 1

    @classmethod
    def one(cls, counts: Sequence[int] | np.ndarray, unit: int = 1) -> Mix:
        """One unnamed source, read whole each epoch."""
        counts = np.asarray(counts, dtype=np.int64)
        return cls(("",), (counts,), (int(counts.sum()),), unit)

    @property
    def total(self) -> int:
        return sum(self.quotas)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(c.sum()) for c in self.counts)

    @property
    def whole(self) -> bool:
        """One source read exactly once an epoch: what repeats and resampling re-read."""
        return len(self.names) == 1 and self.quotas[0] == self.sizes[0]


def plan_epoch(
    sources: Mix | Sequence[int] | np.ndarray,
    part: Partition,
    rank: int,
    seed: int,
    epoch: int,
    segments: Sequence[Segment] = (),
    draws: int | None = None,
) -> EpochPlan:
    """The one plan of an epoch for `rank`, after the `segments` already read of it.

    The main process, every worker and every remote role call it with the same inputs,
    so they agree on the batches by construction; each plans itself.

    Exact (`draws` None): each source's quota positions, less what the segments
    delivered, found by replay: O(shards) without segments, O(consumed samples) with.
    Resampled (`draws` samples an epoch over all ranks, one source): draws are with
    replacement, so the segments only shorten the epoch by the samples they consumed.
    Repeated augmentation (`part.aug_repeats` > 1, one source): copy positions instead
    of the pass's (`pipeline.plan.Repeats`), by the same slicing, replay and resume.

    Args:
        sources: the `Mix`, or one source's samples per shard (a mix of one).
        segments: earlier partitions of this epoch whose deliveries are excluded.

    Raises:
        UsageError: repeats or draws asked of a mix of sources (`Mix.whole` is false).
    """
    mix = sources if isinstance(sources, Mix) else Mix.one(sources)
    if (draws is not None or part.aug_repeats > 1) and not mix.whole:
        asked = "resampled draws" if draws is not None else f"aug_repeats={part.aug_repeats}"
        raise UsageError(
            f"{asked} re-read one source, and this epoch mixes {', '.join(mix.names)} by their "
            "shares (Source(repeat=...) repeats a source); read one source, or leave them out"
        )
    repeats = epoch_repeats(mix.total, part, segments, draws is not None)
    if draws is None:
        remaining = remaining_quota(mix, segments, seed, epoch, repeats)
    else:
        remaining = (remaining_draws(draws, segments),)
    index, padded = rank_slice(sum(len(r) for r in remaining), part, rank)
    batches = batches_for(len(index), part)
    return EpochPlan(
        mix, part, rank, seed, epoch, remaining, index, padded, batches, draws is not None, repeats
    )


def remaining_quota(
    mix: Mix, segments: Sequence[Segment], seed: int, epoch: int, repeats: Repeats | None = None
) -> tuple[Runs, ...]:
    """Per source, the positions not delivered by `segments`, sorted: without segments its
    whole quota (with `repeats`, the copy positions); each segment removes what it consumed."""
    if repeats is None:
        remaining = tuple(Runs.span(0, quota) for quota in mix.quotas)
    else:
        remaining = (repeats.start(),)
    for number, segment in enumerate(segments):
        check_segment(segment, number, sum(len(r) for r in remaining), mix.total)
        plan = EpochPlan.unsliced(mix, segment.partition, seed, epoch, remaining, repeats)
        used = plan.consumed(segment.consumed)
        remaining = tuple(r.without(np.unique(u)) for r, u in zip(remaining, used, strict=True))
    return remaining


def remaining_draws(draws: int, segments: Sequence[Segment]) -> Runs:
    """The draws left of a resampled epoch: each segment made as many as it consumed."""
    left = draws
    for number, segment in enumerate(segments):
        check_segment(segment, number, left, draws)
        read = segment.partition  # draws are with replacement: only their count
        left -= min(left, segment.consumed * read.batch_size * read.world_size)
    return Runs.span(0, left)


@dataclass(frozen=True)
class SourceSlot:
    """What one worker slot reads of one source: its pieces, its shuffle buffer.

    Attributes:
        pieces: in read order, each with its copies (`SourcePieces`); None in resampled
            mode, whose samples are drawn as the worker goes.
        samples: how many samples the slot takes from the source (copies, draws).
    """

    source: int
    name: str
    pieces: SourcePieces | None
    samples: int
    buffer: int
    initial: int


@dataclass(frozen=True)
class WorkerPlan:
    """What one worker slot delivers of an epoch: one slot per source, and the merge order.

    Attributes:
        parts: per source, what the slot reads of it.
        positions: the slot's positions of the interleave, in read order.
        sizes, unit: the interleave they are positions of (`iter_source_order`).
        samples: how many samples the slot delivers; batches: how many batches (its last
            may be partial).
        shuffle_rank: the rank its shuffle buffers are seeded by (repeated augmentation:
            ranks reading the same samples shuffle alike; else its own).
    """

    parts: tuple[SourceSlot, ...]
    positions: Runs
    sizes: tuple[int, ...]
    unit: int
    samples: int
    batches: int
    shuffle_rank: int

    def iter_sources(self) -> Iterator[int]:
        """The source of each sample the slot delivers, in delivery order."""
        return iter_source_order(self.positions, self.sizes, self.unit)


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """One rank's share of what is left of an epoch: its batches, and each slot's pieces.

    The main process reads the batch count and the pad (`len(loader)`, the log line, what
    a resumed epoch has left); each worker asks for its own slot (`worker`), which is
    where the shards are placed: O(shards), in the worker, once an epoch.

    Attributes:
        remaining: per source, the positions not yet delivered, sorted (resampled: the
            draws left to make; repeats: copy positions).
        index: the rank's share, as positions of the interleave of `remaining`.
        padded: positions repeated over all ranks so each gets as many (`pad` rule).
        batches: batches the rank yields from its share.
    """

    mix: Mix
    partition: Partition
    rank: int
    seed: int
    epoch: int
    remaining: tuple[Runs, ...]
    index: Runs
    padded: int
    batches: int
    resampled: bool = False
    repeats: Repeats | None = None

    @classmethod
    def unsliced(
        cls,
        mix: Mix,
        part: Partition,
        seed: int,
        epoch: int,
        remaining: tuple[Runs, ...],
        repeats: Repeats | None = None,
    ) -> EpochPlan:
        """A plan whose rank is chosen later (`consumed` walks every rank)."""
        return cls(mix, part, 0, seed, epoch, remaining, Runs([], []), 0, 0, False, repeats)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.remaining)

    @property
    def total(self) -> int:
        """Samples (or draws) left in the epoch over all ranks."""
        return sum(self.sizes)

    @property
    def samples(self) -> int:
        """Samples in the rank's share, padding included."""
        return len(self.index)

    @property
    def used(self) -> int:
        """Samples of the share the rank's batches hold (drop_last leaves the rest)."""
        return min(self.samples, self.batches * self.partition.batch_size)

    @cached_property
    def epochs(self) -> tuple[SourceEpoch, ...]:
        return tuple(
            SourceEpoch(name, counts, quota, self.seed, self.epoch)
            for name, counts, quota in zip(
                self.mix.names, self.mix.counts, self.mix.quotas, strict=True
            )
        )

    def buffers(self) -> list[tuple[int, int]]:
        """Per source, `(buffer, initial)`: the shuffle buffer shared out by share."""
        part, total = self.partition, max(1, self.total)
        out = []
        for size in self.sizes:
            buffer = max(1, round(part.shuffle_buffer * size / total))
            out.append((buffer, max(1, min(buffer, round(part.shuffle_initial * size / total)))))
        return out

    def shuffle_rank(self, rank: int) -> int:
        """The rank whose shuffles `rank`'s slots use (`Repeats.shuffle_rank`)."""
        return rank if self.repeats is None else self.repeats.shuffle_rank(self.partition, rank)

    def slot_positions(self, index: Runs, role: int) -> tuple[Runs, int]:
        """Interleave positions of slot `role` given its rank's `index`, and its batches."""
        start, stop, batches = worker_slice(len(index), self.partition, role)
        return index.select(start, stop), batches

    def local_runs(self, positions: Runs) -> list[Runs]:
        """Per source, indices into its `remaining` that interleave `positions` hold."""
        return source_runs(positions, self.sizes, self.mix.unit)

    def worker(self, role: int) -> WorkerPlan:
        """What slot `role` of the rank reads: O(shards it touches) beyond the layouts."""
        positions, batches = self.slot_positions(self.index, role)
        parts = []
        buffers = self.buffers()
        for source, local in enumerate(self.local_runs(positions)):
            quota = self.remaining[source].at(local)
            buffer, initial = buffers[source]
            name = self.mix.names[source]
            pieces = self.source_pieces(source, quota)
            parts.append(SourceSlot(source, name, pieces, len(quota), buffer, initial))
        return WorkerPlan(
            tuple(parts),
            positions,
            self.sizes,
            self.mix.unit,
            len(positions),
            batches,
            self.shuffle_rank(self.rank),
        )

    def source_pieces(self, source: int, quota: Runs) -> SourcePieces | None:
        """Quota positions of `source` as pieces: draws have none; copies are read once
        and emitted as the `Repeats` say, from the pass's shard order."""
        if self.resampled:
            return None
        epoch = self.epochs[source]
        if self.repeats is None:
            return epoch.pieces(quota)
        pieces, firsts, copies = self.repeats.pieces(epoch.shuffled(0), quota)
        return SourcePieces(epoch.bare(), ((pieces, firsts, copies),))

    def consumed(self, batches: int) -> list[np.ndarray]:
        """Per source, the positions `batches` batches of every rank delivered.

        Replays each worker's per-source shuffles as far as it read: O(consumed samples).
        """
        part = self.partition
        taken: list[list[np.ndarray]] = [[] for _ in self.mix.names]
        buffers = self.buffers()
        for rank in range(part.world_size if batches else 0):
            index, _ = rank_slice(self.total, part, rank)
            shuffled = self.shuffle_rank(rank)
            for role in range(min(part.num_workers, batches)):  # the slots that read
                done = len(range(role, batches, part.num_workers))
                positions, _ = self.slot_positions(index, role)
                delivered = positions.select(0, done * part.batch_size)
                counts = [len(r) for r in self.local_runs(delivered)]
                for source, local in enumerate(self.local_runs(positions)):
                    if counts[source] == 0:
                        continue
                    name = self.mix.names[source]
                    rng = source_rng(self.seed, self.epoch, shuffled, role, name)
                    order = shuffle_buffer(range(len(local)), *buffers[source], rng)
                    count = counts[source]
                    picked = np.fromiter(itertools.islice(order, count), np.int64, count=count)
                    taken[source].append(self.remaining[source].take(local.take(picked)))
        return [np.concatenate(t) if t else np.empty(0, np.int64) for t in taken]


@dataclass(frozen=True, eq=False)
class SourceEpoch:
    """One source's quota sequence in one epoch, and where each position lies in its shards.

    Positions `[0, passes * size)` are whole passes, each in a shard order of its own;
    the last `rest` positions take `[offset, offset + rest)` (wrapping) of a shard order
    fixed for the run, the offset moving by `rest` each epoch.
    """

    name: str
    counts: np.ndarray
    quota: int
    seed: int
    epoch: int
    orders: dict[int, EpochLayout] = field(default_factory=dict, repr=False)  # per pass

    @cached_property
    def size(self) -> int:
        return int(self.counts.sum())

    @property
    def passes(self) -> int:
        return self.quota // self.size if self.size else 0  # an empty source has no pass

    @property
    def rest(self) -> int:
        return self.quota % self.size if self.size else 0

    @property
    def offset(self) -> int:
        return self.epoch * self.rest % self.size if self.size else 0

    def shuffled(self, repeat: int) -> EpochLayout:
        """Pass `repeat`'s shard order this epoch (from `seed`, `epoch`, the name, the pass):
        a repeated sample's copies sit in different places of the source's sequence."""
        if repeat not in self.orders:
            self.orders[repeat] = self.pass_layout(repeat)
        return self.orders[repeat]

    def pass_layout(self, repeat: int) -> EpochLayout:
        """`shuffled(repeat)` built afresh, not kept: whole passes are laid out as read."""
        epoch = self.epoch if repeat == 0 else f"{self.epoch}.{repeat}"
        return EpochLayout.build(self.counts, source_seed(self.seed, self.name), epoch)

    def bare(self) -> SourceEpoch:
        """This epoch without the layouts it keeps: what a slot's pieces hold on to while
        the epoch is read (whole passes are laid out afresh as reached)."""
        return dataclasses.replace(self, orders={})

    def whole_pass(self, repeat: int) -> Pieces:
        """Every sample of the source once, shard by shard in pass `repeat`'s order."""
        return self.pass_layout(repeat).pieces(Runs.span(0, self.size))

    @cached_property
    def fixed(self) -> EpochLayout:
        """The run's fixed shard order the partial pass walks through, epoch by epoch."""
        return EpochLayout.build(self.counts, source_seed(self.seed, self.name), "rest")

    def spans(self, quota: Runs) -> Iterator[tuple[str, int, int, int]]:
        """`(kind, repeat, start, stop)` of the quota positions, in order: `part` and `rest`
        ranges of pass `repeat`'s layout or of the fixed one, and `passes`, whole passes
        `repeat` to `stop - 1` as one item (k passes are a count: O(runs), not O(quota))."""
        size, full = self.size, self.passes * self.size
        for start, stop in zip(quota.starts.tolist(), quota.stops.tolist(), strict=True):
            while start < min(stop, full):
                repeat, at = divmod(start, size)
                whole = (min(stop, full) - start) // size if at == 0 else 0
                if whole:
                    yield "passes", repeat, repeat, repeat + whole
                    start += whole * size
                    continue
                end = min(stop, (repeat + 1) * size)
                yield "part", repeat, at, at + end - start
                start = end
            while start < stop:
                at = (self.offset + start - full) % size
                end = min(stop, start + size - at)
                yield "rest", self.passes, at, at + end - start
                start = end

    def pieces(self, quota: Runs) -> SourcePieces:
        """The quota positions as pieces of shards, each with its pass number."""
        chunks: list[tuple[Pieces, int] | range] = []
        for (kind, repeat), group in itertools.groupby(
            self.spans(quota), key=operator.itemgetter(0, 1)
        ):
            spans = list(group)
            if kind == "passes":
                chunks += [range(first, stop) for _, _, first, stop in spans]
                continue
            layout = self.fixed if kind == "rest" else self.shuffled(repeat)
            chunks.append(
                (layout.pieces(Runs([s[2] for s in spans], [s[3] for s in spans])), repeat)
            )
        return SourcePieces(self.bare(), tuple(chunks))


@dataclass(frozen=True, eq=False)
class SourcePieces:
    """What one slot reads of one source: pieces in read order, each sample with its copies.

    A chunk is `(pieces, pass)`; a `range` of whole passes laid out one pass at a time
    as the stream reaches them (a source read 10^6 times its size an epoch plans, and
    gives its first batch, as fast as one read once); or, with repeated augmentation,
    `(pieces, firsts, copies)`: each sample of piece `i` emitted `copies[i]` times in a
    row, numbered from `firsts[i]` (`pipeline.plan.Repeats.pieces`).
    """

    epoch: SourceEpoch
    chunks: tuple[tuple[Pieces, int] | tuple[Pieces, np.ndarray, np.ndarray] | range, ...]

    def iter_copies(self) -> Iterator[tuple[Piece, int, int]]:
        """Each piece, the repeat number of its samples' first copy, and their copies: a
        pass's number and one copy, or the copies repeated augmentation asks for."""
        for chunk in self.chunks:
            if isinstance(chunk, range):
                for repeat in chunk:
                    yield from ((p, repeat, 1) for p in self.epoch.whole_pass(repeat))
            elif len(chunk) == 2:
                yield from ((p, chunk[1], 1) for p in chunk[0])
            else:
                yield from zip(chunk[0], chunk[1].tolist(), chunk[2].tolist(), strict=True)

    def __iter__(self) -> Iterator[Piece]:
        return (piece for piece, _, _ in self.iter_copies())

    def __len__(self) -> int:
        """Pieces in all (a whole pass: one a non-empty shard), no pass laid out."""
        shards = int(np.count_nonzero(self.epoch.counts))
        return sum(len(c) * shards if isinstance(c, range) else len(c[0]) for c in self.chunks)

    def ahead(self) -> Iterator[Piece]:
        """The pieces with each run of whole passes cut to its first pass: what a fetch plan
        lists (later passes read the same shards again, fetched as they are opened)."""
        for chunk in self.chunks:
            yield from self.epoch.whole_pass(chunk[0]) if isinstance(chunk, range) else chunk[0]
