"""The pixel operations of the augmentation policies, on a uint8 HxWx3 array, in place.

Each one gives the pixels of the Pillow call timm (or torchvision) makes, computed with
numpy and OpenCV on the uint8 crop, one or two SIMD passes where possible: lookup tables
as masks and saturating adds (posterize, solarize) or `cv2.LUT` (a scalar pass, ~4x a
SIMD one), Pillow's blends from one colour as tables, blends from an image in one
`cv2.addWeighted` (within 1 of Pillow's truncated float32). Geometry is
`pipeline.augment.warp`'s. Arrays must be C-contiguous (`pipeline.augment.Augmenter`
ensures it). None raises on a valid image; one that cannot apply leaves it unchanged.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import cv2
import numpy as np

_LEVELS = np.arange(256, dtype=np.int32)
_LEVELS_F32 = np.arange(256, dtype=np.float32)
_CHANNELS = np.arange(3)
# Pillow's RGB -> L: (R * 19595 + G * 38470 + B * 7471 + 0x8000) >> 16 (ITU-R 601-2 luma).
# In float32 every product and partial sum is an integer below 2**24 times 2**-16, so
# exact, and truncating the result is Pillow's shift (checked on all 2**24 colours).
_LUMA = np.array([[19595, 38470, 7471, 0x8000]], dtype=np.float64) / 65536


def apply_lut(pixels: np.ndarray, lut: np.ndarray) -> None:
    """Map every value through `lut` (256 uint8 values), in place."""
    cv2.LUT(pixels, lut, dst=pixels)


def _flat(pixels: np.ndarray) -> np.ndarray:
    """`pixels` as one HxW*3 channel: OpenCV's element-wise ops take the same time either way,
    and a scalar then means the same value for every byte."""
    return pixels.reshape(pixels.shape[0], -1)


def posterize(pixels: np.ndarray, bits: int) -> None:
    """`ImageOps.posterize`: keep the top `bits` bits; 0 bits (or fewer) is black, as timm means."""
    if bits >= 8:
        return
    if bits <= 0:  # Pillow 13 raises here; timm's level functions ask for it at full severity
        pixels[...] = 0
        return
    np.bitwise_and(pixels, 0xFF & ~(2 ** (8 - bits) - 1), out=pixels)  # Pillow's table, as a mask


def solarize(pixels: np.ndarray, threshold: float) -> None:
    """`ImageOps.solarize`: invert every value at or above `threshold`.

    255 - v is v ^ 0xFF, so the table is a mask of 0xFF where v >= threshold, XORed in:
    two SIMD passes where `cv2.LUT` makes one scalar lookup a byte (about 5x the time).
    """
    flat = _flat(pixels)
    _, mask = cv2.threshold(flat, math.ceil(threshold) - 1, 255, cv2.THRESH_BINARY)
    cv2.bitwise_xor(flat, mask, dst=flat)


def solarize_add(pixels: np.ndarray, add: int, threshold: int = 128) -> None:
    """timm's `solarize_add`: add `add` (capped at 255) to every value below `threshold`."""
    flat = _flat(pixels)
    _, addend = cv2.threshold(flat, math.ceil(threshold) - 1, add, cv2.THRESH_BINARY_INV)
    cv2.add(flat, addend, dst=flat)  # saturates at 255


def invert(pixels: np.ndarray) -> None:
    """`ImageOps.invert`."""
    np.subtract(255, pixels, out=pixels)


def _per_channel_luts(pixels: np.ndarray, planes: Sequence[np.ndarray], luts: Sequence) -> None:
    """Apply `luts[c]` (a uint8 table, or None: leave the channel) to channel c.

    One pass over the image when the three are one table (cached tables are one object),
    else plane by plane: OpenCV's three-channel table is a slower scalar pass.
    """
    if luts[0] is not None and luts[0] is luts[1] is luts[2]:
        apply_lut(pixels, luts[0])
        return
    if all(lut is None for lut in luts):
        return
    for plane, lut in zip(planes, luts, strict=True):
        if lut is not None:
            cv2.LUT(plane, lut, dst=plane)
    cv2.merge(planes, dst=pixels)


@functools.lru_cache(maxsize=8192)  # at most 2 MiB; photos repeat few (low, high) pairs
def _stretch_table(low: int, high: int) -> np.ndarray | None:
    """Pillow's autocontrast table for a channel spanning [low, high]; None: the identity.

    Why cached: in a loader worker, each of numpy's small-array calls costs ~6 us (its
    code and data cold after a JPEG decode), so computing the table cost ~90 us a call.
    """
    if high <= low or (low == 0 and high == 255):
        return None
    scale = 255.0 / (high - low)  # Pillow's float64 arithmetic, then int() truncation
    table = np.clip((_LEVELS * scale + (-low * scale)).astype(np.int64), 0, 255)
    table = table.astype(np.uint8)
    table.flags.writeable = False
    return table


def autocontrast(pixels: np.ndarray) -> None:
    """`ImageOps.autocontrast()`: stretch each channel's [min, max] to [0, 255]."""
    planes = cv2.split(pixels)
    luts = [_stretch_table(*(int(value) for value in cv2.minMaxLoc(plane)[:2])) for plane in planes]
    _per_channel_luts(pixels, planes, luts)


def equalize(pixels: np.ndarray) -> None:
    """`ImageOps.equalize()`: each channel's histogram spread evenly, Pillow's integer steps.

    Pillow's table: value i -> (step // 2 + pixels below i) // step, where step = (all
    pixels - those of the highest value present) // 255; a channel with step 0 (one value
    present, or too few pixels) is left. The three tables in one set of numpy calls on
    (3, 256) counts: in a loader worker each call costs ~6 us, more than its arithmetic.
    """
    planes = cv2.split(pixels)
    counts = np.concatenate([cv2.calcHist([plane], [0], None, [256], [0, 256]) for plane in planes])
    counts = counts.astype(np.int64).reshape(3, 256)
    below = counts.cumsum(axis=1)  # pixels at or below i; then below i
    highest = 255 - (counts[:, ::-1] > 0).argmax(axis=1)
    tops = counts[_CHANNELS, highest].tolist()
    steps = [(total - top) // 255 for total, top in zip(below[:, -1].tolist(), tops, strict=True)]
    if not any(steps):
        return
    below -= counts
    divisors = np.array(steps)[:, None]
    below += divisors // 2
    np.maximum(divisors, 1, out=divisors)
    below //= divisors
    luts = np.minimum(below, 255).astype(np.uint8)
    _per_channel_luts(
        pixels, planes, [lut if step else None for lut, step in zip(luts, steps, strict=True)]
    )


def blend_image(pixels: np.ndarray, other: np.ndarray, alpha: float) -> None:
    """`pixels` = Pillow's `Image.blend(pixels, other, alpha)`, to the byte, in place.

    Pillow computes pixels + alpha * (other - pixels) in C `float` and truncates (clipping
    to 0..255 when alpha extrapolates). Each step here is one correctly rounded float32
    operation on exact inputs (whole-number differences, Pillow's float alpha), so the same
    values as Pillow's C.
    """
    values = cv2.subtract(other, pixels, dtype=cv2.CV_32F)
    np.multiply(values, np.float32(alpha), out=values)  # (cv2's scalar multiply is slower)
    np.add(values, pixels, out=values)
    if not 0.0 <= alpha <= 1.0:
        np.clip(values, 0, 255, out=values)
    np.copyto(pixels, values, casting="unsafe")  # truncates, as Pillow's (UINT8) cast


def blend_constant(pixels: np.ndarray, degenerate: int, factor: float) -> None:
    """`ImageEnhance`'s blend from a one-colour image: a lookup table, Pillow's bytes exactly.

    The table is `blend_image`'s float32 steps on the 256 values (a blend within [0, 1]
    stays within 0..255, so only an extrapolating one is clipped).
    """
    if factor == 1.0:
        return
    first = np.float32(degenerate)
    table = _LEVELS_F32 - first
    table *= np.float32(factor)
    table += first
    if not 0.0 <= factor <= 1.0:
        np.clip(table, 0, 255, out=table)
    apply_lut(pixels, table.astype(np.uint8))


# Pillow truncates its float results; ours (float32 in another order, or OpenCV's rounding)
# are a few 1e-5 off, so whole numbers can land just below. Truncating v + NUDGE (rounding
# v - 0.5 + NUDGE) keeps them, and only values within NUDGE under a whole number go the
# other way (off by 1).
NUDGE = 2.0**-10


def blend_pixels(pixels: np.ndarray, degenerate: np.ndarray, factor: float) -> None:
    """`ImageEnhance`'s blend from a per-pixel degenerate image, within 1 of Pillow's bytes.

    `cv2.addWeighted` in one SIMD pass (Pillow: degenerate + f * (pixels - degenerate) in
    float32, truncated; here f * pixels + (1 - f) * degenerate, rounded after the shift
    -0.5 + `NUDGE`): measured on photos, under 1% of the values differ, by 1.
    """
    if factor != 1.0:
        alpha = float(np.float32(factor))  # Pillow's C float
        cv2.addWeighted(pixels, alpha, degenerate, 1.0 - alpha, NUDGE - 0.5, dst=pixels)


def luma(pixels: np.ndarray) -> np.ndarray:
    """Pillow's `convert("L")`: HxW uint8, integer ITU-R 601-2 luma rounded as Pillow does."""
    return cv2.transform(pixels.astype(np.float32), _LUMA).astype(np.uint8)


def brightness(pixels: np.ndarray, factor: float) -> None:
    """`ImageEnhance.Brightness(img).enhance(factor)`: a blend from black."""
    blend_constant(pixels, 0, factor)


def contrast(pixels: np.ndarray, factor: float) -> None:
    """`ImageEnhance.Contrast(img).enhance(factor)`: a blend from the mean grey."""
    if factor != 1.0:
        gray = luma(pixels)
        total = cv2.sumElems(gray)[0]  # exact: whole numbers far below 2**53
        mean = int(total / gray.size + 0.5)  # ImageStat's mean, rounded as Pillow
        blend_constant(pixels, mean, factor)


def color(pixels: np.ndarray, factor: float) -> None:
    """`ImageEnhance.Color(img).enhance(factor)`: a blend from the greyscale image."""
    if factor != 1.0:
        blend_pixels(pixels, cv2.cvtColor(luma(pixels), cv2.COLOR_GRAY2RGB), factor)


def grayscale(pixels: np.ndarray) -> None:
    """`img.convert("L")` back to three equal channels (torchvision's `RandomGrayscale`)."""
    cv2.cvtColor(luma(pixels), cv2.COLOR_GRAY2RGB, dst=pixels)  # numpy's broadcast is slow


def _smoothed(pixels: np.ndarray) -> np.ndarray:
    """Pillow's SMOOTH kernel on every pixel but the outermost (those are not Pillow's).

    The kernel is the 3x3 box sum plus 4x the centre, over 13: an integer box filter
    (SIMD, exact in uint16) and one weighted sum. That sum over 13 is never within 1/26
    of a half, so its float rounding is Pillow's.
    """
    box = cv2.boxFilter(pixels, cv2.CV_16U, (3, 3), normalize=False)
    return cv2.addWeighted(box, 1 / 13, pixels.astype(np.uint16), 4 / 13, 0, dtype=cv2.CV_8U)


def smooth(pixels: np.ndarray) -> np.ndarray:
    """Pillow's `filter(ImageFilter.SMOOTH)`: a 3x3 kernel, the outermost pixels kept."""
    height, width = pixels.shape[:2]
    if height < 3 or width < 3:
        return pixels.copy()
    out = _smoothed(pixels)
    out[0], out[-1] = pixels[0], pixels[-1]
    out[:, 0], out[:, -1] = pixels[:, 0], pixels[:, -1]
    return out


def sharpness(pixels: np.ndarray, factor: float) -> None:
    """`ImageEnhance.Sharpness(img).enhance(factor)`: a blend from the smoothed image.

    Pillow's smoothed image keeps the outermost pixels, whose blend is then themselves,
    so only the inside is blended (OpenCV writes into the view).
    """
    height, width = pixels.shape[:2]
    if factor != 1.0 and height >= 3 and width >= 3:
        blend_pixels(pixels[1:-1, 1:-1], _smoothed(pixels)[1:-1, 1:-1], factor)


def solid(color: Sequence[int], height: int, width: int) -> np.ndarray:
    """A read-only `height` x `width` image of one colour, made from bytes.

    Why: numpy's broadcast of three values into an HxWx3 array costs ~50x more.
    """
    row = bytes(int(v) for v in color)
    return np.frombuffer(row * (height * width), np.uint8).reshape(height, width, 3)


def gaussian_blur(pixels: np.ndarray, sigma: float, kernel: int | None = None) -> None:
    """A Gaussian blur of standard deviation `sigma`, one separable 1-D kernel each way.

    Without `kernel`: Pillow's `ImageFilter.GaussianBlur(radius=sigma)`, whose three box
    blurs (fractional ends) compose into one kernel (`pillow_blur_kernel`), edges repeated;
    Pillow rounds after each of its 6 passes, here once. With `kernel`: torchvision's
    `GaussianBlur(kernel)` kernel, edges reflected. Taps under 1e-4 are dropped (their sum
    moves no value by 0.03): `cv2.sepFilter2D` costs by the tap.
    """
    if sigma <= 0:
        return
    if kernel:
        weights, border = _torchvision_kernel(kernel, float(sigma)), cv2.BORDER_REFLECT_101
    else:
        weights, border = pillow_blur_kernel(float(sigma)), cv2.BORDER_REPLICATE
    cv2.sepFilter2D(pixels, -1, weights, weights, dst=pixels, borderType=border)


def _trimmed(weights: np.ndarray) -> np.ndarray:
    """`weights` less the outer taps under 1e-4 (symmetric), as a float32 column, sum 1."""
    keep = np.flatnonzero(weights >= 1e-4)
    side = min(keep[0], len(weights) - 1 - keep[-1])
    weights = weights[side : len(weights) - side]
    column = (weights / weights.sum()).astype(np.float32)[:, None]
    column.flags.writeable = False  # cached: shared by every call
    return column


@functools.lru_cache(maxsize=64)
def pillow_blur_kernel(radius: float, passes: int = 3) -> np.ndarray:
    """The 1-D kernel of Pillow's `GaussianBlur(radius)`: `passes` box blurs of the radius
    its `_gaussian_blur_radius` gives, each 2l + 1 taps and two fractional ends (BoxBlur.c)."""
    sigma2 = radius * radius / passes
    whole = math.floor((math.sqrt(12.0 * sigma2 + 1.0) - 1.0) / 2.0)
    extra = (2 * whole + 1) * (whole * (whole + 1) - 3 * sigma2)
    box_radius = whole + extra / (6 * (sigma2 - (whole + 1) * (whole + 1)))
    inner = int(box_radius)
    weight = int((1 << 24) / (box_radius * 2 + 1))
    edge = ((1 << 24) - (inner * 2 + 1) * weight) // 2
    box = np.array([edge] + [weight] * (2 * inner + 1) + [edge], dtype=np.float64) / (1 << 24)
    composed = box
    for _ in range(passes - 1):
        composed = np.convolve(composed, box)
    return _trimmed(composed)


@functools.lru_cache(maxsize=64)
def _torchvision_kernel(size: int, sigma: float) -> np.ndarray:
    """torchvision's `_get_gaussian_kernel1d(size, sigma)`, trimmed."""
    x = np.linspace(-(size - 1) / 2, (size - 1) / 2, size)
    pdf = np.exp(-0.5 * (x / sigma) ** 2)
    return _trimmed(pdf / pdf.sum())


def hue(pixels: np.ndarray, factor: float) -> None:
    """torchvision's `adjust_hue` on a PIL image: the HSV hue (0..255) shifted, wrapping.

    OpenCV's full-range HSV stands in for Pillow's; they round differently.
    """
    shift = int(factor * 255) % 256
    if shift == 0:
        return
    hsv = cv2.cvtColor(pixels, cv2.COLOR_RGB2HSV_FULL)
    hues = hsv[..., 0]
    np.add(hues, shift, out=hues, casting="unsafe")
    cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB_FULL, dst=pixels)
