"""timm's named ops: how a magnitude (0-10) becomes an op's argument, and the op it runs.

The tables mirror timm's `LEVEL_TO_ARG` and `NAME_TO_OP` (timm/data/auto_augment.py), so
`AugmentOp("PosterizeIncreasing", magnitude=9)` means what it means in timm; the pixel
work is `pipeline.augment.ops`'. Every draw (sign, interpolation, noise on the
magnitude) comes from the `random.Random` passed in.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.augment import ops, warp

LEVEL_DENOM = 10.0  # timm's _LEVEL_DENOM: magnitude 10 is an op's full strength


@dataclass(frozen=True)
class Hparams:
    """The settings timm's ops share (timm's `hparams`).

    Attributes:
        translate_const: TranslateX/Y's shift at magnitude 10, in pixels (timm:
            int(image_size * 0.45)).
        translate_pct: TranslateXRel/YRel's shift at magnitude 10, as a share of the side
            (0.45; AugMix 0.3).
        fill: the colour geometric ops fill with (timm: the dataset mean, 0-255).
        resample: geometric ops pick one of these at random (timm: bilinear, bicubic).
        magnitude_std: noise on the magnitude per op (inf: uniform in [0, magnitude]).
        magnitude_max: the magnitude's upper clip; None: 10.
    """

    translate_const: int = 100
    translate_pct: float = 0.45
    fill: tuple[int, int, int] = (128, 128, 128)
    resample: tuple[str, ...] = ("bilinear", "bicubic")
    magnitude_std: float = 0.0
    magnitude_max: float | None = None


def _negate(value: float, rng: random.Random) -> float:
    """timm's _randomly_negate: the sign flips half the time."""
    return -value if rng.random() > 0.5 else value


def _rotate_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _negate(level / LEVEL_DENOM * 30.0, rng)


def _enhance_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return level / LEVEL_DENOM * 1.8 + 0.1


def _enhance_increasing_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return max(0.1, 1.0 + _negate(level / LEVEL_DENOM * 0.9, rng))


def _shear_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _negate(level / LEVEL_DENOM * 0.3, rng)


def _translate_abs_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _negate(level / LEVEL_DENOM * float(hp.translate_const), rng)


def _translate_rel_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _negate(level / LEVEL_DENOM * hp.translate_pct, rng)


def _posterize_level(level: float, hp: Hparams, rng: random.Random) -> int:
    return int(level / LEVEL_DENOM * 4)


def _posterize_increasing_level(level: float, hp: Hparams, rng: random.Random) -> int:
    return 4 - _posterize_level(level, hp, rng)


def _posterize_original_level(level: float, hp: Hparams, rng: random.Random) -> int:
    return int(level / LEVEL_DENOM * 4) + 4


def _solarize_level(level: float, hp: Hparams, rng: random.Random) -> int:
    return min(256, int(level / LEVEL_DENOM * 256))


def _solarize_increasing_level(level: float, hp: Hparams, rng: random.Random) -> int:
    return 256 - _solarize_level(level, hp, rng)


def _solarize_add_level(level: float, hp: Hparams, rng: random.Random) -> int:
    return min(128, int(level / LEVEL_DENOM * 110))


def _minmax_level(level: float, low: float, high: float) -> float:
    """timm's _minmax_level_to_arg: [0, 10] onto [low, high], clamped."""
    return max(low, min(high, low + (high - low) * level / LEVEL_DENOM))


def _desaturate_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _minmax_level(level, 0.5, 1.0)


def _blur_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _minmax_level(level, 0.1, 2.0)


def _unit_level(level: float, hp: Hparams, rng: random.Random) -> float:
    return _minmax_level(level, 0.0, 1.0)


def _resample(hp: Hparams, rng: random.Random) -> str:
    return hp.resample[0] if len(hp.resample) == 1 else rng.choice(hp.resample)


def _shear_x(pixels: np.ndarray, factor: float, hp: Hparams, rng: random.Random) -> None:
    warp.affine(pixels, (1, factor, 0, 0, 1, 0), _resample(hp, rng), hp.fill)


def _shear_y(pixels: np.ndarray, factor: float, hp: Hparams, rng: random.Random) -> None:
    warp.affine(pixels, (1, 0, 0, factor, 1, 0), _resample(hp, rng), hp.fill)


def _translate_x(pixels: np.ndarray, shift: float, hp: Hparams, rng: random.Random) -> None:
    warp.affine(pixels, (1, 0, shift, 0, 1, 0), _resample(hp, rng), hp.fill)


def _translate_y(pixels: np.ndarray, shift: float, hp: Hparams, rng: random.Random) -> None:
    warp.affine(pixels, (1, 0, 0, 0, 1, shift), _resample(hp, rng), hp.fill)


def _translate_x_rel(pixels: np.ndarray, pct: float, hp: Hparams, rng: random.Random) -> None:
    _translate_x(pixels, pct * pixels.shape[1], hp, rng)


def _translate_y_rel(pixels: np.ndarray, pct: float, hp: Hparams, rng: random.Random) -> None:
    _translate_y(pixels, pct * pixels.shape[0], hp, rng)


def _rotate(pixels: np.ndarray, degrees: float, hp: Hparams, rng: random.Random) -> None:
    warp.rotate(pixels, degrees, _resample(hp, rng), hp.fill)


def _desaturate(pixels: np.ndarray, factor: float, hp: Hparams, rng: random.Random) -> None:
    ops.color(pixels, min(1.0, max(0.0, 1.0 - factor)))  # timm: 0 is grey, 1 unchanged


def _blur(pixels: np.ndarray, radius: float, hp: Hparams, rng: random.Random) -> None:
    ops.gaussian_blur(pixels, radius)


def _blur_random(pixels: np.ndarray, factor: float, hp: Hparams, rng: random.Random) -> None:
    ops.gaussian_blur(pixels, rng.uniform(0.1, 2.0 * factor))


Level = Callable[[float, Hparams, random.Random], float] | None


@dataclass(frozen=True)
class _ArgumentOp:
    """Adapts `ops.f(pixels, argument)` to the table's (pixels, argument, hp, rng)."""

    function: Callable[..., None]

    def __call__(self, pixels: np.ndarray, argument: float, hp: Hparams, rng: random.Random):
        self.function(pixels, argument)


@dataclass(frozen=True)
class _BareOp:
    """Adapts `ops.f(pixels)` (no argument) to the table's signature."""

    function: Callable[[np.ndarray], None]

    def __call__(self, pixels: np.ndarray, argument: None, hp: Hparams, rng: random.Random):
        self.function(pixels)


_ENHANCE = {
    "Color": ops.color,
    "Contrast": ops.contrast,
    "Brightness": ops.brightness,
    "Sharpness": ops.sharpness,
}

# name -> (level function or None, op(pixels, argument, hparams, rng)): timm's tables
OPS: dict[str, tuple[Level, Callable]] = {
    "AutoContrast": (None, _BareOp(ops.autocontrast)),
    "Equalize": (None, _BareOp(ops.equalize)),
    "Invert": (None, _BareOp(ops.invert)),
    "Rotate": (_rotate_level, _rotate),
    "Posterize": (_posterize_level, _ArgumentOp(ops.posterize)),
    "PosterizeIncreasing": (_posterize_increasing_level, _ArgumentOp(ops.posterize)),
    "PosterizeOriginal": (_posterize_original_level, _ArgumentOp(ops.posterize)),
    "Solarize": (_solarize_level, _ArgumentOp(ops.solarize)),
    "SolarizeIncreasing": (_solarize_increasing_level, _ArgumentOp(ops.solarize)),
    "SolarizeAdd": (_solarize_add_level, _ArgumentOp(ops.solarize_add)),
    **{name: (_enhance_level, _ArgumentOp(op)) for name, op in _ENHANCE.items()},
    **{
        f"{name}Increasing": (_enhance_increasing_level, _ArgumentOp(op))
        for name, op in _ENHANCE.items()
    },
    "ShearX": (_shear_level, _shear_x),
    "ShearY": (_shear_level, _shear_y),
    "TranslateX": (_translate_abs_level, _translate_x),
    "TranslateY": (_translate_abs_level, _translate_y),
    "TranslateXRel": (_translate_rel_level, _translate_x_rel),
    "TranslateYRel": (_translate_rel_level, _translate_y_rel),
    "Desaturate": (_desaturate_level, _desaturate),
    "GaussianBlur": (_blur_level, _blur),
    "GaussianBlurRand": (_unit_level, _blur_random),
}


def op_argument(name: str, magnitude: float, hp: Hparams, rng: random.Random) -> object:
    """The argument timm's level function gives op `name` at `magnitude` (None: it takes none)."""
    level = OPS[name][0]
    return None if level is None else level(magnitude, hp, rng)


@dataclass(frozen=True)
class AugmentOp:
    """One of timm's named ops at a magnitude, applied with probability `prob`.

    As timm's `AugmentOp`: the magnitude gets noise (`hparams.magnitude_std`: Gaussian,
    or uniform in [0, magnitude] when inf), is clipped to [0, magnitude_max or 10], and
    the level function turns it into the op's argument.
    """

    name: str
    prob: float = 0.5
    magnitude: float = 10.0
    hparams: Hparams = Hparams()

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        if self.prob < 1.0 and rng.random() > self.prob:
            return
        self.apply(pixels, self.draw_magnitude(rng), rng)

    def draw_magnitude(self, rng: random.Random) -> float:
        """The magnitude for one application: noise added, then clipped."""
        magnitude, std = self.magnitude, self.hparams.magnitude_std
        if std == math.inf:
            magnitude = rng.uniform(0, magnitude)
        elif std > 0:
            magnitude = rng.gauss(magnitude, std)
        upper = self.hparams.magnitude_max or LEVEL_DENOM
        return max(0.0, min(magnitude, upper))

    def apply(self, pixels: np.ndarray, magnitude: float, rng: random.Random) -> None:
        """Run the op at exactly `magnitude` (its level function still draws the sign)."""
        argument = op_argument(self.name, magnitude, self.hparams, rng)
        OPS[self.name][1](pixels, argument, self.hparams, rng)
