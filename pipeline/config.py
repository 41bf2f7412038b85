"""`LoaderConfig`: what the loader reads and how, as frozen groups that check themselves.

A group (`Batching`, `Shuffle`, `Crop`, `Workers`, `ReadOptions`, and the sampling
mode `Exact` or `Resampled`) refuses a bad value where it is made, naming the field
and what it allows, so no bad value reaches the epoch plan's arithmetic.
`LoaderOptions` are the groups one run shares across its splits; `TrainConfig`
holds them as one group. Imports no torch: `train --help` and the CLIs stay light.

`Workers` (pipeline/worker_config.py), `ReadOptions` (pipeline/read_config.py) and
`Source`/`Mixing` (pipeline/source_config.py) live in modules of their own and are
re-exported here, so `from pipeline.config import ...` names every group.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.augment import Augment
from pipeline.read_config import ReadOptions
from pipeline.source_config import (  # noqa: F401  (re-exported: `from pipeline.config import`)
    Mixing,
    Source,
    default_source_name,
    redact_source,
    source_names,
)
from pipeline.worker_config import PLACEMENTS, Workers  # noqa: F401  (re-exported)
from shards.errors import UsageError
from shards.flags import (
    OldSpellingWarning,
    SettingError,
    check_choice,
    check_flag,
    check_fraction,
    check_int_at_least,
    option,
    refuse,
    settings_group,
)
from shards.formats import DEFAULT_FORMAT, FORMAT_NAMES, FORMATS
from shards.image.policy import BACKENDS
from shards.sample import Field, resolve_fields

EPOCH_RULES = ("pad", "drop", "uneven")  # how ranks get equal work (`pipeline.plan.rank_slice`)


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

    @property
    def is_train(self) -> bool:
        return self.split == "train" if self.train is None else self.train

    @property
    def resampling(self) -> bool:
        """Whether samples are drawn with replacement."""
        return isinstance(self.sampling, Resampled)
