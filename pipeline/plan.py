"""How an epoch is cut: ranks, worker slots, resumed segments, repeats, shuffle buffers.

Everything here works on integer positions, never on data, so it is cheap,
exactly reproducible, and can be replayed to find what an interrupted run had
already consumed. An epoch's sequence (`pipeline.epoch`, whatever its sources) is cut
the same way: ranks take equal contiguous slices of it (`rank_slice`), worker slots
take contiguous runs of whole batches of their rank's slice (`worker_slice`), and a
seeded shuffle buffer mixes each slot's run (`shuffle_buffer`).

A resumed epoch is described by its segments: each is a partition (world size,
workers, batch, rules) and the batches every rank consumed under it. With the same
partition a resumed run skips exactly the consumed batches; with another one (say 2
ranks -> 1) the consumed samples are found by replaying the positions through the
same seeded shuffles (`pipeline.epoch.EpochPlan.consumed`), and the rest of the epoch
is split afresh: no sample lost or doubled within the epoch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, astuple, dataclass, fields
from typing import TypeVar

import numpy as np

from pipeline.config import EPOCH_RULES, Batching, Shuffle
from pipeline.positions import EpochLayout, Pieces, Runs
from shards.errors import DataError, UsageError

T = TypeVar("T")


@dataclass(frozen=True)
class Partition:
    """The shape of one epoch: who reads, in what batches, through what shuffle.

    Flat integers, not the config groups: it is what a loader state records for each
    segment of an epoch (`Segment.to_dict`), so states saved earlier keep loading, and
    two partitions are equal exactly when they split an epoch alike.
    """

    world_size: int
    num_workers: int  # worker slots (1 when the DataLoader runs in-process)
    batch_size: int
    drop_last: bool
    rule: str  # pad | drop | uneven
    shuffle_buffer: int = 1  # 1: no sample shuffle (evaluation)
    shuffle_initial: int = 1
    aug_repeats: int = 1  # copies of each selected sample an epoch (`Repeats`)

    def __post_init__(self) -> None:
        counts = (
            "world_size",
            "num_workers",
            "batch_size",
            "shuffle_buffer",
            "shuffle_initial",
            "aug_repeats",
        )
        low = [name for name in counts if getattr(self, name) < 1]
        if low or self.rule not in EPOCH_RULES:
            raise ValueError(
                f"partition {self} is not one an epoch can be split by: {', '.join(low)} "
                f"must be at least 1 and rule one of {', '.join(EPOCH_RULES)}; a loader "
                "state with it was edited or written by another program"
            )

    @classmethod
    def of(cls, batch: Batching, shuffle: Shuffle, world_size: int, num_workers: int) -> Partition:
        """The partition the config's groups make: the one place they are read for it.

        Raises:
            ValueError: `batch.drop_last` or `batch.epoch_rule` is still None (the loader
                resolves them per split in `pipeline.loader.stream_settings`).
        """
        if batch.drop_last is None or batch.epoch_rule is None:
            raise ValueError(
                f"{batch} leaves drop_last or epoch_rule to the default rule: resolve them "
                "first (pipeline.loader.stream_settings does, per split)"
            )
        return cls(
            world_size,
            num_workers,
            batch.size,
            batch.drop_last,
            batch.epoch_rule,
            shuffle.buffer,
            shuffle.initial,
            batch.aug_repeats,
        )


def rank_slice(total: int, part: Partition, rank: int) -> tuple[Runs, int]:
    """Indices into the epoch's remaining positions for `rank`, and the pad count.

    `pad` repeats the first few positions so every rank gets `ceil(total/W)`;
    `drop` gives every rank `floor(total/W)` and leaves the rest for the next
    epoch's shuffle; `uneven` splits exactly (ranks differ by at most one
    sample: right for evaluation, where nothing may be counted twice).
    O(1): at most two runs (a padded rank wraps around the end once).
    """
    world = part.world_size
    if part.rule == "pad":
        per_rank = -(-total // world)
        if not total:
            return Runs([], []), 0
        # per_rank <= total, so a rank's range wraps around the end at most once.
        first = rank * per_rank % total
        head = min(per_rank, total - first)
        return Runs([first, 0], [first + head, per_rank - head]), per_rank * world - total
    if part.rule == "drop":
        per_rank = total // world
        return Runs.span(rank * per_rank, (rank + 1) * per_rank), 0
    return Runs.span(total * rank // world, total * (rank + 1) // world), 0


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
    if not 0 <= worker < nw:
        raise ValueError(f"worker {worker} out of range for {nw} workers")
    # O(1), not O(workers): a replay asks this of every slot that read, whatever the
    # segment's worker count. Workers before `worker` own the batches j < total with
    # j % nw < worker; the last owner's batches are laid out after everyone's.
    last_owner = (total_batches - 1) % nw if total_batches else nw - 1
    owned = len(range(worker, total_batches, nw))
    if worker == last_owner:
        start = (total_batches - owned) * part.batch_size
        return start, used, owned
    before = total_batches // nw * worker + min(total_batches % nw, worker)
    if last_owner < worker:
        before -= len(range(last_owner, total_batches, nw))
    start = before * part.batch_size
    return start, start + owned * part.batch_size, owned


@dataclass(frozen=True)
class Segment:
    """Part of an epoch read under one partition; `consumed` batches per rank."""

    partition: Partition
    consumed: int

    def to_dict(self) -> dict:
        data = asdict(self.partition)
        if data["aug_repeats"] == 1:  # a state without repeats reads as it always has
            del data["aug_repeats"]
        return {**data, "consumed": self.consumed}

    @classmethod
    def from_dict(cls, data: dict) -> Segment:
        data = dict(data)
        consumed = data.pop("consumed")
        return cls(Partition(**data), consumed)

    def to_ints(self) -> list[int]:
        """The segment as `SEGMENT_INTS` integers (the rule by its index in `EPOCH_RULES`),
        for shared memory a worker reads at each epoch's start."""
        values = astuple(self.partition)
        return [
            *(EPOCH_RULES.index(v) if isinstance(v, str) else int(v) for v in values),
            self.consumed,
        ]

    @classmethod
    def from_ints(cls, values: Sequence[int]) -> Segment:
        data = dict(zip((f.name for f in fields(Partition)), values, strict=False))
        data["drop_last"] = bool(data["drop_last"])
        data["rule"] = EPOCH_RULES[data["rule"]]
        return cls(Partition(**data), int(values[SEGMENT_INTS - 1]))


SEGMENT_INTS = len(fields(Partition)) + 1


class LoaderStateError(DataError, ValueError):
    """A loader state that describes no point of this epoch for this dataset: malformed,
    edited, or saved for other data. The message names the field and what it must be."""


REPLAY_SLOTS = 1 << 14  # slots any replay may walk, however small the epoch (`check_segment`)


def check_segment(
    segment: Segment, number: int, remaining: int, total: int, batches: int | None = None
) -> None:
    """Refuse a segment no run of this epoch can have read, before anything replays it.

    A rank of the segment had at most `batches` (default: the most any rank gets of the
    `remaining` samples it was read from) to consume, and a replay walks each slot that
    read, `world_size x min(num_workers, consumed)` of them: more than the epoch's
    `total` samples (or `REPLAY_SLOTS`, for tiny epochs) and it is refused, so a replay
    costs about the epoch's own size, never the product of whatever a state holds.

    Raises:
        LoaderStateError: naming `segments[number]`'s field and its bound.
    """
    part, where = segment.partition, f"loader state: segments[{number}]"
    slots = part.world_size * min(part.num_workers, segment.consumed)
    if slots > max(total, REPLAY_SLOTS):
        raise LoaderStateError(
            f"{where}.world_size is {part.world_size} with num_workers {part.num_workers}: "
            f"replaying it walks {slots} slots, past the {max(total, REPLAY_SLOTS)} a replay "
            "of this epoch may: no run of this dataset wrote it; resume from an unedited "
            "checkpoint"
        )
    if batches is None:
        batches = batches_for(-(-remaining // part.world_size), part)
    if segment.consumed > batches:
        raise LoaderStateError(
            f"{where}.consumed is {segment.consumed}, but a rank had at most {batches} "
            f"batches of {part.batch_size} to read of the {remaining} samples left "
            f"({part.world_size} ranks): the state was edited or saved for another "
            "dataset; resume from an unedited checkpoint"
        )


def roles_consumed(consumed: int, num_workers: int) -> list[int]:
    """Batches each worker slot had delivered after `consumed` batches of a rank."""
    return [len(range(w, consumed, num_workers)) for w in range(num_workers)]


@dataclass(frozen=True)
class Repeats:
    """Repeated augmentation's epoch (`Batching.aug_repeats`, DeiT's RASampler): k copies.

    The epoch selects the first `selected` positions of its stream (the shards in the
    `seed + epoch` order, so about 1/k of them and others each epoch) and delivers
    `total` copies of them: as many samples as the ranks deliver without repeats, so
    `len(loader)` is unchanged. The copies are the positions of a stream of their own,
    which ranks and workers slice, replay and resume as any epoch's stream. It is laid
    out for the `world` ranks the epoch started on, each taking `share` copies:

    - the first `aligned` samples (`groups` x `share`, where `groups = world // k` and
      shares are equal) lie in k lanes, one copy each, in stream order: lane `c` is
      ranks `c * groups` to `(c + 1) * groups - 1`, and ranks `g`, `groups + g`, ...
      read the same samples and shuffle alike (`shuffle_rank`), so the k copies of a
      sample reach k ranks at the same step, in the same slot of the batch;
    - the rest, for the `world % k` ranks left (all of them when k > world), lie in
      `lanes` lanes (the greatest common divisor of k and those ranks); each sample is
      emitted `per_read` times in a row, copies `lane * per_read` onward, so a worker
      reads each piece once per lane: one rank alone reads each sample once, and its
      shuffle buffer spreads the k copies over nearby batches.

    When `total` is not a multiple of k, the last selected sample gets the copies left
    (fewer than k), as RASampler's last index does.
    """

    copies: int  # k
    selected: int  # stream positions [0, selected) are read this epoch
    total: int  # copies delivered over all ranks
    world: int
    groups: int  # rank groups whose k ranks read the same samples, one copy each
    aligned: int  # samples those groups read: `groups` shares
    lanes: int  # lanes of the rest

    @classmethod
    def of(cls, samples: int, part: Partition) -> Repeats:
        """The repeats of an epoch of `samples` started under `part`: O(world size).

        Raises:
            UsageError: the epoch would need more distinct samples than there are.
        """
        used = []  # what each rank delivers without repeats (pad and drop_last included)
        for rank in range(part.world_size):
            share = len(rank_slice(samples, part, rank)[0])
            used.append(min(share, batches_for(share, part) * part.batch_size))
        copies, total, world = part.aug_repeats, sum(used), part.world_size
        selected = -(-total // copies)
        if selected > samples:
            raise UsageError(
                f"Batching.aug_repeats={copies} over {world} ranks needs {selected} "
                f"samples an epoch but the split holds {samples}; lower aug_repeats or "
                "the world size"
            )
        equal = part.rule != "uneven"  # pad and drop give every rank the same share
        groups = world // copies if equal else 0
        rest = world - groups * copies
        lanes = math.gcd(copies, rest)
        return cls(copies, selected, total, world, groups, groups * used[0], lanes)

    @property
    def per_read(self) -> int:
        """Copies a worker emits in a row of each sample it reads beyond `aligned`."""
        return self.copies // self.lanes

    def position(self, sample: int, copy: int) -> int:
        """Where copy `copy` of selected sample `sample` sits in the copy stream."""
        if sample < self.aligned:
            return copy * self.aligned + sample
        lane, inner = divmod(copy, self.per_read)
        later = sample - self.aligned + lane * (self.selected - self.aligned)
        return self.copies * self.aligned + later * self.per_read + inner

    def start(self) -> Runs:
        """The epoch's copy positions before any is delivered: the last selected sample's
        copies beyond `total` left out."""
        if not self.selected:
            return Runs([], [])
        last = self.selected - 1
        kept = self.total - self.copies * last  # copies the last selected sample gets
        missing = [self.position(last, copy) for copy in range(kept, self.copies)]
        whole = Runs.span(0, self.copies * self.selected)
        return whole.without(np.asarray(missing, dtype=np.int64))

    def shuffle_rank(self, part: Partition, rank: int) -> int:
        """The rank whose shuffle `rank` uses: ranks reading the same samples (one lane
        each) share one, under the partition the epoch was laid out for."""
        if part.world_size != self.world:
            return rank
        if rank < self.groups * self.copies:
            return rank % self.groups
        rest = self.world - self.groups * self.copies
        return self.groups + (rank - self.groups * self.copies) % (rest // self.lanes)

    def pieces(self, layout: EpochLayout, positions: Runs) -> tuple[Pieces, np.ndarray, np.ndarray]:
        """Copy positions as pieces of shards, each piece's first copy number and copies.

        Each sample of a piece is emitted `copies` times in a row, numbered from `first`:
        the order of the copy positions. O(runs + shards touched), as `EpochLayout.pieces`.
        """
        spans: list[tuple[int, int, int, int]] = []  # (stream start, stop, first, copies)
        for start, stop in zip(positions.starts.tolist(), positions.stops.tolist(), strict=True):
            while start < stop:
                span, start = self.next_span(start, stop)
                spans += span
        runs = Runs([s[0] for s in spans], [s[1] for s in spans])
        pieces = layout.pieces(runs)
        # Every run is cut into one piece or more, in order: a piece's run is the one
        # its last sample falls in.
        ends = np.cumsum(pieces.stops.astype(np.int64) - pieces.starts)
        run = np.searchsorted(runs.ends, ends, side="left")
        firsts = np.asarray([s[2] for s in spans], dtype=np.int32)
        copies = np.asarray([s[3] for s in spans], dtype=np.int32)
        return pieces, firsts[run], copies[run]

    def next_span(self, start: int, stop: int) -> tuple[list[tuple[int, int, int, int]], int]:
        """The spans of copy positions `[start, stop)` up to the end of `start`'s lane, and
        where they end."""
        head = self.copies * self.aligned
        if start < head:
            lane, at = divmod(start, self.aligned)
            end = min(stop, (lane + 1) * self.aligned)
            return [(at, at + end - start, lane, 1)], end
        per, width = self.per_read, self.per_read * (self.selected - self.aligned)
        lane, at = divmod(start - head, width)
        end = min(stop, head + (lane + 1) * width)
        spans = lane_spans(at, at + end - start, per, lane * per)
        return [(a + self.aligned, b + self.aligned, c, n) for a, b, c, n in spans], end


def lane_spans(start: int, stop: int, per: int, base: int) -> list[tuple[int, int, int, int]]:
    """Positions `[start, stop)` of one lane as `(sample start, stop, first copy, copies)`:
    a partial sample at either end, the whole samples between with all `per` copies."""
    first, head = divmod(start, per)
    last, tail = divmod(stop, per)
    if first == last:
        return [(first, first + 1, base + head, tail - head)]
    spans = []
    if head:
        spans.append((first, first + 1, base + head, per - head))
        first += 1
    if last > first:
        spans.append((first, last, base, per))
    if tail:
        spans.append((last, last + 1, base, tail))
    return spans


def epoch_repeats(
    samples: int, part: Partition, segments: Sequence[Segment], resampled: bool
) -> Repeats | None:
    """The epoch's `Repeats`, laid out by the partition it started under; None without.

    Raises:
        UsageError: a resume asks for other repeats than the epoch started with, or
            repeats in resampled mode.
    """
    first = segments[0].partition if segments else part
    if any(s.partition.aug_repeats != part.aug_repeats for s in segments):
        raise UsageError(
            f"this epoch started with Batching.aug_repeats={first.aug_repeats} and is "
            f"resumed with {part.aug_repeats}: resume with {first.aug_repeats}, or from a "
            "state saved at an epoch's end"
        )
    if part.aug_repeats == 1:
        return None
    if resampled:
        raise UsageError(
            f"Batching.aug_repeats={part.aug_repeats} needs the exact epoch: resampled draws "
            "are with replacement; use Exact() or aug_repeats=1"
        )
    return Repeats.of(samples, first)


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
