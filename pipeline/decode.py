"""Per-sample decoding for the streaming loader: sample fields -> label, image bytes -> pixels.

Runs inside DataLoader workers on the shuffled, still-encoded samples; `pipeline.transforms`
builds its crops on `open_image` + `decode_crop`. Bad data raises `SampleError`, which the
loader skips and counts; programming errors (TypeError, a bad box from our own code) propagate.

Error reasons raised here:
    no_image, no_label, bad_label   a sample without an image field, or with a broken `cls`.
    unidentified        not a JPEG, PNG or WEBP (garbage bytes, or a format we never decode:
                        BMP, EPS, PDF, ... are refused unparsed by `formats=`; the detail
                        names what the magic bytes say).
    too_many_pixels     the header declares more than `max_pixels` (checked before decoding),
                        or Pillow's own decompression-bomb guard fired.
    truncated           the data ends early (`LOAD_TRUNCATED_IMAGES` stays False).
    decode_error        any other exception of Pillow's fuzzing set while opening or decoding;
                        the detail names the exception class.
Image errors name the cause, not the sample (transforms see only bytes): the caller adds the
sample's `__key__` and `__url__`. The rules themselves (allowlist, pixel cap, truncation, modes
and alpha: composited onto white, as build-shards does) are `shards.image.policy`'s; this module
keeps only the crop geometry; the filters and the DCT scale rule are `shards.image.geometry`'s,
shared with build-shards.

`open_image` turns Pillow's DecompressionBombWarning into an error with
`warnings.catch_warnings`, which swaps process-wide filter state: decode in one thread per
process, as DataLoader workers do.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageFile

from shards.image.geometry import REDUCING_GAP, dct_scale
from shards.image.policy import load_image, to_rgb

Box = tuple[float, float, float, float]  # (left, top, right, bottom), Pillow's convention


def decode_crop(
    image: ImageFile.ImageFile,
    box: Box,
    size: tuple[int, int],
    resample: Image.Resampling = Image.Resampling.BILINEAR,
    flip: bool = False,
    draft: bool = True,
    writable: bool = True,
) -> np.ndarray:
    """Decode `box` of an image opened by `open_image` and resize it to `size`.

    For a JPEG whose box is at least twice `size` on both axes, libjpeg decodes at 1/2,
    1/4 or 1/8 scale (DCT scaling, `draft`), never below `size`, so the final resize
    still downsamples and the geometry is that of a full decode.

    Args:
        image: an image from `open_image`, not yet loaded.
        box: source region (left, top, right, bottom) in header coordinates.
        size: output (width, height).
        resample: Pillow filter; bilinear and up are antialiased when downscaling.
        flip: mirror the output left-right.
        draft: allow DCT-scaled JPEG decoding.
        writable: return a writable copy; False returns a read-only view of Pillow's
            pixel bytes, one copy (~30 us for 224 px) fewer, for callers that copy anyway.

    Returns:
        A C-contiguous uint8 array of shape (height, width, 3).

    Raises:
        SampleError: `truncated` or `decode_error` from the decoder.
    """
    if draft and image.format in ("JPEG", "MPO"):
        box = _draft(image, box, size)
    load_image(image)
    rgb = to_rgb(image)
    out = rgb.resize(size, resample, box=box, reducing_gap=REDUCING_GAP)
    if flip:
        # Pillow flips its 4-byte pixels in ~30 us; a numpy flip of 3-byte pixels plus the
        # contiguous copy costs ~250 us.
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    # asarray is a read-only view of `tobytes()`: torch warns on (and user transforms fail
    # on) read-only arrays, so callers get a copy unless they say they copy anyway.
    return np.array(out) if writable else np.asarray(out)


def draft_scale(box_width: float, box_height: float, size: tuple[int, int]) -> int:
    """Largest DCT scale divisor (1, 2, 4 or 8) that keeps the box at least `size` on each side."""
    return dct_scale(min(box_width / size[0], box_height / size[1]))


def _draft(image: ImageFile.ImageFile, box: Box, size: tuple[int, int]) -> Box:
    """Ask libjpeg for a DCT-scaled decode if the box allows; return the box in new coordinates."""
    scale = draft_scale(box[2] - box[0], box[3] - box[1], size)
    if scale == 1:
        return box
    width, height = image.size
    # Pillow picks the largest power of two <= min(width // w, height // h); for this request
    # that is exactly `scale`.
    result = image.draft("RGB", (width // scale, height // scale))  # "RGB" keeps L and CMYK
    if result is None:
        return box  # a JPEG Pillow cannot scale (several tiles): decode in full
    # `result` holds the original extent in decoded pixels, (0, 0, width / s, height / s):
    # the exact DCT factor, which `image.size` (rounded up) is not.
    extent = result[1]
    fx, fy = extent[2] / width, extent[3] / height
    return (box[0] * fx, box[1] * fy, box[2] * fx, box[3] * fy)
