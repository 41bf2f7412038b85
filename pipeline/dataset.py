"""`ShardStream`: the IterableDataset that runs inside each DataLoader worker.

Its stage chain is built in `__iter__`, where the worker, the epoch and any
resume point are known: plan this worker's pieces -> read shard samples ->
shuffle buffer of encoded bytes -> skip what a resumed run already delivered ->
decode and augment -> batch. Every worker yields exactly its planned number of
batches, refilling from recent samples when data is bad, so DDP ranks stay in
step to the end of the epoch; an exactly-once epoch (eval, the `uneven` rule)
never repeats a sample and ends short instead (`StreamSettings.exactly_once`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import multiprocessing
import random
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.augment import Augment, build_augmenter
from pipeline.batchring import BatchRing, SlotBatch
from pipeline.config import Batching, ProgressiveResize, ReadOptions, Shuffle
from pipeline.fast_transforms import pillow_fallbacks
from pipeline.fetch import ShardFetcher, plan_shards
from pipeline.mixing import Mix, MixedWorkerPlan, SourceSlot, source_rng
from pipeline.plan import (
    SEGMENT_INTS,
    Partition,
    Segment,
    WorkerPlan,
    plan_epoch,
    roles_consumed,
    shuffle_buffer,
    worker_rng,
)
from pipeline.positions import Piece
from pipeline.sources import ShardSpec
from pipeline.transforms import SampleRandom
from shards.errors import DataError, ShardError, UsageError
from shards.sample import (
    DEFAULT_FIELDS,
    LABEL_FIELDS,
    Field,
    Sample,
    SampleError,
    check_class_range,
    class_ranged_fields,
    collate_values,
    field_value,
    member_caps,
    read_fields,
    skip_budget_hint,
)

log = logging.getLogger("pipeline")

# A bad shard (its bytes, or the manifest's promises about it) and a shard that could not
# be read (ShardReadError and other I/O errors) cost that shard's unread samples, counted.
# Anything else a reader raises (TypeError, ...) is a bug and propagates.
SHARD_ERRORS = (ShardError, OSError)
LOG_EVERY = 100
RESERVE_SIZE = 32
MAX_FRUITLESS_READS = 100_000
DRAWS_AHEAD = 4  # resampled mode: shards drawn (and fetched) beyond the one being read
MAX_SEGMENTS = 8
MAX_EXAMPLES = 5  # bad shards named in a worker's stats (the logs name every one)
# What the stream reads by default: the image and its label. Members no requested
# field needs (a shard's `json` metadata, say) are passed over unread (seeked past in
# tars, a column not read in Parquet).
STREAM_FIELDS = read_fields(DEFAULT_FIELDS)


class LoaderDataError(DataError, RuntimeError):
    """Too much bad data: the skip budget of the epoch was exceeded."""


@dataclass
class WorkerStats:
    """Counters a worker ships with each batch; the loader aggregates them."""

    worker: int = 0
    samples: int = 0
    skipped: Counter = field(default_factory=Counter)
    bad_shards: Counter = field(default_factory=Counter)  # reason -> shards
    bad_shard_examples: list = field(default_factory=list)  # the first few, named
    refilled: int = 0
    unfilled: int = 0  # exactly-once epochs: planned slots left empty (their samples were bad)
    decode_s: float = 0.0  # decoding every field of the samples, augmentation included
    augment_s: float = 0.0  # the part of decode_s spent augmenting images (`LoaderConfig.augment`)
    pillow_fallbacks: int = 0  # samples the fast crops handed to Pillow (non-JPEG, CMYK, ...)
    sources: Counter = field(default_factory=Counter)  # a mix: samples delivered per source
    source_skipped: Counter = field(default_factory=Counter)  # a mix: skips per source
    fetch: dict = field(default_factory=dict)  # remote reads: bytes, cache hits, in flight
    budget: int = 10  # skips allowed before the worker stops

    def snapshot(self) -> dict:
        return {
            "worker": self.worker,
            "samples": self.samples,
            "skipped": dict(self.skipped),
            "bad_shards": dict(self.bad_shards),
            "bad_shard_examples": list(self.bad_shard_examples),
            "refilled": self.refilled,
            "unfilled": self.unfilled,
            "decode_s": self.decode_s,
            "augment_s": self.augment_s,
            "pillow_fallbacks": self.pillow_fallbacks,
            "sources": dict(self.sources),
            "source_skipped": dict(self.source_skipped),
            "fetch": dict(self.fetch),
        }


class SharedState:
    """Epoch number and resume segments, shared with (persistent) worker processes.

    Workers read it in `__iter__`, which the DataLoader calls at the start of
    every epoch even when workers persist, so `set_epoch` always reaches them.
    """

    def __init__(self) -> None:
        self._array = multiprocessing.get_context().Array("q", 2 + MAX_SEGMENTS * SEGMENT_INTS)

    def write(self, epoch: int, segments: list[Segment]) -> None:
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"more than {MAX_SEGMENTS} resumes within one epoch")
        values = [epoch, len(segments)]
        for segment in segments:
            values += segment.to_ints()
        with self._array.get_lock():
            self._array[: len(values)] = values

    def read(self) -> tuple[int, list[Segment]]:
        with self._array.get_lock():
            values = list(self._array)
        epoch, count = values[0], values[1]
        starts = range(2, 2 + count * SEGMENT_INTS, SEGMENT_INTS)
        return epoch, [Segment.from_ints(values[i : i + SEGMENT_INTS]) for i in starts]


@dataclass(frozen=True)
class StreamSettings:
    """What a worker needs besides the shard list (picklable, no closures): the config's
    groups it reads, their None defaults resolved, and what the source decided.

    Built by one function, `pipeline.loader.stream_settings`; no field has a default
    of its own, so none can drift from `LoaderConfig`'s.
    """

    seed: int
    rank: int
    world_size: int
    batch: Batching  # drop_last and epoch_rule resolved (never None)
    shuffle: Shuffle  # a buffer of 1 (no mixing) in evaluation
    io: ReadOptions
    fields: tuple[Field, ...]  # what each batch carries, in this order
    with_keys: bool
    max_skip_fraction: float
    epoch_samples: int | None  # set: resampled mode with this many samples per epoch
    class_weights: tuple[float, ...] | None  # resampled mode: keep-probability per class
    num_classes: int | None  # the manifest's class count: labels past it are skips
    # Eval with the `uneven` rule: every good sample once and none twice, so a batch the
    # stream cannot fill (its bad samples were skipped) is delivered short, never refilled.
    exactly_once: bool
    image_size: int  # the crop's side (eval, or train without a progressive schedule)
    progressive: ProgressiveResize | None  # train: the side by epoch
    augment: Augment | None  # train with an enabled `Augment`: run after each crop


@dataclass(frozen=True)
class EpochImages:
    """How one epoch's images are made: the crop at the epoch's side, then the augmenter."""

    transform: Callable
    augmenter: Callable | None
    size: int


class ShardStream(IterableDataset):
    """Yields ready batches `(values, size, keys, stats)`; an exactly-once epoch that ends
    short ends with `((), 0, None, stats)`, its final counts (`ShardLoader` yields no batch
    for it).

    `values` holds one collated entry per field of `settings.fields`, in that order:
    images uint8 `[B, 3, H, W]` (or a ring `SlotBatch`), labels int64 `[B]`, text and
    JSON as lists, multi-label targets float32 `[B, C]`, weights float32 `[B]`.
    """

    def __init__(
        self,
        shards: Sequence[ShardSpec],
        settings: StreamSettings,
        transform: Callable,
        shared: SharedState,
        ring: BatchRing | None = None,
        counts: np.ndarray | None = None,
        mix: MixedShards | None = None,
    ) -> None:
        super().__init__()
        self.ring = ring
        self.shards = shards
        self.mix = mix
        # Samples per shard (the source's column when given), read once: planning an
        # epoch needs only these, O(shards), never O(samples).
        if counts is None:
            counts = np.fromiter((s.samples for s in shards), dtype=np.int64, count=len(shards))
        self.counts = np.asarray(counts, dtype=np.int64)
        self.total = int(self.counts.sum()) if mix is None else mix.plan.total
        self.settings = settings
        self.read_fields = read_fields(settings.fields)
        # Each member's cap goes to the reader, which skips an oversized member unread
        # instead of holding it in the shuffle buffer until its decode refuses it.
        caps = settings.io.limits.member_caps + member_caps(settings.fields)
        self.read_limits = dataclasses.replace(settings.io.limits, member_caps=caps)
        self.ranged = class_ranged_fields(settings.fields, settings.num_classes)
        self.transform = transform
        self.direct = direct_image_field(settings, transform)
        self.shared = shared
        self.fetcher = ShardFetcher(settings.io)  # per process: threads start on first use

    def partition(self, num_workers: int) -> Partition:
        s = self.settings
        return Partition.of(s.batch, s.shuffle, s.world_size, num_workers)

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        epoch, segments = self.shared.read()
        part = self.partition(num_workers)
        resumed = 0
        if segments and segments[-1].partition == part:
            resumed = segments[-1].consumed
            segments = segments[:-1]
        # After resuming at batch c the DataLoader restarts its round robin at
        # worker 0, so physical worker w plays slot (w + c) % num_workers.
        role = (worker + resumed) % num_workers
        stats = WorkerStats(worker=worker)
        slot = self.plan_slot(epoch, segments, part, role)
        every = self.shards if self.mix is None else itertools.chain(*self.mix.shards)
        stats.fetch = self.fetcher.schedule(plan_shards(slot, self.shards, self.mix), every)
        planned, batches = slot.samples, slot.batches
        stats.budget = max(10, int(planned * self.settings.max_skip_fraction))
        if isinstance(slot, MixedWorkerPlan):
            shuffled = self.iter_mixed(slot, epoch, role, stats)
        else:
            if slot.pieces is None:
                rng = self.draw_rng(epoch, len(segments), role)
                samples = self.iter_draws(rng, stats, slot.samples)
            elif slot.repeats is not None:
                samples = self.iter_copies(slot, stats)
            else:
                samples = self.iter_pieces(slot.pieces, stats)
            # Repeated augmentation: ranks reading one lane each shuffle alike (the plan).
            rank = self.settings.rank if slot.shuffle_rank is None else slot.shuffle_rank
            rng = worker_rng(self.settings.seed, epoch, rank, role)
            shuffled = shuffle_buffer(samples, part.shuffle_buffer, part.shuffle_initial, rng)
        skip_batches = roles_consumed(resumed, num_workers)[role]
        for _ in range(min(skip_batches * part.batch_size, planned)):
            next(shuffled, None)  # delivered before the interruption: read, never decoded
        sizes = iter_batch_sizes(planned, batches, part.batch_size, skip_batches)
        yield from self.iter_batches(shuffled, sizes, epoch, stats)

    def plan_slot(
        self, epoch: int, segments: list[Segment], part: Partition, role: int
    ) -> WorkerPlan | MixedWorkerPlan:
        """Slot `role`'s share of the epoch, by the plan the main process counts batches by.

        Only the slot's plan outlives this call: the epoch's layout (4 bytes a shard) and
        the rank's positions are not held while the epoch is read.
        """
        return self.plan_epoch(part, epoch, segments).worker(role)

    def plan_epoch(self, part: Partition, epoch: int, segments: Sequence[Segment]):
        """This rank's `plan_epoch` of one source or of the mix: the main process and the
        workers ask here, so they plan alike."""
        s = self.settings
        counts = self.counts if self.mix is None else self.mix.plan
        return plan_epoch(counts, part, s.rank, s.seed, epoch, segments, s.epoch_samples)

    def iter_mixed(
        self, slot: MixedWorkerPlan, epoch: int, role: int, stats: WorkerStats
    ) -> Iterator[Sample]:
        """A mix's samples in the plan's merged order, each source through its own buffer.

        One buffer per source, sized by its share, keeps each batch's make-up the
        interleave's: a shared buffer would mix sources by chance.
        """
        s = self.settings
        streams = []
        for part in slot.parts:
            rng = source_rng(s.seed, epoch, s.rank, role, part.name)
            samples = self.iter_source(part, stats)
            streams.append(shuffle_buffer(samples, part.buffer, part.initial, rng))
        return merge_sources(slot.iter_sources(), streams)

    def iter_source(self, part: SourceSlot, stats: WorkerStats) -> Iterator[Sample]:
        """One source's samples of a slot, named for the mix: keys `"{name}/{key}"`, the
        repeat number of their pass, class ids in the mix's classes."""
        shards, remap = self.mix.shards[part.source], self.mix.remaps[part.source]
        for piece, repeat in part.pieces.iter_with_repeats():
            for sample in self.iter_pieces((piece,), stats, shards, part.name):
                sample["__key__"] = f"{part.name}/{sample['__key__']}"
                sample["__source__"], sample["__repeat__"] = part.name, repeat
                if remap is not None:
                    remap_label(sample, remap)
                yield sample

    def iter_copies(self, slot: WorkerPlan, stats: WorkerStats) -> Iterator[Sample]:
        """Repeated augmentation: each sample read once and emitted as the plan's copies,
        each with its repeat number (a different augmentation); the bytes are shared."""
        for piece, first, copies in zip(
            slot.pieces, slot.repeats.tolist(), slot.copies.tolist(), strict=True
        ):
            for sample in self.iter_pieces((piece,), stats):
                for repeat in range(first, first + copies):
                    yield {**sample, "__repeat__": repeat}

    def draw_rng(self, epoch: int, resumes: int, role: int) -> random.Random:
        """The random source of slot `role`'s draws in resampled mode.

        Draws are with replacement (shards weighted by size): a resumed epoch is not
        replayed, a new partition simply continues drawing, from a source of its own.
        """
        s = self.settings
        return random.Random(f"resample:{s.seed}:{epoch}:{resumes}:{s.rank}:{role}")

    def iter_draws(self, rng: random.Random, stats: WorkerStats, planned: int) -> Iterator[Sample]:
        """Samples drawn with replacement, shards weighted by size, for resampled mode.

        With class weights, each sample is kept with a probability proportional to its
        class weight: the streaming analogue of WeightedRandomSampler. Shards are drawn
        up to `DRAWS_AHEAD` ahead of the one read, from a source of their own (so the
        order does not depend on prefetch), and handed to the fetcher, so remote ones
        are fetched while the current one is decoded; no more are drawn ahead than the
        `planned` samples still need (without class weights, where each one is kept).
        """
        weights = self.settings.class_weights
        top = max(weights) if weights else 1.0
        balance = BalanceRule.build(weights, self.settings.fields)
        shard_ids = range(len(self.shards))
        # What rng.choices(weights=counts) computes on every call, computed once.
        cum_counts = list(itertools.accumulate(self.counts.tolist()))
        shard_rng = random.Random(rng.getrandbits(64))
        drawn: deque[int] = deque()
        kept = 0
        fruitless = 0  # samples read since the last one kept: guards a dead dataset
        while True:
            ahead = sum(int(self.counts[i]) for i in drawn)
            while not drawn or (len(drawn) <= DRAWS_AHEAD and (weights or kept + ahead < planned)):
                drawn.append(shard_rng.choices(shard_ids, cum_weights=cum_counts)[0])
                ahead += int(self.counts[drawn[-1]])
            shard = drawn.popleft()
            self.fetcher.plan_ahead([self.shards[i] for i in (shard, *drawn)])
            for sample in self.iter_pieces([Piece(shard, 0, int(self.counts[shard]))], stats):
                fruitless += 1
                if weights and rng.random() * top > balance.weight(sample, top):
                    continue
                fruitless = 0
                kept += 1
                yield sample
            fruitless += 1
            if fruitless > MAX_FRUITLESS_READS:
                raise LoaderDataError(
                    f"worker {stats.worker}: {fruitless} reads without a usable sample "
                    f"(skipped: {dict(stats.skipped)}); check the shards and class weights"
                )

    def iter_pieces(
        self,
        pieces,
        stats: WorkerStats,
        shards: Sequence[ShardSpec] | None = None,
        source: str | None = None,
    ) -> Iterator[Sample]:
        """Samples of each piece in order; a broken shard costs only its unread rest.

        Args:
            shards: what the pieces index (default: the loader's one source).
            source: a mix's source name, for its skip count.
        """
        shards = self.shards if shards is None else shards
        for piece in pieces:
            spec = shards[piece.shard]
            delivered = 0
            try:
                for sample in self.read_piece(spec, piece.start, piece.stop):
                    delivered += 1
                    yield sample
            except SHARD_ERRORS as error:
                reason = error.reason if isinstance(error, ShardError) else "shard_unreadable"
                # A shard read without a count loses an unknown rest: none is counted.
                lost = piece.stop - piece.start - delivered if spec.counted else 0
                stats.bad_shards[reason] += 1
                if len(stats.bad_shard_examples) < MAX_EXAMPLES:
                    stats.bad_shard_examples.append(str(error))
                # Errors name the shard by its redacted URL (ShardError, ShardReadError).
                log.warning("%s; %d of its planned samples not read", error, lost)
                if lost:
                    if source is not None:
                        stats.source_skipped[source] += lost
                    count_skips(stats, reason, lost, f"shard {spec.display}", self.skip_hint)

    def read_piece(self, spec: ShardSpec, start: int, stop: int) -> Iterator[Sample]:
        """Samples `[start, stop)` of one shard, capped by what its manifest entry says."""
        limits = self.read_limits
        if spec.bytes is not None:
            limits = dataclasses.replace(limits, shard_bytes=max(1, spec.bytes))
        with self.fetcher.open(spec) as stream:
            yield from spec.format.iter_samples(
                stream,
                spec.url,
                start,
                stop if spec.counted else None,  # no count: the shard to its end
                fields=self.read_fields,
                limits=limits,
                declared=spec.samples if spec.counted else None,
            )

    def iter_batches(
        self, shuffled, sizes: Iterable[int], epoch: int, stats: WorkerStats
    ) -> Iterator[tuple]:
        reserve: deque = deque(maxlen=RESERVE_SIZE)
        fallbacks = pillow_fallbacks()  # this process's count before this epoch's decodes
        sizes = iter(sizes)  # what an exactly-once epoch leaves unfilled is summed from it
        images = self.epoch_images(epoch)
        for size in sizes:
            target = self.image_target(size, images)
            try:
                rows, keys = self.fill_batch(shuffled, size, epoch, stats, reserve, target, images)
            except BaseException:
                if target is not None:
                    target.abandon()  # a worker's slot is free again, not leaked
                raise
            if len(rows) < size:  # exactly once: the stream ran dry, its bad samples skipped
                stats.unfilled += size - len(rows)
                if not rows:  # no empty batch: the worker's final counts, and the end
                    if target is not None:
                        target.abandon()
                    stats.unfilled += sum(sizes)  # the planned batches left, unfilled too
                    yield (), 0, None, stats.snapshot()
                    return
                if target is not None:
                    target.shorten(len(rows))
            stats.samples += len(rows)
            stats.pillow_fallbacks = pillow_fallbacks() - fallbacks
            yield self.collate(rows, keys, stats, target)

    def fill_batch(
        self,
        shuffled,
        size: int,
        epoch: int,
        stats: WorkerStats,
        reserve: deque,
        target,
        images: EpochImages,
    ) -> tuple[list[tuple], list[str]]:
        """Decode `size` good samples, skipping bad ones; when the stream ends, refill from
        recent good samples, or (`exactly_once`) return the batch short."""
        rows: list[tuple] = []
        keys: list[str] = []
        while len(rows) < size:
            sample = next(shuffled, None)
            if sample is None:
                if self.settings.exactly_once:
                    break
                sample, repeat = self.refill(reserve, stats)
            else:
                repeat = sample.get("__repeat__", 0)  # a mix's pass over its source
            out = None if target is None else target.arrays[len(rows)]
            try:
                row = self.decode(sample, epoch, stats, repeat, out, images)
            except SampleError as error:
                self.log_skip(sample, error, stats)
                if "__source__" in sample:
                    stats.source_skipped[sample["__source__"]] += 1
                where = f"{sample.get('__url__')} key {sample.get('__key__')}"
                count_skips(stats, error.reason, 1, where, self.skip_hint)
                continue
            reserve.append(sample)
            rows.append(row)
            keys.append(sample["__key__"])
            if "__source__" in sample:
                stats.sources[sample["__source__"]] += 1
        return rows, keys

    def epoch_images(self, epoch: int) -> EpochImages:
        """The crop of `epoch` (at its progressive side) and the augmenter for that side.

        Made where a worker starts an epoch (`set_epoch` reaches persistent workers there),
        so a new side needs no new worker: its batches take the first bytes of slots sized
        for the largest side (`ShardLoader.make_ring`).
        """
        s = self.settings
        transform, size = self.transform, s.image_size
        if s.progressive is not None:
            size = s.progressive.size_at(epoch)
            transform = dataclasses.replace(transform, size=size)
        augmenter = build_augmenter(s.augment, size) if s.augment is not None else None
        return EpochImages(transform, augmenter, size)

    def image_target(self, size: int, images: EpochImages) -> ImageTarget | None:
        """The batch buffer the transform writes into, when it can (see `direct_image_field`)."""
        if self.direct is None:
            return None
        side = images.transform.size
        return ImageTarget.allocate((size, side, side, 3), True, self.ring)

    def decode(
        self,
        sample: Sample,
        epoch: int,
        stats: WorkerStats,
        repeat: int = 0,
        out: np.ndarray | None = None,
        images: EpochImages | None = None,
    ) -> tuple:
        """One value per field: the transformed (and augmented) image, the label, text, ...

        Args:
            out: where the image transform writes its pixels (a slot of the batch), when
                the stream writes images in place (`direct_image_field`).
            images: the epoch's crop and augmenter (default: `epoch_images(epoch)`).
        """
        if "__error__" in sample:
            raise sample["__error__"]
        images = self.epoch_images(epoch) if images is None else images
        started = time.perf_counter()
        key, seed = sample["__key__"], self.settings.seed
        parsed: dict = {}  # JSON members parsed once for all fields reading them
        row = []
        for index, spec in enumerate(self.settings.fields):
            value = field_value(sample, spec, parsed)
            # Augmentation randomness comes from the sample key and epoch, so it does
            # not depend on which worker or rank happens to decode the sample.
            if spec.kind == "image":
                rng = SampleRandom(f"aug:{seed}:{epoch}:{key}:{repeat}")
                if out is not None and index == self.direct:
                    value = images.transform(value, rng, out=out)
                    if value is not out:  # a transform that could not use the slot
                        out[...] = value
                        value = out
                else:
                    value = images.transform(value, rng)
                if images.augmenter is not None:
                    # Its own draws: the crop's stay those of a loader without augmentation.
                    rng = SampleRandom(f"augment:{seed}:{epoch}:{key}:{repeat}")
                    value = augment_image(value, images.augmenter, rng, stats)
            else:
                if index in self.ranged:
                    check_class_range(spec, value, self.settings.num_classes, key)
                if spec.transform is not None:
                    rng = SampleRandom(f"{spec.name}:{seed}:{epoch}:{key}:{repeat}")
                    value = spec.transform(value, rng)
            row.append(value)
        stats.decode_s += time.perf_counter() - started
        return tuple(row)

    def refill(self, reserve: deque, stats: WorkerStats) -> tuple[Sample, int]:
        """A recent good sample and its repeat number (for a new augmentation)."""
        if not reserve:
            raise LoaderDataError(
                f"worker {stats.worker}: no readable samples to fill its batches "
                f"(skipped: {dict(stats.skipped)}). {self.skip_hint(stats.skipped)}"
            )
        stats.refilled += 1
        return reserve[stats.refilled % len(reserve)], stats.refilled

    def skip_hint(self, skipped: Mapping[str, int]) -> str:
        """What to do about these skips: a field no sample has is named, with the members
        the samples do have (`shards.sample.skip_budget_hint`)."""
        return skip_budget_hint(self.settings.fields, skipped, self.members_seen())

    def members_seen(self) -> tuple[str, ...] | None:
        """The member names of the first shard's samples, for a failure's message only;
        None when that shard cannot be read either."""
        if not self.shards:
            return None
        spec = self.shards[0]
        try:
            with self.fetcher.open(spec) as stream:
                return spec.format.list_members(stream, spec.url, self.read_limits)
        except SHARD_ERRORS:
            return None

    def log_skip(self, sample: Sample, error: SampleError, stats: WorkerStats) -> None:
        skipped = sum(stats.skipped.values()) + 1
        if skipped == 1 or skipped % LOG_EVERY == 0:
            log.warning(
                "skipped sample %s of %s: %s (%d skipped so far)",
                sample.get("__key__"),
                sample.get("__url__"),
                error,
                skipped,
            )

    def collate(
        self,
        rows: list[tuple],
        keys: list[str],
        stats: WorkerStats,
        target: ImageTarget | None = None,
    ) -> tuple:
        values = []
        columns = zip(*rows, strict=True)
        for index, (spec, column) in enumerate(zip(self.settings.fields, columns, strict=True)):
            if target is not None and index == self.direct:
                values.append(target.finish())  # the images were written in place
            elif spec.kind == "image":
                values.append(
                    stack_images(list(column), self.settings.batch.channels_last, self.ring)
                )
            elif spec.transform is not None:
                values.append(stack_outputs(spec, list(column), keys))
            else:
                collated = collate_values(spec, list(column))
                is_array = isinstance(collated, np.ndarray)
                values.append(torch.from_numpy(collated) if is_array else collated)
        keys = keys if self.settings.with_keys else None
        return tuple(values), len(rows), keys, stats.snapshot()


@dataclass(frozen=True, eq=False)
class MixedShards:
    """What a worker reads a mix by: the plan's `Mix`, each source's shards and class map."""

    plan: Mix
    shards: tuple[Sequence[ShardSpec], ...]
    remaps: tuple[tuple[int, ...] | None, ...]


def merge_sources(order: Iterator[int], streams: list[Iterator[Sample]]) -> Iterator[Sample]:
    """The next sample of source `s` for each `s` of `order`; a source that ran short
    (its bad shards' samples were lost, counted) leaves its places to the others."""
    for source in order:
        sample = next(streams[source], None)
        if sample is not None:
            yield sample


def remap_label(sample: Sample, remap: tuple[int, ...]) -> None:
    """A source's class id made the mix's (by name); an id it cannot read is left for
    decode to count as a skip."""
    for name in LABEL_FIELDS:
        if name in sample:
            try:
                label = int(sample[name])
            except ValueError:
                return
            if 0 <= label < len(remap):
                sample[name] = str(remap[label]).encode()
            return


def stack_outputs(spec: Field, outputs: list, keys: list[str]) -> torch.Tensor | list:
    """A field transform's outputs as one batch: tensors and arrays stacked, others a list.

    Raises:
        ValueError: the outputs are tensors of different shapes (a bug of the
            transform, e.g. a tokenizer that does not pad to a fixed length).
    """
    first = outputs[0]
    if not isinstance(first, (torch.Tensor, np.ndarray)):
        return outputs
    tensors = [torch.as_tensor(output) for output in outputs]
    shapes = {tuple(tensor.shape) for tensor in tensors}
    if len(shapes) > 1:
        raise ValueError(
            f"the transform of field {spec.name!r} returned tensors of shapes "
            f"{sorted(shapes)[:4]} in one batch (keys {keys[0]}...); return one fixed shape "
            "(pad or truncate, e.g. to a fixed token count) so the batch can be stacked"
        )
    return torch.stack(tensors)


def direct_image_field(settings: StreamSettings, transform: Callable) -> int | None:
    """Index of the image field whose transform writes straight into the batch, or None.

    The loader's crops (`writes_into`, a fixed `size`) resize into their slot of a
    channels-last batch: no per-sample output array (fresh pages for each 150 KB image)
    and no copy into the batch. Other transforms, NCHW batches and samples with several
    image fields are stacked as before.
    """
    images = [i for i, spec in enumerate(settings.fields) if spec.kind == "image"]
    direct = getattr(transform, "writes_into", False) and isinstance(
        getattr(transform, "size", None), int
    )
    return images[0] if direct and settings.batch.channels_last and len(images) == 1 else None


class ImageTarget:
    """A channels-last uint8 batch being filled in place: a ring slot or fresh shared memory."""

    def __init__(
        self, batch: torch.Tensor | SlotBatch, arrays: np.ndarray, channels_last: bool, ring
    ) -> None:
        self.batch, self.arrays, self.ring = batch, arrays, ring
        self.channels_last = channels_last

    @classmethod
    def allocate(
        cls, nhwc: tuple[int, int, int, int], channels_last: bool, ring: BatchRing | None
    ) -> ImageTarget:
        """A batch of `nhwc` images (`[B, 3, H, W]`-shaped, NHWC strides when `channels_last`)."""
        count, height, width, channels = nhwc
        shape = nhwc if channels_last else (count, channels, height, width)
        info = get_worker_info()
        slot = ring.acquire(info.id if info else 0, shape) if ring is not None else None
        if slot is not None:
            return cls(slot, slot.writable(), channels_last, ring)
        batch = torch.empty(shape, dtype=torch.uint8)
        if info is not None:
            batch.share_memory_()  # the DataLoader then sends it without copying it again
        return cls(batch, batch.numpy(), channels_last, None)

    def finish(self) -> torch.Tensor | SlotBatch:
        """What the batch carries: the slot (the consumer makes it a tensor) or the tensor."""
        if isinstance(self.batch, SlotBatch):
            self.batch.channels_last = self.channels_last
            return self.batch
        return self.batch.permute(0, 3, 1, 2) if self.channels_last else self.batch

    def abandon(self) -> None:
        """Give an unfinished batch's slot back (an error stopped the batch)."""
        if isinstance(self.batch, SlotBatch) and self.ring is not None:
            self.ring.release(self.batch.slot)

    def shorten(self, count: int) -> None:
        """Keep the first `count` images: a short batch of an exactly-once epoch.

        The batch dimension is the outermost of either layout, so the first `count`
        images are the slot's (or tensor's) first bytes: nothing moves.
        """
        self.arrays = self.arrays[:count]
        if isinstance(self.batch, SlotBatch):
            self.batch.shape = (count, *self.batch.shape[1:])
        else:
            self.batch = self.batch[:count]


def augment_image(
    pixels: np.ndarray, augmenter: Callable, rng: random.Random, stats: WorkerStats
) -> np.ndarray:
    """`pixels` augmented in place (a batch slot), or a writable copy of a read-only crop.

    Raises:
        UsageError: a `Crop.transform` returned something other than uint8 HxWx3.
    """
    started = time.perf_counter()
    image = isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == 3
    if not image or pixels.shape[2] != 3:
        raise UsageError(
            f"Crop.transform returned {type(pixels).__name__} "
            f"{getattr(pixels, 'dtype', '')} {tuple(getattr(pixels, 'shape', ()))}; "
            "LoaderConfig.augment needs uint8 HxWx3 pixels: return those, or leave augment out"
        )
    if not pixels.flags.writeable:
        pixels = np.array(pixels)  # a transform's read-only output (Pillow's bytes): one copy
    augmenter(pixels, rng)
    stats.augment_s += time.perf_counter() - started
    return pixels


def stack_images(
    images: list[np.ndarray], channels_last: bool, ring: BatchRing | None = None
) -> torch.Tensor | SlotBatch:
    """Write HWC images straight into one batch buffer: a reused ring slot when one is free.

    np.stack, then a permuting copy, then the DataLoader's own copy into shared
    memory made three fresh batch-sized buffers (and their page faults) per
    batch. This makes at most one, and none when the ring has a free slot (see
    `pipeline.batchring`). Without a slot, the buffer is made in shared memory
    inside a worker, so the DataLoader sends it without copying it again.

    Returns:
        A uint8 `[B, 3, H, W]` tensor (NHWC strides when `channels_last`), or a
        `SlotBatch` that the consumer turns into that tensor.
    """
    height, width, channels = images[0].shape
    target = ImageTarget.allocate((len(images), height, width, channels), channels_last, ring)
    slots = target.arrays
    # numpy assignment: a plain memcpy (or one transposing loop) per image, no
    # per-call dispatch or thread-pool overhead as with torch's copy_.
    for index, image in enumerate(images):
        slots[index] = image if channels_last else image.transpose(2, 0, 1)
    return target.finish()


def count_skips(
    stats: WorkerStats,
    reason: str,
    count: int,
    where: str,
    hint: Callable[[Mapping[str, int]], str] | None = None,
) -> None:
    """Count skipped samples; past the worker's budget, stop with what, where and what to do
    (a field whose member no sample has is named: the data is not bad, the field is)."""
    stats.skipped[reason] += count
    skipped = sum(stats.skipped.values())
    if skipped > stats.budget:
        raise LoaderDataError(
            f"worker {stats.worker} skipped {skipped} samples, over its budget of {stats.budget} "
            f"({dict(stats.skipped)}); last: {where}. "
            + (hint(stats.skipped) if hint else skip_budget_hint((), stats.skipped))
        )


def class_weight(weights: tuple[float, ...], sample: Sample, default: float) -> float:
    """The sample's class weight; unreadable or unknown labels pass (decode judges them)."""
    value = next((sample[name] for name in LABEL_FIELDS if name in sample), b"")
    try:
        label = int(value)
    except ValueError:
        return default
    return weights[label] if 0 <= label < len(weights) else default


@dataclass(frozen=True)
class BalanceRule:
    """How class balance weighs a drawn sample: by its class, or by its rarest label.

    Single-label (a `label` field among the fields, the default): `class_weight`. Without
    one, a `multi_label` field: the largest weight among the sample's labels (its rarest
    label's `1 / count`), so a sample holding a rare class is drawn as that class's
    samples are; a sample with no label weighs as the most common class (the smallest
    positive weight). Unreadable labels pass, as in `class_weight`.
    """

    weights: tuple[float, ...] | None
    field: Field | None = None  # the multi-label field; None: single-label
    unlabelled: float = 0.0

    @classmethod
    def build(cls, weights: tuple[float, ...] | None, fields: Sequence[Field]) -> BalanceRule:
        kinds = {spec.kind: spec for spec in reversed(fields)}  # the first of each kind
        if not weights or "label" in kinds or "multi_label" not in kinds:
            return cls(weights)
        return cls(weights, kinds["multi_label"], min((w for w in weights if w > 0), default=0.0))

    def weight(self, sample: Sample, default: float) -> float:
        if self.field is None:
            return class_weight(self.weights, sample, default)
        try:
            labels = field_value(sample, self.field)
        except SampleError:
            return default  # decode counts it as a skip
        if not labels:
            return self.unlabelled
        return max((self.weights[i] for i in labels if i < len(self.weights)), default=default)


def batch_sizes(samples: int, batches: int, batch_size: int) -> list[int]:
    """Sizes of a worker's batches: full ones, the last one partial if samples run short."""
    return list(iter_batch_sizes(samples, batches, batch_size))


def iter_batch_sizes(samples: int, batches: int, batch_size: int, start: int = 0) -> Iterator[int]:
    """`batch_sizes` from batch `start` on, one at a time: a worker of a 10^9-sample epoch
    has ~2 million batches, a 16 MB list it would hold all epoch."""
    yield from itertools.repeat(batch_size, max(0, batches - 1 - start))
    if start < batches:
        yield min(batch_size, samples - (batches - 1) * batch_size)
