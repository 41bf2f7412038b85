"""Random erasing (timm's RandomErasing) on the uint8 crop, the last augmentation step.

timm erases after normalisation, filling with 0 (the mean) or N(0, 1) noise; here the
crop is still uint8, so the same fills are the mean colour, or mean + std * N(0, 1),
scaled to 0-255, rounded and clipped. Box sizes, aspect and count are drawn as timm's.
Per-pixel noise is drawn as 16-bit uniforms mapped through a table of the normal's
quantiles (no float normals per value): the uint8 distribution is the exact one, each
value's probability to within 2**-16.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from pipeline.augment.ops import solid

ATTEMPTS = 10  # timm tries this many boxes per erasure before giving up on it


@dataclass(frozen=True)
class RandomErasing:
    """Erase 1..`max_count` boxes of an image with probability `prob`.

    Attributes:
        prob: chance an image is erased at all.
        area: range of a box's area as a share of the image (divided by the count).
        ratio: range of a box's aspect (height / width), drawn log-uniformly.
        mode: `const` (the mean colour), `rand` (one normal colour a box), `pixel`
            (normal noise per pixel and channel).
        max_count: the number of boxes is drawn uniformly in 1..max_count.
        mean, std: the dataset's per-channel mean and standard deviation (0-1 scale).
    """

    prob: float = 0.25
    area: tuple[float, float] = (0.02, 1 / 3)
    ratio: tuple[float, float] = (0.3, 1 / 0.3)
    mode: str = "const"
    max_count: int = 1
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        if rng.random() > self.prob:
            return
        for top, left, height, width in self.boxes(pixels.shape[0], pixels.shape[1], rng):
            pixels[top : top + height, left : left + width] = self.fill(height, width, rng)

    def boxes(self, image_height: int, image_width: int, rng: random.Random) -> list[tuple]:
        """The (top, left, height, width) boxes one erasure draws (timm's `_erase` loop)."""
        count = 1 if self.max_count == 1 else rng.randint(1, self.max_count)
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        boxes = []
        for _ in range(count):
            for _ in range(ATTEMPTS):
                target = rng.uniform(*self.area) * image_height * image_width / count
                aspect = math.exp(rng.uniform(*log_ratio))
                height = int(round(math.sqrt(target * aspect)))
                width = int(round(math.sqrt(target / aspect)))
                if width < image_width and height < image_height:
                    top = rng.randint(0, image_height - height)
                    left = rng.randint(0, image_width - width)
                    boxes.append((top, left, height, width))
                    break
        return boxes

    def fill(self, height: int, width: int, rng: random.Random) -> np.ndarray:
        """The uint8 values of one box, (height, width, 3)."""
        if self.mode == "pixel":  # a generator seeded from rng: the noise stays the sample's own
            count = height * width
            bits = np.random.PCG64(rng.getrandbits(64)).random_raw((3 * count + 3) // 4)
            draws = bits.view(np.uint16)[: 3 * count].reshape(3, count)  # 4 uniforms a draw
            box = np.empty((height, width, 3), dtype=np.uint8)
            for channel, table in enumerate(quantile_tables(self.mean, self.std)):
                box[..., channel] = np.take(table, draws[channel]).reshape(height, width)
            return box
        normal = np.zeros(3)
        if self.mode == "rand":
            normal = np.array([rng.gauss(0.0, 1.0) for _ in range(3)])
        values = np.clip(np.rint((np.array(self.mean) + np.array(self.std) * normal) * 255), 0, 255)
        return solid(values.astype(np.uint8), height, width)


@functools.lru_cache(maxsize=4)
def quantile_tables(mean: tuple[float, ...], std: tuple[float, ...]) -> tuple[np.ndarray, ...]:
    """Per channel, uint8 round(clip(255 (mean + std * z))) for z the normal quantile at the
    centre of each of 2**16 equal steps of probability: a 16-bit uniform through it is
    `pixel` mode's noise. Built from the bin edges of the uint8 values (255 quantiles)."""
    steps = (np.arange(1 << 16) + 0.5) / (1 << 16)
    tables = []
    for m, s in zip(mean, std, strict=True):
        # value v takes the z with 255 (m + s z) in [v - 0.5, v + 0.5): edges in probability
        edges = [NormalDist(m * 255, s * 255).cdf(v + 0.5) for v in range(255)]
        table = np.searchsorted(np.array(edges), steps, side="right").astype(np.uint8)
        table.flags.writeable = False  # cached: shared by every call
        tables.append(table)
    return tuple(tables)
