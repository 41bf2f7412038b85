"""The augmentation policies timm's strings name: RandAugment, AutoAugment, AugMix, TrivialAugment.

`build_policy` turns a parsed `auto_augment` string (`pipeline.augment.grammar`) into a
picklable callable `policy(pixels, rng)` that augments one uint8 HxWx3 crop in place,
every draw from `rng`. Op lists, sub-policies and weights are timm's
(timm/data/auto_augment.py); TrivialAugment's are torchvision's `TrivialAugmentWide`.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from pipeline.augment import ops
from pipeline.augment.grammar import PolicySpec
from pipeline.augment.levels import AffineOp, AugmentOp, DrawnOp, Hparams, PixelOp

RAND_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "SolarizeAdd",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
# `inc1`: the variants whose severity rises with the magnitude
INCREASING = {
    name: f"{name}Increasing"
    for name in ("Posterize", "Solarize", "Color", "Contrast", "Brightness", "Sharpness")
}
RAND_INCREASING_OPS = tuple(INCREASING.get(name, name) for name in RAND_OPS)
# timm's old `-w0` weights, applied by position to the op list (plain or increasing)
_W0 = {"Rotate": 0.3, "ShearX": 0.2, "ShearY": 0.2, "TranslateXRel": 0.1, "TranslateYRel": 0.1}
_W0 |= {"Color": 0.025, "Sharpness": 0.025, "AutoContrast": 0.025, "Posterize": 0, "Invert": 0}
_W0 |= dict.fromkeys(("Solarize", "SolarizeAdd", "Contrast", "Brightness", "Equalize"), 0.005)
RAND_WEIGHTS_W0 = tuple(_W0[name] for name in RAND_OPS)
# timm's `-t` sets: a list is drawn uniformly, a table by weight without replacement
RAND_CHOICES: dict[str, tuple[str, ...] | dict[str, float]] = {
    "weights": {
        "Rotate": 3,
        "ShearX": 2,
        "ShearY": 2,
        "TranslateXRel": 1,
        "TranslateYRel": 1,
        "ColorIncreasing": 0.25,
        "SharpnessIncreasing": 0.25,
        "AutoContrast": 0.25,
        "SolarizeIncreasing": 0.05,
        "SolarizeAdd": 0.05,
        "ContrastIncreasing": 0.05,
        "BrightnessIncreasing": 0.05,
        "Equalize": 0.05,
        "PosterizeIncreasing": 0.05,
        "Invert": 0.05,
    },
    "3a": ("SolarizeIncreasing", "Desaturate", "GaussianBlur"),
    "3aw": {
        "SolarizeIncreasing": 6,
        "Desaturate": 6,
        "GaussianBlur": 6,
        "Rotate": 3,
        "ShearX": 2,
        "ShearY": 2,
        "PosterizeIncreasing": 1,
        "AutoContrast": 1,
        "ColorIncreasing": 1,
        "SharpnessIncreasing": 1,
        "ContrastIncreasing": 1,
        "BrightnessIncreasing": 1,
        "Equalize": 1,
        "Invert": 1,
    },
}
AUGMIX_OPS = (
    "AutoContrast",
    "ColorIncreasing",
    "ContrastIncreasing",
    "BrightnessIncreasing",
    "SharpnessIncreasing",
    "Equalize",
    "Rotate",
    "PosterizeIncreasing",
    "SolarizeIncreasing",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)
V0 = (
    (("Equalize", 0.8, 1), ("ShearY", 0.8, 4)),
    (("Color", 0.4, 9), ("Equalize", 0.6, 3)),
    (("Color", 0.4, 1), ("Rotate", 0.6, 8)),
    (("Solarize", 0.8, 3), ("Equalize", 0.4, 7)),
    (("Solarize", 0.4, 2), ("Solarize", 0.6, 2)),
    (("Color", 0.2, 0), ("Equalize", 0.8, 8)),
    (("Equalize", 0.4, 8), ("SolarizeAdd", 0.8, 3)),
    (("ShearX", 0.2, 9), ("Rotate", 0.6, 8)),
    (("Color", 0.6, 1), ("Equalize", 1.0, 2)),
    (("Invert", 0.4, 9), ("Rotate", 0.6, 0)),
    (("Equalize", 1.0, 9), ("ShearY", 0.6, 3)),
    (("Color", 0.4, 7), ("Equalize", 0.6, 0)),
    (("Posterize", 0.4, 6), ("AutoContrast", 0.4, 7)),
    (("Solarize", 0.6, 8), ("Color", 0.6, 9)),
    (("Solarize", 0.2, 4), ("Rotate", 0.8, 9)),
    (("Rotate", 1.0, 7), ("TranslateYRel", 0.8, 9)),
    (("ShearX", 0.0, 0), ("Solarize", 0.8, 4)),
    (("ShearY", 0.8, 0), ("Color", 0.6, 4)),
    (("Color", 1.0, 0), ("Rotate", 0.6, 2)),
    (("Equalize", 0.8, 4), ("Equalize", 0.0, 8)),
    (("Equalize", 1.0, 4), ("AutoContrast", 0.6, 2)),
    (("ShearY", 0.4, 7), ("SolarizeAdd", 0.6, 7)),
    (("Posterize", 0.8, 2), ("Solarize", 0.6, 10)),
    (("Solarize", 0.6, 8), ("Equalize", 0.6, 1)),
    (("Color", 0.8, 6), ("Rotate", 0.4, 5)),
)
ORIGINAL = (
    (("PosterizeOriginal", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 5)),
    (("Equalize", 0.8, 8), ("Equalize", 0.6, 3)),
    (("PosterizeOriginal", 0.6, 7), ("PosterizeOriginal", 0.6, 6)),
    (("Equalize", 0.4, 7), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, 4), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, 7)),
    (("PosterizeOriginal", 0.8, 5), ("Equalize", 1.0, 2)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, 8), ("PosterizeOriginal", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, 2)),
    (("Equalize", 0.0, 7), ("Equalize", 0.8, 8)),
    (("Invert", 0.6, 4), ("Equalize", 1.0, 8)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, 8)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, 9)),
    (("Color", 0.4, 0), ("Equalize", 0.6, 3)),
    (("Equalize", 0.4, 7), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 5)),
    (("Invert", 0.6, 4), ("Equalize", 1.0, 8)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, 8), ("Equalize", 0.6, 3)),
)


def _renamed(policy: tuple, old: str, new: str) -> tuple:
    """`policy` with op `old` replaced by `new` everywhere."""
    return tuple(
        tuple((new if name == old else name, prob, level) for name, prob, level in sub)
        for sub in policy
    )


# `originalr` and `v0r`: timm's same sub-policies with the increasing posterize
AUTO_POLICIES = {
    "v0": V0,
    "v0r": _renamed(V0, "Posterize", "PosterizeIncreasing"),
    "original": ORIGINAL,
    "originalr": _renamed(ORIGINAL, "PosterizeOriginal", "PosterizeIncreasing"),
    "3a": ((("Solarize", 1.0, 5),), (("Desaturate", 1.0, 10),), (("GaussianBlurRand", 1.0, 10),)),
}


@dataclass(frozen=True)
class RandAugment:
    """timm's RandAugment: `num_layers` ops per image, each applied with its probability.

    Without weights the ops are drawn uniformly with replacement; with weights, without
    replacement (numpy's `choice(replace=False, p=...)`, as timm).
    """

    ops: tuple[AugmentOp, ...]
    num_layers: int = 2
    weights: tuple[float, ...] | None = None

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        apply_drawn(pixels, self.draw(rng))

    def draw(self, rng: random.Random) -> tuple[DrawnOp, ...]:
        """The ops one image gets, in order, every draw made (those not applied left out)."""
        return drawn_ops(self.choose(rng), rng)

    def choose(self, rng: random.Random) -> list[AugmentOp]:
        """The ops one image gets, in order."""
        if self.weights is None:
            return [rng.choice(self.ops) for _ in range(self.num_layers)]
        return [self.ops[i] for i in choose_weighted(self.weights, self.num_layers, rng)]


def drawn_ops(chosen: Sequence[AugmentOp], rng: random.Random) -> tuple[DrawnOp, ...]:
    """`chosen` drawn in order (timm's draws: probability, magnitude, sign, filter)."""
    drawn = []
    for op in chosen:
        one = op.draw(rng)
        if one is not None:
            drawn.append(one)
    return tuple(drawn)


def apply_drawn(pixels: np.ndarray, drawn: Sequence[DrawnOp]) -> None:
    """Run drawn ops in order on `pixels`, in place."""
    for op in drawn:
        op(pixels)


def choose_weighted(weights: Sequence[float], count: int, rng: random.Random) -> list[int]:
    """`count` distinct indices drawn one by one in proportion to `weights` (zero: never)."""
    left = [i for i, weight in enumerate(weights) if weight > 0]
    chosen = []
    for _ in range(min(count, len(left))):
        total = sum(weights[i] for i in left)
        point, index = rng.random() * total, left[-1]
        for i in left:
            point -= weights[i]
            if point < 0:
                index = i
                break
        chosen.append(index)
        left.remove(index)
    return chosen


@dataclass(frozen=True)
class AutoAugment:
    """AutoAugment: one sub-policy drawn uniformly, its ops applied in order."""

    policy: tuple[tuple[AugmentOp, ...], ...]

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        apply_drawn(pixels, self.draw(rng))

    def draw(self, rng: random.Random) -> tuple[DrawnOp, ...]:
        """The sub-policy's ops one image gets, in order, every draw made."""
        return drawn_ops(rng.choice(self.policy), rng)


@dataclass(frozen=True)
class AugMix:
    """timm's AugMixAugment: `width` chains of ops from the original, mixed.

    Dirichlet weights mix the chains and a Beta draw blends the mix with the original
    (float32 and truncation as timm's numpy and `Image.blend`); `blended` instead blends
    each chain in turn with weights that give the same mix (timm's faster mode).
    """

    ops: tuple[AugmentOp, ...]
    alpha: float = 1.0
    width: int = 3
    depth: int = 0  # 0: 1-3 ops a chain, drawn per chain
    blended: bool = False

    def draw(self, rng: random.Random) -> tuple[DrawnOp, ...]:
        """The mix as one op that draws as it goes: its chains interleave draws with pixel
        work on copies, so nothing of it can move to the crop (nothing draws in between)."""
        return (functools.partial(self, rng=rng),)

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        draws = [rng.gammavariate(self.alpha, 1.0) for _ in range(self.width)]
        total = sum(draws) or 1.0
        weights = np.array(draws, dtype=np.float64) / total
        weights = weights.astype(np.float32)
        mix = np.float32(rng.betavariate(self.alpha, self.alpha))
        if self.blended:
            self.mix_blended(pixels, weights, mix, rng)
        else:
            self.mix_basic(pixels, weights, mix, rng)

    def chain(self, original: np.ndarray, rng: random.Random) -> np.ndarray:
        """One chain: 1-3 (or `depth`) ops drawn with replacement, on a copy."""
        pixels = original.copy()
        for _ in range(self.depth or rng.randint(1, 3)):
            rng.choice(self.ops)(pixels, rng)
        return pixels

    def mix_basic(self, pixels: np.ndarray, weights: np.ndarray, mix: float, rng) -> None:
        """timm's numpy sum of weight * chain in float32 (each step one correctly rounded
        float32 operation, without the copies), clipped, truncated, blended."""
        mixed = np.zeros(pixels.shape, dtype=np.float32)
        term = np.empty_like(mixed)
        for weight in weights:
            np.multiply(self.chain(pixels, rng), weight, out=term)  # uint8 * float32
            cv2.add(mixed, term, dst=mixed)
        cv2.threshold(mixed, 255, 255, cv2.THRESH_TRUNC, dst=mixed)  # >= 0: weights are
        ops.blend_image(pixels, mixed.astype(np.uint8), mix)

    def mix_blended(self, pixels: np.ndarray, weights: np.ndarray, mix: float, rng) -> None:
        scaled, remaining, alphas = weights * mix, 1.0, []
        for weight in scaled[::-1]:
            alpha = weight / remaining
            remaining *= 1 - alpha
            alphas.append(alpha)
        original = pixels.copy()
        for alpha in np.array(alphas[::-1], dtype=np.float32):
            ops.blend_image(pixels, self.chain(original, rng), alpha)


TRIVIAL_BINS = 31
# torchvision's TrivialAugmentWide: op -> (magnitude of bin 0, of bin 30, signed); None:
# the op takes no magnitude
TRIVIAL_OPS: dict[str, tuple[float, float, bool] | None] = {
    "Identity": None,
    "ShearX": (0.0, 0.99, True),
    "ShearY": (0.0, 0.99, True),
    "TranslateX": (0.0, 32.0, True),
    "TranslateY": (0.0, 32.0, True),
    "Rotate": (0.0, 135.0, True),
    "Brightness": (0.0, 0.99, True),
    "Color": (0.0, 0.99, True),
    "Contrast": (0.0, 0.99, True),
    "Sharpness": (0.0, 0.99, True),
    "Posterize": (0.0, 6.0, False),  # bits 8 - round(magnitude): 8 down to 2
    "Solarize": (255.0, 0.0, False),  # the threshold
    "AutoContrast": None,
    "Equalize": None,
}
TRIVIAL_NAMES = tuple(TRIVIAL_OPS)


@dataclass(frozen=True)
class TrivialAugment:
    """torchvision's TrivialAugmentWide: one op, one of 31 magnitude bins, a random sign.

    Geometric ops resample `bilinear` (torchvision's classification recipe passes it)
    and fill with `fill` (torchvision's default: black).
    """

    resample: str = "bilinear"
    fill: tuple[int, int, int] = (0, 0, 0)

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        apply_drawn(pixels, self.draw(rng))

    def draw(self, rng: random.Random) -> tuple[DrawnOp, ...]:
        """The op one image gets, with its bin and sign drawn (Identity: none)."""
        name = rng.choice(TRIVIAL_NAMES)
        magnitude, space = 0.0, TRIVIAL_OPS[name]
        if space is not None:
            low, high, signed = space
            magnitude = low + (high - low) * rng.randrange(TRIVIAL_BINS) / (TRIVIAL_BINS - 1)
            if signed and rng.randrange(2):
                magnitude = -magnitude
        op = trivial_op(name, magnitude, self.resample, self.fill)
        return () if op is None else (op,)


def trivial_op(name: str, magnitude: float, resample: str, fill) -> DrawnOp | None:
    """torchvision's `_apply_op` for a PIL image, at `magnitude` (None: Identity)."""
    if name in ("ShearX", "ShearY"):  # F.affine(shear=degrees(atan(m)), center=[0, 0])
        return AffineOp(name, magnitude, resample, fill)
    if name in ("TranslateX", "TranslateY"):  # F.affine(translate=[int(m), 0])
        return AffineOp(name, -int(magnitude), resample, fill)
    if name == "Rotate":
        return AffineOp(name, magnitude, resample, fill)
    if name in ("Brightness", "Color", "Contrast", "Sharpness"):
        return PixelOp(getattr(ops, name.lower()), 1.0 + magnitude)
    if name == "Posterize":
        return PixelOp(ops.posterize, 8 - round(magnitude))
    if name == "Solarize":
        return PixelOp(ops.solarize, magnitude)
    if name == "AutoContrast":
        return PixelOp(ops.autocontrast)
    if name == "Equalize":
        return PixelOp(ops.equalize)
    return None


def build_policy(spec: PolicySpec, hparams: Hparams):
    """The policy `spec` names, its ops sharing `hparams` (fill, translate, interpolation)."""
    hparams = dataclasses.replace(
        hparams, magnitude_std=spec.magnitude_std, magnitude_max=spec.magnitude_max
    )
    if spec.kind == "trivial":
        return TrivialAugment()
    if spec.kind == "auto":
        return AutoAugment(
            tuple(
                tuple(AugmentOp(name, prob, magnitude, hparams) for name, prob, magnitude in sub)
                for sub in AUTO_POLICIES[spec.name]
            )
        )
    if spec.kind == "augmix":
        hparams = dataclasses.replace(hparams, translate_pct=0.3)
        augmix_ops = tuple(AugmentOp(name, 1.0, spec.magnitude, hparams) for name in AUGMIX_OPS)
        return AugMix(augmix_ops, spec.alpha, spec.width, spec.depth, spec.blended)
    return _build_rand(spec, hparams)


def _build_rand(spec: PolicySpec, hparams: Hparams) -> RandAugment:
    names = RAND_INCREASING_OPS if spec.increasing else RAND_OPS
    weights = RAND_WEIGHTS_W0 if spec.choices == "w0" else None
    chosen = RAND_CHOICES.get(spec.choices or "")
    if isinstance(chosen, dict):
        names, weights = tuple(chosen), tuple(chosen.values())
    elif chosen is not None:
        names = chosen
    rand_ops = tuple(AugmentOp(name, spec.prob, spec.magnitude, hparams) for name in names)
    return RandAugment(rand_ops, spec.num_layers, weights)
