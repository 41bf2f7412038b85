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

from pipeline.affine import Matrix, centre_matrix, compose
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


def _desaturate(pixels: np.ndarray, factor: float) -> None:
    ops.color(pixels, min(1.0, max(0.0, 1.0 - factor)))  # timm: 0 is grey, 1 unchanged


Level = Callable[[float, Hparams, random.Random], float] | None
# An op with every draw made: it changes the pixels it is given, in place, drawing nothing.
DrawnOp = Callable[[np.ndarray], None]


@dataclass(frozen=True)
class AffineOp:
    """A geometric op with its draws made: Pillow's affine `transform` on a crop of any size.

    Kept as a matrix (not a closure) so the fast crop can fold it into its own resize
    (`pipeline.fast_transforms`): one resampling of the decoded image instead of two.

    Attributes:
        kind: ShearX/Y (argument: the factor), TranslateX/Y (pixels), TranslateXRel/YRel
            (a share of the side), Rotate (degrees, counter-clockwise about the centre).
        resample: "bilinear" or "bicubic", as drawn.
        fill: the colour where the input point falls outside the image.
    """

    kind: str
    argument: float
    resample: str
    fill: tuple[int, int, int]

    def matrix(self, width: int, height: int) -> tuple[float, ...] | None:
        """Pillow's matrix (output pixel centre to input point) on a width x height image;
        None when the op leaves every pixel where it is."""
        kind, value = self.kind, float(self.argument)
        if kind == "Rotate":  # as `img.rotate`: the angle taken modulo 360 first
            degrees = value % 360.0
            return None if degrees == 0 else tuple(warp.rotate_matrix(degrees, width, height))
        if value == 0:
            return None
        if kind == "ShearX":
            return (1.0, value, 0.0, 0.0, 1.0, 0.0)
        if kind == "ShearY":
            return (1.0, 0.0, 0.0, value, 1.0, 0.0)
        along_x = kind.startswith("TranslateX")
        if kind.endswith("Rel"):  # a share of the side
            value *= width if along_x else height
        return (1.0, 0.0, value, 0.0, 1.0, 0.0) if along_x else (1.0, 0.0, 0.0, 0.0, 1.0, value)

    def __call__(self, pixels: np.ndarray) -> None:
        matrix = self.matrix(pixels.shape[1], pixels.shape[0])
        if matrix is not None:
            warp.affine(pixels, matrix, self.resample, self.fill)

    def centre_matrix(self, width: int, height: int) -> Matrix | None:
        """The matrix in pixel-centre coordinates (OpenCV's); None: the identity."""
        matrix = self.matrix(width, height)
        return None if matrix is None else centre_matrix(matrix)


@dataclass(frozen=True)
class AffineRun:
    """A policy's leading geometric ops, in order, as the fast crop folds them.

    For output pixel p the crop reads the image at C . M1 . M2 ... p (C: the crop's own
    matrix; Mi: op i's, pixel centres), so where the first op would fill, the point is
    outside the crop's region, whose border is the fill; where a later op would fill (its
    point leaves the frame), `paint_fills` paints it after, exactly as Pillow would.
    """

    ops: tuple[AffineOp, ...]

    @property
    def fill(self) -> tuple[int, int, int]:
        return self.ops[0].fill

    def centre_matrix(self, width: int, height: int) -> Matrix | None:
        """The composite in pixel-centre coordinates; None: every op the identity."""
        matrices = [op.centre_matrix(width, height) for op in self.ops]
        return compose([m for m in matrices if m is not None])

    def paint_fills(self, pixels: np.ndarray) -> None:
        """Paint each later op's fill where its point (through the ops after it) leaves the
        frame: Pillow's pixels exactly (the first op's is the crop's border)."""
        height, width = pixels.shape[:2]
        suffix: list[tuple[float, ...]] = []
        for op in reversed(self.ops[1:]):
            matrix = op.matrix(width, height)
            if matrix is not None:
                suffix.insert(0, matrix)
                warp.fill_outside(pixels, compose(suffix), op.fill)

    def __call__(self, pixels: np.ndarray) -> None:
        for op in self.ops:
            op(pixels)


@dataclass(frozen=True)
class _Affine:
    """Makes `AffineOp`s of one kind: draws the filter (timm draws it in the op)."""

    kind: str

    def __call__(self, argument: float, hp: Hparams, rng: random.Random) -> AffineOp:
        return AffineOp(self.kind, argument, _resample(hp, rng), hp.fill)


@dataclass(frozen=True)
class PixelOp:
    """A photometric op with its argument: `function(pixels, argument)` (or without one)."""

    function: Callable[..., None]
    argument: object = None

    def __call__(self, pixels: np.ndarray) -> None:
        if self.argument is None:
            self.function(pixels)
        else:
            self.function(pixels, self.argument)


@dataclass(frozen=True)
class _Pixel:
    """Makes `PixelOp`s of one function (they draw nothing beyond the level's draws)."""

    function: Callable[..., None]

    def __call__(self, argument: object, hp: Hparams, rng: random.Random) -> PixelOp:
        return PixelOp(self.function, argument)


def _blur_random(factor: float, hp: Hparams, rng: random.Random) -> PixelOp:
    """timm's GaussianBlurRand: the op draws a radius in [0.1, 2 x factor]."""
    return PixelOp(ops.gaussian_blur, rng.uniform(0.1, 2.0 * factor))


_ENHANCE = {
    "Color": ops.color,
    "Contrast": ops.contrast,
    "Brightness": ops.brightness,
    "Sharpness": ops.sharpness,
}

# name -> (level function or None, maker(argument, hparams, rng) -> DrawnOp): timm's tables
OPS: dict[str, tuple[Level, Callable]] = {
    "AutoContrast": (None, _Pixel(ops.autocontrast)),
    "Equalize": (None, _Pixel(ops.equalize)),
    "Invert": (None, _Pixel(ops.invert)),
    "Rotate": (_rotate_level, _Affine("Rotate")),
    "Posterize": (_posterize_level, _Pixel(ops.posterize)),
    "PosterizeIncreasing": (_posterize_increasing_level, _Pixel(ops.posterize)),
    "PosterizeOriginal": (_posterize_original_level, _Pixel(ops.posterize)),
    "Solarize": (_solarize_level, _Pixel(ops.solarize)),
    "SolarizeIncreasing": (_solarize_increasing_level, _Pixel(ops.solarize)),
    "SolarizeAdd": (_solarize_add_level, _Pixel(ops.solarize_add)),
    **{name: (_enhance_level, _Pixel(op)) for name, op in _ENHANCE.items()},
    **{
        f"{name}Increasing": (_enhance_increasing_level, _Pixel(op))
        for name, op in _ENHANCE.items()
    },
    **{
        name: (level, _Affine(name))
        for name, level in (
            ("ShearX", _shear_level),
            ("ShearY", _shear_level),
            ("TranslateX", _translate_abs_level),
            ("TranslateY", _translate_abs_level),
            ("TranslateXRel", _translate_rel_level),
            ("TranslateYRel", _translate_rel_level),
        )
    },
    "Desaturate": (_desaturate_level, _Pixel(_desaturate)),
    "GaussianBlur": (_blur_level, _Pixel(ops.gaussian_blur)),
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
    the level function turns it into the op's argument. `draw` makes every draw, in
    timm's order, before any pixel work, so a policy can hand its first op to the crop.
    """

    name: str
    prob: float = 0.5
    magnitude: float = 10.0
    hparams: Hparams = Hparams()

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        drawn = self.draw(rng)
        if drawn is not None:
            drawn(pixels)

    def draw(self, rng: random.Random) -> DrawnOp | None:
        """This op for one image, every draw made; None when it is not applied."""
        if self.prob < 1.0 and rng.random() > self.prob:
            return None
        return self.at(self.draw_magnitude(rng), rng)

    def draw_magnitude(self, rng: random.Random) -> float:
        """The magnitude for one application: noise added, then clipped."""
        magnitude, std = self.magnitude, self.hparams.magnitude_std
        if std == math.inf:
            magnitude = rng.uniform(0, magnitude)
        elif std > 0:
            magnitude = rng.gauss(magnitude, std)
        upper = self.hparams.magnitude_max or LEVEL_DENOM
        return max(0.0, min(magnitude, upper))

    def at(self, magnitude: float, rng: random.Random) -> DrawnOp:
        """The op at exactly `magnitude` (its level function still draws the sign)."""
        argument = op_argument(self.name, magnitude, self.hparams, rng)
        return OPS[self.name][1](argument, self.hparams, rng)
