"""How well the loader's stream mixes classes, measured against an ideal shuffle.

Replays the loader's own epoch plan (`pipeline.plan`) on integer positions and reads only
the labels of the shards (never an image), so sizing the shuffle buffer costs seconds.
Multi-label samples are measured as their rarest label (the label class balance weighs
them by). `pipeline inspect-shuffle` prints the result; `inspect_shuffle()` returns it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np

from pipeline.assemble import batch_sizes
from pipeline.checksum import open_shard
from pipeline.epoch import plan_epoch, source_rng
from pipeline.loader import LoaderConfig, ShardLoader
from pipeline.plan import Partition, shuffle_buffer
from pipeline.positions import Piece, Runs
from pipeline.sources import ResolvedSource, ShardSpec, resolve_source
from shards.errors import DataError, ShardError, UsageError
from shards.formats import FORMATS
from shards.manifest import FormatNotBuiltError
from shards.sample import LabelField, SampleError, decode_label, parse_json
from shards.storage import RetryPolicy

LABEL_FIELDS = frozenset({"cls"})
METRICS = ("same_class_rate", "batch_tv", "position_ks")
METRIC_NAMES = {
    "same_class_rate": "same class as previous sample",
    "batch_tv": "batch class mix vs epoch (TV distance)",
    "position_ks": "class positions vs uniform (KS)",
}
NOISE_SIGMAS = 3.0  # a stream is only called worse than ideal beyond this many standard errors


class LabelReadError(DataError, RuntimeError):
    """A shard's labels could not be read, or their count disagrees with the manifest."""


@dataclass(frozen=True)
class DeliveryOrder:
    """The samples one rank receives in one epoch, in the order the loader yields them.

    Attributes:
        shards: index (into the loader's shard list) of each delivered sample.
        offsets: the sample's position within its shard.
        batch_sizes: sizes of the rank's batches, in delivery order.
    """

    shards: np.ndarray
    offsets: np.ndarray
    batch_sizes: list[int]


@dataclass(frozen=True)
class MixingStats:
    """Three views of how mixed a stream is; for each, lower is better mixed.

    Attributes:
        same_class_rate: share of consecutive samples with the same class (lag-1
            agreement; an ideal shuffle gives about `sum(p_c ** 2)`).
        batch_tv: mean total-variation distance between a batch's class mix and the
            epoch's class distribution.
        position_ks: Kolmogorov-Smirnov distance between each class's positions within a
            rank's epoch and a uniform spread, averaged over classes weighted by count.
    """

    same_class_rate: float
    batch_tv: float
    position_ks: float

    def values(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in METRICS])


@dataclass(frozen=True)
class ShuffleReport:
    """What `inspect_shuffle` measured.

    Attributes:
        stream: the loader's stream, averaged over epochs (and ranks, weighted by samples).
        ideal: the same statistics for ideal shuffles (random permutations of the same
            epoch's samples, split into the same ranks and batch sizes), averaged over trials.
        ideal_std: standard error of `ideal`'s statistics for one measurement as long as
            `stream`'s (it sets how much of a difference is noise).
        excess: `stream / ideal - 1` for each metric.
        within_ideal: no metric is worse than ideal by more than the tolerance and noise.
        suggested_buffer: `(shuffle_buffer, shuffle_initial)`, the smallest doubled buffer
            that mixes within tolerance (only searched when the stream does not); None when
            none does or none was searched.
        verdict: one line for humans.
        samples: samples per epoch over all ranks; classes: number of classes (with
            multi-label, samples without a label count as one class more).
        label_field: the member the labels were read from (`LabelField.text`).
        labels: `labels[epoch][rank]`, each rank's delivered labels in delivery order.
        orders: `orders[epoch][rank]`, where each delivered sample comes from.
    """

    config: LoaderConfig
    epochs: int
    samples: int
    classes: int
    stream: MixingStats
    ideal: MixingStats
    ideal_std: MixingStats
    excess: dict[str, float]
    within_ideal: bool
    suggested_buffer: tuple[int, int] | None
    verdict: str
    labels: list[list[np.ndarray]]
    orders: list[list[DeliveryOrder]]
    label_field: str = "cls"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary (without the per-sample arrays)."""
        c = self.config
        return {
            "samples": self.samples,
            "classes": self.classes,
            "label_field": self.label_field,
            "epochs": self.epochs,
            "world_size": c.world_size or 1,
            "num_workers": c.workers.count,
            "batch_size": c.batch.size,
            "shuffle_buffer": c.shuffle.buffer,
            "shuffle_initial": c.shuffle.initial,
            "stream": {name: getattr(self.stream, name) for name in METRICS},
            "ideal": {name: getattr(self.ideal, name) for name in METRICS},
            "excess": self.excess,
            "within_ideal": self.within_ideal,
            "suggested_buffer": self.suggested_buffer,
            "verdict": self.verdict,
        }


def inspect_shuffle(
    config: LoaderConfig,
    epochs: int = 1,
    *,
    trials: int = 16,
    tolerance: float = 0.10,
    search_buffer: bool = True,
    threads: int = 8,
    label_field: str = "cls",
) -> ShuffleReport:
    """Measure how well the loader configured by `config` mixes classes, per rank and epoch.

    The delivery order is the real one: the loader's epoch plan (shard order from
    `seed + epoch`, rank and worker slices, each worker's seeded shuffle buffer) is replayed
    on positions, and batches are interleaved round-robin over workers as the DataLoader
    does. Only labels are read: the `label_field` column of Parquet shards (the Parquet twin
    of tar shards when the manifest lists one; both hold the same samples in the same
    order), or those members of tar shards. A multi-label sample is measured as its rarest
    label (fewest samples in the split; ties: the lower id), one without a label as one
    class more. Assumes shards that read cleanly (`preprocess verify`).

    Args:
        config: the loader's configuration; `world_size` (default 1) ranks are all measured,
            `rank` and `fields` are ignored (labels come from `label_field`). Resampled
            and class-balanced modes are not supported.
        epochs: epochs to measure, from epoch 0.
        trials: ideal shuffles simulated per epoch.
        tolerance: relative excess over ideal still called "within" an ideal shuffle.
        search_buffer: when the stream is not within tolerance, replay doubled buffer sizes
            (no extra reads) to suggest one.
        threads: shards whose labels are read concurrently.
        label_field: `cls` (default), `label`, `labels` or `json:KEY`; see `LabelField`.

    Returns:
        A `ShuffleReport`.

    Raises:
        ValueError: bad arguments or an unsupported loader mode.
        LabelReadError: a shard's labels could not be read.
    """
    if epochs < 1 or trials < 2:
        raise UsageError("epochs must be at least 1 and trials at least 2")
    if config.resampling:
        raise UsageError("inspect-shuffle measures exact epochs; resampled mode draws at random")
    source = resolve_source(
        config.source,
        config.split,
        config.format,
        retry=config.io.retry,
        storage_options=config.io.storage_options,
    )
    labels_by_shard = read_labels(
        label_source(source, config).shards,
        config.io.retry,
        config.io.storage_options,
        threads,
        label_field,
    )
    flat = np.concatenate(labels_by_shard) if labels_by_shard else np.empty(0, np.int64)
    classes = max(len(source.classes or []), int(flat.max()) + 1 if len(flat) else 0)
    # The partition is the same for every rank; rank 0's loader gives it, as configured.
    # The labels were read by `label_field`, and the probe reads no sample: the loader's
    # own label field is not asked of the shards (label-free or multi-label ones lack it).
    ranks = config.world_size or 1
    probe = ShardLoader(replace(config, rank=0, world_size=ranks, fields=("image",)), source)
    part, counts = probe.partition(), probe.dataset.sources.plan.counts[0]
    labels, orders = [], []
    for epoch in range(epochs):
        orders.append(epoch_delivery(part, counts, config.seed, epoch))
        labels.append([stream_labels(o, labels_by_shard) for o in orders[-1]])
    check_delivers(config, source, sum(len(x) for x in labels[0]))
    measured, ideal_runs = measure(labels, orders, classes, trials, config.seed)
    stream = measured.mean(axis=0)
    ideal_all = np.concatenate(ideal_runs)
    ideal = ideal_all.mean(axis=0)
    ideal_std = ideal_all.std(axis=0, ddof=1) / math.sqrt(epochs)
    passed, excess = judge(stream, ideal, ideal_std, tolerance)
    suggested = None
    if not passed and search_buffer and config.is_train:
        suggested = suggest_buffer(
            part, counts, config.seed, labels_by_shard, classes, ideal_runs[0], tolerance
        )
    return ShuffleReport(
        config=config,
        epochs=epochs,
        samples=sum(len(x) for x in labels[0]),
        classes=classes,
        stream=MixingStats(*stream.tolist()),
        ideal=MixingStats(*ideal.tolist()),
        ideal_std=MixingStats(*ideal_std.tolist()),
        excess=dict(zip(METRICS, excess.tolist(), strict=True)),
        within_ideal=passed,
        suggested_buffer=suggested,
        verdict=verdict(passed, excess, tolerance, part, suggested, config.is_train),
        labels=labels,
        orders=orders,
        label_field=label_field,
    )


def check_delivers(config: LoaderConfig, source: ResolvedSource, delivered: int) -> None:
    """Refuse a configuration whose epoch delivers no sample (a rank's share under one
    batch per worker): its metrics would be zeros that read as a perfect shuffle."""
    if delivered:
        return
    ranks, workers = config.world_size or 1, max(1, config.workers.count)
    share = source.total_samples // ranks
    fits = max(1, share // workers)
    raise UsageError(
        f"{source.total_samples} samples over {ranks} ranks x {workers} workers deliver no "
        f"batch of {config.batch.size} (each rank's {share} samples are under one batch a "
        f"worker, and only whole batches are delivered): measure with --batch-size {fits} "
        "or fewer, or with a smaller --world-size or --workers"
    )


def measure(
    labels: list[list[np.ndarray]],
    orders: list[list[DeliveryOrder]],
    classes: int,
    trials: int,
    seed: int,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Statistics of each epoch's streams `[epoch, metric]`, and of its ideal shuffles."""
    rng = np.random.default_rng(seed)
    measured, ideal_runs = [], []
    for epoch_labels, epoch_orders in zip(labels, orders, strict=True):
        sizes = [o.batch_sizes for o in epoch_orders]
        measured.append(mixing_stats(epoch_labels, sizes, classes).values())
        ideal_runs.append(ideal_trials(epoch_labels, sizes, classes, trials, rng))
    return np.array(measured), ideal_runs


def epoch_delivery(
    part: Partition, counts: Sequence[int], seed: int, epoch: int
) -> list[DeliveryOrder]:
    """Delivery order of every rank of `part` in `epoch`."""
    return [plan_delivery(part, rank, counts, seed, epoch) for rank in range(part.world_size)]


def delivery_order(loader: ShardLoader, epoch: int) -> DeliveryOrder:
    """Where each sample `loader` yields in a fresh `epoch` comes from, in yield order.

    Raises:
        ValueError: the loader is in resampled mode (its draws are not a fixed plan).
    """
    if loader.settings.epoch_samples is not None:
        raise UsageError("a resampled loader has no fixed delivery order")
    return plan_delivery(
        loader.partition(),
        loader.rank,
        loader.dataset.sources.plan.counts[0],
        loader.config.seed,
        epoch,
    )


def plan_delivery(
    part: Partition, rank: int, counts: Sequence[int], seed: int, epoch: int
) -> DeliveryOrder:
    """`delivery_order` from the plan's inputs alone.

    Each worker slot's plan (`plan_epoch`, what `ShardStream` reads) goes through the
    seeded buffer exactly as `ShardStream` shuffles samples; the DataLoader then takes
    batch j from slot `j % num_workers`.
    """
    epoch_plan = plan_epoch(counts, part, rank, seed, epoch)
    per_worker: list[list[np.ndarray]] = []
    for role in range(part.num_workers):
        plan = epoch_plan.worker(role)
        rng = source_rng(seed, epoch, rank, role, "")
        picks = shuffle_buffer(range(plan.samples), part.shuffle_buffer, part.shuffle_initial, rng)
        shuffled = piece_samples(plan.parts[0].pieces)[
            np.fromiter(picks, np.int64, count=plan.samples)
        ]
        bounds = np.cumsum([0, *batch_sizes(plan.samples, plan.batches, part.batch_size)])
        per_worker.append([shuffled[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)])
    delivered = []
    for j in range(sum(len(w) for w in per_worker)):
        delivered.append(per_worker[j % part.num_workers][j // part.num_workers])
    samples = np.concatenate(delivered) if delivered else np.empty((0, 2), dtype=np.int64)
    return DeliveryOrder(
        np.ascontiguousarray(samples[:, 0]),
        np.ascontiguousarray(samples[:, 1]),
        [len(b) for b in delivered],
    )


def piece_samples(pieces: Iterable[Piece]) -> np.ndarray:
    """`[shard index, offset within the shard]` of every sample of `pieces`, in order."""
    rows = np.asarray([(p.shard, p.start, p.stop) for p in pieces], np.int64).reshape(-1, 3)
    shards = np.repeat(rows[:, 0], rows[:, 2] - rows[:, 1])
    offsets = Runs(rows[:, 1], rows[:, 2]).to_array()
    return np.stack([shards, offsets], axis=1)


def stream_labels(order: DeliveryOrder, labels_by_shard: Sequence[np.ndarray]) -> np.ndarray:
    """The labels of a delivery order."""
    starts = np.concatenate([[0], np.cumsum([len(x) for x in labels_by_shard])])
    flat = np.concatenate(labels_by_shard) if labels_by_shard else np.empty(0, np.int64)
    return flat[starts[order.shards] + order.offsets]


def label_source(source: ResolvedSource, config: LoaderConfig) -> ResolvedSource:
    """Shards to read labels from: a columnar twin (Parquet) of the shards when the
    manifest has one.

    A columnar format gives the labels by reading one small column; tar shards must be
    read through.
    """
    if source.manifest_url is None or not source.shards or source.shards[0].format.columnar:
        return source
    for columnar in (fmt.name for fmt in FORMATS.values() if fmt.columnar):
        try:
            twin = resolve_source(
                source.manifest_url,
                config.split,
                columnar,
                retry=config.io.retry,
                storage_options=config.io.storage_options,
            )
        except FormatNotBuiltError:  # the manifest lists no shards of this format
            continue
        if [s.samples for s in twin.shards] == [s.samples for s in source.shards]:
            return twin
    return source


def read_labels(
    shards: Sequence[ShardSpec],
    retry: RetryPolicy,
    storage_options: dict | None,
    threads: int = 8,
    label_field: str = "cls",
) -> list[np.ndarray]:
    """One class id per sample of every shard, in shard order, read `threads` shards at a time.

    Multi-label: each sample's rarest label over all `shards` (see `rarest_labels`).

    Raises:
        ValueError: an unknown `label_field`; LabelReadError: see `read_shard_labels`.
    """
    field = LabelField.parse(label_field)
    reader = partial(
        read_shard_labels, retry=retry, storage_options=storage_options, label_field=field
    )
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        read = list(pool.map(reader, shards))
    return rarest_labels(read) if field.multi else read


def read_shard_labels(
    spec: ShardSpec,
    retry: RetryPolicy,
    storage_options: dict | None = None,
    label_field: LabelField | str = "cls",
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """The labels of one shard, in sample order, without reading an image.

    Returns:
        Single-label: the class ids. Multi-label: `(ids, lengths)`, every sample's class
        ids one after the other and how many each sample has.

    Raises:
        LabelReadError: unreadable shard or label, or a count unlike the manifest's
            (the reader's `shard_short` / `shard_long`).
    """
    field = LabelField.parse(label_field) if isinstance(label_field, str) else label_field
    try:
        with open_shard(spec, retry, storage_options) as stream:
            samples = spec.format.iter_samples(
                stream, spec.url, fields=frozenset({field.member}), declared=spec.samples
            )
            if not field.multi:
                return np.fromiter((decode_label(s, (field.member,)) for s in samples), np.int64)
            sets = [label_set(s, field) for s in samples]
    except ShardError as error:  # names the shard and says what to do
        raise LabelReadError(f"cannot read the labels: {error}") from error
    except (OSError, SampleError) as error:
        raise LabelReadError(
            f"cannot read the labels of {spec.display}: {error}; check the shards with "
            "`preprocess verify`, or pick the member with --label-field"
        ) from error
    lengths = np.fromiter((len(ids) for ids in sets), np.int64, count=len(sets))
    return np.fromiter((i for ids in sets for i in ids), np.int64, int(lengths.sum())), lengths


def label_set(sample: dict, field: LabelField) -> list[int]:
    """A multi-label sample's class ids (a single id under json:KEY counts as a list of one).

    Raises:
        SampleError: the member is missing, not JSON, or not a list of class ids.
    """
    where = f"sample {sample.get('__key__')!r} field {field.member}"
    if "__error__" in sample:
        raise sample["__error__"]
    if field.member not in sample:
        raise SampleError("no_labels", f"{where} is missing")
    value = parse_json(sample[field.member], where)
    if field.key is not None:
        if not isinstance(value, dict) or field.key not in value:
            raise SampleError("no_labels", f"{where} holds no JSON object with key {field.key!r}")
        value = value[field.key]
    ids = [value] if type(value) is int else value
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise SampleError("bad_labels", f"{where}: {value!r:.60} is not a list of class ids")
    return ids


def rarest_labels(sets: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[np.ndarray]:
    """Each sample's rarest label: fewest samples over all shards, ties to the lower id.

    A sample without a label gets one id more than any label has.
    """
    flat = np.concatenate([ids for ids, _ in sets]) if sets else np.empty(0, np.int64)
    counts = np.bincount(flat)
    none = len(counts)  # the "no label" class
    out = []
    for ids, lengths in sets:
        rarest = np.full(len(lengths), none, dtype=np.int64)
        filled = lengths > 0
        if filled.any():
            # Sort key: the label's count first, then its id; one reduceat per shard.
            key = counts[ids] * (none + 1) + ids
            starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])[filled]
            rarest[filled] = np.minimum.reduceat(key, starts) % (none + 1)
        out.append(rarest)
    return out


def mixing_stats(
    streams: Sequence[np.ndarray], sizes: Sequence[Sequence[int]], classes: int
) -> MixingStats:
    """Statistics of one epoch's rank streams, averaged over ranks weighted by length."""
    pooled = np.concatenate(streams) if streams else np.empty(0, np.int64)
    distribution = np.bincount(pooled, minlength=classes) / max(1, len(pooled))
    weights = np.array([len(s) for s in streams], dtype=np.float64)
    if weights.sum() == 0:
        return MixingStats(0.0, 0.0, 0.0)
    rows = [
        (same_class_rate(s), batch_tv(s, b, distribution), position_ks(s, classes))
        for s, b in zip(streams, sizes, strict=True)
    ]
    return MixingStats(*np.average(np.array(rows), axis=0, weights=weights).tolist())


def ideal_trials(
    streams: Sequence[np.ndarray],
    sizes: Sequence[Sequence[int]],
    classes: int,
    trials: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """`mixing_stats` of `trials` random permutations of the epoch, split like `streams`."""
    # Sorted first, so the ideal depends only on the epoch's multiset of labels.
    pooled = np.sort(np.concatenate(streams)) if streams else np.empty(0, np.int64)
    bounds = np.cumsum([len(s) for s in streams])[:-1]
    runs = []
    for _ in range(trials):
        permuted = np.split(rng.permutation(pooled), bounds)
        runs.append(mixing_stats(permuted, sizes, classes).values())
    return np.array(runs)


def same_class_rate(labels: np.ndarray) -> float:
    """Share of consecutive pairs that share a class."""
    if len(labels) < 2:
        return 0.0
    return float(np.mean(labels[1:] == labels[:-1]))


def batch_tv(labels: np.ndarray, sizes: Sequence[int], distribution: np.ndarray) -> float:
    """Mean total-variation distance of each batch's class mix from `distribution`."""
    if not len(sizes) or not len(labels):
        return 0.0
    classes = len(distribution)
    batch_ids = np.repeat(np.arange(len(sizes)), sizes)
    counts = np.bincount(
        batch_ids * classes + labels[: len(batch_ids)], minlength=len(sizes) * classes
    ).reshape(len(sizes), classes)
    freq = counts / np.asarray(sizes, dtype=np.float64)[:, None]
    return float(np.mean(0.5 * np.abs(freq - distribution).sum(axis=1)))


def position_ks(labels: np.ndarray, classes: int) -> float:
    """KS distance of each class's positions from uniform, averaged weighted by class size."""
    n = len(labels)
    if n == 0:
        return 0.0
    order = np.argsort(labels, kind="stable")  # positions grouped by class, ascending
    grouped = labels[order]
    counts = np.bincount(labels, minlength=classes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    within = np.arange(n) - starts[grouped]  # index of each position within its class
    size = counts[grouped]
    where = (order + 0.5) / n  # positions as quantiles of the stream
    gap = np.maximum((within + 1) / size - where, where - within / size)
    present = np.flatnonzero(counts)
    ks = np.maximum.reduceat(gap, starts[present])
    return float(np.average(ks, weights=counts[present]))


def judge(
    stream: np.ndarray, ideal: np.ndarray, ideal_std: np.ndarray, tolerance: float
) -> tuple[bool, np.ndarray]:
    """Relative excess over ideal per metric, and whether all stay within tolerance or noise."""
    safe = np.where(ideal > 0, ideal, 1.0)
    excess = np.where(ideal > 0, stream / safe - 1, np.where(stream > 0, np.inf, 0.0))
    allowed = np.maximum(tolerance, NOISE_SIGMAS * ideal_std / safe)
    return bool(np.all(excess <= allowed)), excess


def suggest_buffer(
    part: Partition,
    counts: Sequence[int],
    seed: int,
    labels_by_shard: Sequence[np.ndarray],
    classes: int,
    ideal_runs: np.ndarray,
    tolerance: float,
) -> tuple[int, int] | None:
    """The smallest `(buffer, initial)` whose epoch 0 mixes within tolerance, or None.

    Buffers double from the current one (at least one batch). Each size is tried with the
    current initial fill, then filled completely before the first sample: the buffer only
    grows while it emits, so a small initial fill biases the start of each worker's run.
    Stops at the longest worker run: a buffer holding a worker's whole run is a full shuffle
    of it, and anything larger changes nothing.
    """
    plans = [plan_epoch(counts, part, rank, seed, 0) for rank in range(part.world_size)]
    longest = max(plan.worker(role).samples for plan in plans for role in range(part.num_workers))
    ideal = ideal_runs.mean(axis=0)
    ideal_std = ideal_runs.std(axis=0, ddof=1)
    size = max(2 * part.shuffle_buffer, part.batch_size)  # less than a batch mixes no batch
    while True:
        size = min(size, max(longest, 2))
        for initial in dict.fromkeys((min(part.shuffle_initial, size), size)):
            trial = replace(part, shuffle_buffer=size, shuffle_initial=initial)
            orders = epoch_delivery(trial, counts, seed, 0)
            streams = [stream_labels(o, labels_by_shard) for o in orders]
            stats = mixing_stats(streams, [o.batch_sizes for o in orders], classes).values()
            if judge(stats, ideal, ideal_std, tolerance)[0]:
                return size, initial
        if size >= longest:
            return None
        size *= 2


def verdict(
    passed: bool,
    excess: np.ndarray,
    tolerance: float,
    part: Partition,
    suggested: tuple[int, int] | None,
    train: bool = True,
) -> str:
    """One line: how close to ideal, or what to change."""
    worst = float(max(0.0, np.max(excess))) if len(excess) else 0.0
    if passed:
        noise = " (the rest is sampling noise at this size)" if worst > tolerance else ""
        return f"mixing is within {worst:.0%} of an ideal shuffle{noise}"
    if not train:
        return (
            f"mixing is {worst:.0%} worse than ideal: outside training the split is read in order"
        )
    if suggested is not None:
        size, initial = suggested
        fill = f" and --shuffle-initial to ~{initial}" if initial > part.shuffle_initial else ""
        return (
            f"buffer too small: raise --shuffle-buffer to ~{size}{fill} "
            f"(mixing is {worst:.0%} worse than ideal)"
        )
    return (
        f"mixing is {worst:.0%} worse than ideal and no shuffle buffer fixes it: each worker "
        "mixes only its own run of whole shards, and each batch comes from one worker; use "
        "fewer workers per rank, more and smaller shards, or shards built with samples "
        "shuffled across them"
    )


def format_report(report: ShuffleReport) -> str:
    """A small table and the verdict."""
    c = report.config
    field = LabelField.parse(report.label_field)
    how = " (multi-label: each sample as its rarest label)" if field.multi else ""
    lines = [
        f"labels from {field.text}{how}",
        f"{report.samples} samples/epoch, {report.classes} classes, {report.epochs} epoch(s), "
        f"world size {c.world_size or 1} x {max(1, c.workers.count)} worker slot(s), "
        f"batch {c.batch.size}, shuffle buffer {c.shuffle.buffer} (initial {c.shuffle.initial})",
        "",
        f"{'metric (lower is better mixed)':<42}{'stream':>9}{'ideal':>9}{'excess':>9}",
    ]
    for name in METRICS:
        stream, ideal = getattr(report.stream, name), getattr(report.ideal, name)
        excess = report.excess[name]
        shown = f"{excess:+.0%}" if math.isfinite(excess) else "inf"
        lines.append(f"{METRIC_NAMES[name]:<42}{stream:>9.4f}{ideal:>9.4f}{shown:>9}")
    lines += ["", f"verdict: {report.verdict}"]
    return "\n".join(lines)
