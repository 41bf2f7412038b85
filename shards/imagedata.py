"""The image-decode policy shared by the sharder, the loader and `preprocess verify`.

Which formats may be parsed, the pixel cap, how Pillow's exceptions on hostile bytes
are sorted (data errors are skipped and counted, anything else is a bug), and how a
truncated file is told from a corrupt one. Torch-free, so `preprocess` uses it too.
"""

from __future__ import annotations

import warnings
from io import BytesIO

from PIL import Image, ImageFile, UnidentifiedImageError

from shards.sample import SampleError

# Formats the loader lets Pillow parse, and `preprocess verify` checks shards against:
# exactly what `preprocess build-shards` writes.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")
# The loader's default pixel cap (its transforms' `max_pixels`), which verify applies too.
MAX_PIXELS = 64_000_000

# Exceptions Pillow's own fuzzers accept from decoders of hostile files
# (Tests/oss-fuzz), plus EOFError, raised by some plugins on data that stops
# early. MemoryError counts as data: the pixel cap bounds what a legitimate
# image may allocate, so running out points at the file.
DECODER_ERRORS = (
    OSError,
    SyntaxError,
    ValueError,
    NotImplementedError,
    OverflowError,
    EOFError,
    MemoryError,
)


def riff_truncated(data: bytes) -> bool:
    """True for a WebP whose RIFF header declares more bytes than there are.

    libwebp reports such a file only as "could not create decoder object",
    so the length check is what tells a cut file from a corrupt one.
    """
    if not (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return False
    return int.from_bytes(data[4:8], "little") + 8 > len(data)


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
            raise classify_decoder_error(error, data) from error
    width, height = image.size
    if width * height > max_pixels:
        raise SampleError(
            "too_many_pixels", f"header says {width}x{height} = {width * height} > {max_pixels}"
        )
    return image


def check_image(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Decode an image in full exactly as the loader would judge it; return its size.

    `preprocess verify` calls this so that a shard it passes is read by the loader
    without a skip: same format allowlist, pixel cap, truncation and decoder checks.

    Raises:
        SampleError: what the loader would skip the sample for.
    """
    image = open_image(data, max_pixels)
    try:
        image.load()
    except DECODER_ERRORS as error:
        raise classify_decoder_error(error, data) from error
    finally:
        image.close()
    return image.size


def classify_decoder_error(error: BaseException, data: bytes = b"") -> SampleError:
    """Map an exception raised by a Pillow decoder to a `SampleError` reason."""
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, EOFError) or "truncated" in str(error) or riff_truncated(data):
        return SampleError("truncated", detail)
    return SampleError("decode_error", detail)
