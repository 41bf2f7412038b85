"""Weighted sources: several datasets read as one epoch (`LoaderConfig(source=[Source(...)])`).

A `Source` declares its share of the epoch (a weight, a sample count or a repeat
factor); `source_quotas` turns the shares into exact per-source sample counts, and
`Mix.plan_epoch` (what `pipeline.plan.plan_epoch` delegates to) lays them out. No
torch here: `pipeline.config` checks a config's `Source`s with it.

The mixed epoch is one global sequence that interleaves the sources' quota sequences
(`interleave_counts`: closed form, O(sources) per position asked). Ranks and workers
take contiguous slices of it exactly as for one source (`pipeline.plan.rank_slice`,
`worker_slice`), so a worker's slice holds a contiguous run of each source's quota
sequence: it reads one piece stream per source, shuffles each in its own buffer and
merges them in the global order, which is why every batch holds each source's share.
A source's quota sequence is `passes` whole passes, each in a shard order of its own
(repeat `p` of a sample is augmented as repeat `p`), and then `rest` samples of a
fixed shard order, taken at an offset that moves by `rest` each epoch: an
under-sampled source shows a new part of itself each epoch and all of it over
`ceil(size / rest)` epochs, and no sample comes more than `passes + 1` times.
A resumed epoch keeps, per source, the quota positions not yet delivered (found by
replaying the per-source shuffles, as `pipeline.plan` does for one source) and
interleaves what is left afresh, on any world size.
"""

from __future__ import annotations

import itertools
import operator
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import Any

import numpy as np

from pipeline.config import Source, source_names
from pipeline.plan import (
    Partition,
    Segment,
    batches_for,
    check_segment,
    rank_slice,
    shuffle_buffer,
    worker_slice,
)
from pipeline.positions import EpochLayout, Piece, Pieces, Runs
from pipeline.sources import ResolvedSource, resolve_source
from shards.errors import DataError, ShardpipeError, UsageError

# The most samples a mix's epoch may hold: stream positions are int64 and a share's
# float arithmetic (shuffle buffers) is exact below 2**53, which at 10^5 samples/s is
# ~2,800 years of reading: far past any epoch, and refused in one line beyond.
MAX_EPOCH_SAMPLES = 2**53


def source_quotas(
    sources: Sequence[Source], sizes: Sequence[int], epoch_samples: int | None
) -> tuple[int, ...]:
    """Samples each source gives an epoch: exact, summing to the epoch.

    Weights share `epoch_samples` (default: the sum of `sizes`), rounded down, the
    samples left over given one each to the largest remainders (ties: the first
    source); a repeat factor is rounded to the nearest sample (halves up).

    Raises:
        UsageError: weights given for some sources only, `epoch_samples` without
            weights, an empty source, a source whose share rounds to no sample, or an
            epoch past `MAX_EPOCH_SAMPLES` (named by the source and its field).
    """
    names = source_names(sources)
    for name, size in zip(names, sizes, strict=True):
        if size < 1:
            raise UsageError(f"source {name!r} holds no samples; leave it out of the mix")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise UsageError(
            "give every source of a mix a weight, or none (then samples= or repeat=): "
            f"{', '.join(n for n, w in zip(names, weighted, strict=True) if not w)} have none"
        )
    if all(weighted):
        total = sum(sizes) if epoch_samples is None else epoch_samples
        if total > MAX_EPOCH_SAMPLES:
            raise UsageError(
                f"Mixing.epoch_samples={total} is past the 2**53 samples an epoch a mix can "
                "plan exactly; lower it (one epoch need not be the whole run)"
            )
        shares = [
            Fraction(s.weight) * total / sum(Fraction(x.weight) for x in sources) for s in sources
        ]
        quotas = [int(share) for share in shares]
        by_remainder = sorted(range(len(sources)), key=lambda i: (-(shares[i] - quotas[i]), i))
        for i in by_remainder[: total - sum(quotas)]:
            quotas[i] += 1
    elif epoch_samples is not None:
        raise UsageError(
            "Mixing(epoch_samples=...) is shared out by weights; with samples= or repeat= "
            "the epoch is their sum: leave epoch_samples out, or give weights"
        )
    else:
        quotas = [
            s.samples if s.samples is not None else int(Fraction(s.repeat) * size + Fraction(1, 2))
            for s, size in zip(sources, sizes, strict=True)
        ]
    for name, source, quota in zip(names, sources, quotas, strict=True):
        asked = "samples" if source.samples is not None else "repeat"
        if source.weight is None and quota > MAX_EPOCH_SAMPLES:
            raise UsageError(
                f"source {name!r}: {asked}={getattr(source, asked)!r} asks {quota} samples an "
                "epoch, past the 2**53 a mix can plan exactly; lower it"
            )
    if sum(quotas) > MAX_EPOCH_SAMPLES:
        raise UsageError(
            f"the quotas of sources {', '.join(names)} sum to {sum(quotas)} samples an epoch, "
            "past the 2**53 a mix can plan exactly; lower their samples= or repeat="
        )
    empty = [name for name, quota in zip(names, quotas, strict=True) if quota < 1]
    if empty:
        raise UsageError(
            f"sources {', '.join(empty)} get no sample an epoch at these shares; raise "
            "their share or Mixing(epoch_samples=...)"
        )
    return tuple(quotas)


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
    # multiply Python ints instead, exact at any size up to `MAX_EPOCH_SAMPLES`.
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
    """The sources of a mix as the plan sees them: names, shard counts and quotas.

    Attributes:
        names: each source's name.
        counts: per source, samples per shard (by shard index).
        quotas: per source, samples an epoch (`source_quotas`).
        unit: 1 interleaves samples; the batch size gives single-source batches.
    """

    names: tuple[str, ...]
    counts: tuple[np.ndarray, ...]
    quotas: tuple[int, ...]
    unit: int = 1

    @property
    def total(self) -> int:
        return sum(self.quotas)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(c.sum()) for c in self.counts)

    def plan_epoch(
        self, part: Partition, rank: int, seed: int, epoch: int, segments: Sequence[Segment]
    ) -> MixedEpochPlan:
        """`pipeline.plan.plan_epoch` for a mix: O(shards) without segments.

        Raises:
            UsageError: repeated augmentation asked for (`Batching.aug_repeats` > 1): a
                mix repeats a source by its share (`Source(repeat=...)`) instead.
        """
        if part.aug_repeats > 1:
            raise UsageError(
                f"Batching.aug_repeats={part.aug_repeats} is refused for a mix of sources "
                "(a mix repeats a source by its share, Source(repeat=...)); use aug_repeats=1"
            )
        remaining = remaining_quota(self, segments, seed, epoch)
        index, padded = rank_slice(sum(len(r) for r in remaining), part, rank)
        batches = batches_for(len(index), part)
        return MixedEpochPlan(self, part, rank, seed, epoch, remaining, index, padded, batches)


def remaining_quota(
    mix: Mix, segments: Sequence[Segment], seed: int, epoch: int
) -> tuple[Runs, ...]:
    """Per source, the quota positions not delivered by `segments`, sorted."""
    remaining = tuple(Runs.span(0, quota) for quota in mix.quotas)
    for number, segment in enumerate(segments):
        check_segment(segment, number, sum(len(r) for r in remaining), mix.total)
        plan = MixedEpochPlan.unsliced(mix, segment.partition, seed, epoch, remaining)
        used = plan.consumed(segment.consumed)
        remaining = tuple(r.without(np.unique(u)) for r, u in zip(remaining, used, strict=True))
    return remaining


@dataclass(frozen=True)
class SourceSlot:
    """What one worker reads of one source: its pieces with their pass numbers, its buffer."""

    source: int
    name: str
    pieces: SourcePieces
    samples: int
    buffer: int
    initial: int


@dataclass(frozen=True)
class MixedWorkerPlan:
    """A worker's share of a mixed epoch: one slot per source and the merge order.

    Attributes:
        parts: per source, what the worker reads of it.
        positions: the worker's positions of the interleave, in read order.
        sizes, unit: the interleave they are positions of (`iter_source_order`).
        samples, batches: as in `pipeline.plan.WorkerPlan`.
    """

    parts: tuple[SourceSlot, ...]
    positions: Runs
    sizes: tuple[int, ...]
    unit: int
    samples: int
    batches: int

    pieces = None  # never resampled; `ShardStream` tells a mix by its `parts`

    def iter_sources(self) -> Iterator[int]:
        """The source of each sample the worker delivers, in delivery order."""
        return iter_source_order(self.positions, self.sizes, self.unit)


@dataclass(frozen=True, eq=False)
class MixedEpochPlan:
    """`pipeline.plan.EpochPlan` of a mix: the same questions, per-source answers inside.

    Attributes:
        remaining: per source, the quota positions not yet delivered, sorted.
        index: the rank's share, as positions of the interleave of `remaining`.
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

    @classmethod
    def unsliced(
        cls, mix: Mix, part: Partition, seed: int, epoch: int, remaining: tuple[Runs, ...]
    ) -> MixedEpochPlan:
        """A plan whose rank is chosen later (`consumed` walks every rank)."""
        return cls(mix, part, 0, seed, epoch, remaining, Runs([], []), 0, 0)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.remaining)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def samples(self) -> int:
        return len(self.index)

    @property
    def used(self) -> int:
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

    def slot_positions(self, index: Runs, role: int) -> tuple[Runs, int]:
        """Interleave positions of slot `role` given its rank's `index`, and its batches."""
        start, stop, batches = worker_slice(len(index), self.partition, role)
        return index.select(start, stop), batches

    def local_runs(self, positions: Runs) -> list[Runs]:
        """Per source, indices into its `remaining` that interleave `positions` hold."""
        return source_runs(positions, self.sizes, self.mix.unit)

    def worker(self, role: int) -> MixedWorkerPlan:
        """What slot `role` of the rank reads: O(shards it touches) beyond the layouts."""
        positions, batches = self.slot_positions(self.index, role)
        parts = []
        buffers = self.buffers()
        for source, local in enumerate(self.local_runs(positions)):
            quota = self.remaining[source].at(local)
            pieces = self.epochs[source].pieces(quota)
            buffer, initial = buffers[source]
            name = self.mix.names[source]
            parts.append(SourceSlot(source, name, pieces, len(quota), buffer, initial))
        return MixedWorkerPlan(
            tuple(parts), positions, self.sizes, self.mix.unit, len(positions), batches
        )

    def consumed(self, batches: int) -> list[np.ndarray]:
        """Per source, the quota positions `batches` batches of every rank delivered.

        Replays each worker's per-source shuffles as far as it read: O(consumed samples).
        """
        part = self.partition
        taken: list[list[np.ndarray]] = [[] for _ in self.mix.names]
        buffers = self.buffers()
        for rank in range(part.world_size if batches else 0):
            index, _ = rank_slice(self.total, part, rank)
            for role in range(min(part.num_workers, batches)):  # the slots that read
                done = len(range(role, batches, part.num_workers))
                positions, _ = self.slot_positions(index, role)
                delivered = positions.select(0, done * part.batch_size)
                counts = [len(r) for r in self.local_runs(delivered)]
                for source, local in enumerate(self.local_runs(positions)):
                    if counts[source] == 0:
                        continue
                    rng = source_rng(self.seed, self.epoch, rank, role, self.mix.names[source])
                    order = shuffle_buffer(range(len(local)), *buffers[source], rng)
                    count = counts[source]
                    picked = np.fromiter(itertools.islice(order, count), np.int64, count=count)
                    taken[source].append(self.remaining[source].take(local.take(picked)))
        return [np.concatenate(t) if t else np.empty(0, np.int64) for t in taken]


def source_rng(seed: int, epoch: int, rank: int, worker: int, name: str) -> random.Random:
    """The shuffle buffer of one source in one worker (`pipeline.plan.worker_rng`, per source)."""
    return random.Random(f"buffer:{seed}:{epoch}:{rank}:{worker}:{name}")


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
        return self.quota // self.size

    @property
    def rest(self) -> int:
        return self.quota % self.size

    @property
    def offset(self) -> int:
        return self.epoch * self.rest % self.size

    def shuffled(self, repeat: int) -> EpochLayout:
        """Pass `repeat`'s shard order this epoch (from `seed`, `epoch`, the name, the pass):
        a repeated sample's copies sit in different places of the source's sequence."""
        if repeat not in self.orders:
            self.orders[repeat] = self.pass_layout(repeat)
        return self.orders[repeat]

    def pass_layout(self, repeat: int) -> EpochLayout:
        """`shuffled(repeat)` built afresh, not kept: whole passes are laid out as read."""
        epoch = self.epoch if repeat == 0 else f"{self.epoch}.{repeat}"
        return EpochLayout.build(self.counts, f"{self.seed}:{self.name}", epoch)

    def whole_pass(self, repeat: int) -> Pieces:
        """Every sample of the source once, shard by shard in pass `repeat`'s order."""
        order = self.pass_layout(repeat).order
        order = order[self.counts[order] > 0]  # an empty shard is no piece
        return Pieces(order, np.zeros(len(order), np.int64), self.counts[order])

    @cached_property
    def fixed(self) -> EpochLayout:
        """The run's fixed shard order the partial pass walks through, epoch by epoch."""
        return EpochLayout.build(self.counts, f"{self.seed}:{self.name}", "rest")

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
        return SourcePieces(self, tuple(chunks))


@dataclass(frozen=True, eq=False)
class SourcePieces:
    """What one slot reads of one source: pieces in read order, each of a pass.

    A chunk is `(pieces, pass)`, or a `range` of whole passes laid out one pass at a time
    as the stream reaches them: a source read 10^6 times its size an epoch plans, and
    gives its first batch, as fast as one read once.
    """

    epoch: SourceEpoch
    chunks: tuple[tuple[Pieces, int] | range, ...]

    def iter_with_repeats(self) -> Iterator[tuple[Piece, int]]:
        """Each piece and the pass over the source it belongs to."""
        for chunk in self.chunks:
            passes = (
                ((self.epoch.whole_pass(r), r) for r in chunk)
                if isinstance(chunk, range)
                else (chunk,)
            )
            for pieces, repeat in passes:
                yield from zip(pieces, itertools.repeat(repeat))

    def __iter__(self) -> Iterator[Piece]:
        return (piece for piece, _ in self.iter_with_repeats())

    def ahead(self) -> Iterator[Piece]:
        """The pieces with each run of whole passes cut to its first pass: what a fetch plan
        lists (later passes read the same shards again, fetched as they are opened)."""
        for chunk in self.chunks:
            yield from self.epoch.whole_pass(chunk[0]) if isinstance(chunk, range) else chunk[0]


@dataclass(frozen=True)
class ResolvedMix:
    """A mix's sources resolved: what the loader plans, reads and reports by.

    Attributes:
        parts: each source's shards, as one source's (`pipeline.sources.ResolvedSource`).
        names, quotas: each source's name and samples an epoch.
        classes: the class names of all sources by name (one list when they agree, else
            their sorted union); None when no source names its classes.
        remaps: per source, its class ids to `classes`' (None: the same ids).
    """

    parts: tuple[ResolvedSource, ...]
    names: tuple[str, ...]
    quotas: tuple[int, ...]
    classes: list[str] | None
    remaps: tuple[tuple[int, ...] | None, ...]

    manifest_url = None
    class_counts = None  # per-source counts do not add up to the epoch's
    label_counts = None

    @cached_property
    def shards(self) -> ChainedShards:
        """Every source's shards, one after another (what a run's data identity lists)."""
        return ChainedShards(self.names, tuple(part.shards for part in self.parts))

    @property
    def label_mode(self) -> str:
        """`none` when no source has labels, `multi` when one has multi-label targets."""
        modes = {part.label_mode for part in self.parts}
        return "multi" if "multi" in modes else "none" if modes == {"none"} else "single"

    @property
    def unreadable(self) -> tuple[tuple[str, str], ...]:
        return tuple(item for part in self.parts for item in part.unreadable)

    @property
    def total_samples(self) -> int:
        """Samples an epoch: the quotas' sum."""
        return sum(self.quotas)

    def mix(self, unit: int = 1) -> Mix:
        return Mix(self.names, tuple(p.counts for p in self.parts), self.quotas, unit)


def resolve_mix(
    sources: Sequence[Source], epoch_samples: int | None, fmt: str | None, **read: Any
) -> ResolvedMix:
    """Each source resolved (`pipeline.sources.resolve_source`), its quota, the classes unified.

    Args:
        fmt: the loader's format, for sources that name none.
        read: `retry`, `storage_options`, `checksums`, `allow_missing`, as for one source.

    Raises:
        UsageError: names clash, the shares do not work out (`source_quotas`), or
            multi-label sources name their classes differently.
        What `resolve_source` raises, the message prefixed with the source's name.
    """
    names = source_names(sources)
    parts = []
    for name, source in zip(names, sources, strict=True):
        try:
            parts.append(resolve_source(source.source, source.split, source.format or fmt, **read))
        except ShardpipeError as error:
            kind = UsageError if isinstance(error, UsageError) else DataError
            raise kind(f"source {name!r}: {error}") from error
    quotas = source_quotas(sources, [p.total_samples for p in parts], epoch_samples)
    classes, remaps = unify_classes(parts)
    multi = any(p.label_mode == "multi" for p in parts)
    if multi and any(r is not None for r in remaps):
        raise UsageError(
            "multi-label sources of a mix must name the same classes in the same order "
            f"({', '.join(names)} do not); rebuild them with one class list"
        )
    return ResolvedMix(tuple(parts), names, quotas, classes, remaps)


def unify_classes(
    parts: Sequence[ResolvedSource],
) -> tuple[list[str] | None, tuple[tuple[int, ...] | None, ...]]:
    """One class list for all sources, by name, and each source's ids mapped into it."""
    named = [p.classes for p in parts if p.classes]
    if not named:
        return None, tuple(None for _ in parts)
    if all(c == named[0] for c in named):
        return list(named[0]), tuple(None for _ in parts)
    classes = sorted(set().union(*named))
    position = {name: i for i, name in enumerate(classes)}
    remaps = tuple(None if not p.classes else tuple(position[c] for c in p.classes) for p in parts)
    return classes, remaps


class ChainedShards(Sequence):
    """The shards of a mix's sources as one read-only sequence, in source order.

    Speaks the `pipeline.sources.ShardSpecs` columns a trainer reads (`samples`,
    `iter_file_names`, `iter_sha256`), file names prefixed with the source's name.
    """

    table_sha256 = None  # several manifests: each shard's own digest stands for it

    def __init__(self, names: tuple[str, ...], parts: tuple[Sequence, ...]) -> None:
        self.names, self.parts = names, parts
        self.ends = np.cumsum([len(part) for part in parts])
        self.samples = np.concatenate([np.asarray(p.samples, np.int64) for p in parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index: int):  # type: ignore[override]
        index = operator.index(index) % len(self) if len(self) else operator.index(index)
        part = int(np.searchsorted(self.ends, index, side="right"))
        return self.parts[part][index - (int(self.ends[part - 1]) if part else 0)]

    def __iter__(self) -> Iterator:
        return itertools.chain.from_iterable(self.parts)

    def iter_file_names(self) -> Iterator[str]:
        for name, part in zip(self.names, self.parts, strict=True):
            yield from (f"{name}/{file}" for file in part.iter_file_names())

    def iter_sha256(self) -> Iterator[str | None]:
        return itertools.chain.from_iterable(part.iter_sha256() for part in self.parts)
