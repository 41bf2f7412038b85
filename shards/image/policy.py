"""The one image-decode policy of build-shards, the loader and `preprocess verify`.

Which formats may be parsed (sniffed by magic bytes first), the pixel cap, how Pillow's
exceptions on hostile bytes are sorted (a truncated file told from a corrupt one), EXIF
orientation, every mode to RGB with one alpha rule, and loading the optional fast backends
(simplejpeg, OpenCV). Torch-free, so `preprocess` and Ray workers use it too; callers keep
only their geometry (`preprocess.images`: resize and encode, `pipeline.decode`: crops).

Policy, in one place:
    formats     shards hold `ALLOWED_FORMATS` (what build-shards writes); build inputs may be
                any of `INPUT_FORMATS`. Only those Pillow plugins ever see the bytes; a known
                foreign signature (EPS, PDF, PSD, ...) is named by `sniff_format` without
                running any parser.
    pixel cap   `check_pixels` on the header, before any pixel is decoded (also on each of
                an ICO's frame headers, which may disagree with the icon directory).
                Pillow's `DecompressionBombWarning` is an error while opening.
    truncation  `classify_decoder_error`: EOFError, "truncated" in the message (any case),
                or a RIFF (WebP) header that declares more bytes than there are.
                `LOAD_TRUNCATED_IMAGES` stays False: no grey partial image, ever.
    alpha       `to_rgb` composites every kind of transparency (RGBA, LA, PA, premultiplied
                RGBa/La, a tRNS colour on P, L or RGB) onto `BACKGROUND`, white, as
                img2dataset does; build-shards can choose another colour, the loader uses
                white. The same function runs at build and at load.
    orientation `read_orientation` reads EXIF (and AVIF's irot/imir, which Pillow maps to
                EXIF); malformed EXIF means upright. build-shards applies it; the loader
                does not (shards are written upright and without EXIF).
    backends    `resolve_backend`: what `auto` means, for build-shards and the loader alike;
                `fast_backend_available` / `load_fast_backends`: the one place that decides
                whether simplejpeg + OpenCV can be used, and imports them once per process.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import struct
import warnings
from io import BytesIO
from types import ModuleType

import numpy as np
from PIL import ExifTags, Image, ImageFile, UnidentifiedImageError, features

from shards.sample import SampleError

log = logging.getLogger("shards")

# Formats the loader lets Pillow parse, and `preprocess verify` checks shards against:
# exactly what `preprocess build-shards` writes.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP")
# Formats build-shards accepts as inputs. MPO (camera JPEGs) is read by the JPEG plugin, first
# picture only; PPM covers PBM/PGM/PPM/PFM; ICO gives its largest frame; AVIF only where this
# Pillow was built with libavif. Each plugin is attack surface: keep the list short.
INPUT_FORMATS = (
    "JPEG",
    "PNG",
    "WEBP",
    "GIF",
    "BMP",
    "TIFF",
    "PPM",
    "ICO",
    *(("AVIF",) if features.check("avif") else ()),
)
# The loader's default pixel cap (its transforms' `max_pixels`), which verify applies too.
MAX_PIXELS = 64_000_000
# What transparent pixels are composited onto, at build (unless configured) and at load.
BACKGROUND = (255, 255, 255)

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

# Magic bytes -> format name, checked with plain byte comparisons, so naming a file runs no
# parser at all. Names of formats we decode are Pillow's; the others are for messages.
_SIGNATURES = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"%!PS", "EPS/PostScript"),
    (b"\xc5\xd0\xd3\xc6", "EPS"),
    (b"%PDF", "PDF"),
    (b"8BPS", "PSD"),
    (b"SIMPLE  =", "FITS"),
    (b"\x00\x00\x00\x0cjP  \r\n\x87\n", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"\x00\x00\x02\x00", "CUR"),
    (b"icns", "ICNS"),
    (b"DDS ", "DDS"),
    (b"qoif", "QOI"),
    (b"\x01\xda", "SGI"),
    (b"\x59\xa6\x6a\x95", "Sun raster"),
    (b"/* XPM */", "XPM"),
    (b"#define", "XBM"),
    (b"BLP1", "BLP"),
    (b"BLP2", "BLP"),
    (b"FTEX", "FTEX"),
    (b"BUFR", "BUFR"),
    (b"GRIB", "GRIB"),
    (b"\x89HDF\r\n\x1a\n", "HDF5"),
    (b"\x00\x00\x00\x00\x00\x00\x00\x04", "McIdas"),
)
_ICO_MAGIC = b"\x00\x00\x01\x00"
_AVIF_BRANDS = frozenset((b"avif", b"avis"))
_HEIF_BRANDS = frozenset((b"heic", b"heix", b"hevc", b"mif1", b"msf1"))
_PNM_KINDS = b"123456fF"  # P1-P6 (PBM, PGM, PPM), Pf/PF (PFM); Pillow reads no P7 (PAM)

# EXIF orientation -> the transposition that makes the image upright (ImageOps.exif_transpose's
# table). We apply it ourselves: exif_transpose also rewrites the EXIF block, which can raise
# on the malformed EXIF we must tolerate.
TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
# The array version of `TRANSPOSE`: orientation -> (transpose first?, OpenCV flip code after:
# 1 mirrors left-right, 0 top-bottom, -1 both, None no flip). OpenCV's transpose and flip are
# ~10x faster than copying a transposed numpy view.
_ORIENT_ARRAY = {
    2: (False, 1),
    3: (False, -1),
    4: (False, 0),
    5: (True, None),
    6: (True, 1),
    7: (True, -1),
    8: (True, 0),
}
_ALPHA_MODES = frozenset(("RGBA", "LA", "PA", "RGBa", "La"))

# What a `backend` setting of build-shards or the loader may say (`resolve_backend`).
BACKENDS = ("auto", "fast", "pillow")
# The optional fast backends (the `fast` extra), by import name.
FAST_PACKAGES = ("simplejpeg", "cv2")
FAST_HINT = (
    "the fast backend needs simplejpeg and opencv-python-headless, which shardpipe depends "
    "on: reinstall them with `pip install simplejpeg opencv-python-headless`"
)
# JPEG colour spaces libjpeg-turbo converts to RGB exactly as Pillow does. CMYK and YCCK
# (Adobe's inverted variants) stay with Pillow, whose handling the shards were checked with.
FAST_JPEG_COLORSPACES = frozenset(("YCbCr", "Gray", "RGB"))
# What simplejpeg 1.9 raises on bytes it cannot take, measured by fuzzing headers of real and
# crafted JPEGs (20,000 mutants of 4:2:0, progressive, grey, 4:4:1 and 12-bit files): its
# header reader raises ValueError (libjpeg-turbo's error) or KeyError (a subsampling it
# cannot name: 4:4:1 is TJSAMP_441 = 6); its decoder only ValueError, also for warnings in
# strict mode (12-bit data: "Unsupported JPEG data precision 12"). RuntimeError (no decoder
# could be made: out of memory) and TypeError stay bugs or the environment, and propagate.
SIMPLEJPEG_HEADER_ERRORS = (ValueError, KeyError)
SIMPLEJPEG_DECODE_ERRORS = (ValueError,)


# --- formats ---------------------------------------------------------------------------


def sniff_format(data: bytes) -> str | None:
    """The format `data`'s magic bytes name, or None when no signature matches.

    Names of formats we decode are Pillow's (`JPEG`, `PNG`, `WEBP`, `PPM`, `AVIF`, ...);
    others are descriptive (`EPS/PostScript`, `HEIF`, ...). TGA has no magic bytes, so
    it is never named (and never decoded: it is in no allowlist).
    """
    for prefix, name in _SIGNATURES:
        if data.startswith(prefix):
            return name
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp":
        if data[8:12] in _AVIF_BRANDS:
            return "AVIF"
        if data[8:12] in _HEIF_BRANDS:
            return "HEIF"
    if len(data) > 2 and data[0:1] == b"P" and data[1:2] in _PNM_KINDS and data[2:3].isspace():
        return "PPM"
    return None


def refuse_foreign_format(data: bytes, formats: tuple[str, ...]) -> None:
    """Refuse, unparsed, bytes whose signature names a format outside `formats`.

    Raises:
        SampleError: `format_not_allowed`, naming the format found.
    """
    name = sniff_format(data)
    if name is not None and name not in formats:
        raise SampleError(
            "format_not_allowed",
            f"{_describe_format(name)} data; allowed: {', '.join(formats)}; convert it "
            "to one of those, or leave it out",
        )


def _describe_format(name: str) -> str:
    if name == "AVIF":
        return "AVIF (this Pillow has no AVIF support)"
    return name


def describe_unidentified(data: bytes, formats: tuple[str, ...]) -> str:
    """Why Pillow could not identify `data`, from its signature."""
    name = sniff_format(data)
    if name in formats:
        return f"{name} signature but an unreadable header (corrupt or truncated)"
    allowed = ", ".join(formats)
    if name is not None:
        return f"{_describe_format(name)} data, not an image in an allowed format ({allowed})"
    return f"not an image in an allowed format ({allowed}); starts with {bytes(data[:8])!r}"


# --- the pixel cap ---------------------------------------------------------------------


def check_max_pixels(max_pixels: int) -> None:
    """Validate a configured pixel cap: at least 1, at most Pillow's `MAX_IMAGE_PIXELS`.

    Raises:
        ValueError: the cap is out of range (a configuration error, not bad data).
    """
    limit = Image.MAX_IMAGE_PIXELS
    if max_pixels < 1 or (limit is not None and max_pixels > limit):
        raise ValueError(
            f"max_pixels {max_pixels} must be in 1..{limit} (Pillow's MAX_IMAGE_PIXELS); "
            "raise the cap only together with the per-worker memory limit"
        )


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """The pixel cap, applied to a header's size before anything is decoded.

    Raises:
        SampleError: `too_many_pixels`.
    """
    if width * height > max_pixels:
        raise SampleError(
            "too_many_pixels",
            f"header says {width}x{height} = {width * height} pixels > {max_pixels}",
        )


# --- opening and decoding --------------------------------------------------------------


def riff_truncated(data: bytes) -> bool:
    """True for a WebP whose RIFF header declares more bytes than there are.

    libwebp reports such a file only as "could not create decoder object",
    so the length check is what tells a cut file from a corrupt one.
    """
    if not (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return False
    return int.from_bytes(data[4:8], "little") + 8 > len(data)


def classify_decoder_error(error: BaseException, data: bytes = b"") -> SampleError:
    """Map an exception raised by a Pillow decoder to a `SampleError` reason.

    `truncated` for EOFError, a message that says "truncated" (any case: libjpeg's
    "Truncated File Read" is a cut file too), or a cut RIFF header; else `decode_error`.
    """
    detail = f"{type(error).__name__}: {error}"
    if isinstance(error, EOFError) or "truncated" in str(error).lower() or riff_truncated(data):
        return SampleError("truncated", detail)
    return SampleError("decode_error", detail)


def open_image(
    data: bytes, max_pixels: int, formats: tuple[str, ...] = ALLOWED_FORMATS
) -> ImageFile.ImageFile:
    """Read the header of an encoded image without decoding its pixels.

    Only the plugins in `formats` ever see the bytes, so no other parser (and
    never Ghostscript) runs on them.

    Args:
        data: encoded image bytes.
        max_pixels: largest `width * height` accepted, checked on the header.
        formats: Pillow format names that may be parsed; shard formats by default.

    Returns:
        The lazily opened image: `.size` and `.format` are known, pixels are not decoded.

    Raises:
        SampleError: `unidentified`, `too_many_pixels`, `truncated` or `decode_error`.
    """
    if "ICO" in formats and data.startswith(_ICO_MAGIC):
        check_icon_frames(data, max_pixels)  # Pillow decodes an icon while opening it
    with warnings.catch_warnings():
        # Pillow only warns between MAX_IMAGE_PIXELS and twice that; here a warning is a skip.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(BytesIO(data), formats=formats)
            check_pixels(*image.size, max_pixels)
        except UnidentifiedImageError as error:
            detail = describe_unidentified(data, formats)
            raise SampleError("unidentified", f"{type(error).__name__}: {detail}") from error
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
            raise SampleError("too_many_pixels", f"{type(error).__name__}: {error}") from error
        except DECODER_ERRORS as error:
            raise classify_decoder_error(error, data) from error
    return image


def check_icon_frames(data: bytes, max_pixels: int) -> None:
    """The pixel cap on every frame header of an ICO, read by hand before Pillow sees it.

    Each frame (PNG or BMP) carries its own header, which a hostile icon makes far larger
    than its directory entry says; Pillow decodes the chosen frame while opening, so the cap
    must come first. Entries pointing outside the data are left for Pillow to refuse.

    Raises:
        SampleError: `too_many_pixels`.
    """
    count = int.from_bytes(data[4:6], "little")
    for index in range(min(count, (len(data) - 6) // 16)):
        offset = int.from_bytes(data[6 + 16 * index + 12 : 6 + 16 * index + 16], "little")
        frame = data[offset : offset + 24]
        if frame.startswith(b"\x89PNG\r\n\x1a\n") and len(frame) == 24:
            width, height = struct.unpack(">II", frame[16:24])
        elif len(frame) >= 12:  # a DIB: width, then the height of image and mask together
            core = frame[:4] == b"\x0c\x00\x00\x00"  # the old 12-byte header, 16-bit sides
            width, height = struct.unpack("<hh" if core else "<ii", frame[4 : 8 if core else 12])
            width, height = abs(width), abs(height) // 2
        else:
            continue
        check_pixels(width, height, max_pixels)


def load_image(image: ImageFile.ImageFile, data: bytes = b"") -> None:
    """Decode the pixels of an image from `open_image` (its first frame only).

    Args:
        data: the encoded bytes, when at hand: they tell a cut WebP from a corrupt one.

    Raises:
        SampleError: `truncated`, `too_many_pixels` or `decode_error`.
    """
    try:
        image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as error:
        raise SampleError("too_many_pixels", f"{type(error).__name__}: {error}") from error
    except DECODER_ERRORS as error:
        raise classify_decoder_error(error, data) from error


def check_image(data: bytes, max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """Decode an image in full exactly as the loader would judge it; return its size.

    `preprocess verify` calls this so that a shard it passes is read by the loader
    without a skip: same format allowlist, pixel cap, truncation and decoder checks.

    Raises:
        SampleError: what the loader would skip the sample for.
    """
    image = open_image(data, max_pixels)
    try:
        load_image(image, data)
    finally:
        image.close()
    return image.size


# --- orientation and colour ------------------------------------------------------------


def read_orientation(image: Image.Image) -> int:
    """EXIF orientation 1-8 of an opened image; 1 when absent, out of range or unreadable."""
    try:
        value = image.getexif().get(ExifTags.Base.Orientation, 1)
    except (*DECODER_ERRORS, struct.error, KeyError, IndexError):
        return 1  # malformed EXIF means "no rotation", never a skipped image
    return value if isinstance(value, int) and value in TRANSPOSE else 1


def orient_array(cv2: ModuleType, pixels: np.ndarray, orientation: int) -> np.ndarray:
    """Turn (height, width, 3) stored pixels upright for EXIF `orientation` (1-8)."""
    if orientation not in _ORIENT_ARRAY:
        return pixels
    transpose, flip = _ORIENT_ARRAY[orientation]
    if transpose:
        pixels = cv2.transpose(pixels)
    return pixels if flip is None else cv2.flip(pixels, flip)


def to_rgb(image: Image.Image, background: tuple[int, int, int] = BACKGROUND) -> Image.Image:
    """Convert a loaded image of any mode to RGB, compositing transparency onto `background`.

    Returns `image` itself when it is opaque RGB already, avoiding a copy on the common path.
    16-bit greys (I;16*) keep their high byte (`>> 8`), never clipped at 255. 32-bit `I` and
    float `F` are scaled by range: values in 0..255 are kept, `I` within 0..65535 is treated
    as 16-bit, `F` within 0..1 is multiplied by 255, anything else is min-max stretched to
    0..255 (NaN -> 0). CMYK uses Pillow's conversion (which undoes the Adobe inversion).
    """
    mode = image.mode
    if mode == "RGB" and "transparency" not in image.info:
        return image
    if mode.startswith("I") or mode == "F":
        return _grey_to_l(image).convert("RGB")
    if mode in _ALPHA_MODES or "transparency" in image.info:
        # Pillow converts premultiplied La only to LA; every other mode goes to RGBA directly.
        rgba = (image.convert("LA") if mode == "La" else image).convert("RGBA")
        canvas = Image.new("RGB", rgba.size, background)
        canvas.paste(rgba, None, rgba)  # the RGBA image is its own mask: one blend pass
        return canvas
    return image.convert("RGB")


def _grey_to_l(image: Image.Image) -> Image.Image:
    """Scale a 16-bit, 32-bit integer or float grey image to 8 bits (see `to_rgb`)."""
    array = np.asarray(image)
    if image.mode.startswith("I;16"):
        return Image.fromarray((array >> 8).astype(np.uint8))
    finite = array[np.isfinite(array)] if image.mode == "F" else array
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    if low >= 0 and high <= 255:
        scaled = array * 255.0 if image.mode == "F" and high <= 1 else array
    elif image.mode == "I" and low >= 0 and high <= 65535:
        scaled = array >> 8
    else:
        span = high - low if high > low else 1.0
        scaled = (array.astype(np.float32) - np.float32(low)) * np.float32(255.0 / span)
    if image.mode == "F" or scaled.dtype.kind == "f":
        scaled = np.nan_to_num(np.rint(scaled), nan=0.0, posinf=255.0, neginf=0.0)
    return Image.fromarray(np.clip(scaled, 0, 255).astype(np.uint8))


# --- the fast backends -----------------------------------------------------------------


def fast_backend_available() -> bool:
    """True when simplejpeg and OpenCV (the `fast` extra) can be imported."""
    return all(importlib.util.find_spec(name) is not None for name in FAST_PACKAGES)


def resolve_backend(backend: str, fast_can_run: bool = True) -> str:
    """`fast` or `pillow`: what a `BACKENDS` choice runs, by the one rule for `auto`.

    `auto` is `fast` where simplejpeg and OpenCV import and the caller's fast path does
    what is asked (`fast_can_run`: build-shards' fast resize is bilinear only), else
    `pillow`, with a warning when the packages are what is missing, since Pillow decodes
    about half as fast. Build-shards and the loader both resolve their setting here.

    Raises:
        ImportError: `fast` was asked for and simplejpeg or OpenCV is missing.
    """
    if backend == "pillow" or (backend == "auto" and not fast_can_run):
        return "pillow"
    if fast_backend_available():
        return "fast"
    if backend == "fast":
        raise ImportError(f"backend='fast': {FAST_HINT}, or use backend='pillow'")
    log.warning("decoding with Pillow, about half as fast: %s", FAST_HINT)
    return "pillow"


class _FastModules:
    """simplejpeg and cv2 as imported in this process; None until then, and again in a
    forked child (`_forget_fast_modules`), which must set OpenCV's threads itself."""

    simplejpeg: ModuleType | None = None
    cv2: ModuleType | None = None


def _forget_fast_modules() -> None:
    _FastModules.simplejpeg = _FastModules.cv2 = None


# Forgotten at a fork rather than checked against os.getpid() on every call: this runs
# several times an image, and getpid is a system call (~2 us a call in a loader worker).
os.register_at_fork(after_in_child=_forget_fast_modules)


def load_fast_backends() -> tuple[ModuleType, ModuleType]:
    """Import simplejpeg and OpenCV once per process and return them.

    OpenCV runs single-threaded: each worker process (DataLoader worker, Ray task) decodes
    one image at a time, so its own thread pool would oversubscribe the CPUs, and a pool
    inherited through fork is not safe to use.

    Raises:
        ImportError: either package is missing; the message says what to install.
    """
    if _FastModules.cv2 is None:
        try:
            import cv2
            import simplejpeg
        except ImportError as error:
            raise ImportError(FAST_HINT) from error
        cv2.setNumThreads(1)
        _FastModules.simplejpeg, _FastModules.cv2 = simplejpeg, cv2
    return _FastModules.simplejpeg, _FastModules.cv2


def read_jpeg_header(data: bytes) -> tuple[int, int, str] | None:
    """(width, height, colorspace) of a JPEG as libjpeg-turbo reads it, or None.

    None covers every non-JPEG and every header simplejpeg cannot read: the caller then
    hands the bytes to Pillow, which judges them. simplejpeg raises ValueError for what
    TurboJPEG refuses (a corrupt header, sampling factors it cannot classify, such as 3x1)
    and KeyError for a subsampling TurboJPEG reads but simplejpeg has no name for (4:4:1,
    `KeyError: 6`): `SIMPLEJPEG_HEADER_ERRORS`, found by fuzzing its header.
    """
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    simplejpeg, _ = load_fast_backends()
    try:
        height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except SIMPLEJPEG_HEADER_ERRORS:
        return None
    return width, height, colorspace


def decode_jpeg_scaled(
    data: bytes,
    width: int,
    height: int,
    scale: int,
    *,
    fast_upsample: bool = False,
    out: np.ndarray | None = None,
) -> np.ndarray | None:
    """RGB pixels of a `width` x `height` JPEG decoded at 1/`scale` (1, 2, 4 or 8), or None.

    libjpeg's scaled size is ceil(side / scale), which is what is asked for; None when
    libjpeg-turbo refuses the data (strict: a truncated file or any libjpeg warning) or
    decodes another size, so nothing ever becomes a grey partial image: the caller hands
    the bytes to Pillow, which classifies them or accepts what it tolerates.

    Args:
        fast_upsample: libjpeg-turbo's plain chroma upsampling (each chroma sample
            repeated, integer arithmetic, deterministic) instead of its "fancy" triangle
            filter: 10-15% less decode time for 4:2:0 JPEGs at ~49 dB PSNR against the
            exact decode (docs/LOADER.md, "Image decoding"; the study that measured it,
            benchmarks/roi_decode.py, is in git history).
        out: a C-contiguous uint8 array of exactly the decoded shape to decode into.
    """
    simplejpeg, _ = load_fast_backends()
    want = (-(-height // scale), -(-width // scale))
    try:
        pixels = simplejpeg.decode_jpeg(
            data,
            "RGB",
            fastupsample=fast_upsample,
            min_height=want[0],
            min_width=want[1],
            buffer=out,
            strict=True,
        )
    except SIMPLEJPEG_DECODE_ERRORS:
        return None
    return pixels if pixels.shape[:2] == want else None
