"""Colour jitter, random greyscale and random Gaussian blur, as timm's train transform adds them.

torchvision's `ColorJitter`, `RandomGrayscale` and `RandomApply([GaussianBlur(23)])` on a
PIL image, done on the uint8 crop with `pipeline.augment.ops`; draws from the `rng`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from pipeline.augment import ops

BLUR_KERNEL = 23  # timm's train transform: GaussianBlur(kernel_size=23), sigma in [0.1, 2.0]
BLUR_SIGMA = (0.1, 2.0)


def jitter_range(strength: float, center: float = 1.0) -> tuple[float, float] | None:
    """torchvision's range for a jitter strength: [max(0, 1 - s), 1 + s]; None: no jitter."""
    if not strength:
        return None
    return max(0.0, center - strength), center + strength


@dataclass(frozen=True)
class ColorJitter:
    """torchvision's ColorJitter: brightness, contrast, saturation and hue, in a random order.

    Each factor range is `jitter_range` of timm's strength (hue: [-h, h]); None skips it.
    The factors are drawn after the order, in torchvision's order (b, c, s, h).
    """

    brightness: tuple[float, float] | None = None
    contrast: tuple[float, float] | None = None
    saturation: tuple[float, float] | None = None
    hue: tuple[float, float] | None = None

    @classmethod
    def from_strengths(cls, strengths: tuple[float, ...]) -> ColorJitter:
        """From timm's `color_jitter` (3 or 4 strengths; a float means 3 equal ones)."""
        brightness, contrast, saturation, *hue = strengths
        hue_range = (-hue[0], hue[0]) if hue and hue[0] else None
        return cls(
            jitter_range(brightness), jitter_range(contrast), jitter_range(saturation), hue_range
        )

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        order = [0, 1, 2, 3]
        rng.shuffle(order)
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        factors = [None if span is None else rng.uniform(*span) for span in ranges]
        adjust = (ops.brightness, ops.contrast, ops.color, ops.hue)
        for index in order:
            if factors[index] is not None:
                adjust[index](pixels, factors[index])


@dataclass(frozen=True)
class RandomGrayscale:
    """torchvision's RandomGrayscale(p): Pillow's luma in all three channels."""

    prob: float

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        if rng.random() < self.prob:
            ops.grayscale(pixels)


@dataclass(frozen=True)
class RandomGaussianBlur:
    """timm's RandomApply([GaussianBlur(23)], p): sigma uniform in [0.1, 2.0]."""

    prob: float

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        if rng.random() < self.prob:
            ops.gaussian_blur(pixels, rng.uniform(*BLUR_SIGMA), BLUR_KERNEL)
