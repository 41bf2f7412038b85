"""The Pillow calls timm and torchvision make for each augmentation op, as references.

tests/pipeline/test_augment_ops.py compares `pipeline.augment`'s pixels with these, and
benchmarks/augment_ops.py times both. Each function takes the op's argument as timm's
level function (or torchvision's magnitude bin) gives it, and calls Pillow with exactly
the arguments timm (torchvision) passes.
"""

from __future__ import annotations

import math
import random

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

ENHANCERS = ("Color", "Contrast", "Brightness", "Sharpness")


class FixedSign(random.Random):
    """An rng whose `random()` is fixed: 0.0 keeps timm's sign, 0.9 negates (`> 0.5`)."""

    def __init__(self, value: float) -> None:
        super().__init__(0)
        self.value = value

    def random(self) -> float:
        return self.value


def psnr(ours: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB (inf when equal)."""
    error = np.mean((ours.astype(np.float64) - reference.astype(np.float64)) ** 2)
    return math.inf if error == 0 else 10 * math.log10(255**2 / error)


def timm_pillow_op(name: str, argument, img: Image.Image, resample: str, fill) -> Image.Image:
    """What timm's op `name` (timm/data/auto_augment.py) returns for `img` and `argument`."""
    kwargs = dict(resample=getattr(Image.Resampling, resample.upper()), fillcolor=fill)
    if name in ("AutoContrast", "Equalize", "Invert"):
        return getattr(ImageOps, name.lower())(img)
    if name.startswith("Posterize"):
        # timm returns the image for 8 bits; 0 bits is black in timm's meaning (Pillow
        # before 13 returned black, Pillow 13 raises)
        if argument >= 8:
            return img
        return ImageOps.posterize(img, argument) if argument else Image.new("RGB", img.size)
    if name == "SolarizeAdd":
        lut = [min(255, i + argument) if i < 128 else i for i in range(256)]
        return img.point(lut * 3)
    if name.startswith("Solarize"):
        return ImageOps.solarize(img, argument)
    if name.startswith(ENHANCERS):
        return getattr(ImageEnhance, name.removesuffix("Increasing"))(img).enhance(argument)
    if name == "Desaturate":
        return ImageEnhance.Color(img).enhance(min(1.0, max(0.0, 1.0 - argument)))
    if name == "Rotate":
        return img.rotate(argument, **kwargs)
    if name in ("ShearX", "ShearY"):
        matrix = (1, argument, 0, 0, 1, 0) if name == "ShearX" else (1, 0, 0, argument, 1, 0)
        return img.transform(img.size, Image.Transform.AFFINE, matrix, **kwargs)
    if name.startswith("Translate"):
        side = img.size[0] if "X" in name else img.size[1]
        shift = argument * side if name.endswith("Rel") else argument
        matrix = (1, 0, shift, 0, 1, 0) if "X" in name else (1, 0, 0, 0, 1, shift)
        return img.transform(img.size, Image.Transform.AFFINE, matrix, **kwargs)
    if name == "GaussianBlur":
        return img.filter(ImageFilter.GaussianBlur(radius=argument))
    raise ValueError(f"no Pillow reference for op {name!r}")


def pillow(name: str, argument, image: np.ndarray, resample: str, fill) -> np.ndarray:
    """`timm_pillow_op` on a uint8 HxWx3 array, as an array."""
    return np.asarray(timm_pillow_op(name, argument, Image.fromarray(image), resample, fill))


def torchvision_pillow_op(name: str, magnitude: float, img: Image.Image) -> Image.Image:
    """torchvision's `_apply_op` for TrivialAugmentWide on a PIL image (bilinear, fill 0)."""
    kwargs = dict(resample=Image.Resampling.BILINEAR, fillcolor=(0, 0, 0))
    if name in ("ShearX", "ShearY"):  # F.affine(shear=degrees(atan(m))): matrix entry tan()
        factor = math.tan(math.radians(math.degrees(math.atan(magnitude))))
        matrix = (1, factor, 0, 0, 1, 0) if name == "ShearX" else (1, 0, 0, factor, 1, 0)
        return img.transform(img.size, Image.Transform.AFFINE, matrix, **kwargs)
    if name in ("TranslateX", "TranslateY"):  # F.affine(translate=[int(m), 0]): inverse -m
        shift = -int(magnitude)
        matrix = (1, 0, shift, 0, 1, 0) if name == "TranslateX" else (1, 0, 0, 0, 1, shift)
        return img.transform(img.size, Image.Transform.AFFINE, matrix, **kwargs)
    if name == "Rotate":
        return img.rotate(magnitude, **kwargs)
    if name in ENHANCERS:
        return getattr(ImageEnhance, name)(img).enhance(1.0 + magnitude)
    if name == "Posterize":
        return ImageOps.posterize(img, 8 - round(magnitude))
    if name == "Solarize":
        return ImageOps.solarize(img, magnitude)
    if name == "Identity":
        return img
    return getattr(ImageOps, name.lower())(img)
