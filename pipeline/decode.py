"""Per-sample decoding for the streaming loader: sample fields -> label, image bytes -> pixels.

Runs inside DataLoader workers on the shuffled, still-encoded samples; `pipeline.transforms`
builds its crops on `open_image` + `decode_crop`. Bad data raises `SampleError`, which the
loader skips and counts; programming errors (TypeError, a bad box from our own code) propagate.

Error reasons raised here:
    no_image, no_label, bad_label   a sample without an image field, or with a broken `cls`.
    unidentified        not a JPEG, PNG or WEBP (garbage bytes, or a format we never decode:
                        BMP, EPS, PDF, ... are refused unparsed by `formats=`).
    too_many_pixels     the header declares more than `max_pixels` (checked before decoding),
                        or Pillow's own decompression-bomb guard fired.
    truncated           the data ends early (`LOAD_TRUNCATED_IMAGES` stays False).
    decode_error        any other exception of Pillow's fuzzing set while opening or decoding;
                        the detail names the exception class.
Image errors name the cause, not the sample (transforms see only bytes): the caller adds the
sample's `__key__` and `__url__`.

`open_image` turns Pillow's DecompressionBombWarning into an error with
`warnings.catch_warnings`, which swaps process-wide filter state: decode in one thread per
process, as DataLoader workers do.
"""

from __future__ import annotations

import warnings
from io import BytesIO

import numpy as np
from PIL import Image, ImageFile, UnidentifiedImageError

from shards.imagedata import DECODER_ERRORS, riff_truncated
from shards.sample import IMAGE_FIELDS, Sample, SampleError

# Formats the loader lets Pillow parse: exactly what `preprocess build-shards` writes.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")
RESAMPLING = {
    "nearest": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "lanczos": Image.Resampling.LANCZOS,
}
# A box at least this many times the output is first box-reduced by an integer factor:
# cheap for large PNG/WEBP sources, which have no DCT scaling. Same value as preprocess.
REDUCING_GAP = 2.0
# Transparent pixels are composited onto white, as `preprocess` does for its shards.
BACKGROUND = (255, 255, 255)

Box = tuple[float, float, float, float]  # (left, top, right, bottom), Pillow's convention

_ALPHA_MODES = frozenset(("RGBA", "LA", "PA", "RGBa", "La"))
_DCT_SCALES = (8, 4, 2)  # what libjpeg can decode to directly: 1/8, 1/4, 1/2
_MAX_LABEL_DIGITS = 18  # fits int64; anything longer is garbage, not a class index


def image_field_of(sample: Sample) -> str:
    """Return the name of the image field a sample holds: `jpg`, `webp` or `png`.

    Fields are tried in that order, so a sample holding several uses the first.

    Raises:
        SampleError: `no_image` when the sample holds none of them.
    """
    for field in IMAGE_FIELDS:
        if field in sample:
            return field
    fields = sorted(name for name in sample if not name.startswith("__"))
    raise SampleError(
        "no_image",
        f"sample {sample.get('__key__')!r} has no {'/'.join(IMAGE_FIELDS)} field "
        f"(fields: {', '.join(fields) or 'none'})",
    )


def decode_label(sample: Sample) -> int:
    """Return the class index stored in the sample's `cls` field (ASCII digits, e.g. `b"3"`).

    Raises:
        SampleError: `no_label` when `cls` is missing, `bad_label` when it is not a
            non-negative integer of at most 18 digits.
    """
    key = sample.get("__key__")
    if "cls" not in sample:
        raise SampleError("no_label", f"sample {key!r} has no cls field")
    value = sample["cls"]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value  # already decoded by a user's own reader stage
    text = value.encode("ascii", "replace") if isinstance(value, str) else value
    if isinstance(text, (bytes, bytearray)):
        text = text.strip()
        # bytes.isdigit() is ASCII-only, so no sign, no underscores, no Unicode digits.
        if 0 < len(text) <= _MAX_LABEL_DIGITS and text.isdigit():
            return int(text)
    raise SampleError(
        "bad_label", f"sample {key!r}: cls {value!r:.40} is not a non-negative integer"
    )


def open_image(data: bytes, max_pixels: int) -> ImageFile.ImageFile:
    """Read the header of an encoded image without decoding its pixels.

    Only the plugins in `ALLOWED_FORMATS` ever see the bytes, so no other parser (and
    never Ghostscript) runs on shard data.

    Args:
        data: encoded JPEG, PNG or WEBP bytes.
        max_pixels: largest `width * height` accepted, checked on the header.

    Returns:
        The lazily opened image: `.size` and `.format` are known, pixels are not decoded.

    Raises:
        SampleError: `unidentified`, `too_many_pixels`, `truncated` or `decode_error`.
    """
    with warnings.catch_warnings():
        # Pillow only warns between MAX_IMAGE_PIXELS and twice that; here a warning is a skip.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(BytesIO(data), formats=ALLOWED_FORMATS)
        except UnidentifiedImageError as error:
            raise SampleError(
                "unidentified",
                f"{type(error).__name__}: not a {', '.join(ALLOWED_FORMATS)} image "
                f"(starts with {bytes(data[:8])!r})",
            ) from error
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise SampleError("too_many_pixels", f"{type(error).__name__}: {error}") from error
        except DECODER_ERRORS as error:
            raise _classify(error, data) from error
    width, height = image.size
    if width * height > max_pixels:
        raise SampleError(
            "too_many_pixels", f"header says {width}x{height} = {width * height} > {max_pixels}"
        )
    return image


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
    try:
        image.load()
    except DECODER_ERRORS as error:
        raise _classify(error) from error
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
    room = min(box_width / size[0], box_height / size[1])
    for scale in _DCT_SCALES:
        if room >= scale:
            return scale
    return 1


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert a loaded image of any mode to RGB; returns `image` itself when already RGB.

    Transparency is composited onto white. 16-bit greys keep their high byte (Pillow's own
    conversion would clip everything above 255 to white).
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I;16"):
        grey = Image.fromarray((np.asarray(image) >> 8).astype(np.uint8))
        return grey.convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGB", rgba.size, BACKGROUND)
        canvas.paste(rgba, None, rgba)  # the RGBA image is its own mask: one blend pass
        return canvas
    return image.convert("RGB")


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


def _classify(error: BaseException, data: bytes = b"") -> SampleError:
    """Map an exception raised by a Pillow decoder to a `SampleError` reason."""
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, EOFError) or "truncated" in str(error) or riff_truncated(data):
        return SampleError("truncated", detail)
    return SampleError("decode_error", detail)
