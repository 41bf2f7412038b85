"""`build_loader(LoaderConfig(...))`: shard URLs or a manifest in, batches of the chosen fields out.

The main process only forwards batches that workers built (and pins them);
it counts what was consumed so `state_dict()` can resume mid-epoch, and it
times how long the consumer waited for each batch. Images come in reused ring
slots and small fields as bytes (`inline_small_tensors`), so no batch costs it
a shared-memory file.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, default_convert

from pipeline.batchring import BatchRing, InlineTensor, materialize
from pipeline.checksum import open_shard
from pipeline.config import EPOCH_RULES, Batching, LoaderConfig, Resampled, Shuffle
from pipeline.dataset import MAX_SEGMENTS, ShardStream, SharedState
from pipeline.epoch import EpochPlan
from pipeline.fast_transforms import FastCenterCrop, FastRandomResizedCrop
from pipeline.mixing import ResolvedMix, resolve_mix
from pipeline.plan import LoaderStateError, Partition, Segment, check_segment
from pipeline.remote import RemoteRoles, start_remote_roles
from pipeline.sources import ResolvedSource, resolve_source
from pipeline.stages import SourceShards, StreamSettings
from pipeline.stats import LoaderStats
from pipeline.transforms import CenterCrop, RandomResizedCrop
from pipeline.worker_start import worker_context
from shards.errors import ShardError, UsageError
from shards.image.policy import resolve_backend
from shards.redact import redact_url
from shards.sample import Field, MissingFieldError, label_free_fields, resolve_fields

log = logging.getLogger("pipeline")
STATE_VERSION = 1
STATE_INT_MAX = 2**63 - 1  # a state's integers reach the workers in an int64 array


def build_loader(config: LoaderConfig) -> ShardLoader:
    """Resolve the source, plan nothing yet (plans are per epoch), return the loader."""
    return ShardLoader(config, resolve_config_source(config))


def resolve_config_source(config: LoaderConfig) -> ResolvedSource | ResolvedMix:
    """The shards `config` names, read as it says (retries, storage, checksums); a mix's
    sources each resolved, with their quotas and one class list."""
    read = dict(
        retry=config.io.retry,
        storage_options=config.io.storage_options,
        checksums=config.io.wants_digests,
        allow_missing=config.io.allow_missing_shards,
    )
    if config.is_mix:
        return resolve_mix(config.source, config.mixing.epoch_samples, config.format, **read)
    if isinstance(config.sampling, Resampled):
        counts = "skip"  # draws need no counts: shards without them are drawn uniformly
    else:
        counts = "stream" if config.io.count_remote_shards else "refuse"
    return resolve_source(config.source, config.split, config.format, remote_counts=counts, **read)


def distributed_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return rank or 0, world_size or 1


class ShardLoader:
    """Iterable of batches for one rank: one entry per field (`(images, labels)` by
    default), then the keys when `with_keys`."""

    def __init__(self, config: LoaderConfig, source: ResolvedSource | ResolvedMix) -> None:
        self.config = config
        self.source = source
        self.rank, self.world_size = distributed_defaults(config.rank, config.world_size)
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is outside world size {self.world_size}")
        fields = resolve_fields(config.fields)
        check_source_fields(fields, source, config.io)
        settings = stream_settings(config, source, fields, self.rank, self.world_size)
        self.settings = settings
        self.shared = SharedState()
        # Workers that exit with every iteration can take slots with them (batches
        # still queued when they are shut down are never received, so never freed);
        # persistent ones hand those batches over when the next iteration drains them.
        workers = config.workers
        reusable = workers.placement == "local" and (workers.count == 0 or workers.persistent)
        has_images = any(spec.kind == "image" for spec in fields)
        self.ring = self.make_ring() if workers.reuse_buffers and reusable and has_images else None
        self.dataset = self.make_stream(settings)
        self.epoch = 0
        self.segments: list[Segment] = []  # earlier partitions of this epoch (resume)
        self.consumed = 0  # batches delivered in the current segment
        self._plans: dict[tuple, EpochPlan] = {}  # (epoch, segments, partition) -> plan
        self.stats = LoaderStats()
        self._loader: DataLoader | None = None
        self._remote: RemoteRoles | None = None  # Workers(placement="ray"): made on first use
        log_epoch_plan(self)

    def make_stream(self, settings: StreamSettings) -> ShardStream:
        """The workers' dataset: the sources' plan (one plain source is a mix of one)
        and their shards."""
        source = self.source
        unit = self.config.batch.size if self.config.mixing.batches == "single" else 1
        shards = tuple(part.shards for part in source.parts)
        sources = SourceShards(source.mix(unit), shards, source.remaps)
        return ShardStream(
            sources,
            settings,
            self.make_transform(),
            self.shared,
            ring=self.ring,
            num_roles=self.num_worker_slots,
        )

    def make_transform(self) -> Callable:
        c = self.config.crop
        if c.transform is not None:
            return c.transform
        fast = resolve_backend(c.backend) == "fast"
        if self.config.is_train:
            crop = FastRandomResizedCrop if fast else RandomResizedCrop
            options = dict(size=c.image_size, scale=c.scale, ratio=c.ratio, hflip=c.hflip)
        else:
            crop = FastCenterCrop if fast else CenterCrop
            options = dict(size=c.image_size, crop_fraction=c.crop_fraction)
        # The Pillow crops copy into the batch slot themselves: their own array may be a
        # read-only view of Pillow's bytes (one copy fewer).
        return crop(**options) if fast else crop(**options, writable=False)

    def make_ring(self) -> BatchRing:
        """Slots for a batch of crops: one being built, `prefetch_factor` queued, one in the
        consumer's hands (a custom transform's other sizes allocate). Sized for the largest
        side a progressive schedule reaches; smaller epochs use each slot's first bytes."""
        c = self.config
        return BatchRing(self.num_worker_slots, c.workers.prefetch_factor + 2, self.slot_bytes())

    def slot_bytes(self) -> int:
        """The largest image batch: a progressive schedule's largest side in train."""
        c = self.config
        side = c.crop.largest_train_size if c.is_train else c.crop.image_size
        return c.batch.size * side * side * 3

    @property
    def image_size(self) -> int:
        """The side of the current epoch's images: in train, `Crop.progressive`'s when set."""
        crop = self.config.crop
        return crop.train_size(self.epoch) if self.config.is_train else crop.image_size

    @property
    def num_worker_slots(self) -> int:
        workers = self.config.workers
        if workers.placement == "ray":
            return workers.count + workers.remote  # the DataLoader's roles, then the actors'
        return max(1, workers.count)

    def partition(self) -> Partition:
        return self.dataset.partition(self.num_worker_slots)

    def epoch_plan(self, segments: Sequence[Segment] | None = None) -> EpochPlan:
        """This rank's plan of the current epoch after `segments` (default: the loader's
        own, so the epoch as resumed; `()`: the whole epoch), what the workers read by.

        Computed once per (epoch, segments, partition): `len()`, `batches_remaining()`
        and the log line read it, so a resumed epoch's replay is not redone per question.
        """
        part = self.partition()
        key = (self.epoch, tuple(self.segments if segments is None else segments), part)
        plan = self._plans.get(key)
        if plan is None:
            self._plans = {k: v for k, v in self._plans.items() if k[0] == self.epoch}
            plan = self.dataset.plan_epoch(part, self.epoch, key[1])
            self._plans[key] = plan
        return plan

    def __len__(self) -> int:
        """Batches this rank yields in a full epoch (the same on every rank unless `uneven`)."""
        return self.epoch_plan(()).batches

    def set_epoch(self, epoch: int) -> None:
        """Read `epoch` at the next iteration (from its start, unless resumed into it).

        A completed iteration advances the epoch by itself, so calling
        `set_epoch(n)` before each epoch, as with DistributedSampler, is optional.
        """
        if epoch != self.epoch:
            self.epoch, self.segments, self.consumed = epoch, [], 0

    def dataloader(self) -> DataLoader:
        if self._loader is None:
            c = self.config.workers
            workers = c.count
            self._loader = DataLoader(
                self.dataset,
                batch_size=None,
                num_workers=workers,
                pin_memory=torch.cuda.is_available() if c.pin_memory is None else c.pin_memory,
                prefetch_factor=c.prefetch_factor if workers else None,
                persistent_workers=c.persistent and workers > 0,
                timeout=self.batch_timeout() if workers else 0,  # torch needs workers for it
                worker_init_fn=seed_worker,
                collate_fn=inline_small_tensors if workers else None,
                multiprocessing_context=(
                    worker_context(c.start_method, self.dataset) if workers else None
                ),
            )
        return self._loader

    def iter_workers(self) -> Iterator[tuple]:
        """The workers' batches of this epoch from where it stands: the DataLoader's, or
        the remote roles' (`Workers.placement`), in the same order."""
        c = self.config.workers
        if c.placement == "ray" and self._remote is None:
            pin = torch.cuda.is_available() if c.pin_memory is None else c.pin_memory
            self._remote = start_remote_roles(self.dataset.source, c, pin, self.slot_bytes())
            if self._remote is None:  # no room on the cluster: its roles run here, for good
                self.config = replace(self.config, workers=c.as_local())
                c = self.config.workers
        if c.placement == "local":
            return iter(self.dataloader())
        plan = self.epoch_plan()
        batches = [plan.worker(role).batches for role in range(self.num_worker_slots)]
        local = iter(self.dataloader()) if c.count else None
        segments = tuple(self.segments)
        return self._remote.iter_epoch(self.epoch, segments, self.consumed, batches, local)

    def batch_timeout(self) -> float:
        """Seconds the DataLoader waits for one batch: see `ReadOptions.timeout`."""
        if self.config.io.timeout is not None:
            return self.config.io.timeout
        retry = self.config.io.retry
        return retry.deadline + 2 * retry.timeout

    def batches_remaining(self) -> int:
        """Batches this rank has left to yield in the current epoch (all of them unless
        resumed into it or part-way through it)."""
        return max(0, self.epoch_plan().batches - self.consumed)

    def __iter__(self) -> Iterator[tuple]:
        segments = self.segments + (
            [Segment(self.partition(), self.consumed)] if self.consumed else []
        )
        self.shared.write(self.epoch, segments)
        if self.settings.progressive is not None:
            log.info("epoch %d: train images of %d px (progressive)", self.epoch, self.image_size)
        started = time.perf_counter()
        self.stats.start_epoch()
        iterator = self.iter_workers()
        while True:
            waited = time.perf_counter()
            try:
                batch = next(iterator, None)
            except BaseException as error:
                # The workers end here, in this process. The traceback's frames hold the
                # DataLoader's iterator, and a notebook keeps the error: collected later,
                # possibly in a worker forked for the next loader, the iterator's __del__
                # fails there ("can only test a child process"). Clearing the frames'
                # locals keeps the traceback's lines.
                traceback.clear_frames(error.__traceback__)
                del iterator
                self._loader = None
                raise
            if batch is None:
                break
            values, size, keys, worker_stats = batch
            if not size:  # an exactly-once worker ended short: its last counts, no samples
                self.stats.record_worker(worker_stats)
                continue
            # A ring slot becomes a tensor (once pinned, it already is one).
            values = tuple(materialize(value) for value in values)
            self.stats.record_batch(time.perf_counter() - waited, size, worker_stats, started)
            self.consumed += 1
            yield (*values, keys) if self.config.with_keys else values
        self.stats.end_epoch()
        log_fallbacks(self.stats)
        log_sources(self.stats)
        log_fetch(self.stats)
        # The epoch is complete: a new iteration (or a state saved now) starts the next one.
        self.epoch, self.segments, self.consumed = self.epoch + 1, [], 0

    def state_dict(self, in_flight: int = 0) -> dict[str, Any]:
        """Epoch, seed and position: enough to continue this epoch exactly.

        Args:
            in_flight: batches already taken from the loader but not yet used
                (a prefetcher holding one batch ahead passes 1), so a resume
                delivers them again.
        """
        if not 0 <= in_flight <= self.consumed:
            raise UsageError(f"in_flight={in_flight} but only {self.consumed} batches were taken")
        segments = self.segments + [Segment(self.partition(), self.consumed - in_flight)]
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.config.seed,
            "total_samples": self.dataset.total,
            "segments": [s.to_dict() for s in segments],
        }
        sources = mix_identity(self.dataset.sources)
        if sources is not None:
            state["sources"] = sources
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration continues `state`'s epoch where it stopped.

        Raises:
            LoaderStateError: `state` describes no point of this epoch for this dataset
                (`check_state`, then each segment against the plan: `check_segment`);
                the loader is left as it was.
        """
        mine = mix_identity(self.dataset.sources)
        segments = check_state(state, self.config.seed, self.dataset.total, mine)
        before = self.epoch, self.segments, self.consumed
        self.epoch = state["epoch"]
        if segments[-1].partition == self.partition():
            self.segments, self.consumed = segments[:-1], segments[-1].consumed
        else:
            self.segments, self.consumed = [s for s in segments if s.consumed], 0
        try:  # planning replays the earlier segments, each checked before its replay
            plan = self.epoch_plan()
            if self.consumed:
                last = len(segments) - 1
                check_segment(segments[-1], last, plan.total, self.dataset.total, plan.batches)
        except LoaderStateError:
            self.epoch, self.segments, self.consumed = before
            raise


@dataclass(frozen=True)
class Expect:
    """One field of a loader state: its exact type (a bool is not a count, a float not an
    int), and for an int its lowest value, or for a field tying the state to this loader
    the only value it may hold and what a mismatch means (`why`)."""

    kind: type
    low: int | None = None
    value: Any = None
    why: str = ""  # set: the field is tied to `value`

    def problem(self, value: Any) -> str | None:
        """What is wrong with `value` for this field, or None."""
        if type(value) is not self.kind:
            return f"expected {self.kind.__name__}"
        if self.low is not None and not self.low <= value <= STATE_INT_MAX:
            return f"expected an integer in [{self.low}, 2**63 - 1]"
        if self.why and not strictly_equal(value, self.value):
            return f"but this loader's is {short_repr(self.value)}: {self.why}"
        return None


def check_state(state: Any, seed: int, total: int, sources: list[list] | None) -> list[Segment]:
    """The segments of `state` once its shape is proven: one schema, one error.

    Keys exact (none missing, none extra), types exact, integers in range, and the fields
    that tie it to this loader's data (version, seed, samples, a mix's sources) equal.
    What a segment can have consumed needs the epoch's plan: `pipeline.plan.check_segment`.

    Raises:
        LoaderStateError: naming the first field that is wrong and what it must be.
    """
    other = "saved for another dataset or seed"
    top = {
        "version": Expect(int, value=STATE_VERSION, why="this code reads no other version"),
        "epoch": Expect(int, low=0),
        "seed": Expect(int, value=seed, why=other),
        "total_samples": Expect(int, value=total, why=other),
        "segments": Expect(list),
    }
    if sources is not None:
        mix = "saved for another mix of sources; resume with the same sources, names, shares"
        top["sources"] = Expect(list, value=sources, why=mix)
    check_fields(state, "", top, top)
    count = len(state["segments"])
    if not 1 <= count <= MAX_SEGMENTS:
        raise LoaderStateError(
            f"loader state: segments holds {count} segments, expected 1 to {MAX_SEGMENTS} "
            "(one per partition the epoch was read under); resume from an unedited checkpoint"
        )
    kinds = {"int": Expect(int, low=1), "bool": Expect(bool), "str": Expect(str)}
    schema = {f.name: kinds[f.type] for f in fields(Partition)} | {"consumed": Expect(int, low=0)}
    required = [f.name for f in fields(Partition) if f.default is MISSING] + ["consumed"]
    segments = []
    for number, data in enumerate(state["segments"]):
        check_fields(data, f"segments[{number}].", schema, required)
        if data["rule"] not in EPOCH_RULES:
            raise LoaderStateError(
                f"loader state: segments[{number}].rule is {short_repr(data['rule'])}, "
                f"expected one of {', '.join(EPOCH_RULES)}; the state was edited"
            )
        segments.append(Segment.from_dict(data))
    return segments


def check_fields(data: Any, prefix: str, schema: dict[str, Expect], required: Iterable) -> None:
    """`data` is a dict of `schema`'s keys, the `required` ones present, each as expected."""
    if type(data) is not dict:
        where = f": {prefix[:-1]}" if prefix else ""
        raise LoaderStateError(
            f"loader state{where} is a {type(data).__name__}, not a dict: it was not saved "
            "by ShardLoader.state_dict(); resume from an unedited checkpoint"
        )
    unknown = [f"unknown key {prefix}{key}" for key in data if key not in schema]
    missing = [f"missing key {prefix}{name}" for name in required if name not in data]
    if unknown or missing:
        raise LoaderStateError(
            f"loader state: {(unknown + missing)[0]}; resume from an unedited checkpoint"
        )
    for name, value in data.items():
        problem = schema[name].problem(value)
        if problem is not None:
            raise LoaderStateError(
                f"loader state: {prefix}{name} is {short_repr(value)}, {problem}"
            )


def strictly_equal(a: Any, b: Any) -> bool:
    """`a == b` with types compared too, all the way down (`True == 1` is not enough)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(map(strictly_equal, a, b))
    return a == b


def short_repr(value: Any, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: a state's values may be any size."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def inline_small_tensors(batch: tuple) -> tuple:
    """A worker's batch ready for the queue: small tensors travel as bytes (`InlineTensor`).

    What the DataLoader would do without a `collate_fn` (`default_convert`), then the
    labels and other small fields wrapped so the main process unpickles a few KiB instead
    of fetching a shared-memory file per tensor; `materialize` unwraps them.
    """
    values, size, keys, worker_stats = default_convert(batch)
    return tuple(InlineTensor.wrap(value) for value in values), size, keys, worker_stats


def mix_identity(sources: SourceShards) -> list[list] | None:
    """`[name, size, quota, unit]` per source: what a mix's saved position depends on.
    None for one unnamed source, whose state the seed and sample count tie to its data."""
    plan = sources.plan
    if not any(plan.names):
        return None
    return [
        [name, size, quota, plan.unit]
        for name, size, quota in zip(plan.names, plan.sizes, plan.quotas, strict=True)
    ]


def log_sources(stats: LoaderStats) -> None:
    """A mix: each source's samples, skips and rate this epoch, in one line."""
    sources = stats.sources
    if sources:
        log.info(
            "epoch sources: %s",
            ", ".join(
                f"{name} {row['samples']} samples ({row['skipped']} skipped, "
                f"{row['images_per_s']:.0f}/s)"
                for name, row in sources.items()
            ),
        )


def log_fetch(stats: LoaderStats) -> None:
    """Remote shards this epoch, in one line: fetched (and their bytes), cache hits, the
    time readers waited on a fetch; nothing when every shard was local."""
    fetch = stats.fetch
    if not fetch.get("shards_fetched") and not fetch.get("cache_hits"):
        return
    log.info(
        "epoch fetch: %d remote shards fetched (%.1f MiB), %d cache hits, %d fetched past "
        "the cache, %.1f s waited on fetches",
        fetch["shards_fetched"],
        fetch["bytes_fetched"] / 2**20,
        fetch["cache_hits"],
        fetch["uncached"],
        fetch["wait_s"],
    )


def log_fallbacks(stats: LoaderStats) -> None:
    """Say how many samples of the epoch the fast crops handed to Pillow, if any."""
    if stats.pillow_fallbacks:
        log.info(
            "%d of %d samples (%.1f%%) were decoded by Pillow, not the fast backend "
            "(non-JPEG, CMYK or JPEGs libjpeg-turbo refuses); rebuilding the shards with "
            "build-shards makes them plain JPEGs",
            stats.pillow_fallbacks,
            stats.samples,
            100 * stats.pillow_fallbacks / max(1, stats.samples),
        )


def epoch_samples(sampling: Resampled, source: ResolvedSource | ResolvedMix) -> int:
    """A resampled epoch's samples: as given, else the dataset's size when it is known.

    Raises:
        UsageError: shards read without counts and no `epoch_samples`.
    """
    if sampling.epoch_samples is not None:
        return sampling.epoch_samples
    if not getattr(getattr(source, "shards", None), "counted", True):
        raise UsageError(
            f"{len(source.shards)} remote shards without a manifest have no sample counts: "
            "say how many samples an epoch draws with Resampled(epoch_samples=N)"
        )
    return source.total_samples


def stream_settings(
    config: LoaderConfig,
    source: ResolvedSource,
    fields: tuple[Field, ...],
    rank: int,
    world_size: int,
) -> StreamSettings:
    """What the workers read from `config`, with the rules its None defaults stand for
    resolved (train: `pad` and drop_last, eval: `uneven`, every sample once) and what
    the source decides (epoch length, class weights)."""
    train = config.is_train
    rule = config.batch.epoch_rule or ("pad" if train else "uneven")
    drop_last = train if config.batch.drop_last is None else config.batch.drop_last
    sampling = config.sampling
    resampled = isinstance(sampling, Resampled)
    return StreamSettings(
        seed=config.seed,
        rank=rank,
        world_size=world_size,
        batch=Batching(
            config.batch.size,
            drop_last,
            rule,
            config.batch.channels_last,
            config.batch.aug_repeats if train else 1,  # eval reads each sample once
        ),
        # Evaluation reads in order: a buffer of one passes samples straight through.
        shuffle=config.shuffle if train else Shuffle(buffer=1, initial=1),
        io=config.io,
        fields=fields,
        with_keys=config.with_keys,
        max_skip_fraction=config.max_skip_fraction,
        epoch_samples=epoch_samples(sampling, source) if resampled else None,
        class_weights=class_weights(source, fields) if resampled and sampling.balance else None,
        num_classes=len(source.classes) if source.classes else None,
        exactly_once=not train and rule == "uneven" and not resampled,
        image_size=config.crop.image_size,
        progressive=config.crop.progressive if train else None,
        augment=config.augment if train and config.augment.enabled else None,
    )


def class_weights(source: ResolvedSource, fields: Sequence[Field] = ()) -> tuple[float, ...]:
    """Keep-probabilities 1/count per class, from the manifest's counts.

    Single-label: the split's class counts. Multi-label (a `multi_label` field and no
    `label` one): the samples holding each class (`fields.label_counts`), which the
    stream turns into each sample's rarest-label weight.
    """
    kinds = {spec.kind for spec in fields}
    counts = source.class_counts
    if "multi_label" in kinds and "label" not in kinds:
        counts = source.label_counts
    if not counts or not any(counts):
        raise UsageError(
            "class_balance needs per-class counts: use the dataset's manifest as the source "
            "(multi-label counts are recorded by `build-shards --label multi`)"
        )
    return tuple(1.0 / n if n else 0.0 for n in counts)


def check_source_fields(
    fields: Sequence[Field], source: ResolvedSource | ResolvedMix, io: Any = None
) -> None:
    """`check_fields_fit` for each source (a mix's named in the error); with `io`
    (`LoaderConfig.io`), what a source's manifest does not say is read off its first
    shard (`known_members`)."""
    for name, part in zip(source.names, source.parts, strict=True):
        try:
            check_fields_fit(fields, part, known_members(part, io))
        except UsageError as error:
            if not name:
                raise
            raise UsageError(
                f"source {name!r}: {error}; label-free sources mix with labelled ones only "
                "when 'label' is not among the fields"
            ) from error


def known_members(source: ResolvedSource, io: Any) -> tuple[str, ...] | None:
    """The members `source`'s samples hold: as its manifest records them, else (given
    `io`) as its first shard's first sample (tar) or columns (Parquet) name them, unless
    a manifest of ours promises a class per sample (nothing to check then).

    Read here, in the main process and before any worker starts, so that shards holding
    no label (img2dataset's, a `--label none` build) read with the default fields are one
    line naming what they do hold, not every sample skipped in every worker.
    """
    if source.members is not None or io is None or not len(source.shards):
        return source.members
    if source.manifest_url is not None and source.label_mode == "single" and source.classes:
        return None
    spec = source.shards[0]
    try:
        with open_shard(spec, io.retry, io.storage_options, False) as stream:
            return spec.format.list_members(stream, spec.url, io.limits)
    except (ShardError, OSError):  # an unreadable shard is the workers' counted skip
        return None


def check_fields_fit(
    fields: Sequence[Field], source: ResolvedSource, members: Sequence[str] | None = None
) -> None:
    """Refuse, before any shard is read, a field the dataset says its samples lack.

    Without this a label-free or multi-label dataset read with the default fields
    would skip every sample as `no_label` and stop at the skip budget, and a field
    reading a member no sample has (`txt` of shards that keep their captions in
    `caption`) would do the same, with a hint about bad data that does not apply.

    Args:
        members: the members every sample of the source carries, when it knows them
            (the manifest's `fields.members`, or what `preprocess index` recorded): a
            field reading none of them is refused in one line naming the field, the
            members and the `Field` to write (`shards.sample.missing_field_hint`).

    Raises:
        MissingFieldError: a field none of `members` gives, naming what they do hold.
        UsageError: naming the dataset and what to ask for instead.
    """
    where = redact_url(source.manifest_url) if source.manifest_url else first_shard(source)
    reads_cls = any(
        spec.kind == "label" and set(spec.source) <= {"cls", "label"} for spec in fields
    )
    if not reads_cls or source.label_mode == "single":
        for spec in fields if members is not None else ():
            if not set(spec.source) & set(members):
                raise MissingFieldError(where, spec, members)
        return
    if source.label_mode == "none":
        example = label_free_fields(members) if members is not None else "fields=('image',)"
        raise UsageError(
            f"{where} has no class labels (built with --label none): leave 'label' out of "
            f"fields, e.g. {example}"
        )
    raise UsageError(
        f"{where} holds multi-label targets (a list of class ids in 'labels', built with "
        "--label multi): ask for them with shards.sample.Field('labels', 'multi_label', "
        "num_classes=len(classes)) instead of 'label'"
    )


def first_shard(source: ResolvedSource) -> str:
    """`the shards (first: URL)`, redacted, for a message about shards without a manifest."""
    if not len(source.shards):
        return "the dataset"
    return f"the shards (first: {redact_url(source.shards[0].url)})"


def seed_worker(worker_id: int) -> None:
    """Seed global RNGs in each worker for user transforms that use them."""
    import random

    import numpy as np

    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def log_epoch_plan(loader: ShardLoader) -> None:
    source = loader.source
    if source.unreadable:
        log.warning(
            "%d shards could not be read and are left out of every epoch (first: %s: %s)",
            len(source.unreadable),
            *source.unreadable[0],
        )
    parts = source.parts
    # Only looked at when asked: it visits every shard.
    if loader.config.io.checksums:
        unchecked = sum(s.sha256 is None for part in parts for s in part.shards)
        if unchecked:
            log.warning(
                "verify_checksums: %d of %d shards have no recorded sha256 (no manifest) and "
                "are read unchecked",
                unchecked,
                sum(len(part.shards) for part in parts),
            )
    if any(source.names):
        log.info(
            "mixing %d sources, %d samples an epoch: %s",
            len(parts),
            source.total_samples,
            ", ".join(
                f"{name} {quota} ({quota / part.total_samples:.3g}x its {part.total_samples})"
                for name, quota, part in zip(source.names, source.quotas, parts, strict=True)
            ),
        )
    plan = loader.epoch_plan(())
    part = plan.partition
    repeats = plan.repeats
    if repeats is not None:
        log.info(
            "aug_repeats %d: each epoch reads %d of the %d samples, %d times each (%d "
            "copies over %d ranks, the epoch's plain length)",
            repeats.copies,
            repeats.selected,
            plan.mix.total,
            repeats.copies,
            repeats.total,
            part.world_size,
        )
    if plan.padded:
        log.info(
            "epoch rule pad: %d samples repeated so %d ranks get %d each",
            plan.padded,
            part.world_size,
            plan.samples,
        )
    dropped = plan.total - plan.used * part.world_size if part.rule != "uneven" else 0
    if part.rule == "drop" and dropped > 0:
        log.info(
            "epoch rule drop: %d samples left out of each epoch (a different few each epoch)",
            dropped,
        )
    if part.drop_last and plan.samples > plan.used:
        log.info("drop_last: %d samples per rank dropped each epoch", plan.samples - plan.used)
