"""Pillow's affine `Image.transform` on the uint8 crop: the policies' rotate, shear and translate.

Pillow maps output pixel (x, y) to the input point `matrix . (x + 0.5, y + 0.5, 1)`, fills
where that point falls outside the image and otherwise interpolates with the edge repeated
(bilinear, or bicubic with a = -1, its `Geometry.c`), truncating to uint8. A translation
moves every row (or column) alike: one 1-D `cv2.filter2D` with Pillow's weights (or a
copy), the fill exactly Pillow's. Any other bilinear matrix (rotation, shear) is one
`cv2.warpAffine` with the fill as its constant border, as the crop's fold does
(`pipeline.fast_transforms`): 51-54 dB from Pillow a pixel away from the fill's edge,
the edge soft over one pixel, the fill beyond it exactly Pillow's. Bicubic keeps
Pillow's hard edge: a bicubic shear moves each row with Pillow's weights (each row
gathered at its whole shift, one weighted sum of 4 shifted views, `numpy.einsum`; within
a value of Pillow, where OpenCV's 2-D bicubic warp, a scalar loop at ~6x the time, is 51
dB), a rotation is a bilinear warp of the image upsampled 2x by `cv2.resize`'s bicubic
(SIMD), at half the time of OpenCV's bicubic warp and within 1 dB of it; each row's
inside span is solved from the matrix, a row whose edge falls within 1e-6 of a pixel
centre scanned with Pillow's double arithmetic, and the fill painted outside.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import cv2
import numpy as np

from pipeline.affine import centre_matrix
from pipeline.augment.ops import NUDGE, solid

RESAMPLE = {"nearest": cv2.INTER_NEAREST, "bilinear": cv2.INTER_LINEAR, "bicubic": cv2.INTER_CUBIC}
_TAPS = {"bilinear": 2, "bicubic": 4}  # interpolation taps; bicubic's start one to the left
_MARGIN = 2  # bicubic's taps reach 2 pixels past a point inside the image


def affine(pixels: np.ndarray, matrix: Sequence[float], resample: str, fill: Sequence[int]) -> None:
    """`img.transform(img.size, Image.AFFINE, matrix, resample, fillcolor=fill)`, in place.

    Translations: 1-D interpolation, the fill exactly Pillow's. Other bilinear matrices:
    one soft-edged warp (`_warp_bilinear`), as the crop's fold. Bicubic shears: rows
    moved with Pillow's weights; the rest: `_warp`, the fill exactly Pillow's.
    """
    a, b, c, d, e, f = map(float, matrix)
    if resample in _TAPS and a == 1.0 and e == 1.0 and b == 0.0 and d == 0.0:
        if f.is_integer():  # translate-x
            _translate(pixels, c, int(f), 1, resample, fill)
            return
        if c.is_integer():  # translate-y
            _translate(pixels, f, int(c), 0, resample, fill)
            return
    if resample == "bilinear":
        _warp_bilinear(pixels, (a, b, c, d, e, f), fill)
        return
    if resample in _TAPS and a == 1.0 and e == 1.0:
        if d == 0.0 and f.is_integer():  # rows move along x: shear-x
            _shift_rows(pixels, b, c, int(f), resample, fill)
            return
        if b == 0.0 and c.is_integer():  # columns move along y: the same, transposed
            work = cv2.transpose(pixels)
            _shift_rows(work, d, f, int(c), resample, fill)
            cv2.transpose(work, dst=pixels)
            return
    _warp(pixels, (a, b, c, d, e, f), resample, fill)


def _warp_bilinear(pixels: np.ndarray, matrix: tuple[float, ...], fill: Sequence[int]) -> None:
    """Pillow's transform as one soft-edged warp of a copy (`warp_filled`), in place.

    Why not Pillow's hard edge, as `_warp` paints it: solving and painting it (and, for a
    shear, Pillow's own weights) cost 2-3x the warp (about 290 us a rotation or shear
    after another op in a loader worker, against 130), for the edge pixels alone.
    """
    height, width = pixels.shape[:2]
    warp_filled(pixels.copy(), centre_matrix(matrix), (width, height), fill, pixels)


def warp_filled(
    source: np.ndarray,
    matrix: Sequence[float],
    size: tuple[int, int],
    fill: Sequence[int],
    out: np.ndarray | None = None,
) -> np.ndarray:
    """One bilinear `cv2.warpAffine` of `source` to `size` (width, height), output pixel
    (x, y) reading the point `matrix` (pixel centres, `pipeline.affine`'s order) gives,
    the fill as OpenCV's constant border: where the point is outside `source` the fill,
    within half a source pixel of its edge the fill and the edge pixel blended (Pillow's
    hard edge made soft over one source pixel, centred where Pillow's is). The way of a
    geometric op run on the crop (`_warp_bilinear`) and of one folded into it
    (`pipeline.fast_transforms`)."""
    return cv2.warpAffine(
        source,
        np.array(matrix, dtype=np.float64).reshape(2, 3),
        size,
        dst=out,
        flags=cv2.INTER_LINEAR | cv2.WARP_INVERSE_MAP,
        borderMode=cv2.BORDER_CONSTANT,
        borderValue=tuple(float(value) for value in fill),
    )


def rotate_matrix(degrees: float, width: int, height: int) -> list[float]:
    """The matrix Pillow's `img.rotate(degrees)` hands to `transform` (about the centre)."""
    angle = -math.radians(degrees)
    matrix = [
        round(math.cos(angle), 15),
        round(math.sin(angle), 15),
        0.0,
        round(-math.sin(angle), 15),
        round(math.cos(angle), 15),
        0.0,
    ]
    cx, cy = width / 2, height / 2
    a, b, _, d, e, _ = matrix
    matrix[2] = a * -cx + b * -cy + cx
    matrix[5] = d * -cx + e * -cy + cy
    return matrix


def fill_outside(pixels: np.ndarray, matrix: Sequence[float], fill: Sequence[int]) -> None:
    """Paint `fill` exactly where Pillow's transform with `matrix`, of an image of
    `pixels`' size, fills: for an op whose resampling was folded into the crop."""
    height, width = pixels.shape[:2]
    _fill_outside(pixels, inside_spans(matrix, width, height), fill)


def _warp(pixels: np.ndarray, matrix: tuple[float, ...], resample: str, fill) -> None:
    """Any matrix through `cv2.warpAffine`, edge repeated, then Pillow's fill.

    Pillow samples at pixel centres in a frame whose pixels span [i, i + 1); OpenCV at
    integer centres, so the offsets shift by a half pixel each way. Every point Pillow
    samples (not fills) has its taps within 2 pixels of the image, so the source gets a
    2-pixel repeated edge and OpenCV's constant border (its faster path: 110 against 150
    us bilinear at 224 px) is never read where it shows.

    Bicubic: OpenCV's bicubic warp is a scalar loop (~860 us at 224 px); instead the
    bordered source is upsampled 2x by `cv2.resize`'s bicubic (a SIMD pass) and warped
    bilinear at the doubled matrix (~440 us). Against Pillow's bicubic that is 50.4-51.1
    dB on the test photo where the bicubic warp was 51.2-52.0 (both a = -0.75 where
    Pillow's is -1; the bilinear step between half-pixel samples costs the 1 dB).
    """
    a, b, c, d, e, f = matrix
    margin = _MARGIN
    scale = 2 if resample == "bicubic" else 1
    # Pillow's input point u (pixel edges at whole numbers) is index scale (u + margin) - 0.5
    # of the bordered source, upsampled by scale
    inverse = np.array(
        [
            [a, b, c + (a + b) / 2 + margin],
            [d, e, f + (d + e) / 2 + margin],
        ],
        dtype=np.float64,
    )
    inverse *= scale
    inverse[:, 2] -= 0.5
    height, width = pixels.shape[:2]
    source = cv2.copyMakeBorder(pixels, margin, margin, margin, margin, cv2.BORDER_REPLICATE)
    if scale > 1:
        source = cv2.resize(source, None, fx=scale, fy=scale, interpolation=cv2.INTER_CUBIC)
        resample = "bilinear"
    flags = RESAMPLE[resample] | cv2.WARP_INVERSE_MAP
    cv2.warpAffine(
        source, inverse, (width, height), dst=pixels, flags=flags, borderMode=cv2.BORDER_CONSTANT
    )
    _fill_outside(pixels, inside_spans(matrix, width, height), fill)


def _shift_rows(
    pixels: np.ndarray, shear: float, shift: float, row_shift: int, resample: str, fill
) -> None:
    """Output row y is input row y + `row_shift`, sampled at x + `shear` (y + 0.5) + `shift`."""
    height, width = pixels.shape[:2]
    row_terms = shear * (np.arange(height) + 0.5)
    offsets = row_terms + shift  # Pillow's x_in - 0.5, less x
    whole = np.floor(offsets)
    _shift_rows_each(pixels, whole, offsets - whole, row_shift, resample)
    _fill_outside(pixels, _row_spans(row_terms, shift, row_shift, width), fill)


# Pillow's weights of the taps as polynomials in the fraction d: [1, d, d^2, d^3] @ this.
# Bilinear a + d (b - a); bicubic p1 + d (p2 + d (p3 + d p4)) of its BICUBIC macro (a = -1).
_POLYNOMIALS = {
    "bilinear": np.array([[1, 0], [-1, 1]], dtype=np.float64),
    "bicubic": np.array(
        [[0, 1, 0, 0], [-1, 0, 1, 0], [2, -2, 1, -1], [-1, 1, -1, 1]], dtype=np.float64
    ),
}


def _weights(fraction: np.ndarray, resample: str) -> np.ndarray:
    """Pillow's interpolation weights (len(fraction), taps) at each `fraction` in [0, 1)."""
    if resample == "bilinear":  # [1 - d, d]: the polynomial's values, without its matmul
        weights = np.empty((len(fraction), 2), dtype=np.float32)
        np.subtract(1.0, fraction, out=weights[:, 0])
        weights[:, 1] = fraction
        return weights
    polynomial = _POLYNOMIALS[resample]
    powers = np.empty((len(fraction), len(polynomial)))
    powers[:, 0] = 1.0
    for degree in range(1, len(polynomial)):
        np.multiply(powers[:, degree - 1], fraction, out=powers[:, degree])
    return (powers @ polynomial).astype(np.float32)


def _padded(pixels: np.ndarray, whole_min: int, whole_max: int, taps: int, axis: int = 1) -> tuple:
    """`pixels` with the edge lines along `axis` repeated as far as the taps reach:
    (array, padding before less the taps' lead)."""
    first = taps // 2 - 1  # taps start this far before the whole shift
    before = max(0, first - whole_min)
    after = max(0, whole_max - first + taps - 1)
    sides = (0, 0, before, after) if axis == 1 else (before, after, 0, 0)
    padded = cv2.copyMakeBorder(pixels, *sides, cv2.BORDER_REPLICATE)
    return padded, before - first


def _shift_rows_each(
    pixels: np.ndarray, whole: np.ndarray, fraction: np.ndarray, row_shift: int, resample: str
) -> None:
    """A shear: each row gathered at its whole shift, then one weighted sum of the taps.

    The taps of a point Pillow samples lie within `_MARGIN` columns of the image, so the
    rows get only that much repeated edge (and as many spare rows above and below): a
    row's window may run on into the next row's bytes, but only under points Pillow fills,
    which `_fill_outside` paints after.
    """
    height, width = pixels.shape[:2]
    taps, margin = _TAPS[resample], _MARGIN
    padded = cv2.copyMakeBorder(pixels, margin, margin, margin, margin, cv2.BORDER_REPLICATE)
    window = (width + taps - 1) * 3
    # past the image: all fill (`np.clip`'s Python wrapper costs more than its pass here)
    whole = np.minimum(np.maximum(whole, -width - margin), width + margin).astype(np.int64)
    rows = np.minimum(np.maximum(np.arange(height) + row_shift, 0), height - 1) + margin
    starts = rows * padded.shape[1] * 3 + (margin - (taps // 2 - 1) + whole) * 3
    gathered = _windows(padded.reshape(-1), window)[starts].astype(np.float32)
    views = _strided(gathered, (height, taps, width * 3), (gathered.strides[0], 12, 4))
    out = np.einsum("yk,ykx->yx", _weights(fraction, resample), views)
    _truncate(out, pixels.reshape(height, -1), signed=resample == "bicubic")


def _truncate(values: np.ndarray, out: np.ndarray, signed: bool = True) -> None:
    """Pillow's clip and truncation of float32 `values` (nudged up by `NUDGE`) into uint8.

    Negative values (bicubic's undershoot; `signed`) to 0 first; then |v + NUDGE - 0.5|
    rounded (OpenCV saturates at 255) is the truncation of v + NUDGE: SIMD passes.
    """
    if signed:
        cv2.threshold(values, 0, 0, cv2.THRESH_TOZERO, dst=values)
    cv2.convertScaleAbs(values, dst=out, alpha=1.0, beta=NUDGE - 0.5)


def _translate(
    pixels: np.ndarray, shift: float, cross_shift: int, axis: int, resample: str, fill
) -> None:
    """A translation by `shift` along `axis` (1: x, 0: y) and a whole `cross_shift` across:
    every line alike, so one 1-D filter (or a copy) of what stays inside, and fill slabs."""

    def index(along: slice, across: slice) -> tuple:
        return (across, along) if axis == 1 else (along, across)

    size, cross_size = pixels.shape[axis], pixels.shape[1 - axis]
    low, high = _first_inside(0.0, shift, size), _first_inside(float(size), shift, size)
    top, bottom = max(0, -cross_shift), min(cross_size, cross_size - cross_shift)
    if low < high and top < bottom:
        whole = math.floor(shift)
        taps = _TAPS[resample]
        padded, origin = _padded(pixels, whole, whole, taps, axis)
        start = origin + whole + low
        lines = slice(top + cross_shift, bottom + cross_shift)
        source = padded[index(slice(start, start + high - low + taps - 1), lines)]
        if shift == whole:  # a whole-pixel shift: Pillow's weights are 0 and 1, a copy
            first = taps // 2 - 1
            moved = source[index(slice(first, first + high - low), slice(None))]
        else:
            kernel = _weights(np.array([shift - whole]), resample)
            moved = cv2.filter2D(
                source,
                -1,
                kernel if axis == 1 else kernel.T,
                anchor=(0, 0),
                delta=-0.5 + NUDGE,
                borderType=cv2.BORDER_REPLICATE,
            )[index(slice(0, high - low), slice(None))]
        pixels[index(slice(low, high), slice(top, bottom))] = moved
    else:
        top = bottom = low = high = 0
    color = _fill_image(tuple(int(value) for value in fill), *pixels.shape[:2])
    for part in (
        index(slice(None), slice(None, top)),
        index(slice(None), slice(bottom, None)),
        index(slice(None, low), slice(top, bottom)),
        index(slice(high, None), slice(top, bottom)),
    ):
        pixels[part] = color[part]


def _first_inside(limit: float, shift: float, width: int) -> int:
    """The first x in [0, width] whose x_in = (x + 0.5) + shift (Pillow's double) >= limit."""
    x = min(max(math.ceil(limit - shift - 0.5), 0), width)
    while x > 0 and (x - 0.5) + shift >= limit:
        x -= 1
    while x < width and (x + 0.5) + shift < limit:
        x += 1
    return x


def inside_spans(matrix: Sequence[float], width: int, height: int) -> tuple:
    """Per output row, the columns [low, high) whose input point Pillow samples (not fills).

    Pillow fills where x_in = a (x + 0.5) + b (y + 0.5) + c is outside [0, width) or y_in
    (d, e, f) outside [0, height). Both are linear in x, so a row's inside is one span,
    solved in closed form; a row where an edge crossing falls within 1e-6 of a pixel
    centre (where double rounding could decide) is scanned with Pillow's own arithmetic.
    """
    a, b, c, d, e, f = (float(value) for value in matrix)
    centres = np.arange(height) + 0.5
    rows_x, rows_y = b * centres, e * centres
    # per row, where x_in meets 0 and width and y_in meets 0 and height (x + 0.5 = ...)
    rests = np.empty((4, height))  # numpy's Python wrappers (stack, clip) cost more here
    np.subtract(-c, rows_x, out=rests[0])
    np.subtract(width - c, rows_x, out=rests[1])
    np.subtract(-f, rows_y, out=rests[2])
    np.subtract(height - f, rows_y, out=rests[3])
    slopes = np.array([a, a, d, d])[:, None]
    flat = slopes == 0  # x_in (or y_in) the same all along the row
    crossings = np.divide(rests, slopes, out=np.zeros((4, height)), where=~flat) - 0.5
    near = (np.abs(crossings - np.round(crossings)) < 1e-6).any(axis=0)
    # first x past each crossing: inside starts at 0's crossing when rising, else limit's
    starts = np.where(slopes > 0, np.ceil(crossings), np.floor(crossings) + 1)
    starts = np.minimum(np.maximum(starts, 0), width)
    spans = []
    for slope, (zero, limit), rest_zero, rest_limit in (
        (a, starts[:2], rests[0], rests[1]),
        (d, starts[2:], rests[2], rests[3]),
    ):
        if slope == 0.0:  # inside all along the row, or nowhere: 0 <= value < limit
            inside = (rest_zero <= 0) & (rest_limit > 0)
            spans.append((np.where(inside, 0, width), np.full(height, width)))
        else:
            spans.append((zero, limit) if slope > 0 else (limit, zero))
    low = np.maximum(spans[0][0], spans[1][0]).astype(np.int64)
    high = np.maximum(low, np.minimum(spans[0][1], spans[1][1])).astype(np.int64)
    near_rows = np.flatnonzero(near)
    if near_rows.size:
        columns = np.arange(width) + 0.5
        # Pillow's a0 * xin + a1 * yin + a2, every column of the near rows at once
        x_in = a * columns + rows_x[near_rows, None]
        x_in += c
        y_in = d * columns + rows_y[near_rows, None]
        y_in += f
        inside = (x_in >= 0) & (x_in < width) & (y_in >= 0) & (y_in < height)
        low[near_rows], high[near_rows] = _first_and_end(inside)
    return low, high


def _first_and_end(inside: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a boolean matrix whose True values are one run: its [first, end), or
    (0, 0) for a row without any. One set of numpy calls for every row (a row at a time
    cost ~10 us each, and a shear by 0.2 has a near row in every 5)."""
    width = inside.shape[1]
    any_inside = inside.any(axis=1)
    first = np.where(any_inside, inside.argmax(axis=1), 0)
    end = np.where(any_inside, width - inside[:, ::-1].argmax(axis=1), 0)
    return first, end


def _row_spans(row_terms: np.ndarray, shift: float, row_shift: int, width: int) -> tuple:
    """`inside_spans` of a row shift (matrix 1, b, c, 0, 1, f): x_in = (x + 0.5) + b y_in + c.

    Closed form; a row whose edge crossing falls within 1e-6 of a pixel centre is scanned
    with Pillow's double arithmetic in its order.
    """
    height = len(row_terms)
    crossings = np.empty((2, height))
    np.subtract(-shift, row_terms, out=crossings[0])  # Pillow's x_in at 0 and width, less 0.5
    np.subtract(width - shift, row_terms, out=crossings[1])
    crossings -= 0.5
    low, high = np.minimum(np.maximum(np.ceil(crossings), 0), width).astype(np.int64)
    near_rows = np.flatnonzero((np.abs(crossings - np.round(crossings)) < 1e-6).any(axis=0))
    if near_rows.size:
        x_in = (np.arange(width) + 0.5) + row_terms[near_rows, None]  # Pillow's order
        x_in += shift
        inside = (x_in >= 0) & (x_in < width)
        low[near_rows], high[near_rows] = _first_and_end(inside)
    outside = slice(None, max(0, -row_shift)), slice(min(height, height - row_shift), None)
    for rows in outside:  # input row y + row_shift off the image: all fill
        low[rows] = high[rows] = 0
    return low, np.maximum(low, high)


@functools.lru_cache(maxsize=8)
def _fill_image(fill: tuple[int, ...], height: int, width: int) -> np.ndarray:
    """A cached read-only image of the fill colour (policies reuse one fill and size)."""
    return solid(fill, height, width)


def _strided(base: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A read-only view of C-contiguous `base`'s memory: numpy's `as_strided` without its
    Python overhead (~7 us a call, against a shear's 200); numpy checks it stays inside."""
    view = np.ndarray(shape, base.dtype, base, 0, strides)
    view.flags.writeable = False
    return view


def _windows(flat: np.ndarray, width: int) -> np.ndarray:
    """Every `width`-long window of 1-D `flat`, as a view: row i is flat[i : i + width]."""
    return _strided(flat, (len(flat) - width + 1, width), (flat.strides[0],) * 2)


@functools.lru_cache(maxsize=8)
def _step_windows(width: int) -> np.ndarray:
    """The windows of `width` ones then `width` zeros: each is a row of a span mask."""
    return _windows(np.repeat(np.array([1, 0], dtype=np.uint8), width), width)


def _fill_outside(pixels: np.ndarray, spans: tuple, fill: Sequence[int]) -> None:
    """Paint `fill` outside each row's [low, high): a mask of the spans, one masked copy.

    Row y of the mask is a window of `_steps`: ones before low (window at width - low),
    and ones from high on (1 minus the window at width - high); gathering 2 windows a row
    costs a quarter of numpy's broadcast comparisons.
    """
    low, high = spans
    height, width = pixels.shape[:2]
    if (low == 0).all() and (high == width).all():
        return
    windows = _step_windows(width)
    outside = windows[width - low]
    np.bitwise_or(outside, 1 - windows[width - high], out=outside)
    color = _fill_image(tuple(int(value) for value in fill), height, width)
    cv2.copyTo(color, outside, pixels)
