"""`LoaderConfig`: what the loader reads and how, as frozen groups that check themselves.

A group (`Batching`, `Shuffle`, `Crop`, `Workers`, `ReadOptions`, and the sampling
mode `Exact` or `Resampled`) refuses a bad value where it is made, naming the field
and what it allows, so no bad value reaches the epoch plan's arithmetic.
`LoaderOptions` are the groups one run shares across its splits; `TrainConfig`
holds them as one group. Imports no torch: `train --help` and the CLIs stay light.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import posixpath
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from pipeline.augment import Augment
from shards.errors import ReadLimits, UsageError
from shards.flags import (
    OldSpellingWarning,
    SettingError,
    check_at_least,
    check_bytes,
    check_choice,
    check_flag,
    check_fraction,
    check_int_at_least,
    option,
    refuse,
    settings_group,
)
from shards.formats import DEFAULT_FORMAT, FORMAT_NAMES, FORMATS, is_format
from shards.image.policy import BACKENDS
from shards.redact import redact_url
from shards.sample import Field, resolve_fields
from shards.storage import RetryPolicy, is_remote
from shards.storage.ranged import DEFAULT_CONNECTIONS, DEFAULT_PREFETCH_BYTES
from shards.units import ByteSize

PLACEMENTS = ("local", "ray")  # where worker roles run (`Workers.placement`)
EPOCH_RULES = ("pad", "drop", "uneven")  # how ranks get equal work (`pipeline.plan.rank_slice`)


def default_workers() -> int:
    """DataLoader workers by default: one per CPU, up to 8."""
    return min(8, os.cpu_count() or 1)


@dataclass(frozen=True)
class Batching:
    """How a rank's samples become batches.

    Attributes:
        size: samples per batch (per rank).
        drop_last: drop a rank's last partial batch; default (None): True for train.
        epoch_rule: how ranks get equal work when samples don't divide: `pad` (repeat
            a few samples; train default), `drop`, or `uneven` (exactly once, ranks may
            differ by one batch; eval default). In eval `uneven` never delivers a
            sample twice: where bad samples were skipped the stream's last batches come
            short (`stats.unfilled`), where training refills them from recent good
            samples (`stats.refilled`).
        channels_last: images keep the NHWC memory layout the workers build them in
            (shape still `[B, 3, H, W]`, `torch.channels_last` strides), as FFCV does;
            transposing to NCHW in a worker costs ~50 us an image while the GPU does it
            for free. `CudaPrefetcher` outputs NCHW unless asked for channels-last; on
            the CPU call `.contiguous()` if code needs NCHW strides. False: workers
            transpose.
        aug_repeats: repeated augmentation (DeiT's `--aug-repeats`): each epoch reads
            about 1/k of the samples, chosen anew each epoch, k times each with k
            different augmentations (repeat numbers 0..k-1), and keeps the length it
            has without repeats (`pipeline.plan.Repeats`). Training only; 1: off.
    """

    size: int = option(256, "samples per batch per rank", "batch")
    drop_last: bool | None = option(
        None, "drop a rank's last partial batch; default: for train only", "batch", flag="drop_last"
    )
    epoch_rule: str | None = option(
        None,
        "equal work per rank: pad (repeat a few samples), drop, or uneven (every sample "
        "once); default: pad for train, uneven for eval",
        "batch",
        EPOCH_RULES,
        flag="epoch_rule",
    )
    channels_last: bool = option(
        True, "images in NHWC memory layout", "batch", flag="channels_last"
    )
    aug_repeats: int = option(
        1,
        "repeated augmentation: each epoch reads about 1/k of the samples, k times each "
        "with k different augmentations, at the epoch's usual length (train only; 1: off)",
        "batch",
        flag="aug_repeats",
    )

    def __post_init__(self) -> None:
        check_int_at_least(self, "size", 1)
        check_flag(self, "drop_last", optional=True)
        check_choice(self, "epoch_rule", EPOCH_RULES, optional=True)
        check_flag(self, "channels_last")
        check_int_at_least(self, "aug_repeats", 1)


@dataclass(frozen=True)
class Exact:
    """Every sample once per epoch (the epoch rule pads or drops the few that don't divide)."""


@dataclass(frozen=True)
class Resampled:
    """Draw samples with replacement, shards weighted by size.

    Attributes:
        epoch_samples: samples per epoch over all ranks (default: the dataset size).
        balance: sample classes evenly (weights 1/count from the manifest's class
            counts, applied in the stream); the fields must hold a label.
    """

    epoch_samples: int | None = None
    balance: bool = False

    def __post_init__(self) -> None:
        if self.epoch_samples is not None:
            check_int_at_least(self, "epoch_samples", 1)
        check_flag(self, "balance")


@dataclass(frozen=True)
class Mixing:
    """How a mix of sources (`source=[Source(...), ...]`) shares out each epoch.

    Attributes:
        epoch_samples: samples an epoch over all ranks that the sources' weights share
            out; default: the sum of the sources' sizes. Only with weights (with
            `samples=` or `repeat=` the epoch is their sum).
        batches: `mixed` (default): every batch holds each source's share, rounded,
            the remainder rotated; `single`: sources take turns in runs of a batch, so a
            batch holds one source when its rank's share starts on a run (see
            docs/LOADER.md, "Mixing datasets").
    """

    epoch_samples: int | None = None
    batches: str = "mixed"

    def __post_init__(self) -> None:
        if self.epoch_samples is not None:
            check_int_at_least(self, "epoch_samples", 1)
        check_choice(self, "batches", ("mixed", "single"))


SOURCE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # keys become "{name}/{key}": no slash


@dataclass(frozen=True)
class Source:
    """One dataset of a mix and its share of each epoch.

    `Source("s3://big/manifest.json", weight=0.7)`. Give exactly one of:

    Attributes:
        source: anything `LoaderConfig.source` takes for one dataset: a manifest
            (file, directory or URL), shard URLs or a brace pattern, tar or Parquet.
        weight: its share of `Mixing.epoch_samples` (default: the sum of the sources'
            sizes); weights are relative, and every source of a mix then has one.
        samples: exactly this many samples an epoch.
        repeat: this many times its size an epoch (0.5: half of it, 2: twice).
        split: the manifest split to read.
        format: `tar` or `parquet`; default: the loader's `format`.
        name: what its keys (`"{name}/{key}"`), stats and logs call it; default: a
            short name from the source (`s3://big/manifest.json` -> `big`,
            `data/curated` -> `curated`), unique within the mix.
    """

    source: str | os.PathLike | Sequence[str]
    weight: float | None = field(default=None, kw_only=True)
    samples: int | None = field(default=None, kw_only=True)
    repeat: float | None = field(default=None, kw_only=True)
    split: str = field(default="train", kw_only=True)
    format: str | None = field(default=None, kw_only=True)
    name: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        single = isinstance(self.source, (str, os.PathLike))
        many = isinstance(self.source, Sequence) and not single and len(self.source) > 0
        if not (single and os.fspath(self.source)) and not many:
            raise refuse(self, "source", f" must name a manifest or shards, got {self.source!r}")
        given = [
            name for name in ("weight", "samples", "repeat") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise refuse(
                self,
                "weight",
                f": give exactly one of weight, samples or repeat, got {given or 'none'}",
            )
        value = getattr(self, given[0])
        if given[0] == "samples":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise refuse(self, "samples", f" must be an integer of at least 1, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise refuse(self, given[0], f" must be a number above 0, got {value!r}")
        elif not math.isfinite(value):
            raise refuse(self, given[0], f" must be finite, got {value!r}")
        if not isinstance(self.split, str) or not self.split:
            raise refuse(self, "split", f" must be a split name, got {self.split!r}")
        if self.format is not None and not is_format(self.format):
            raise refuse(self, "format", f" {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.name is not None and not (
            isinstance(self.name, str) and SOURCE_NAME.match(self.name)
        ):
            raise refuse(
                self, "name", f" must be letters, digits, '_', '.' or '-', got {self.name!r}"
            )

    def __repr__(self) -> str:
        # URLs may carry credentials (`user:password@`, presigned signatures).
        shown = {"source": redact_source(self.source)}
        for name in ("weight", "samples", "repeat", "split", "format", "name"):
            value = getattr(self, name)
            if value is not None and not (name == "split" and value == "train"):
                shown[name] = value
        return f"Source({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def label(self) -> str:
        """Its name as given, else the one derived from the source."""
        return self.name or default_source_name(self.source)


def default_source_name(source: Any) -> str:
    """A short name for a source: its dataset directory, bucket or shard folder."""
    text = os.fspath(source if isinstance(source, (str, os.PathLike)) else source[0])
    parts = urlsplit(text) if is_remote(text) else None
    path = (parts.path if parts else text).rstrip("/")
    base = posixpath.basename(path)
    files = (".json", *(fmt.suffix for fmt in FORMATS.values()))
    if base.lower().endswith(files) or "{" in base:  # a manifest or shard files
        base = posixpath.basename(posixpath.dirname(path))
        if is_format(base):  # the build's format folders: name the dataset
            base = posixpath.basename(posixpath.dirname(posixpath.dirname(path)))
    if not base and parts:
        base = parts.netloc.rsplit("@", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.")
    return name or "source"


def source_names(sources: Sequence[Source]) -> tuple[str, ...]:
    """Each source's name; two alike are refused (their keys would clash)."""
    names = tuple(source.label for source in sources)
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise UsageError(
            f"sources of a mix are named alike ({', '.join(clashes)}): give each a name, "
            "e.g. Source(..., name='web')"
        )
    return names


@dataclass(frozen=True)
class Shuffle:
    """Samples (encoded bytes) each worker holds for mixing; training only.

    Attributes:
        buffer: samples held; 1 turns mixing off.
        initial: samples held before the first one is emitted (the buffer grows
            to `buffer` while emitting, so the first batch comes quickly).
    """

    buffer: int = option(2000, "samples (encoded) held for shuffling", "shuffle")
    initial: int = option(500, "samples buffered before the first is emitted", "shuffle")

    def __post_init__(self) -> None:
        check_int_at_least(self, "buffer", 1)
        check_int_at_least(self, "initial", 1)


@dataclass(frozen=True, kw_only=True)
class ProgressiveResize:
    """Train images that grow (or shrink) with the epochs, as FFCV's ResNet recipes do.

    `ProgressiveResize(start=160, end=192, last_epoch=10)`: `start` px up to `first_epoch`,
    `end` px from `last_epoch` on, and in between the straight line from one to the other
    rounded to the nearest multiple of `step` (FFCV's `get_resolution`), kept within
    `start..end`. The size changes only where an epoch starts; eval keeps `Crop.image_size`.

    Attributes:
        start, end: the first and last output sides in pixels.
        first_epoch, last_epoch: where the ramp starts and ends (0-based epochs).
        step: sizes in between are multiples of it.
    """

    start: int
    end: int
    first_epoch: int = 0
    last_epoch: int
    step: int = 32

    def __post_init__(self) -> None:
        check_int_at_least(self, "step", 1)
        check_int_at_least(self, "start", self.step)
        check_int_at_least(self, "end", self.step)
        check_int_at_least(self, "first_epoch", 0)
        check_int_at_least(self, "last_epoch", self.first_epoch)

    def size_at(self, epoch: int) -> int:
        """The output side of `epoch`'s train images."""
        if epoch <= self.first_epoch:
            return self.start
        if epoch >= self.last_epoch:
            return self.end
        share = (epoch - self.first_epoch) / (self.last_epoch - self.first_epoch)
        # round() as FFCV's np.round: to the nearest multiple, halves to the even one.
        side = round((self.start + share * (self.end - self.start)) / self.step) * self.step
        return min(max(side, min(self.start, self.end)), self.largest)

    @property
    def largest(self) -> int:
        """The largest side of the schedule: what a batch slot is sized for."""
        return max(self.start, self.end)


@dataclass(frozen=True)
class Crop:
    """What a sample's image becomes: random-resized crop + flip (train) or center crop.

    Attributes:
        image_size: output height and width.
        scale, ratio: the random crop's area share and aspect-ratio ranges (train).
        hflip: probability of a horizontal flip (train).
        crop_fraction: the center crop's share of the shorter side (eval).
        backend: the built-in crops' decoder. `auto` (default): `fast` when simplejpeg
            and OpenCV import, else `pillow`. `fast`: libjpeg-turbo decodes (DCT-scaled
            when the crop allows) and OpenCV resizes straight into the batch; samples it
            does not take (non-JPEG, CMYK, JPEGs libjpeg-turbo warns about) go to Pillow
            one by one, counted in `stats.pillow_fallbacks`. `pillow`: Pillow only.
            Same crop boxes and flips either way; pixels differ slightly
            (docs/LOADER.md, "Image decoding").
        transform: replaces the built-in crop; called as `transform(bytes, rng)` and
            returns uint8 HxWx3.
        progressive: train images sized by epoch (`ProgressiveResize`) instead of
            `image_size`, which eval keeps; the built-in crops only.
    """

    image_size: int = option(224, "image side in pixels", "crop")
    scale: tuple[float, float] = option(
        (0.08, 1.0), "train: the random crop's share of the image area, min,max", "crop"
    )
    ratio: tuple[float, float] = option(
        (3 / 4, 4 / 3), "train: the random crop's aspect-ratio range, min,max", "crop"
    )
    hflip: float = option(0.5, "train: probability of a horizontal flip", "crop")
    crop_fraction: float = option(0.875, "eval: center crop's share of the shorter side", "crop")
    backend: str = option(
        "auto",
        "decoder: fast (libjpeg-turbo + OpenCV), pillow, or auto (fast when installed)",
        "crop",
        BACKENDS,
    )
    transform: Callable | None = option(
        None, "replaces the built-in crop: transform(bytes, rng) -> uint8 HxWx3", cli=False
    )
    progressive: ProgressiveResize | None = option(
        None, "train: image sides by epoch (ProgressiveResize); eval keeps image_size", cli=False
    )

    def __post_init__(self) -> None:
        check_int_at_least(self, "image_size", 1)
        for name, top in (("scale", 1.0), ("ratio", None)):
            low, high = pair(getattr(self, name))
            if not 0 < low <= high or (top is not None and high > top):
                allowed = f"0 < min <= max <= {top}" if top else "0 < min <= max"
                raise refuse(
                    self, name, f" must be (min, max) with {allowed}, got {getattr(self, name)!r}"
                )
        check_fraction(self, "hflip")
        check_fraction(self, "crop_fraction", low_open=True)
        check_choice(self, "backend", BACKENDS)
        if self.transform is not None and not callable(self.transform):
            raise refuse(self, "transform", f" must be callable or None, got {self.transform!r}")
        if self.progressive is not None and not isinstance(self.progressive, ProgressiveResize):
            raise refuse(
                self,
                "progressive",
                f" must be a ProgressiveResize or None, got {self.progressive!r}",
            )
        if self.progressive is not None and self.transform is not None:
            raise refuse(
                self,
                "progressive",
                " resizes the built-in crops, and transform= replaces them: give one of the two",
            )

    def train_size(self, epoch: int) -> int:
        """The side of `epoch`'s train images: the progressive schedule's, else `image_size`."""
        return self.image_size if self.progressive is None else self.progressive.size_at(epoch)

    @property
    def largest_train_size(self) -> int:
        """The largest side a train image takes in any epoch."""
        return self.image_size if self.progressive is None else self.progressive.largest


def pair(value: Any) -> tuple[float, float]:
    """`(low, high)` of a range setting; `(0, -1)` (refused) for anything else."""
    numbers = isinstance(value, Sequence) and len(value) == 2
    if numbers and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return value[0], value[1]
    return 0, -1


@dataclass(frozen=True)
class Workers:
    """The DataLoader's worker processes.

    Attributes:
        count: worker processes (0: read in the main process).
        prefetch_factor: batches each worker builds ahead.
        persistent: workers live across epochs.
        pin_memory: page-locked batches; default (None): when CUDA is available.
        reuse_buffers: workers build batches in a ring of reused shared-memory slots
            (`pipeline.batchring`), `prefetch_factor + 2` batches per worker, instead
            of fresh shared memory per batch (~8% of a worker's time goes to new pages
            otherwise). Safe when batches are held: a slot is reused only once no
            tensor over it is left. Needs persistent workers when `count > 0`.
        placement: `local` (worker processes of this machine) or `ray`: `remote` worker
            roles run as Ray actors on the cluster (`pipeline.remote`) and stream their
            uint8 batches here, `prefetch_factor` in flight per role, beside `count` local
            roles (DataLoader workers; 0: only remote ones).
        ray_address: the cluster (default: `RAY_ADDRESS`, else a local Ray).
        remote: worker roles on the cluster (`placement="ray"`).
        ray_cpus: CPUs each role's actor asks of the cluster.
        ray_resources: custom resources each actor asks for, e.g. `{"cpu_node": 1}` to keep
            the roles on nodes started with `--resources='{"cpu_node": 8}'`.
    """

    count: int = option(
        default_factory=default_workers,
        text="loader worker processes per rank; default: one per CPU, up to 8",
        group="workers",
        flag="workers",
    )
    prefetch_factor: int = option(2, "batches each worker builds ahead", "workers")
    persistent: bool = option(
        True, "loader workers live across epochs", "workers", flag="persistent_workers"
    )
    pin_memory: bool | None = option(
        None, "page-locked batches; default: when CUDA is available", "workers", cli=False
    )
    reuse_buffers: bool = option(
        True, "workers build batches in reused shared-memory slots", "workers"
    )
    placement: str = option("local", "where worker roles run", "workers", PLACEMENTS, cli=False)
    ray_address: str | None = option(None, "the Ray cluster", "workers", cli=False)
    remote: int = option(2, "worker roles on the Ray cluster", "workers", cli=False)
    ray_cpus: float = option(1.0, "CPUs of each remote role", "workers", cli=False)
    ray_resources: dict | None = option(None, "resources of each remote role", "workers", cli=False)

    def __post_init__(self) -> None:
        check_int_at_least(self, "count", 0)
        check_int_at_least(self, "prefetch_factor", 1)
        check_flag(self, "persistent")
        check_flag(self, "pin_memory", optional=True)
        check_flag(self, "reuse_buffers")
        check_choice(self, "placement", PLACEMENTS)
        check_int_at_least(self, "remote", 1)
        check_at_least(self, "ray_cpus", 0)


@dataclass(frozen=True)
class ReadOptions:
    """How shard bytes are read.

    Attributes:
        retry: retries, stall limit and per-shard deadline of every request.
        storage_options: fsspec options for object stores (e.g. endpoint_url); never
            shown in a repr, since credentials go here.
        limits: caps on one shard read (member and cell bytes, members, bytes, Parquet
            row-group size); the manifest's byte count caps each shard too.
        checksums: hash every shard against the manifest's sha256 before reading it;
            a mismatch makes it a bad shard (counted, never half-read). Costs one extra
            read of local shards or a spool to a temporary file for remote ones.
        timeout: seconds to wait for one batch from a worker before raising (a stuck,
            not dead, worker; dead ones raise at once). 0 waits forever. Default: the
            retry policy's per-shard deadline plus two stall limits, so a shard that
            stalls ends as a counted bad shard naming its URL before this watchdog
            (which cannot name one) fires.

        The two byte sizes take an int or a text (`"512MiB"`, `"200GB"`: powers of 1024
        with an `i`, else of 1000; `shards.units`).

        prefetch_bytes: bytes of remote shards fetched ahead per worker (in flight and
            fetched, not yet read), into the cache or a temporary file, never memory;
            the next shard is always fetched, even one larger. 0: stream each remote
            shard as it is read, one connection, no read-ahead.
        fetch_connections: parallel ranged requests per shard fetched, so a store that
            caps one connection's bandwidth does not cap the worker's.
        cache_dir: a node-local directory where fetched shards are kept (checked against
            the manifest's sha256, else its size) for later epochs and for every
            worker and rank on the node. None: no cache.
        cache_limit: bytes the cache may hold; least-recently-used shards not in use and
            not of this job are evicted to stay under it (a dataset larger than the
            limit keeps what fitted first and streams the rest). None: no limit but the
            disk (a full disk turns the cache off with one warning).
        count_remote_shards: count remote tar shards without a manifest by reading each
            once (exact epochs need counts; resampled sampling needs none).
    """

    retry: RetryPolicy = option(
        default_factory=RetryPolicy, text="retries and deadlines of reads", cli=False
    )
    # repr=False: credentials put here must not leak wherever a config is logged.
    storage_options: dict | None = field(
        default=None, repr=False, metadata={"help": "fsspec options", "cli": False}
    )
    limits: ReadLimits = option(
        default_factory=ReadLimits, text="caps on one shard read", cli=False
    )
    checksums: bool = option(
        False,
        "hash every shard against the manifest's sha256 before reading it",
        "reading",
        flag="verify_checksums",
    )
    timeout: float | None = option(
        None,
        "seconds to wait for one batch from a loader worker (0: forever); default: the "
        "per-shard read deadline plus two stall limits",
        "reading",
        flag="batch_timeout",
    )
    prefetch_bytes: ByteSize = option(
        DEFAULT_PREFETCH_BYTES,
        "bytes of remote shards fetched ahead per worker (e.g. 512MiB); 0: stream without "
        "read-ahead",
        "reading",
    )
    fetch_connections: int = option(
        DEFAULT_CONNECTIONS, "parallel ranged requests per remote shard fetched", "reading"
    )
    cache_dir: str | None = option(
        None,
        "node-local directory that keeps fetched remote shards for later epochs; default: no cache",
        "reading",
    )
    cache_limit: ByteSize | None = option(
        None,
        "bytes the shard cache may hold (e.g. 200GB or 200GiB); default: no limit but the disk",
        "reading",
    )
    allow_missing_shards: bool = option(
        False,
        "read the shards that exist when some named ones do not (a half-synced brace "
        "range); default: refuse, naming how many are missing",
        "reading",
    )
    count_remote_shards: bool = option(
        False,
        "count remote tar shards without a manifest by reading each once, with progress "
        "(exact epochs need counts); default: refuse, saying how else (resampled sampling "
        "needs none)",
        "reading",
    )

    @property
    def wants_digests(self) -> bool:
        """Whether the shards' sha256 should be read: checked reads or the cache's check."""
        return self.checksums or self.cache_dir is not None

    def __post_init__(self) -> None:
        if not isinstance(self.retry, RetryPolicy):
            raise refuse(self, "retry", f" must be a RetryPolicy, got {self.retry!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise refuse(self, "storage_options", " must be a dict of fsspec options or None")
        if not isinstance(self.limits, ReadLimits):
            raise refuse(self, "limits", f" must be a ReadLimits, got {self.limits!r}")
        check_flag(self, "checksums")
        if self.timeout is not None:
            check_at_least(self, "timeout", 0)
        check_bytes(self, "prefetch_bytes")
        check_int_at_least(self, "fetch_connections", 1)
        if isinstance(self.cache_dir, os.PathLike):
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        if self.cache_dir is not None and not (isinstance(self.cache_dir, str) and self.cache_dir):
            raise refuse(self, "cache_dir", f" must be a directory or None, got {self.cache_dir!r}")
        check_bytes(self, "cache_limit", 1, optional=True)
        check_flag(self, "allow_missing_shards")
        check_flag(self, "count_remote_shards")


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """The loader's options that one run shares across its splits (`TrainConfig.loader`).

    Attributes:
        format: a registered format (`tar`, `parquet`); default: `DEFAULT_FORMAT` (tar)
            when the manifest has it.
        shuffle, crop, workers, io: see their groups.
        max_skip_fraction: bad samples a worker may skip before it stops.
    """

    format: str | None = option(
        None, f"shard format to read; default: {DEFAULT_FORMAT} when built", "data", FORMAT_NAMES
    )
    shuffle: Shuffle = settings_group(Shuffle, "the shuffle buffer")
    crop: Crop = settings_group(Crop, "decode and crop", prefix="")
    workers: Workers = settings_group(Workers, "the DataLoader's workers", prefix="")
    io: ReadOptions = settings_group(ReadOptions, "how shard bytes are read", prefix="")
    max_skip_fraction: float = option(
        0.01, "share of a worker's samples it may skip as bad before it stops", "reading"
    )

    def __post_init__(self) -> None:
        check_choice(self, "format", tuple(FORMATS), optional=True)
        for name in ("shuffle", "crop", "workers", "io"):
            group = GROUP_TYPES[name]
            if not isinstance(getattr(self, name), group):
                raise refuse(
                    self, name, f" must be a {group.__name__}, got {getattr(self, name)!r}"
                )
        check_fraction(self, "max_skip_fraction")

    @property
    def options(self) -> dict[str, Any]:
        """This object's `LoaderOptions` fields, for `LoaderConfig(**options, ...)`."""
        return {f.name: getattr(self, f.name) for f in fields(LoaderOptions)}


# The flat keyword arguments `LoaderConfig` took before it had groups, kept for one release
# (each warns once, `warn_flat_name`), and the group field each one sets. The three sampling
# keywords make one `sampling` choice (`flat_sampling`).
FLAT_NAMES: dict[str, tuple[str, str]] = {
    "batch_size": ("batch", "size"),
    "drop_last": ("batch", "drop_last"),
    "epoch_rule": ("batch", "epoch_rule"),
    "channels_last": ("batch", "channels_last"),
    "shuffle_buffer": ("shuffle", "buffer"),
    "shuffle_initial": ("shuffle", "initial"),
    "image_size": ("crop", "image_size"),
    "scale": ("crop", "scale"),
    "ratio": ("crop", "ratio"),
    "hflip": ("crop", "hflip"),
    "crop_fraction": ("crop", "crop_fraction"),
    "backend": ("crop", "backend"),
    "transform": ("crop", "transform"),
    "num_workers": ("workers", "count"),
    "prefetch_factor": ("workers", "prefetch_factor"),
    "persistent_workers": ("workers", "persistent"),
    "pin_memory": ("workers", "pin_memory"),
    "reuse_buffers": ("workers", "reuse_buffers"),
    "retry": ("io", "retry"),
    "storage_options": ("io", "storage_options"),
    "read_limits": ("io", "limits"),
    "verify_checksums": ("io", "checksums"),
    "timeout": ("io", "timeout"),
    "cache_dir": ("io", "cache_dir"),
    "cache_limit": ("io", "cache_limit"),
    "allow_missing_shards": ("io", "allow_missing_shards"),
}
# The sampling keywords and the `Resampled` field each sets ("": `Resampled()` itself).
SAMPLING_FIELDS = {"resampled": "", "epoch_samples": "epoch_samples", "class_balance": "balance"}
SAMPLING_NAMES = tuple(SAMPLING_FIELDS)
GROUP_TYPES: dict[str, type] = {
    "batch": Batching,
    "shuffle": Shuffle,
    "crop": Crop,
    "workers": Workers,
    "io": ReadOptions,
}


# The flat names that have warned in this process: each warns once.
WARNED_FLAT_NAMES: set[str] = set()


def grouped_spelling(name: str) -> str:
    """`batch_size` -> `LoaderConfig(batch=Batching(size=...))`: what replaces a flat name."""
    if name in SAMPLING_FIELDS:
        inner = SAMPLING_FIELDS[name]
        return f"LoaderConfig(sampling=Resampled({f'{inner}=...' if inner else ''}))"
    group, inner = FLAT_NAMES[name]
    return f"LoaderConfig({group}={GROUP_TYPES[group].__name__}({inner}=...))"


def warn_flat_name(name: str) -> None:
    """The first use of a flat name in this process warns, naming its grouped spelling."""
    if name in WARNED_FLAT_NAMES:
        return
    WARNED_FLAT_NAMES.add(name)
    warnings.warn(
        f"LoaderConfig({name}=...) is now {grouped_spelling(name)}; the flat keyword "
        "goes in the next release",
        OldSpellingWarning,
        stacklevel=4,  # warn_flat_name <- group_flat_names <- __init__ <- the caller
    )


def group_flat_names(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with every flat name moved into its group (`batch_size=8` -> `batch=Batching(size=8)`).

    Each flat name warns once (`OldSpellingWarning`), naming its grouped spelling.

    Raises:
        SettingError: a group and one of its flat names both given, or a flat value
            its group refuses (named as the user wrote it).
    """
    for name in kwargs:
        if name in FLAT_NAMES or name in SAMPLING_NAMES:
            warn_flat_name(name)
    out = {k: v for k, v in kwargs.items() if k not in FLAT_NAMES and k not in SAMPLING_NAMES}
    by_group: dict[str, dict[str, str]] = {}
    for name in kwargs:
        if name in FLAT_NAMES:
            group, inner = FLAT_NAMES[name]
            by_group.setdefault(group, {})[inner] = name
    for group, names in by_group.items():
        if group in kwargs:
            given = ", ".join(sorted(names.values()))
            raise SettingError(
                "LoaderConfig",
                group,
                f" and {given} were both given: set {given} inside "
                f"{group}={GROUP_TYPES[group].__name__}(...), or leave {group} out (with "
                f"dataclasses.replace: {group}=replace(config.{group}, ...))",
            )
        try:
            out[group] = GROUP_TYPES[group](
                **{inner: kwargs[flat] for inner, flat in names.items()}
            )
        except SettingError as error:
            raise error.spelled(names.get(error.name, error.name)) from error
    sampling = {name: kwargs[name] for name in SAMPLING_NAMES if name in kwargs}
    if sampling:
        if "sampling" in kwargs:
            given = ", ".join(sampling)
            raise SettingError(
                "LoaderConfig", "sampling", f" and {given} were both given: use one of them"
            )
        out["sampling"] = flat_sampling(**sampling)
    return out


def flat_sampling(
    resampled: bool = False, epoch_samples: int | None = None, class_balance: bool = False
) -> Exact | Resampled:
    """The sampling mode the three flat keywords meant (`class_balance` implied `resampled`)."""
    if not (resampled or class_balance):
        if epoch_samples is not None:
            raise SettingError(
                "",
                "epoch_samples",
                " needs resampled=True (or class_balance=True); "
                "or pass sampling=Resampled(epoch_samples=...)",
            )
        return Exact()
    try:
        return Resampled(epoch_samples=epoch_samples, balance=bool(class_balance))
    except SettingError as error:
        raise error.spelled({"balance": "class_balance"}.get(error.name, error.name)) from error


def accepts_flat_names(cls: type) -> type:
    """Let `cls(...)` take the flat keyword arguments of `FLAT_NAMES` besides its groups."""
    grouped_init = cls.__init__

    @functools.wraps(grouped_init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        grouped_init(self, *args, **group_flat_names(kwargs))

    cls.__init__ = __init__
    return cls


@accepts_flat_names
@dataclass(frozen=True)
class LoaderConfig(LoaderOptions):
    """Everything the loader does, with the defaults users expect.

    `LoaderConfig(source, batch=Batching(size=64), crop=Crop(image_size=160))`. The
    flat keywords of earlier versions (`batch_size=64, image_size=160, num_workers=4,
    resampled=True, ...`: `FLAT_NAMES`) still work for this release, each set in its
    group, and each warns once (`OldSpellingWarning`) with its grouped spelling.

    Attributes:
        source: a `manifest.json` (path, directory or URL), or shard URLs: a path,
            `file://`, `http(s)://`, `s3://`, a brace pattern, or a list of these; or a
            mix of datasets, a list of `pipeline.Source` (each with its weight, sample
            count or repeat factor, its split and format), shared out by `mixing`.
        split: split to read from a manifest.
        train: random-resized-crop + flip and shuffling when True; resize + center
            crop, no shuffle, every sample once when False. Default: `split == "train"`.
        batch: `Batching`: batch size, drop_last, the epoch rule, the memory layout.
        sampling: `Exact()` (each sample once an epoch) or `Resampled(epoch_samples,
            balance)` (drawn with replacement, classes evened out with `balance`).
        fields: what each batch carries, in this order: `image` (uint8 images),
            `label` (int64 classes from `cls`, else `label`), `txt` (a list of str),
            `json` (a list of dicts), or a `shards.sample.Field` (multi-label targets,
            weights, other members, a per-field transform such as a tokenizer).
            Leave `label` out for shards without classes (img2dataset, webdataset's
            `ShardWriter`). `with_keys` appends the keys after the last field.
        with_keys: also yield the batch's sample keys (`"{name}/{key}"` in a mix).
        mixing: `Mixing`: a mix's epoch length and batch make-up.
        seed: shard order and buffers come from `seed + epoch`.
        rank, world_size: default from `torch.distributed` when initialised.
        augment: `Augment`: what each training crop gets after crop and flip
            (RandAugment, colour jitter, random erasing, your own ops), in the workers;
            None is `Augment()`, nothing. Eval never augments: an eval loader given an
            enabled one is refused.
        format, shuffle, crop, workers, io, max_skip_fraction: see `LoaderOptions`.
    """

    source: str | os.PathLike | Sequence[str] | Source | Sequence[Source]
    split: str = "train"
    train: bool | None = None
    batch: Batching = field(default_factory=Batching)
    sampling: Exact | Resampled = field(default_factory=Exact)
    fields: Sequence[str | Field] = ("image", "label")
    with_keys: bool = False
    mixing: Mixing = field(default_factory=Mixing)
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    augment: Augment = field(default_factory=Augment)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_source()
        if not isinstance(self.split, str) or not self.split:
            raise refuse(self, "split", f" must be a split name, got {self.split!r}")
        check_flag(self, "train", optional=True)
        if not isinstance(self.batch, Batching):
            raise refuse(self, "batch", f" must be a Batching, got {self.batch!r}")
        if not isinstance(self.sampling, (Exact, Resampled)):
            raise refuse(
                self, "sampling", f" must be Exact() or Resampled(...), got {self.sampling!r}"
            )
        self.check_aug_repeats()
        check_flag(self, "with_keys")
        check_int_at_least(self, "seed", 0)
        self.check_ranks()
        self.check_augment()
        resolved = resolve_fields(self.fields)  # a mistake fails before any shard is opened
        balance = isinstance(self.sampling, Resampled) and self.sampling.balance
        if balance and not any(s.kind in ("label", "multi_label") for s in resolved):
            raise UsageError(
                "class_balance weighs samples by class: fields must hold 'label' (one class "
                "id) or a multi_label field (weighted by each sample's rarest label)"
            )

    def check_source(self) -> None:
        """One source as today, or a mix: Sources only, read exactly."""
        if isinstance(self.source, Source):
            object.__setattr__(self, "source", (self.source,))
        if not isinstance(self.source, (str, os.PathLike, Sequence)) or not self.source:
            raise refuse(self, "source", f" must name a manifest or shards, got {self.source!r}")
        if not isinstance(self.mixing, Mixing):
            raise refuse(self, "mixing", f" must be a Mixing, got {self.mixing!r}")
        if not self.is_mix:
            return
        if not all(isinstance(item, Source) for item in self.source):
            raise refuse(
                self, "source", " mixes Source(...) with plain URLs: make each one a Source"
            )
        if isinstance(self.sampling, Resampled):
            raise refuse(
                self,
                "sampling",
                " must be Exact() for a mix of sources (each gives its declared samples); "
                "declare shares with Source(weight=...) and Mixing(epoch_samples=...)",
            )

    def check_aug_repeats(self) -> None:
        """Repeated augmentation plans copies of one source's exact epoch (`pipeline.plan`)."""
        repeats = self.batch.aug_repeats
        if repeats > 1 and self.is_mix:
            raise refuse(
                self,
                "batch",
                f".aug_repeats={repeats} is refused for a mix of sources (a mix already "
                "repeats a source by its share, Source(repeat=...)); use aug_repeats=1",
            )
        if repeats > 1 and isinstance(self.sampling, Resampled):
            raise refuse(
                self,
                "batch",
                f".aug_repeats={repeats} needs the exact epoch: resampled draws are with "
                "replacement, so no copy count can be kept; use Exact() or aug_repeats=1",
            )

    @property
    def is_mix(self) -> bool:
        """Whether `source` is a list of `Source`s (a mix, even of one)."""
        source = self.source
        return not isinstance(source, (str, os.PathLike)) and any(
            isinstance(item, Source) for item in source
        )

    def check_ranks(self) -> None:
        if self.world_size is not None:
            check_int_at_least(self, "world_size", 1)
        if self.rank is not None:
            check_int_at_least(self, "rank", 0)
        if self.rank is not None and self.world_size is not None and self.rank >= self.world_size:
            raise refuse(
                self, "rank", f" must be below world_size {self.world_size}, got {self.rank}"
            )

    def __repr__(self) -> str:
        # Source URLs may carry credentials (`user:password@`, presigned signatures);
        # `ReadOptions.storage_options` is left out of its repr.
        shared = {item.name for item in fields(LoaderOptions)}
        parts = []
        # What this reading is (source first), then the options it shares with others.
        for item in sorted(fields(self), key=lambda item: item.name in shared):
            value = getattr(self, item.name)
            if item.name == "source":
                value = redact_source(value)
            parts.append(f"{item.name}={value!r}")
        return f"LoaderConfig({', '.join(parts)})"

    def check_augment(self) -> None:
        """An `Augment` (None: `Augment()`, nothing), enabled only where the loader trains."""
        if self.augment is None:
            object.__setattr__(self, "augment", Augment())
        if not isinstance(self.augment, Augment):
            raise refuse(self, "augment", f" must be an Augment, got {self.augment!r}")
        if self.augment.enabled and not self.is_train:
            raise refuse(
                self,
                "augment",
                f" is for training, and this loader evaluates (split {self.split!r}, "
                f"train={self.train}): eval never augments, so leave augment out of it",
            )

    @property
    def is_train(self) -> bool:
        return self.split == "train" if self.train is None else self.train

    @property
    def resampling(self) -> bool:
        """Whether samples are drawn with replacement."""
        return isinstance(self.sampling, Resampled)


def redact_source(source: Any) -> Any:
    """A loader source with every URL in it redacted, for reprs and logs."""
    if isinstance(source, (str, os.PathLike)):
        return redact_url(os.fspath(source))
    if isinstance(source, Sequence):
        return [redact_source(item) for item in source]
    if hasattr(source, "source"):  # a `pipeline.Source`: its URLs redacted, the rest kept
        return dataclasses.replace(source, source=redact_source(source.source))
    return source
