"""Faster drop-in crops for the loader's workers: simplejpeg decodes, OpenCV resizes.

Same arguments, crop boxes, flips and `SampleError` reasons as `pipeline.transforms`; about
2x the images/s per core on 256-px shards. Needs `pip install "shardpipe[fast]"`.
"""

from __future__ import annotations

import functools
import math
import os
import random
from dataclasses import dataclass, fields
from types import ModuleType
from typing import ClassVar

import numpy as np

from pipeline.decode import RESAMPLING, Box, decode_crop, draft_scale
from pipeline.transforms import CenterCrop, CenterCropSpec, RandomCropSpec, RandomResizedCrop
from shards.imagedata import open_image
from shards.sample import SampleError

FAST_HINT = (
    'the fast transforms need simplejpeg and opencv-python-headless: pip install "shardpipe[fast]"'
)
# Above this shrink factor (source box side / output side) OpenCV's INTER_AREA replaces the
# interpolating filters: Pillow's filters are antialiased when shrinking, OpenCV's are not, and
# INTER_AREA averages as Pillow does. Measured against Pillow's output: for 1.25-2x shrinks
# (1024-px shards) the mean abs difference is 0.7-0.8 grey levels with INTER_AREA and 1.1-1.7
# with INTER_LINEAR; on 256-px shards, where few crops shrink, INTER_AREA everywhere would
# cost 13% of the throughput for a 0.01 smaller difference, so milder shrinks stay linear.
AREA_SHRINK = 1.25
# JPEG colour spaces libjpeg-turbo converts to RGB exactly as Pillow does. CMYK and YCCK
# (Adobe's inverted variants) go to Pillow, whose handling the shards were checked with.
DIRECT_COLORSPACES = frozenset(("YCbCr", "Gray", "RGB"))
# OpenCV's InterpolationFlags values (cv2.INTER_NEAREST, _LINEAR, _CUBIC, _LANCZOS4), spelled
# out so this module imports without OpenCV.
WARP_FILTERS = {"nearest": 0, "bilinear": 1, "bicubic": 2, "lanczos": 4}
_JPEG_MAGIC = b"\xff\xd8\xff"
_INTEGRAL_EPS = 1e-6


class _Backends:
    """simplejpeg and cv2, imported on first use, with OpenCV single-threaded in each process.

    DataLoader workers are already one per core; OpenCV's own thread pool would oversubscribe
    them, and a pool inherited through fork is not safe to use.
    """

    pid: int | None = None
    simplejpeg: ModuleType | None = None
    cv2: ModuleType | None = None


def load_backends() -> tuple[ModuleType, ModuleType]:
    """Import simplejpeg and cv2 (once per process) and return them.

    Raises:
        ImportError: either package is missing; the message says what to install.
    """
    if _Backends.pid != os.getpid():
        try:
            import cv2
            import simplejpeg
        except ImportError as error:
            raise ImportError(FAST_HINT) from error
        cv2.setNumThreads(1)
        _Backends.simplejpeg, _Backends.cv2, _Backends.pid = simplejpeg, cv2, os.getpid()
    return _Backends.simplejpeg, _Backends.cv2


class _FastCrop:
    """The validation, Pillow fallback and decode of both fast crops.

    Mixed into a `RandomCropSpec` or `CenterCropSpec` dataclass, which holds the
    arguments and chooses the crop; `pillow_class` is the matching Pillow transform.
    """

    pillow_class: ClassVar[type[RandomResizedCrop | CenterCrop]]

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc] - the spec checks the arguments
        load_backends()  # fail in the main process, not later in every worker

    @functools.cached_property
    def pillow(self) -> RandomResizedCrop | CenterCrop:
        """The Pillow transform with the same arguments (the fallback for non-JPEG input)."""
        names = [field.name for field in fields(self)]  # type: ignore[arg-type]
        return self.pillow_class(**{name: getattr(self, name) for name in names})

    def __call__(self, image_bytes: bytes, rng: random.Random) -> np.ndarray:
        """Decode this transform's crop of `image_bytes` at `size` x `size`, flipped if drawn.

        Raises:
            SampleError: the bytes are not a decodable, allowed image within `max_pixels`.
        """
        header = read_jpeg_header(image_bytes)
        if header is None:
            return self.pillow(image_bytes, rng)
        width, height, colorspace = header
        check_pixels(width, height, self.max_pixels)
        box, flip = self.choose_crop(width, height, rng)  # the Pillow transform's draws
        crop = JpegCrop(image_bytes, width, height, colorspace)
        return crop.decode(box, self.size, self.resample, flip, self.draft, self.max_pixels)


@dataclass(frozen=True)
class FastRandomResizedCrop(_FastCrop, RandomCropSpec):
    """`pipeline.transforms.RandomResizedCrop`, decoded by simplejpeg and resized by OpenCV.

    The same rng draws in the same order give the same crop box and flip. JPEGs decode at
    1/2, 1/4 or 1/8 scale (DCT scaling) when `draft` and the box allow, as with Pillow.
    Anything but a YCbCr, grey or RGB JPEG that libjpeg-turbo decodes without complaint
    (PNG, WEBP, CMYK, garbage, a truncated file) goes to the Pillow transform, so bad data
    raises exactly the `SampleError` reasons of `pipeline.decode`.

    Attributes:
        size, scale, ratio, hflip, resample, max_pixels, draft: as for
            `pipeline.transforms.RandomResizedCrop`.
    """

    pillow_class = RandomResizedCrop


@dataclass(frozen=True)
class FastCenterCrop(_FastCrop, CenterCropSpec):
    """`pipeline.transforms.CenterCrop`, decoded by simplejpeg and resized by OpenCV.

    Same source region and fallbacks as `FastRandomResizedCrop`; ignores `rng`.

    Attributes:
        size, crop_fraction, resample, max_pixels, draft: as for
            `pipeline.transforms.CenterCrop`.
    """

    pillow_class = CenterCrop


def read_jpeg_header(data: bytes) -> tuple[int, int, str] | None:
    """(width, height, colorspace) of a JPEG, or None when simplejpeg cannot read a header.

    None covers every non-JPEG and every broken header: the Pillow transform then judges
    the bytes and raises the reason `pipeline.decode` gives them.
    """
    if not data.startswith(_JPEG_MAGIC):
        return None
    simplejpeg, _ = load_backends()
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None
    return width, height, colorspace


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """The pixel cap, on the header, before anything is decoded.

    Raises:
        SampleError: `too_many_pixels`.
    """
    if width * height > max_pixels:
        raise SampleError(
            "too_many_pixels", f"header says {width}x{height} = {width * height} > {max_pixels}"
        )


@dataclass(frozen=True)
class JpegCrop:
    """One JPEG whose header was read: decodes a box of it at an output size."""

    data: bytes
    width: int
    height: int
    colorspace: str

    def decode(
        self, box: Box, size: int, resample: str, flip: bool, draft: bool, max_pixels: int
    ) -> np.ndarray:
        """Decode `box` (source pixels) resized to `size` x `size`, maybe mirrored.

        A colour space libjpeg-turbo should not convert, or any decoder complaint (simplejpeg
        is strict: a warning is an error), hands the same box to Pillow, which either
        decodes the image or raises the reason `pipeline.decode` gives it.
        """
        scale = draft_scale(box[2] - box[0], box[3] - box[1], (size, size)) if draft else 1
        pixels = self.decode_scaled(scale) if self.colorspace in DIRECT_COLORSPACES else None
        if pixels is None:
            image = open_image(self.data, max_pixels)
            return decode_crop(image, box, (size, size), RESAMPLING[resample], flip, draft)
        scaled = (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)
        return resize_box(pixels, scaled, size, resample, flip)

    def decode_scaled(self, scale: int) -> np.ndarray | None:
        """RGB pixels at 1/`scale` of the full size, or None if the decoder refuses the data.

        libjpeg's scaled size is ceil(side / scale), which is what we ask for; a smaller
        image whose nearest M/8 factor is not 1/`scale` is decoded in full instead.
        """
        simplejpeg, _ = load_backends()
        want = (math.ceil(self.height / scale), math.ceil(self.width / scale))
        try:
            pixels = simplejpeg.decode_jpeg(
                self.data, colorspace="RGB", min_height=want[0], min_width=want[1]
            )
        except ValueError:
            return None
        if pixels.shape[:2] != want:
            return self.decode_scaled(1)
        return pixels


def resize_box(pixels: np.ndarray, box: Box, size: int, resample: str, flip: bool) -> np.ndarray:
    """Resize `box` of `pixels` to `size` x `size` with Pillow's sample positions.

    A whole-pixel box, or one shrunk by more than `AREA_SHRINK`, is sliced and resized
    (edges rounded to whole pixels: at most half an output pixel off when shrinking). A
    fractional box that is enlarged goes through an affine warp that samples where Pillow
    does, with the flip folded into the matrix.

    Returns:
        A writable, C-contiguous uint8 array of shape (size, size, 3).
    """
    _, cv2 = load_backends()
    left, top, right, bottom = box
    shrink = max((right - left) / size, (bottom - top) / size)
    if shrink <= AREA_SHRINK and not _integral(box):
        return _warp(cv2, pixels, box, size, WARP_FILTERS[resample], flip)
    left, top = round(left), round(top)
    right, bottom = max(round(right), left + 1), max(round(bottom), top + 1)
    if resample == "nearest":
        interpolation = cv2.INTER_NEAREST_EXACT  # bit-exact with Pillow's nearest
    elif shrink > AREA_SHRINK:
        interpolation = cv2.INTER_AREA
    else:
        interpolation = WARP_FILTERS[resample]
    out = cv2.resize(pixels[top:bottom, left:right], (size, size), interpolation=interpolation)
    # cv2.flip writes a new array: the result never shares memory with `pixels`.
    return cv2.flip(out, 1) if flip else out


def _warp(
    cv2: ModuleType, pixels: np.ndarray, box: Box, size: int, interpolation: int, flip: bool
) -> np.ndarray:
    """Affine resample: output pixel centre x + 0.5 maps to source left + (x + 0.5) * sx."""
    left, top, right, bottom = box
    sx, sy = (right - left) / size, (bottom - top) / size
    # Flipped, output column x reads where unflipped column size - 1 - x would.
    offset = left + ((size - 0.5) if flip else 0.5) * sx - 0.5
    row_x = (-sx if flip else sx, 0.0, offset)
    matrix = np.array([row_x, (0.0, sy, top + 0.5 * sy - 0.5)])
    return cv2.warpAffine(
        pixels,
        matrix,
        (size, size),
        flags=interpolation | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )


def _integral(box: Box) -> bool:
    return all(abs(value - round(value)) < _INTEGRAL_EPS for value in box)
