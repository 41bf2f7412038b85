"""The loader's crops against torchvision's: box distribution and pixels.

torchvision cannot be installed beside our torch, so `reference_get_params` is
`RandomResizedCrop.get_params` (torchvision 0.20) line by line, drawing from torch's
generator as torchvision does. Our crops draw from `SampleRandom` (the loader's per-sample
RNG); the two streams differ, so the distributions are compared, not the boxes: a
two-sample Kolmogorov-Smirnov statistic per quantity, bounded at the 0.1% level.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.transforms import RandomResizedCrop, SampleRandom, sample_crop_box
from tests.oddimages import photo_jpeg

pytest.importorskip("simplejpeg")
pytest.importorskip("cv2")

from pipeline.fast_transforms import FastCenterCrop, FastRandomResizedCrop  # noqa: E402
from pipeline.transforms import CenterCrop  # noqa: E402

SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
DRAWS = 4000
# c(alpha) of the two-sample KS test at alpha = 0.001: reject when D > c * sqrt(2 / n).
KS_C = 1.949
# The fast crops against the Pillow crops on the same boxes (same seeds), 8-bit PSNR.
# Measured on photo-like JPEGs: RandomResizedCrop 47-54 dB (mean 51-54), CenterCrop 48 dB
# at 640x480 and bit-exact on 256-px shards (whole-pixel boxes); another box gives < 25 dB.
MIN_PSNR_DB = 42.0


def reference_get_params(
    height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """torchvision's `RandomResizedCrop.get_params`: (top, left, height, width)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = math.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1]).item())
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def features(boxes: np.ndarray, width: int, height: int) -> dict[str, np.ndarray]:
    """Area fraction, aspect ratio and offsets (as a share of the room) of (l, t, r, b) boxes."""
    left, top, right, bottom = boxes.T.astype(float)
    w, h = right - left, bottom - top
    return {
        "area": w * h / (width * height),
        "aspect": w / h,
        "left": np.where(width > w, left / np.maximum(width - w, 1), 0.0),
        "top": np.where(height > h, top / np.maximum(height - h, 1), 0.0),
    }


def ours(width: int, height: int, scale=SCALE, ratio=RATIO) -> np.ndarray:
    boxes = [
        sample_crop_box(width, height, scale, ratio, SampleRandom(f"aug:0:0:{key:08d}:0"))
        for key in range(DRAWS)
    ]
    return np.array(boxes)


def theirs(width: int, height: int, scale=SCALE, ratio=RATIO) -> np.ndarray:
    torch.manual_seed(1234)
    boxes = []
    for _ in range(DRAWS):
        i, j, h, w = reference_get_params(height, width, scale, ratio)
        boxes.append((j, i, j + w, i + h))
    return np.array(boxes)


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Largest gap between the two empirical distribution functions."""
    grid = np.sort(np.concatenate([a, b]))
    cdf_a = np.searchsorted(np.sort(a), grid, side="right") / len(a)
    cdf_b = np.searchsorted(np.sort(b), grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "width,height,scale",
    [
        (341, 256, SCALE),  # a 256-px shard image, the common case
        (256, 341, SCALE),
        (400, 60, SCALE),  # a strip: many attempts fail, some draws fall back
        (300, 200, (0.6, 1.0)),  # large crops: attempts often overflow one side
    ],
)
def test_crop_boxes_follow_torchvisions_distribution(width, height, scale):
    mine = features(ours(width, height, scale), width, height)
    reference = features(theirs(width, height, scale), width, height)
    bound = KS_C * math.sqrt(2 / DRAWS)
    for name in mine:
        statistic = ks_statistic(mine[name], reference[name])
        assert statistic < bound, (name, statistic, bound)


def test_ks_bound_detects_a_wrong_distribution():
    # Area drawn from (0.2, 1) instead of (0.08, 1): the test above must see it.
    wrong = features(ours(341, 256, (0.2, 1.0)), 341, 256)
    reference = features(theirs(341, 256), 341, 256)
    assert ks_statistic(wrong["area"], reference["area"]) > KS_C * math.sqrt(2 / DRAWS)


@pytest.mark.parametrize("width,height", [(1000, 10), (10, 1000), (120, 100)])
def test_fallback_box_is_torchvisions_centre_crop(width, height):
    # No attempt can fit (a 100:1 strip, or areas above the image): the centre crop with
    # the aspect ratio clamped into `ratio`, exactly.
    scale = (0.9, 1.0) if width != 120 else (2.0, 3.0)
    i, j, h, w = reference_get_params(height, width, scale, RATIO)
    for key in range(20):
        box = sample_crop_box(width, height, scale, RATIO, SampleRandom(f"k{key}"))
        assert box == (j, i, j + w, i + h)


def test_flip_rate_is_the_configured_probability():
    transform = FastRandomResizedCrop(size=16)
    flips = [transform.choose_crop(341, 256, SampleRandom(f"f{key}"))[1] for key in range(DRAWS)]
    assert abs(np.mean(flips) - 0.5) < 4 * math.sqrt(0.25 / DRAWS)


@pytest.mark.parametrize("width,height", [(341, 256), (256, 341), (640, 480)])
@pytest.mark.parametrize(
    "fast,pillow",
    [(FastRandomResizedCrop(), RandomResizedCrop()), (FastCenterCrop(), CenterCrop())],
)
def test_fast_pixels_agree_with_pillow_on_the_same_boxes(width, height, fast, pillow):
    values = []
    for seed in range(8):
        data = photo_jpeg(width, height, seed=seed)
        key = f"aug:0:0:{seed}:0"
        a, b = fast(data, SampleRandom(key)), pillow(data, SampleRandom(key))
        values.append(psnr(a, b))
    assert min(values) > MIN_PSNR_DB, values


def test_psnr_bound_detects_a_shifted_box():
    data = photo_jpeg(341, 256)
    rng_a, rng_b = SampleRandom("a"), SampleRandom("b")
    assert psnr(FastRandomResizedCrop()(data, rng_a), RandomResizedCrop()(data, rng_b)) < 25
