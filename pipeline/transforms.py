"""Per-sample image transforms of the streaming loader: encoded bytes in, uint8 HxWx3 out.

Called once per sample inside DataLoader workers, after the shuffle buffer and before
batching. Randomness comes only from the `random.Random` passed in, seeded per sample by
the loader (`SampleRandom`), so a crop is reproducible. Normalisation happens later, on the
GPU. The loader's default crops are `pipeline.fast_transforms`'; these Pillow ones are
their fallback and the `backend="pillow"` choice.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

from pipeline.decode import Box, decode_crop
from shards.image.geometry import RESAMPLING
from shards.image.policy import check_max_pixels, open_image

_ATTEMPTS = 10  # torchvision's RandomResizedCrop.get_params tries this often before falling back
_WORDS = struct.Struct("<8Q")  # one 64-byte BLAKE2b digest as eight 64-bit words
_TO_UNIT = 1.0 / (1 << 53)


class Transform(Protocol):
    """What the loader calls on each sample's image bytes; users may pass their own.

    Must be picklable (a module-level class, not a lambda or closure) to reach spawned
    workers, and must raise `shards.sample.SampleError` on bad data, nothing broader.
    """

    def __call__(self, image_bytes: bytes, rng: random.Random) -> np.ndarray:
        """Return a C-contiguous uint8 array of shape (height, width, 3) (may be read-only)."""
        ...


class SampleRandom(random.Random):
    """A `random.Random` for one sample, seeded from a string by BLAKE2b, drawing from the hash.

    Why: seeding Mersenne Twister costs ~5 us (from a string) to ~6 us (from an int), more
    than the handful of draws a crop makes. This hashes the seed string once (64 bytes of
    BLAKE2b: eight 64-bit words) and serves `random()` and `getrandbits()` from those words,
    hashing again with a counter when a sample needs more. Every other method (`uniform`,
    `randint`, `choice`, `shuffle`, `gauss`, ...) is `random.Random`'s own, built on those
    two, so user transforms keep the whole API. Deterministic across processes and
    platforms: the same string gives the same draws.
    """

    def seed(self, a: object = None, version: int = 2) -> None:  # noqa: ARG002 - Random's API
        """Seed from `a` (str, bytes or int), as `random.Random(a)` would be seeded."""
        if isinstance(a, str):
            a = a.encode()
        elif not isinstance(a, bytes):
            a = repr(a).encode()
        self._key = a
        self._block = 0
        self._words = list(_WORDS.unpack(hashlib.blake2b(a).digest()))

    def _next_word(self) -> int:
        words = self._words
        if not words:
            self._block += 1
            digest = hashlib.blake2b(self._key, salt=self._block.to_bytes(16, "little")).digest()
            words.extend(_WORDS.unpack(digest))
        return words.pop()

    def random(self) -> float:
        """A float in [0, 1) from the top 53 bits of the next word."""
        return (self._next_word() >> 11) * _TO_UNIT

    def getrandbits(self, k: int) -> int:
        """`k` random bits (whole words, then the top bits of one more)."""
        if k <= 64:
            return self._next_word() >> (64 - k) if k else 0
        value, bits = 0, 0
        while bits < k:
            value, bits = (value << 64) | self._next_word(), bits + 64
        return value >> (bits - k)

    def choice(self, seq):
        """`random.Random.choice`'s draw (the fewest bits holding len(seq), again while
        out of range), with its layers inline: policies choose ops for every sample."""
        size = len(seq)
        if not size:
            raise IndexError("Cannot choose from an empty sequence")
        shift = 64 - size.bit_length()
        index = self._next_word() >> shift
        while index >= size:
            index = self._next_word() >> shift
        return seq[index]

    def getstate(self) -> tuple:
        return (self._key, self._block, tuple(self._words))

    def setstate(self, state: tuple) -> None:
        self._key, self._block, words = state
        self._words = list(words)


@dataclass(frozen=True)
class RandomCropSpec:
    """The checked arguments of a random resized crop, and its draw of crop box and flip.

    Shared by `RandomResizedCrop` (which documents the attributes) and
    `pipeline.fast_transforms.FastRandomResizedCrop`, so both draw the same crops.
    """

    size: int = 224
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    resample: str = "bilinear"
    max_pixels: int = 64_000_000
    draft: bool = True

    def __post_init__(self) -> None:
        _check_common(self.size, self.resample, self.max_pixels)
        for name, (low, high) in (("scale", self.scale), ("ratio", self.ratio)):
            if not 0 < low <= high:
                raise ValueError(f"{name} {(low, high)} must satisfy 0 < low <= high")
        if not 0 <= self.hflip <= 1:
            raise ValueError(f"hflip {self.hflip} is a probability and must be in 0..1")

    def choose_crop(self, width: int, height: int, rng: random.Random) -> tuple[Box, bool]:
        """The source box to crop from a `width` x `height` image, and whether to flip it."""
        box = sample_crop_box(width, height, self.scale, self.ratio, rng)
        return box, rng.random() < self.hflip  # drawn after the box, as in torchvision's order


@dataclass(frozen=True)
class RandomResizedCrop(RandomCropSpec):
    """Training crop: torchvision's RandomResizedCrop and RandomHorizontalFlip in one decode.

    Attributes:
        size: output side in pixels (the output is square).
        scale: range of the crop's area as a fraction of the image area.
        ratio: range of the crop's aspect ratio (width / height), sampled log-uniformly.
        hflip: probability of a left-right flip.
        resample: `nearest`, `bilinear`, `bicubic` or `lanczos`.
        max_pixels: images whose header declares more pixels are skipped unread, at most
            Pillow's `Image.MAX_IMAGE_PIXELS`.
        draft: let libjpeg decode large JPEGs at 1/2, 1/4 or 1/8 scale when the crop allows.
        writable: False returns read-only arrays, one copy fewer (the loader's setting,
            since it copies each image into the batch).
    """

    writable: bool = True
    writes_into: ClassVar[bool] = True  # accepts `out=`, a batch slot (see `__call__`)

    def __call__(
        self, image_bytes: bytes, rng: random.Random, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Decode a random crop of `image_bytes`, resized to `size` x `size`, maybe flipped.

        Args:
            out: a uint8 (size, size, 3) array to copy the crop into; returned.

        Raises:
            SampleError: the bytes are not a decodable, allowed image within `max_pixels`.
        """
        return _decode(self, image_bytes, rng, self.writable, out)


@dataclass(frozen=True)
class CenterCropSpec:
    """The checked arguments of a centre crop, and its crop box.

    Shared by `CenterCrop` (which documents the attributes) and
    `pipeline.fast_transforms.FastCenterCrop`.
    """

    size: int = 224
    crop_fraction: float = 0.875
    resample: str = "bilinear"
    max_pixels: int = 64_000_000
    draft: bool = True

    def __post_init__(self) -> None:
        _check_common(self.size, self.resample, self.max_pixels)
        if not 0 < self.crop_fraction <= 1:
            raise ValueError(f"crop_fraction {self.crop_fraction} must be in (0, 1]")

    def choose_crop(self, width: int, height: int, rng: random.Random) -> tuple[Box, bool]:
        """The source box to crop from a `width` x `height` image; never flipped, `rng` unused."""
        return center_crop_box(width, height, self.size, self.crop_fraction), False


@dataclass(frozen=True)
class CenterCrop(CenterCropSpec):
    """Evaluation crop: resize the shorter side to `round(size / crop_fraction)`, then crop the centre.

    Gives the pixels of torchvision's `Resize(round(size / crop_fraction))` followed by
    `CenterCrop(size)`, computed in one resize of the source region. Ignores `rng`.

    Attributes:
        size: output side in pixels (the output is square).
        crop_fraction: share of the resized shorter side that the crop keeps, in (0, 1].
        resample: `nearest`, `bilinear`, `bicubic` or `lanczos`.
        max_pixels: images whose header declares more pixels are skipped unread.
        draft: let libjpeg decode large JPEGs at 1/2, 1/4 or 1/8 scale.
        writable: False returns read-only arrays, one copy fewer.
    """

    writable: bool = True
    writes_into: ClassVar[bool] = True  # accepts `out=`, a batch slot (see `__call__`)

    def __call__(
        self, image_bytes: bytes, rng: random.Random, out: np.ndarray | None = None
    ) -> np.ndarray:
        """Decode the centre crop of `image_bytes` at `size` x `size`.

        Args:
            out: a uint8 (size, size, 3) array to copy the crop into; returned.

        Raises:
            SampleError: the bytes are not a decodable, allowed image within `max_pixels`.
        """
        return _decode(self, image_bytes, rng, self.writable, out)


def sample_crop_box(
    width: int,
    height: int,
    scale: tuple[float, float],
    ratio: tuple[float, float],
    rng: random.Random,
) -> tuple[int, int, int, int]:
    """Draw a crop box exactly as torchvision's `RandomResizedCrop.get_params` does.

    Up to 10 attempts draw an area fraction uniformly from `scale` and an aspect ratio
    log-uniformly from `ratio`, keeping the first crop that fits in the image, at a
    uniform position. If none fits, the centre crop of the whole image with its aspect
    ratio clamped into `ratio`.

    Returns:
        (left, top, right, bottom) in pixels, Pillow's box convention.
    """
    area = width * height
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(_ATTEMPTS):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_low, log_high))
        crop_w = round(math.sqrt(target_area * aspect))
        crop_h = round(math.sqrt(target_area / aspect))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            top = rng.randint(0, height - crop_h)
            left = rng.randint(0, width - crop_w)
            return left, top, left + crop_w, top + crop_h
    in_ratio = width / height
    crop_w, crop_h = width, height
    if in_ratio < min(ratio):
        crop_h = round(width / min(ratio))
    elif in_ratio > max(ratio):
        crop_w = round(height * max(ratio))
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    return left, top, left + crop_w, top + crop_h


def center_crop_box(width: int, height: int, size: int, crop_fraction: float) -> Box:
    """Source region that torchvision's `Resize(r)` + `CenterCrop(size)` would keep.

    `r = round(size / crop_fraction)` is the resized shorter side; the longer side is
    resized to `int(r * long / short)` as torchvision does, and the crop offset in the
    resized image is rounded like `CenterCrop`'s.

    Returns:
        (left, top, right, bottom) in source pixels, fractional.
    """
    resized_short = round(size / crop_fraction)
    if width <= height:
        resized = (resized_short, int(resized_short * height / width))
    else:
        resized = (int(resized_short * width / height), resized_short)
    left = int(round((resized[0] - size) / 2.0))
    top = int(round((resized[1] - size) / 2.0))
    sx, sy = width / resized[0], height / resized[1]
    return (left * sx, top * sy, (left + size) * sx, (top + size) * sy)


def _check_common(size: int, resample: str, max_pixels: int) -> None:
    if size < 1:
        raise ValueError(f"size {size} must be at least 1")
    if resample not in RESAMPLING:
        raise ValueError(f"resample {resample!r} is not one of {', '.join(RESAMPLING)}")
    check_max_pixels(max_pixels)


def _decode(
    spec: RandomCropSpec | CenterCropSpec,
    image_bytes: bytes,
    rng: random.Random,
    writable: bool,
    out: np.ndarray | None = None,
) -> np.ndarray:
    image = open_image(image_bytes, spec.max_pixels)
    box, flip = spec.choose_crop(*image.size, rng)
    size = (spec.size, spec.size)
    resample = RESAMPLING[spec.resample]
    pixels = decode_crop(image, box, size, resample, flip, spec.draft, writable and out is None)
    if out is None:
        return pixels
    out[...] = pixels  # Pillow owns its pixel bytes: one copy, as the batch copy was
    return out
