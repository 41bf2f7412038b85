"""The loader's first stages, over encoded samples: per source, a plan slice's pieces ->
shard samples (`ShardReader`) -> the plan's copies (`iter_source`) or draws (`iter_draws`)
-> its shuffle buffer (`pipeline.plan.shuffle_buffer`); then the sources merged
(`merge_sources`; one source: as it is) -> `skip_delivered`.

Each stage is an iterator -> iterator function over `Sample` dicts (encoded bytes, 10-50x
smaller than pixels); none knows which process runs it. `pipeline.assemble` decodes what
comes out of them into batches, and `pipeline.roles` lays the chain out for one role.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from pipeline.augment import Augment
from pipeline.config import Batching, ProgressiveResize, ReadOptions, Shuffle
from pipeline.epoch import Mix, SourceSlot
from pipeline.fetch import ShardFetcher
from pipeline.positions import Piece
from pipeline.sources import ShardSpec
from pipeline.stats import LoaderDataError, WorkerStats, count_skips
from shards.errors import ShardError
from shards.sample import (
    DEFAULT_FIELDS,
    LABEL_FIELDS,
    Field,
    Sample,
    SampleError,
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
MAX_FRUITLESS_READS = 100_000
DRAWS_AHEAD = 4  # resampled mode: shards drawn (and fetched) beyond the one being read
MAX_EXAMPLES = 5  # bad shards named in a worker's stats (the logs name every one)
# What the stream reads by default: the image and its label. Members no requested
# field needs (a shard's `json` metadata, say) are passed over unread (seeked past in
# tars, a column not read in Parquet).
STREAM_FIELDS = read_fields(DEFAULT_FIELDS)


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


@dataclass(frozen=True, eq=False)
class SourceShards:
    """What a worker reads its sources by: the plan's `Mix` (one plain source is a mix of
    one), each source's shards and its class ids in the mix's (None: the same)."""

    plan: Mix
    shards: tuple[Sequence[ShardSpec], ...]
    remaps: tuple[tuple[int, ...] | None, ...]


class ShardReader:
    """Reads planned pieces of shards as samples: one per process, its fetcher's threads
    started on first use, so a forked worker or a Ray actor reads through its own.

    Args:
        first: a shard a failure's message may list the members of (`members_seen`).
    """

    def __init__(self, settings: StreamSettings, first: ShardSpec | None) -> None:
        self.fields = settings.fields
        self.read_fields = read_fields(settings.fields)
        # Each member's cap goes to the reader, which skips an oversized member unread
        # instead of holding it in the shuffle buffer until its decode refuses it.
        caps = settings.io.limits.member_caps + member_caps(settings.fields)
        self.read_limits = dataclasses.replace(settings.io.limits, member_caps=caps)
        self.fetcher = ShardFetcher(settings.io)
        self.first = first

    def iter_pieces(
        self,
        pieces: Iterable[Piece],
        shards: Sequence[ShardSpec],
        stats: WorkerStats,
        source: str | None = None,
    ) -> Iterator[Sample]:
        """Samples of each piece of `shards` in order; a broken shard costs only its unread
        rest, counted (`source`: a mix's source name, for its skip count)."""
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

    def skip_hint(self, skipped: Mapping[str, int]) -> str:
        """What to do about these skips: a field no sample has is named, with the members
        the samples do have (`shards.sample.skip_budget_hint`)."""
        return skip_budget_hint(self.fields, skipped, self.members_seen())

    def members_seen(self) -> tuple[str, ...] | None:
        """The member names of the first shard's samples, for a failure's message only;
        None when that shard cannot be read either."""
        if self.first is None:
            return None
        try:
            with self.fetcher.open(self.first) as stream:
                return self.first.format.list_members(stream, self.first.url, self.read_limits)
        except SHARD_ERRORS:
            return None


def iter_source(
    reader: ShardReader, sources: SourceShards, part: SourceSlot, stats: WorkerStats
) -> Iterator[Sample]:
    """One source's samples of a slot: each read once and emitted as the plan's copies
    (a pass's number, or repeated augmentation's copies, each a different augmentation;
    the bytes are shared), named for the mix (`name_sample`)."""
    shards, remap = sources.shards[part.source], sources.remaps[part.source]
    for piece, first, copies in part.pieces.iter_copies():
        for sample in reader.iter_pieces((piece,), shards, stats, part.name or None):
            name_sample(sample, part.name, remap)
            if copies == 1:
                sample["__repeat__"] = first
                yield sample
                continue
            for repeat in range(first, first + copies):
                yield {**sample, "__repeat__": repeat}


def name_sample(sample: Sample, name: str, remap: tuple[int, ...] | None) -> None:
    """A named source's sample as the mix knows it: key `"{name}/{key}"`, its source
    counted by name, class ids in the mix's classes. An unnamed source's is left as read."""
    if name:
        sample["__key__"] = f"{name}/{sample['__key__']}"
        sample["__source__"] = name
    if remap is not None:
        remap_label(sample, remap)


def merge_sources(order: Iterator[int], streams: list[Iterator[Sample]]) -> Iterator[Sample]:
    """The next sample of source `s` for each `s` of `order`; a source that ran short
    (its bad shards' samples were lost, counted) leaves its places to the others. One
    source is its own order: its stream as it is."""
    if len(streams) == 1:
        yield from streams[0]
        return
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


@dataclass(frozen=True)
class Draws:
    """What resampled mode draws from: one source's shards, their sample counts, and the
    keep-probability per class (None: every sample is kept)."""

    shards: Sequence[ShardSpec]
    counts: Sequence[int]
    weights: tuple[float, ...] | None
    fields: tuple[Field, ...]
    name: str = ""  # the source's name in a mix (`name_sample`)
    remap: tuple[int, ...] | None = None


def iter_draws(
    reader: ShardReader, draws: Draws, rng: random.Random, stats: WorkerStats, planned: int
) -> Iterator[Sample]:
    """Samples drawn with replacement, shards weighted by size, for resampled mode.

    With class weights, each sample is kept with a probability proportional to its
    class weight: the streaming analogue of WeightedRandomSampler. Shards are drawn
    up to `DRAWS_AHEAD` ahead of the one read, from a source of their own (so the
    order does not depend on prefetch), and handed to the fetcher, so remote ones
    are fetched while the current one is decoded; no more are drawn ahead than the
    `planned` samples still need (without class weights, where each one is kept).
    """
    weights, counts = draws.weights, draws.counts
    top = max(weights) if weights else 1.0
    balance = BalanceRule.build(weights, draws.fields)
    shard_ids = range(len(draws.shards))
    # What rng.choices(weights=counts) computes on every call, computed once.
    cum_counts = list(itertools.accumulate(counts))
    shard_rng = random.Random(rng.getrandbits(64))
    drawn: deque[int] = deque()
    kept = 0
    fruitless = 0  # samples read since the last one kept: guards a dead dataset
    while True:
        ahead = sum(counts[i] for i in drawn)
        while not drawn or (len(drawn) <= DRAWS_AHEAD and (weights or kept + ahead < planned)):
            drawn.append(shard_rng.choices(shard_ids, cum_weights=cum_counts)[0])
            ahead += counts[drawn[-1]]
        shard = drawn.popleft()
        reader.fetcher.plan_ahead([draws.shards[i] for i in (shard, *drawn)])
        pieces = [Piece(shard, 0, counts[shard])]
        for sample in reader.iter_pieces(pieces, draws.shards, stats, draws.name or None):
            name_sample(sample, draws.name, draws.remap)
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


def skip_delivered(samples: Iterator[Sample], count: int) -> Iterator[Sample]:
    """`samples` after the first `count`: what a resumed role delivered before it was
    interrupted is read again (to keep the shuffle's order) but never decoded."""
    for _ in itertools.islice(samples, count):
        pass
    yield from samples
