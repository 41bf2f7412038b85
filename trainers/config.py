"""`TrainConfig`: every option of `train`, turned into CLI flags and stored with every run.

Flags are generated from the dataclass fields (type, default, help and group
live in the field metadata), so the CLI, the optional YAML/TOML config file,
`RUN_DIR/config.json` and the copy inside each checkpoint cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from pipeline.augment import Augment
from pipeline.config import LoaderOptions
from shards.errors import UsageError
from shards.flags import (
    CommandParser,
    add_config_flags,
    add_version_flag,
    check_at_least,
    check_choice,
    check_flag,
    check_fraction,
    check_int_at_least,
    config_from_args,
    default_values,
    flag_specs,
    flat_defaults,
    option,
    parse_float_pair,
    parse_int_list,
    refuse,
    settings_group,
    unwrap_optional,
)
from shards.sample import LabelField
from shards.units import ByteSize, ByteSizeError
from trainers.placement import check_placement_settings

COMMANDS = ("train", "find-batch-size", "scan-throughput")


def parse_float_list(text: str) -> tuple[float, ...]:
    """`"0.7,0.3"` -> `(0.7, 0.3)`."""
    try:
        return tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


ERASE_MODES = ("const", "rand", "pixel")  # timm's RandomErasing modes
OVERLAP_CHECKS = ("keys", "urls", "off")
TASKS = ("single-label", "multi-label")
LR_SCALINGS = ("linear", "sqrt", "none")
OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("auto", "cpu", "cuda")
AMP_MODES = ("off", "bf16", "fp16")
SCAN_SOURCES = ("synthetic", "loader")
MIX_MODES = ("batch", "pair", "elem")  # pipeline.mixup.MODES (that module imports torch)
# Flags renamed to timm's spelling; the old names still work on the command line and in
# config files.
RENAMED_FLAGS = {"label-smoothing": "smoothing"}


@dataclass(frozen=True)
class Recipe:
    """The training recipe beyond random-resized crop + flip, in timm's flags.

    Per-sample policies, random erasing and repeated augmentation run in the train
    loader's workers (`pipeline.Augment`, `Batching.aug_repeats`); mixup and cutmix on
    the batch after normalisation, on the device (`pipeline.MixupCutmix` in the
    prefetcher); progressive resizing sizes the train crops by epoch
    (`pipeline.config.ProgressiveResize`). Evaluation never augments or mixes.
    """

    auto_augment: str | None = option(
        None,
        "per-sample policy in timm's grammar: rand-m9-mstd0.5-inc1 (RandAugment), original, "
        "v0 (AutoAugment), augmix-m5-w3-d2, trivialaugment, 3a (DeiT III); default: none",
        "augment",
        flag="aa",
    )
    color_jitter: float = option(
        0.0, "colour jitter strength: brightness, contrast and saturation (0: off)", "augment"
    )
    re_prob: float = option(0.0, "random erasing probability per image", "augment", flag="reprob")
    re_mode: str = option(
        "pixel",
        "random erasing fill: const (zeros), rand (one colour per box), pixel (noise per pixel)",
        "augment",
        ERASE_MODES,
        flag="remode",
    )
    re_count: int = option(1, "random erasing boxes per erased image", "augment", flag="recount")
    aug_repeats: int = option(
        1,
        "repeated augmentation (DeiT's RASampler): each sample this many times an epoch, "
        "differently augmented, spread across ranks and batches (1: off)",
        "augment",
    )
    label_smoothing: float = option(
        0.0,
        "label smoothing of the training loss (with --mixup/--cutmix: of the soft targets)",
        "mixup",
        flag="smoothing",
    )
    mixup: float = option(0.0, "mixup alpha (0: off)", "mixup")
    cutmix: float = option(0.0, "cutmix alpha (0: off)", "mixup")
    cutmix_minmax: tuple[float, float] | None = option(
        None,
        "cutmix box sides as min,max shares of the image, instead of from the alpha "
        "(turns cutmix on); default: none",
        "mixup",
        parse=parse_float_pair,
    )
    mixup_prob: float = option(
        1.0, "probability that a batch (or pair, element) is mixed at all", "mixup"
    )
    mixup_switch_prob: float = option(
        0.5, "with --mixup and --cutmix both on: probability of cutmix", "mixup"
    )
    mixup_mode: str = option(
        "batch",
        "one mixup/cutmix draw per batch, per pair or per element (pair, elem: even batches)",
        "mixup",
        MIX_MODES,
    )
    progressive_start: int | None = option(
        None,
        "progressive resizing: the train image side up to --progressive-first-epoch; "
        "default: none (train at --image-size)",
        "progressive",
    )
    progressive_end: int | None = option(
        None,
        "progressive resizing: the train image side from --progressive-last-epoch on; "
        "default: none",
        "progressive",
    )
    progressive_first_epoch: int = option(
        0, "progressive resizing: epoch (from 0) where the side starts to change", "progressive"
    )
    progressive_last_epoch: int | None = option(
        None,
        "progressive resizing: epoch where the side reaches --progressive-end; "
        "default: the last epoch",
        "progressive",
    )
    progressive_step: int = option(
        32, "progressive resizing: sides in between are multiples of this", "progressive"
    )

    def __post_init__(self) -> None:
        if self.auto_augment is not None and not (
            isinstance(self.auto_augment, str) and self.auto_augment.strip()
        ):
            raise refuse(self, "auto_augment", f" must be a policy name, got {self.auto_augment!r}")
        for name in ("color_jitter", "mixup", "cutmix"):
            check_at_least(self, name, 0)
        for name in ("re_prob", "mixup_prob", "mixup_switch_prob"):
            check_fraction(self, name)
        check_below_one(self, "label_smoothing")
        check_choice(self, "re_mode", ERASE_MODES)
        check_int_at_least(self, "re_count", 1)
        check_int_at_least(self, "aug_repeats", 1)
        check_choice(self, "mixup_mode", MIX_MODES)
        minmax = self.cutmix_minmax
        if minmax is not None and not (len(minmax) == 2 and 0 < minmax[0] < minmax[1] <= 1):
            raise refuse(
                self, "cutmix_minmax", f" must be min,max with 0 < min < max <= 1, got {minmax!r}"
            )
        self.check_progressive()
        self.augment()  # a policy outside timm's grammar is refused here, named as --aa

    def augment(self) -> Augment | None:
        """The train workers' `pipeline.Augment`, or None when nothing is asked for.

        Raises:
            SettingError: from `Augment`, naming its field (the flag's spelling comes from
                the flag generator: `--aa 'rand-x': ...`).
        """
        if not self.augments:
            return None
        return Augment(
            auto_augment=self.auto_augment,
            color_jitter=self.color_jitter or None,
            re_prob=self.re_prob,
            re_mode=self.re_mode,
            re_count=self.re_count,
        )

    def check_progressive(self) -> None:
        """A schedule needs both sides; its other flags mean nothing without one."""
        check_int_at_least(self, "progressive_first_epoch", 0)
        check_int_at_least(self, "progressive_step", 1)
        ends = (self.progressive_start, self.progressive_end)
        if (ends[0] is None) != (ends[1] is None):
            raise refuse(self, "progressive_start", " and progressive_end go together: give both")
        for name in ("progressive_start", "progressive_end"):
            if getattr(self, name) is not None:
                check_int_at_least(self, name, self.progressive_step)
        last = self.progressive_last_epoch
        if last is not None and ends[0] is None:
            raise refuse(self, "progressive_last_epoch", " needs progressive_start and _end")
        if last is not None and last < self.progressive_first_epoch:
            raise refuse(
                self,
                "progressive_last_epoch",
                f" must be at least progressive_first_epoch ({self.progressive_first_epoch}), "
                f"got {last}",
            )

    @property
    def mixes(self) -> bool:
        """Whether batches are mixed (mixup or cutmix): the loss then takes soft targets."""
        return self.mixup > 0 or self.cutmix > 0 or self.cutmix_minmax is not None

    @property
    def augments(self) -> bool:
        """Whether the train workers apply a per-sample policy, jitter or erasing."""
        return self.auto_augment is not None or self.color_jitter > 0 or self.re_prob > 0

    @property
    def progressive(self) -> bool:
        return self.progressive_start is not None


@dataclass(frozen=True)
class Data:
    """What the run trains and evaluates on, and what its targets are."""

    train_shards: str | None = option(
        None,
        "train shards: a manifest.json (file, dir or URL) or shard URLs/pattern; several "
        "datasets to mix: A::B, or the flag repeated; required (default: none, unless "
        "--config sets it)",
        "data",
    )
    train_weights: tuple[float, ...] | None = option(
        None,
        "a mix's share of each --train-shards dataset, in order, e.g. 0.7,0.3 (default: "
        "each dataset once an epoch)",
        "data",
        parse=parse_float_list,
    )
    train_epoch_samples: int | None = option(
        None,
        "samples an epoch: what --train-weights share out, or what --resampled draws "
        "(default: the datasets' sizes summed)",
        "data",
    )
    resampled: bool = option(
        False,
        "draw train samples with replacement, shards weighted by size (webdataset's "
        "resampled mode): needs no sample counts, so remote tars without a manifest train "
        "with --train-epoch-samples N",
        "data",
    )
    val_shards: str | None = option(
        None,
        "validation shards; default: the `val` split of the train manifest when it has one",
        "data",
    )
    train_split: str = option("train", "split of the train manifest to train on", "data")
    val_split: str = option("val", "split of the validation manifest to evaluate", "data")
    overlap_check: str = option(
        "keys",
        "refuse train/val splits that share samples: compare every key (`keys`), "
        "only shard files (`urls`), or skip (`off`)",
        "data",
        OVERLAP_CHECKS,
    )
    task: str = option(
        "single-label",
        "single-label (one class per sample: softmax, cross-entropy, accuracy) or multi-label "
        "(any number of classes: a sigmoid per class, BCE, mAP and F1)",
        "data",
        TASKS,
    )
    label_field: str | None = option(
        None,
        "sample member the labels are read from (cls, label; for multi-label: labels, a JSON "
        "list of class ids) or json:KEY (a key of the json member); default: cls then label, "
        "or labels with --task multi-label",
        "data",
    )

    def __post_init__(self) -> None:
        for name in ("train_shards", "val_shards"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise refuse(self, name, f" must be a source text or None, got {value!r}")
        for name in ("train_split", "val_split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise refuse(self, name, f" must be a split name, got {getattr(self, name)!r}")
        check_choice(self, "overlap_check", OVERLAP_CHECKS)
        check_choice(self, "task", TASKS)
        check_flag(self, "resampled")
        multi = self.task == "multi-label"
        if self.label_field is not None and LabelField.parse(self.label_field).multi != multi:
            raise UsageError(
                f"--label-field {self.label_field} does not hold {self.task} targets: "
                "cls and label hold one class id (single-label), labels and json:KEY "
                "a list of class ids (--task multi-label)"
            )
        self.check_mix()

    @property
    def train_sources(self) -> tuple[str, ...]:
        """The datasets of `--train-shards`: one, or those of a mix (`A::B`)."""
        return split_sources(self.train_shards) if self.train_shards else ()

    def check_mix(self) -> None:
        """A mix's weights: one per dataset, above 0; the epoch length only with them."""
        weights, count = self.train_weights, len(self.train_sources)
        if weights is not None and len(weights) != count:
            raise UsageError(
                f"--train-weights gives {len(weights)} weights for {count} --train-shards "
                "datasets: give one per dataset, in order"
            )
        if weights is not None and not all(w > 0 for w in weights):
            raise UsageError(f"--train-weights must all be above 0, got {weights}")
        if self.train_epoch_samples is not None and weights is None and not self.resampled:
            raise UsageError(
                "--train-epoch-samples is shared out by --train-weights or drawn by "
                "--resampled: give one of them with it"
            )
        if self.resampled and weights is not None:
            raise UsageError(
                "--resampled draws from one dataset; a mix (--train-weights) keeps exact "
                "quotas: give one of them"
            )
        if self.train_epoch_samples is not None:
            check_int_at_least(self, "train_epoch_samples", 1)

    @property
    def is_mix(self) -> bool:
        """Several datasets, or one given a weight: the loader reads a mix of `Source`s."""
        return len(self.train_sources) > 1 or self.train_weights is not None


@dataclass(frozen=True)
class Model:
    """The network: which one, its outputs, and its layout."""

    model: str = option(
        "resnet-tiny",
        "cnn, cnn-nobn, resnet-tiny, resnet-small, or torchvision:NAME / timm:NAME",
        "model",
    )
    num_classes: int | None = option(
        None, "classifier outputs; default: the classes in the manifest", "model"
    )
    sync_bn: bool = option(False, "convert BatchNorm to SyncBatchNorm under DDP", "model")
    channels_last: bool = option(
        False, "NHWC memory layout for the model and the images it is given", "model"
    )

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise refuse(self, "model", f" must be a model name, got {self.model!r}")
        if self.num_classes is not None:
            check_int_at_least(self, "num_classes", 1)
        check_flag(self, "sync_bn")
        check_flag(self, "channels_last")


@dataclass(frozen=True)
class Schedule:
    """Steps and learning rate: the batch plan and the warmup + cosine schedule
    (`trainers.schedule`).

    Batch sizes are per device; the effective batch of one optimizer step is
    `batch_size x accum_steps x world_size`, and `lr` is the learning rate at
    `lr_ref_batch`, scaled to the effective batch by `lr_scaling`.
    """

    batch_size: int = option(64, "samples per device per micro-step", "batch")
    accum_steps: int = option(1, "micro-steps accumulated per optimizer step", "batch")
    epochs: int = option(10, "epochs; the LR schedule spans all of them", "batch")
    max_steps: int | None = option(
        None,
        "stop after this many optimizer steps (the schedule still spans --epochs); "
        "default: no limit",
        "batch",
    )
    lr: float = option(0.1, "peak learning rate at --lr-ref-batch", "optimizer")
    lr_ref_batch: int = option(256, "effective batch that --lr is given for", "optimizer")
    lr_scaling: str = option(
        "linear",
        "scale --lr by effective/ref batch (linear), its square root (sqrt), or not (none)",
        "optimizer",
        LR_SCALINGS,
    )
    min_lr: float = option(0.0, "learning rate at the end of the cosine decay", "optimizer")
    warmup_ratio: float = option(0.05, "share of optimizer steps in linear warmup", "optimizer")
    warmup_steps: int | None = option(
        None, "warmup optimizer steps; overrides --warmup-ratio (default: none)", "optimizer"
    )

    def __post_init__(self) -> None:
        for name in ("batch_size", "accum_steps", "epochs", "lr_ref_batch"):
            check_int_at_least(self, name, 1)
        if self.max_steps is not None:
            check_int_at_least(self, "max_steps", 1)
        check_at_least(self, "lr", 0)
        check_at_least(self, "min_lr", 0)
        if self.min_lr > self.lr:
            raise refuse(self, "min_lr", f" must be at most lr ({self.lr}), got {self.min_lr}")
        check_choice(self, "lr_scaling", LR_SCALINGS)
        check_below_one(self, "warmup_ratio")
        if self.warmup_steps is not None:
            check_int_at_least(self, "warmup_steps", 0)


@dataclass(frozen=True)
class Optimization:
    """The optimizer and what it does to the gradients (`trainers.numerics.build_optimizer`)."""

    optimizer: str = option(
        "sgd", "SGD (with --momentum, --nesterov) or AdamW", "optimizer", OPTIMIZERS
    )
    momentum: float = option(0.9, "SGD momentum (AdamW beta1)", "optimizer")
    nesterov: bool = option(False, "Nesterov momentum for SGD", "optimizer")
    weight_decay: float = option(
        1e-4, "weight decay (never applied to norm weights and biases)", "optimizer"
    )
    clip_grad: float = option(0.0, "clip the gradient norm to this (0: off)", "optimizer")

    def __post_init__(self) -> None:
        check_choice(self, "optimizer", OPTIMIZERS)
        check_at_least(self, "momentum", 0)
        check_flag(self, "nesterov")
        check_at_least(self, "weight_decay", 0)
        check_at_least(self, "clip_grad", 0)


@dataclass(frozen=True)
class Runtime:
    """Where and how the run executes, and what it writes into its run directory."""

    device: str = option(
        "auto", "where to train: auto (CUDA when available), cpu or cuda", "device", DEVICES
    )
    amp: str = option(
        "off",
        "mixed precision: off, bf16 autocast, or fp16 autocast with a gradient scaler (CUDA only)",
        "device",
        AMP_MODES,
    )
    seed: int = option(0, "seeds Python, NumPy, torch, CUDA and the loader", "device")
    deterministic: bool = option(False, "deterministic cuDNN/torch algorithms (slower)", "device")
    dist_timeout_s: int = option(600, "collective timeout under torchrun, seconds", "device")
    run_dir: str = option("runs/train", "config, metrics, plots and checkpoints go here", "run")
    eval_every: int = option(0, "optimizer steps between evaluations (0: epoch ends only)", "run")
    log_every: int = option(10, "optimizer steps between metrics rows", "metrics")
    verdict_every: int = option(
        100, "optimizer steps between bottleneck verdicts in the log", "metrics"
    )
    input_bound_threshold: float = option(
        0.1, "data-wait share of step time above which the run is input-bound", "metrics"
    )
    progress: bool = option(True, "progress bar on rank 0", "metrics")
    tensorboard: bool = option(True, "TensorBoard event files (when installed)", "metrics")
    plot: bool = option(True, "PNG plot of the run: RUN_DIR/metrics.png", "metrics")
    debug_trace: bool = option(
        False, "write sample keys and parameter digests per rank to RUN_DIR/trace", "metrics"
    )

    def __post_init__(self) -> None:
        check_choice(self, "device", DEVICES)
        check_choice(self, "amp", AMP_MODES)
        check_int_at_least(self, "seed", 0)
        check_int_at_least(self, "dist_timeout_s", 1)
        if not isinstance(self.run_dir, str) or not self.run_dir:
            raise refuse(self, "run_dir", f" must be a directory, got {self.run_dir!r}")
        check_int_at_least(self, "eval_every", 0)
        check_int_at_least(self, "log_every", 1)
        check_int_at_least(self, "verdict_every", 1)
        check_fraction(self, "input_bound_threshold")
        for name in ("deterministic", "progress", "tensorboard", "plot", "debug_trace"):
            check_flag(self, name)


@dataclass(frozen=True)
class Checkpointing:
    """When checkpoints are written and kept, and what a resume starts from (`trainers.run`)."""

    resume: str | None = option(
        None,
        "`auto` (latest checkpoint in --run-dir, if any) or a checkpoint path; "
        "default: a fresh run",
        "run",
    )
    allow_data_change: bool = option(
        False, "resume although the data, global batch or seed changed", "run"
    )
    checkpoint_every: int = option(
        500, "optimizer steps between checkpoints (0: epoch ends only)", "run"
    )
    keep_checkpoints: int = option(3, "checkpoints kept in the run directory", "run")

    def __post_init__(self) -> None:
        if self.resume is not None and not (isinstance(self.resume, str) and self.resume):
            raise refuse(self, "resume", f" must be auto or a checkpoint path, got {self.resume!r}")
        check_flag(self, "allow_data_change")
        check_int_at_least(self, "checkpoint_every", 0)
        check_int_at_least(self, "keep_checkpoints", 1)


@dataclass(frozen=True)
class Probes:
    """`train find-batch-size` and `train scan-throughput` (`trainers.probe`)."""

    memory_fraction: float = option(0.7, "find-batch-size: share of device memory to fill", "probe")
    memory_budget_mb: float | None = option(
        None,
        "find-batch-size: device memory to assume, in MiB (2**20 bytes; default: measured)",
        "probe",
    )
    probe_batches: tuple[int, ...] = option(
        (4, 8, 16), "find-batch-size: batch sizes measured for the extrapolation", "probe"
    )
    scan_batch_sizes: tuple[int, ...] = option(
        (8, 16, 32, 64, 128, 256), "scan-throughput: batch sizes to time", "probe"
    )
    scan_steps: int = option(10, "scan-throughput: timed steps per batch size", "probe")
    scan_warmup: int = option(3, "scan-throughput: untimed steps first", "probe")
    scan_source: str = option(
        "synthetic",
        "scan-throughput: random images (model speed) or the train loader (end to end)",
        "probe",
        SCAN_SOURCES,
    )

    def __post_init__(self) -> None:
        check_fraction(self, "memory_fraction", low_open=True)
        if self.memory_budget_mb is not None:
            check_at_least(self, "memory_budget_mb", 1)
        for name in ("probe_batches", "scan_batch_sizes"):
            sizes = getattr(self, name)
            if not sizes or any(
                isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes
            ):
                raise refuse(self, name, f" must be batch sizes of at least 1, got {sizes!r}")
        if len(set(self.probe_batches)) < 2:
            raise refuse(self, "probe_batches", " needs at least two different batch sizes")
        check_int_at_least(self, "scan_steps", 1)
        check_int_at_least(self, "scan_warmup", 0)
        check_choice(self, "scan_source", SCAN_SOURCES)


def check_below_one(group: object, name: str) -> None:
    """A share in [0, 1)."""
    value = getattr(group, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise refuse(group, name, f" must be a number in [0, 1), got {value!r}")


@dataclass(frozen=True)
class TrainConfig:
    """All options of a training run (and of the `find-batch-size`/`scan-throughput` probes),
    in groups that each check themselves; what is checked across groups is checked here.

    Every field of every group is a flag of its own name (`--batch-size`, `--workers`,
    `--aa`, ...) and a key of a config file; `to_dict` nests them by group. `loader`
    holds the loader's own options (`pipeline.config.LoaderOptions`: format, shuffle
    buffer, crop, workers, reading), shared by the train and val loaders; `recipe` the
    training recipe in timm's flags (`--aa`, `--mixup`, `--smoothing`, ...; train only).
    """

    data: Data = settings_group(Data, "train and validation data", prefix="")
    loader: LoaderOptions = settings_group(
        LoaderOptions, "the loader's options, for the train and val loaders", prefix=""
    )
    model: Model = settings_group(Model, "the network", prefix="")
    schedule: Schedule = settings_group(Schedule, "steps and learning rate", prefix="")
    optimizer: Optimization = settings_group(Optimization, "the optimizer", prefix="")
    recipe: Recipe = settings_group(
        Recipe, "augmentation, mixup/cutmix, smoothing and progressive resizing", prefix=""
    )
    run: Runtime = settings_group(Runtime, "device, run directory and logs", prefix="")
    checkpoint: Checkpointing = settings_group(Checkpointing, "checkpoints and resume", prefix="")
    probe: Probes = settings_group(Probes, "find-batch-size and scan-throughput", prefix="")

    def __post_init__(self) -> None:
        for f in fields(self):
            group = GROUP_TYPES[f.name]
            if not isinstance(getattr(self, f.name), group):
                raise refuse(
                    self, f.name, f" must be a {group.__name__}, got {getattr(self, f.name)!r}"
                )
        if self.data.task == "multi-label" and self.recipe.label_smoothing:
            raise UsageError("--smoothing is for single-label training; leave it at 0")
        recipe, batch = self.recipe, self.schedule.batch_size
        if recipe.mixes and recipe.mixup_mode != "batch" and batch % 2:
            raise UsageError(
                f"--mixup-mode {recipe.mixup_mode} mixes pairs of images: --batch-size "
                f"must be even, got {batch}"
            )
        check_placement_settings(self.loader.workers)
        if recipe.aug_repeats > 1 and self.data.is_mix:
            raise UsageError(
                "--aug-repeats repeats the samples of one --train-shards dataset; a mix "
                "shares its epoch by --train-weights: leave --aug-repeats at 1"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready values, one mapping per group (tuples become lists); also what
        checkpoints and `RUN_DIR/config.json` store."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of `to_dict`; unknown keys are an error (they would be silently ignored).

        Also reads what runs wrote before the groups (`batch_size` at the top, beside
        `loader` and `recipe`): each such key goes into its group.
        """
        return build_config(cls, group_flat_keys(data), source="config")


GROUP_TYPES: dict[str, type] = {
    "data": Data,
    "loader": LoaderOptions,
    "model": Model,
    "schedule": Schedule,
    "optimizer": Optimization,
    "recipe": Recipe,
    "run": Runtime,
    "checkpoint": Checkpointing,
    "probe": Probes,
}
# Each field of a group that was a top-level field of `TrainConfig` before the groups,
# and its group (`label_smoothing` sat beside `recipe`; `model` and `optimizer` name a
# group and, in a stored flat config, the field inside it).
FLAT_FIELDS: dict[str, str] = {
    f.name: group
    for group, kind in GROUP_TYPES.items()
    if group != "loader"
    for f in fields(kind)
    if group != "recipe" or f.name == "label_smoothing"
}


def group_flat_keys(data: dict[str, Any]) -> dict[str, Any]:
    """A stored config in the layout of before the groups, moved into them; others as given."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key in FLAT_FIELDS and not isinstance(value, dict):
            group = FLAT_FIELDS[key]
            out[group] = {**out.get(group, {}), key: value}
        elif isinstance(value, dict):  # a group (`recipe` may have met `label_smoothing`)
            out[key] = {**value, **out.get(key, {})}
        else:
            out[key] = value
    return out


def split_sources(text: str) -> tuple[str, ...]:
    """`A::B` -> `("A", "B")` (open_clip's form); a `::` inside `[...]` (an IPv6 host) stays."""
    return tuple(part for part in SOURCE_SEPARATOR.split(text) if part)


SOURCE_SEPARATOR = re.compile(r"::(?![^\[]*\])")


def rename_old_flags(argv: Sequence[str]) -> list[str]:
    """`--label-smoothing 0.1` -> `--smoothing 0.1` (`RENAMED_FLAGS`), also in `--flag=value`."""
    out = []
    for item in argv:
        name, equals, value = item.partition("=")
        if name.startswith("--") and name[2:] in RENAMED_FLAGS:
            item = f"--{RENAMED_FLAGS[name[2:]]}{equals}{value}"
        out.append(item)
    return out


def join_repeated_sources(argv: Sequence[str]) -> list[str]:
    """`--train-shards A --train-shards B` -> `--train-shards A::B`: a repeated flag is a mix."""
    values, rest, at = [], [], 0
    argv = list(argv)
    while at < len(argv):
        item = argv[at]
        if item == "--train-shards" and at + 1 < len(argv):
            values.append(argv[at + 1])
            at += 2
            continue
        if item.startswith("--train-shards="):
            values.append(item.split("=", 1)[1])
        else:
            rest.append(item)
        at += 1
    if len(values) < 2:
        return argv
    return [*rest, "--train-shards", "::".join(values)]


def build_config(cls: type, data: dict[str, Any], source: str) -> Any:
    """`cls` from a `to_dict`-shaped mapping: each group a nested mapping of its fields."""
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in known:
            raise UsageError(f"{source}: unknown option {key!r}; see `train --help`")
        values[key] = coerce_value(hints[key], value, f"{source}: {key}")
    return cls(**values)


def coerce_value(kind: Any, value: Any, where: str) -> Any:
    """`value` (from JSON, TOML or YAML) as the field type `kind` wants it, or ValueError."""
    base, optional = unwrap_optional(kind)
    if value is None and optional:
        return None
    if dataclasses.is_dataclass(base) and isinstance(value, dict):
        return build_config(base, value, where)
    if get_origin(base) is tuple and isinstance(value, (list, tuple, str)):
        args = get_args(base)
        if isinstance(value, str):
            if base != tuple[int, ...]:
                raise UsageError(f"{where} must be a list, got {value!r}")
            return parse_int_list(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce_value(args[0], item, where) for item in value)
        if len(args) == len(value):
            return tuple(coerce_value(a, item, where) for a, item in zip(args, value, strict=True))
    elif base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    elif base is ByteSize:  # `cache-limit = "200GB"` or a count, as the flag takes
        try:
            return ByteSize(value)
        except ByteSizeError as error:
            raise UsageError(f"{where}: {error}") from error
    elif isinstance(base, type) and isinstance(value, base):
        return value
    name = getattr(base, "__name__", str(base))
    raise UsageError(f"{where} must be {name}, got {value!r}")


def coerce_values(data: dict[str, Any], source: str) -> dict[str, Any]:
    """Check keys and types of `option = value` pairs from a file.

    Keys are flag names, as `train --help` lists them (`batch-size` or `batch_size`,
    `workers`, `shuffle-buffer`); the values become the flags' defaults.
    """
    specs = {spec.dest: spec for spec in flag_specs(TrainConfig)}
    out = {}
    for raw_key, value in data.items():
        key = RENAMED_FLAGS.get(raw_key.replace("_", "-"), raw_key).replace("-", "_")
        if key not in specs:
            raise UsageError(f"{source}: unknown option {raw_key!r}; see `train --help`")
        if key == "train_shards" and isinstance(value, list):  # a mix, one dataset a line
            value = "::".join(str(item) for item in value)
        out[key] = coerce_value(specs[key].kind, value, f"{source}: {raw_key}")
    return out


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Option values from a `.toml` (stdlib) or `.yaml`/`.yml` (needs PyYAML) file."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".toml":
        import tomllib

        with open(path, "rb") as f:
            try:
                data = tomllib.load(f)
            except tomllib.TOMLDecodeError as exc:
                raise UsageError(f"{path}: not valid TOML: {exc}") from exc
    elif suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise UsageError(
                f"{path}: YAML config files need PyYAML (`pip install pyyaml`); "
                "or write the same keys as TOML"
            ) from exc
        with open(path, encoding="utf-8") as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise UsageError(f"{path}: not valid YAML: {exc}".replace("\n", " ")) from exc
    else:
        raise UsageError(f"{path}: config files must end in .toml, .yaml or .yml")
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a table of option = value")
    return coerce_values(data, source=str(path))


def build_parser(command: str, defaults: dict[str, Any]) -> argparse.ArgumentParser:
    parser = CommandParser(
        prog=f"train {command}" if command != "train" else "train",
        usage="%(prog)s --train-shards SHARDS [options]"
        if command == "train"
        else "%(prog)s [options]",
        description=COMMAND_HELP[command],
        epilog="Commands: train (default), find-batch-size, scan-throughput. "
        "Under torchrun: `torchrun --nproc-per-node N -m trainers.train ...`.",
    )
    add_version_flag(parser)
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML or TOML file of option defaults; flags win (default: none)",
    )
    add_config_flags(parser, TrainConfig, defaults)
    return parser


COMMAND_HELP = {
    "train": "Train an image classifier on shards built by `preprocess build-shards`.",
    "find-batch-size": "Largest per-device batch that fits in --memory-fraction of memory.",
    "scan-throughput": "Images/s across --scan-batch-sizes, with the knee marked.",
}


def parse_command_line(argv: Sequence[str]) -> tuple[str, TrainConfig]:
    """`(command, config)` from argv: command first (optional), then flags.

    Precedence: dataclass defaults < `--config FILE` < command-line flags.
    """
    argv = join_repeated_sources(rename_old_flags(argv))
    command = argv.pop(0) if argv and argv[0] in COMMANDS else "train"
    pre = CommandParser(prog="train" if command == "train" else f"train {command}", add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    # Keyed by flag: a file's `model = "cnn"` is the flag's, not the `model` group's.
    defaults = flat_defaults(TrainConfig, default_values(TrainConfig))
    if known.config:
        defaults.update(config_file_values(known.config, pre))
    parser = build_parser(command, defaults)
    namespace = parser.parse_args(argv)
    try:
        config = config_from_args(TrainConfig, namespace)
    except UsageError as exc:
        parser.error(str(exc))
    if needs_train_shards(command, config) and not config.data.train_shards:
        # Not argparse's `required=True`: the value may come from --config FILE.
        parser.error(
            "the following arguments are required: --train-shards "
            "(a manifest.json, its directory, or shard files)"
        )
    return command, config


def config_file_values(path: str, parser: CommandParser) -> dict[str, Any]:
    """`read_config_file`, its problems reported as one usage line (exit 2)."""
    try:
        return read_config_file(path)
    except OSError as exc:
        parser.error(
            f"--config {path}: {exc.strerror or exc}; pass an existing .toml or .yaml file"
        )
    except UsageError as exc:
        parser.error(str(exc))


def needs_train_shards(command: str, config: TrainConfig) -> bool:
    """Training reads shards; the probes only when timing the real loader."""
    return command == "train" or (
        command == "scan-throughput" and config.probe.scan_source == "loader"
    )


def diff_configs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """`name: saved -> current` lines for fields that differ."""
    lines = []
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            lines.append(f"  {key}: {saved.get(key)!r} -> {current.get(key)!r}")
    return lines
