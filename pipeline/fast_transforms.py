"""The loader's default crops: simplejpeg decodes, OpenCV resizes, straight into the batch.

Same arguments, crop boxes, flips and `SampleError` reasons as `pipeline.transforms`; about
2.5x the images/s per core on 256-px shards. The decode policy (backend loading, JPEG header,
pixel cap, strict decoding) is `shards.image.policy`'s; this module keeps the crop geometry in
OpenCV. Whatever the fast decoder does not take (non-JPEG, CMYK/YCCK, a JPEG libjpeg-turbo
warns about) goes to the Pillow transform with the same box, per sample, counted in
`pillow_fallbacks()` (the loader reports it as `LoaderStats.pillow_fallbacks`).

A random crop can take geometric ops to run on it (`then=`, an augmentation policy's
leading rotates, shears and translates: `pipeline.augment.levels.AffineRun`). Where the
crop is one bilinear resample of the decoded pixels, their matrices are folded into it:
one warp from the decoded image, reading only the box's region, whose border is the fill.
That saves each op's own pass over the crop (its resampling, edge and fill) and resamples
once instead of twice or more, so a folded op is a little sharper than the op run on the
crop (docs/LOADER.md, "Leading geometric ops are folded into the crop"). Other crops (box-averaged
shrinks, other filters, Pillow fallbacks) run the op on the crop after.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, fields
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from pipeline.affine import Matrix, compose
from pipeline.decode import Box, decode_crop, draft_scale
from pipeline.transforms import CenterCrop, CenterCropSpec, RandomCropSpec, RandomResizedCrop
from shards.image.bands import crop_band
from shards.image.geometry import RESAMPLING
from shards.image.policy import (
    FAST_JPEG_COLORSPACES,
    check_pixels,
    decode_jpeg_scaled,
    load_fast_backends,
    open_image,
    read_jpeg_header,
)

if TYPE_CHECKING:
    from pipeline.augment.levels import AffineRun

# Above this shrink factor (source box side / output side) a crop is box-averaged (OpenCV's
# INTER_AREA) instead of resized with OpenCV's bilinear, which is not antialiased: Pillow's
# filters are. DCT scaling keeps almost every crop below 2x. Up to 1.5x the bilinear alone
# differs little from Pillow, and the box average costs 3-4x the bilinear: measured on the
# loader's crops (docs/BENCHMARKS.md, "Decisions"; the study script is in git history), a
# threshold of 1.25 instead costs 256-px shards ~11% of a crop's time for the same PSNR
# against Pillow (53.5 dB pooled) and 512-px shards ~4% (51.6 dB pooled against 50.7).
# Higher thresholds alias visibly: at 1.75, bicubic crops to 96 px differ from Pillow by up
# to 2.1 grey levels on average. build-shards' resize keeps its own rule (bilinear up to 2x,
# `preprocess.images`).
AREA_SHRINK = 1.5
# OpenCV's InterpolationFlags values (cv2.INTER_NEAREST, _LINEAR, _CUBIC, _LANCZOS4), spelled
# out so this module imports without OpenCV.
WARP_FILTERS = {"nearest": 0, "bilinear": 1, "bicubic": 2, "lanczos": 4}
_INTEGRAL_EPS = 1e-6
# Source rows OpenCV's warp reads beyond a fractional box's edge: its widest kernel
# (Lanczos-4) spans 4 rows on each side; the edges replicate, so rows outside a band would
# not be the image's.
_WARP_REACH = 4
# Chroma upsampling. libjpeg's "fancy" triangle filter is what Pillow decodes with; its plain
# upsampling (each chroma sample repeated, merged with the colour conversion) decodes 10-15%
# faster. Crops the resize box-averages (shrunk by more than AREA_SHRINK after any DCT
# scaling) take the plain one: the average spans the repeated samples, so it costs them
# almost nothing. Measured on the loader's random crops of 800 512-px JPEGs against Pillow's
# output for the same boxes: pooled PSNR 50.6 -> 50.2 dB, the worst crop and the largest
# mean difference unchanged (39.6 dB, 1.87 levels), a crop 3.4% faster (1,000 JPEGs, 7
# interleaved rounds, medians); the odd images of tests/oddimages.py stay within 0.04 grey
# levels of Pillow. Every other crop keeps the triangle filter: there plain upsampling costs
# 1-4 dB, and up to 4 grey levels mean difference on small enlarged images (and the centre
# crop stays bit-exact with Pillow's on 256-px shards). The fast IDCT is not used:
# 1.05-1.08x (AVX2 already speeds up the accurate one) for ~46 dB.
PLAIN_UPSAMPLING_WHEN_AVERAGED = True


# Decoded pixels, the DCT scale they were decoded at, and the decoded column and row of their
# corner in the whole image at that scale.
_Decoded = tuple[np.ndarray, int, int, int]


class _Counts:
    """Per-process count of samples the fast crops handed to Pillow (forks copy it: the
    loader takes differences, never the absolute value)."""

    pillow_fallbacks = 0


def pillow_fallbacks() -> int:
    """Samples this process's fast crops decoded with Pillow so far (see the module docstring)."""
    return _Counts.pillow_fallbacks


class _FastCrop:
    """The validation, Pillow fallback and decode of both fast crops.

    Mixed into a `RandomCropSpec` or `CenterCropSpec` dataclass, which holds the
    arguments and chooses the crop; `pillow_class` is the matching Pillow transform.
    """

    pillow_class: ClassVar[type[RandomResizedCrop | CenterCrop]]
    # The loader may pass `out=`, a (size, size, 3) slot of the batch: the crop is resized
    # straight into it (no per-sample output array, no copy into the batch).
    writes_into: ClassVar[bool] = True
    # It takes `then=`, geometric ops to fold into the crop (the module docstring).
    folds_affine: ClassVar[bool] = True
    # JPEGs whose MCU rows start restart intervals are decoded only over the intervals under
    # the crop (`JpegCrop.decode_band`); benchmarks turn it off to time the whole decode.
    band_decode: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc] - the spec checks the arguments
        load_fast_backends()  # fail in the main process, not later in every worker

    @functools.cached_property
    def pillow(self) -> RandomResizedCrop | CenterCrop:
        """The Pillow transform with the same arguments (the fallback for non-JPEG input)."""
        names = [field.name for field in fields(self)]  # type: ignore[arg-type]
        return self.pillow_class(**{name: getattr(self, name) for name in names})

    def __call__(
        self,
        image_bytes: bytes,
        rng: random.Random,
        out: np.ndarray | None = None,
        then: AffineRun | None = None,
    ) -> np.ndarray:
        """Decode this transform's crop of `image_bytes` at `size` x `size`, flipped if drawn.

        Args:
            out: a C-contiguous uint8 (size, size, 3) array to write the crop into.
            then: geometric ops to apply to the crop, folded into its resize where the
                crop is one bilinear resample (see the module docstring).

        Returns:
            `out` when given, else a new writable array.

        Raises:
            SampleError: the bytes are not a decodable, allowed image within `max_pixels`.
        """
        header = read_jpeg_header(image_bytes)
        if header is None:
            return _then(_counted(self.pillow(image_bytes, rng, out), out), then)
        width, height, colorspace = header
        check_pixels(width, height, self.max_pixels)
        box, flip = self.choose_crop(width, height, rng)  # the Pillow transform's draws
        crop = JpegCrop(image_bytes, width, height, colorspace, self.band_decode)
        return crop.decode(
            box, self.size, self.resample, flip, self.draft, self.max_pixels, out, then
        )


def _then(pixels: np.ndarray, then: AffineRun | None) -> np.ndarray:
    """`pixels` with `then` run on them (on a writable copy if they are read-only)."""
    if then is None:
        return pixels
    if not pixels.flags.writeable or not pixels.flags.c_contiguous:
        pixels = np.array(pixels)
    then(pixels)
    return pixels


def _counted(pixels: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """A Pillow fallback's pixels, counted, and in `out` when given."""
    _Counts.pillow_fallbacks += 1
    if out is None or pixels is out:
        return pixels
    out[...] = pixels
    return out


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


@dataclass(frozen=True)
class JpegCrop:
    """One JPEG whose header was read: decodes a box of it at an output size."""

    data: bytes
    width: int
    height: int
    colorspace: str
    band_decode: bool = True  # decode only the box's rows where the JPEG allows it

    def decode(
        self,
        box: Box,
        size: int,
        resample: str,
        flip: bool,
        draft: bool,
        max_pixels: int,
        out: np.ndarray | None = None,
        then: AffineRun | None = None,
    ) -> np.ndarray:
        """Decode `box` (source pixels) resized to `size` x `size`, maybe mirrored, and
        `then` applied (folded into the resize where that is one bilinear resample).

        A colour space libjpeg-turbo should not convert, or any decoder complaint (simplejpeg
        is strict: a warning is an error), hands the same box to Pillow, which either
        decodes the image (a counted fallback) or raises the reason `pipeline.decode` gives.
        """
        scale = draft_scale(box[2] - box[0], box[3] - box[1], (size, size)) if draft else 1
        averaged = _shrink(box, size) / scale > AREA_SHRINK  # as `resize_box` decides
        plain = PLAIN_UPSAMPLING_WHEN_AVERAGED and averaged and resample != "nearest"
        fold = mapping = read = None
        if then is not None and resample == "bilinear" and not averaged:
            fold = then.centre_matrix(size, size)
        if fold is not None:  # a shifted crop reads only part of its box: decode that
            mapping = compose((_crop_matrix(_scaled(box, scale), size, flip), fold))
            read = _fold_region(_scaled(box, scale), size, mapping)
        decoded = None
        if self.colorspace in FAST_JPEG_COLORSPACES:
            band = box if read is None else tuple(float(edge * scale) for edge in read)
            decoded = self.decode_band(band, scale, plain) if self.band_decode else None
            if decoded is None:
                decoded = self.decode_scaled(scale, plain)
        if decoded is None:
            image = open_image(self.data, max_pixels)
            writable = out is None
            fallback = decode_crop(
                image, box, (size, size), RESAMPLING[resample], flip, draft, writable
            )
            return _then(_counted(fallback, out), then)
        pixels, decoded_scale, left, top = decoded
        scaled = _scaled(box, decoded_scale)
        if fold is None:
            crop = resize_box(pixels, scaled, size, resample, flip, out, origin=(left, top))
            return _then(crop, then)
        if decoded_scale != scale:  # a small image decoded whole at full scale instead
            mapping = compose((_crop_matrix(scaled, size, flip), fold))
            read = _fold_region(scaled, size, mapping)
        crop = _fold(pixels, read, mapping, size, then.fill, out, (left, top))
        then.paint_fills(crop)
        return crop

    def decode_band(self, box: Box, scale: int, plain: bool = False) -> _Decoded | None:
        """Only the restart intervals under `box`, decoded at 1/`scale`, or None.

        `plain`: libjpeg-turbo's plain chroma upsampling (see
        `PLAIN_UPSAMPLING_WHEN_AVERAGED`), which reads no chroma beyond an MCU.

        Only JPEGs whose every MCU row starts a restart interval (build-shards writes
        intervals of about 64 px) are cut (`shards.image.bands`). The band's pixels are
        bit-identical to those of the whole decode wherever the resize reads them: the cut
        keeps a guard around the box, and a fractional box is warped, which reads up to
        `_WARP_REACH` pixels beyond it, so those are in the band too. None: no usable
        markers, anything but stuffed bytes and restart markers in turn before the band's
        end (docs/RELIABILITY.md, "Band decode: the proof"), or the decoder refused the
        band; the whole file is then decoded, and judged, as without markers.
        """
        reach = 0 if _integral(tuple(edge / scale for edge in box)) else _WARP_REACH * scale
        band = crop_band(
            self.data,
            int(box[0]) - reach,
            int(box[1]) - reach,
            math.ceil(box[2]) + reach,
            math.ceil(box[3]) + reach,
            scale,
        )
        if band is None:
            return None
        pixels = decode_jpeg_scaled(band.data, band.width, band.height, scale, fast_upsample=plain)
        if pixels is None:
            return None
        return pixels, scale, band.left // scale, band.top // scale

    def decode_scaled(self, scale: int, plain: bool = False) -> _Decoded | None:
        """The whole image at 1/`scale`, or None if the decoder refuses the data.

        A small image whose nearest M/8 factor is not 1/`scale` is decoded in full instead
        (a refused one is tried again in full too, and refused again: bad data only).
        `plain`: as for `decode_band`.
        """
        fast = plain
        pixels = decode_jpeg_scaled(self.data, self.width, self.height, scale, fast_upsample=fast)
        if pixels is None and scale > 1:
            scale = 1
            pixels = decode_jpeg_scaled(self.data, self.width, self.height, 1, fast_upsample=fast)
        return None if pixels is None else (pixels, scale, 0, 0)


def resize_box(
    pixels: np.ndarray,
    box: Box,
    size: int,
    resample: str,
    flip: bool,
    out: np.ndarray | None = None,
    origin: tuple[int, int] = (0, 0),
) -> np.ndarray:
    """Resize `box` of an image to `size` x `size` with Pillow's sample positions.

    A whole-pixel box, or one shrunk by more than `AREA_SHRINK`, is sliced and resized
    (edges rounded to whole pixels: at most half an output pixel off when shrinking). A
    fractional box that is enlarged goes through an affine warp that samples where Pillow
    does, with the flip folded into the matrix.

    Args:
        out: a C-contiguous uint8 (size, size, 3) array to write into (a batch slot):
            OpenCV resizes into it and mirrors it in place, allocating nothing.
        origin: the (column, row) of the image where `pixels` starts: `pixels` may be a
            band of it that holds every pixel the resize reads; `box` is in the image's
            coordinates.

    Returns:
        `out`, or a new writable, C-contiguous uint8 array of shape (size, size, 3).
    """
    _, cv2 = load_fast_backends()
    shrink = _shrink(box, size)
    if shrink <= AREA_SHRINK and not _integral(box):
        canvas = _at_origin(pixels, origin)
        return _warp(cv2, canvas, box, size, WARP_FILTERS[resample], flip, out)
    left, top = round(box[0]), round(box[1])
    right, bottom = max(round(box[2]), left + 1), max(round(box[3]), top + 1)
    if resample == "nearest":
        interpolation = cv2.INTER_NEAREST_EXACT  # bit-exact with Pillow's nearest
    elif shrink > AREA_SHRINK:
        interpolation = cv2.INTER_AREA
    else:
        interpolation = WARP_FILTERS[resample]
    region = pixels[top - origin[1] : bottom - origin[1], left - origin[0] : right - origin[0]]
    if interpolation == cv2.INTER_AREA:
        region = _to_integral_shrink(cv2, region, size, shrink)
    out = cv2.resize(region, (size, size), dst=out, interpolation=interpolation)
    # The mirror runs in place (OpenCV swaps pixel pairs): no second array, and the result
    # never shares memory with `pixels` (resize always writes its own output).
    return cv2.flip(out, 1, dst=out) if flip else out


def _shrink(box: Box, size: int) -> float:
    """By how much the resize to `size` shrinks `box` along its longer side (< 1: enlarges)."""
    return max(box[2] - box[0], box[3] - box[1]) / size


def _at_origin(pixels: np.ndarray, origin: tuple[int, int]) -> np.ndarray:
    """`pixels` placed at `origin` of a larger array, whose other pixels are never read.

    OpenCV's warp computes sample positions in float32, so the same box translated by whole
    pixels can round differently (+-1 on a few pixels in 10^4): warping in the image's own
    coordinates keeps a band's crop bit-identical to the whole decode's. Only fractional
    boxes are warped (DCT-scaled random crops, centre crops), so the copy is rare.
    """
    left, top = origin
    if left == 0 and top == 0:
        return pixels
    height, width = pixels.shape[:2]
    canvas = np.empty((top + height, left + width, pixels.shape[2]), np.uint8)
    canvas[top:, left:] = pixels
    return canvas


def _to_integral_shrink(cv2: ModuleType, region: np.ndarray, size: int, shrink: float):
    """`region` resized (linearly) to `k * size` square, so INTER_AREA then shrinks by k.

    OpenCV's INTER_AREA is fast at integer ratios and slow at fractional ones: 0.7-1.5 ms
    for a 300-600 px crop to 224 against ~0.05 ms at 2:1 (one core). The linear step to
    `k = max(2, floor(shrink))` times the output keeps the box average that antialiases:
    against Pillow's output on the same boxes, 53.5 dB median (46.7 worst) with it and
    52.4 dB (47.9) with INTER_AREA alone, at 306 us instead of 685 (2.2x) per crop.
    """
    side = max(2, int(shrink)) * size
    if region.shape[0] == side and region.shape[1] == side:
        return region
    return cv2.resize(region, (side, side), interpolation=cv2.INTER_LINEAR)


def _crop_matrix(box: Box, size: int, flip: bool) -> tuple[float, ...]:
    """Output pixel centre x + 0.5 maps to source left + (x + 0.5) * sx: the 2 x 3 matrix
    (pixel centres), row by row."""
    left, top, right, bottom = box
    sx, sy = (right - left) / size, (bottom - top) / size
    # Flipped, output column x reads where unflipped column size - 1 - x would.
    offset = left + ((size - 0.5) if flip else 0.5) * sx - 0.5
    return (-sx if flip else sx, 0.0, offset, 0.0, sy, top + 0.5 * sy - 0.5)


def _as_cv2(matrix: tuple[float, ...]) -> np.ndarray:
    """A 2 x 3 matrix given row by row, as OpenCV takes it."""
    return np.array(matrix, dtype=np.float64).reshape(2, 3)


def _warp(
    cv2: ModuleType,
    pixels: np.ndarray,
    box: Box,
    size: int,
    interpolation: int,
    flip: bool,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Affine resample of `box` (`_crop_matrix`), edges repeated."""
    return cv2.warpAffine(
        pixels,
        _as_cv2(_crop_matrix(box, size, flip)),
        (size, size),
        dst=out,
        flags=interpolation | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_REPLICATE,
    )


def _scaled(box: Box, scale: int) -> Box:
    """`box` in the pixels of an image decoded at 1/`scale`."""
    return (box[0] / scale, box[1] / scale, box[2] / scale, box[3] / scale)


# Pixels a folded warp's region keeps past the points it samples (bilinear taps reach one
# past the point), where it cuts away part of the box no output pixel reads.
_FOLD_MARGIN = 2


def _fold_region(box: Box, size: int, mapping: Matrix) -> tuple[int, int, int, int]:
    """The whole pixels of `box` a folded warp reads: the box's region (edges rounded, at
    most half a pixel), less what no output pixel samples but `_FOLD_MARGIN` pixels.

    `mapping` takes each output pixel to the image point it reads (the crop's matrix
    composed with the folded ops'). A shift moves part of the crop out of the output: at
    timm's 0.45 x 0.9 of the side, 40% of the box is never read, so its JPEG band need
    not be decoded. The bounding box of the output square's corners, mapped into the
    image, bounds every point sampled, also those outside the box; a side is cut only
    where no point lies beyond it, so the region's border (the fill) stays where the
    box's edge is.
    """
    left, top = round(box[0]), round(box[1])
    right, bottom = max(round(box[2]), left + 1), max(round(box[3]), top + 1)
    a, b, c, d, e, f = mapping
    corners = ((-0.5, -0.5), (size - 0.5, -0.5), (-0.5, size - 0.5), (size - 0.5, size - 0.5))
    columns = [a * x + b * y + c for x, y in corners]
    rows = [d * x + e * y + f for x, y in corners]
    read_left = min(max(left, math.floor(min(columns)) - _FOLD_MARGIN), right - 1)
    read_top = min(max(top, math.floor(min(rows)) - _FOLD_MARGIN), bottom - 1)
    read_right = max(min(right, math.floor(max(columns)) + 2 + _FOLD_MARGIN), read_left + 1)
    read_bottom = max(min(bottom, math.floor(max(rows)) + 2 + _FOLD_MARGIN), read_top + 1)
    return read_left, read_top, read_right, read_bottom


def _fold(
    pixels: np.ndarray,
    read: tuple[int, int, int, int],
    mapping: Matrix,
    size: int,
    fill: tuple[int, int, int],
    out: np.ndarray | None,
    origin: tuple[int, int],
) -> np.ndarray:
    """The crop with geometric ops folded in: one bilinear warp of the decoded pixels,
    reading the box's region `read` (`_fold_region`) only, the fill outside it.

    `mapping` (pixel centres, `pipeline.affine`'s order: the crop's matrix composed with
    the ops') maps each output pixel to the image point the ops would read. The source is
    the box's region (edges rounded to whole pixels, at most half a source pixel), so the
    warp's constant border (`warp_filled`) is the first op's fill, its edge soft over one
    source pixel: the crop's enlargement in output pixels. A warp that also repeated the edge and
    painted Pillow's fill exactly cost 4x as much (+221 us a rotated crop against +56):
    nearly all the fold saves. The matrix is the region's own (the image's, shifted by
    the region's corner), so a band decode and the whole decode give the same bytes.
    """
    from pipeline.augment.warp import warp_filled  # OpenCV's side: loaded where folds run

    left, top, right, bottom = read
    region = pixels[top - origin[1] : bottom - origin[1], left - origin[0] : right - origin[0]]
    a, b, c, d, e, f = mapping
    return warp_filled(region, (a, b, c - left, d, e, f - top), (size, size), fill, out)


def _integral(box: Box) -> bool:
    return all(abs(value - round(value)) < _INTEGRAL_EPS for value in box)
