"""`Augment`: the per-sample augmentation a loader applies to each training crop.

A frozen settings group like `pipeline.config`'s: it refuses a bad value where it is made,
naming the field, what it allows and what it got. Imports neither numpy nor OpenCV;
`pipeline.augment.build_augmenter` turns it into the picklable `Augmenter` the workers run.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeline.augment.grammar import GRAMMAR, PolicyError, parse_policy
from shards.flags import check_choice, check_fraction, check_int_at_least, refuse

RE_MODES = ("const", "rand", "pixel")  # random erasing's fills (pipeline.augment.erasing)
# The policy's geometric filters: either of the two (drawn per op), or one
INTERPOLATIONS = ("bilinear", "bicubic", "random")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Augment:
    """What each training crop gets after RandomResizedCrop and flip, in this order.

    `Augment(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)` is DeiT's worker recipe.
    Eval never augments. See docs/LOADER.md, "Augmentation recipes".

    Attributes:
        auto_augment: a policy in timm's grammar: `rand-m9-mstd0.5-inc1` (RandAugment),
            `original`, `originalr`, `v0`, `v0r` (AutoAugment), `augmix-m5-w3-d2`,
            `trivialaugment` (torchvision's TrivialAugmentWide) or `3a` (DeiT III).
        color_jitter: brightness, contrast, saturation (and hue) strengths as timm's
            `--color-jitter`: one float for the first three, or a 3- or 4-tuple.
        grayscale: probability of greyscale (torchvision's RandomGrayscale).
        gaussian_blur: probability of a Gaussian blur (kernel 23, sigma in [0.1, 2]).
        re_prob: probability of random erasing (timm's `--reprob`), applied last.
        re_mode: erasing fill: `const` (the mean colour), `rand` (a random colour per
            box) or `pixel` (per-pixel noise), as timm's after normalisation.
        re_count: boxes per erasure, drawn in 1..re_count (timm's `--recount`).
        re_area: range of a box's area as a share of the image.
        re_ratio: range of a box's aspect ratio.
        mean, std: the dataset's per-channel mean and standard deviation (0-1 scale):
            the fill of geometric ops and erasing.
        interpolation: the filter of the policy's rotations, shears and translations:
            `bilinear`, `bicubic`, or `random` (either, drawn per op: timm's train.py
            default, `--train-interpolation random`). None: the crop's (`Crop.resample`)
            when it is bilinear or bicubic, as timm's `create_transform(interpolation=...)`
            sets it (its loaders' default: bilinear crops, bilinear ops); else random.
        ops: your own ops, `op(pixels, rng)` on the uint8 HxWx3 crop in place, after
            the policy and colour steps, before erasing; picklable (module-level
            functions or classes, `functools.partial`), drawing only from `rng`.
    """

    auto_augment: str | None = None
    color_jitter: float | tuple[float, ...] | None = None
    grayscale: float = 0.0
    gaussian_blur: float = 0.0
    re_prob: float = 0.0
    re_mode: str = "const"
    re_count: int = 1
    re_area: tuple[float, float] = (0.02, 1 / 3)
    re_ratio: tuple[float, float] = (0.3, 1 / 0.3)
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: str | None = None
    ops: tuple[Callable, ...] = ()

    def __post_init__(self) -> None:
        if self.auto_augment is not None:
            try:
                parse_policy(self.auto_augment)
            except PolicyError as error:
                raise refuse(
                    self, "auto_augment", f" {self.auto_augment!r}: {error}; grammar: {GRAMMAR}"
                ) from None
        self._check_color_jitter()
        for name in ("grayscale", "gaussian_blur", "re_prob"):
            check_fraction(self, name)
        check_choice(self, "re_mode", RE_MODES)
        check_choice(self, "interpolation", INTERPOLATIONS, optional=True)
        check_int_at_least(self, "re_count", 1)
        _check_range(self, "re_area", top=1.0)
        _check_range(self, "re_ratio")
        _check_channels(self, "mean", lambda v: 0 <= v <= 1, "in [0, 1]")
        _check_channels(self, "std", lambda v: v > 0, "above 0")
        self._check_ops()

    @property
    def enabled(self) -> bool:
        """Whether anything is asked; False: the loader skips augmentation entirely."""
        jitter = self.color_jitter is not None and any(self.jitter_strengths)
        chances = (self.grayscale, self.gaussian_blur, self.re_prob)
        return self.auto_augment is not None or jitter or any(chances) or bool(self.ops)

    def policy_resample(self, crop_resample: str | None) -> tuple[str, ...]:
        """The filters the policy's geometric ops draw from (timm's `hparams`), given the
        crop's filter (None: unknown, a transform of the user's own)."""
        chosen = self.interpolation
        if chosen is None and crop_resample in ("bilinear", "bicubic"):
            chosen = crop_resample
        return ("bilinear", "bicubic") if chosen in (None, "random") else (chosen,)

    @property
    def jitter_strengths(self) -> tuple[float, ...]:
        """`color_jitter` as timm's 3- or 4-tuple (a float is three equal strengths)."""
        jitter = self.color_jitter
        if jitter is None:
            return ()
        return (float(jitter),) * 3 if _is_number(jitter) else tuple(jitter)

    def _check_color_jitter(self) -> None:
        jitter = self.color_jitter
        if jitter is None:
            return
        if isinstance(jitter, list):
            jitter = tuple(jitter)
            object.__setattr__(self, "color_jitter", jitter)
        strengths = self.jitter_strengths if _is_number(jitter) or isinstance(jitter, tuple) else ()
        if len(strengths) not in (3, 4) or not all(
            _is_number(v) and 0 <= v < math.inf for v in strengths
        ):
            raise refuse(
                self,
                "color_jitter",
                " must be a number of at least 0 or 3 or 4 of them (brightness, contrast, "
                f"saturation, hue), got {jitter!r}",
            )
        if len(strengths) == 4 and strengths[3] > 0.5:
            raise refuse(self, "color_jitter", f"'s hue must be at most 0.5, got {strengths[3]!r}")

    def _check_ops(self) -> None:
        ops = self.ops
        if isinstance(ops, list):
            ops = tuple(ops)
            object.__setattr__(self, "ops", ops)
        if not isinstance(ops, tuple) or not all(callable(op) for op in ops):
            raise refuse(
                self, "ops", f" must be a sequence of callables op(pixels, rng), got {ops!r}"
            )
        for op in ops:
            try:
                pickle.dumps(op)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                raise refuse(
                    self,
                    "ops",
                    f": {op!r} cannot be pickled ({error}); workers may be spawned, so use a "
                    "module-level function or class, or functools.partial of one",
                ) from None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(group: object, name: str, top: float | None = None) -> None:
    """`(low, high)` numbers with 0 < low <= high (<= top); a list becomes a tuple."""
    value = getattr(group, name)
    pair = tuple(value) if isinstance(value, (tuple, list)) else ()
    fine = len(pair) == 2 and all(_is_number(v) and math.isfinite(v) for v in pair)
    if not fine or not 0 < pair[0] <= pair[1] or (top is not None and pair[1] > top):
        bound = f" <= {top}" if top is not None else ""
        raise refuse(
            group, name, f" must be (low, high) with 0 < low <= high{bound}, got {value!r}"
        )
    object.__setattr__(group, name, pair)


def _check_channels(group: object, name: str, allowed: Callable, words: str) -> None:
    """Three per-channel numbers (R, G, B), each `allowed`; a list becomes a tuple."""
    value = getattr(group, name)
    values = tuple(value) if isinstance(value, (tuple, list)) else ()
    if len(values) != 3 or not all(_is_number(v) and allowed(v) for v in values):
        raise refuse(group, name, f" must be three numbers {words} (R, G, B), got {value!r}")
    object.__setattr__(group, name, values)
