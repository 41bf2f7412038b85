"""Per-image step of `preprocess build-shards`: one input's bytes in, one upright RGB image out.

Runs once per input inside a shard task (`preprocess.build`): read the bytes (`read_source`,
local or through `shards.storage`), check the header before decoding, apply EXIF
orientation, convert to RGB, resize (`plan_resize`) and encode (`ImageConfig`). The pixel
policy (allowed formats, pixel cap, truncation, alpha onto `background`) is
`shards.image.policy`'s, the same the loader applies; the filters and the DCT scale rule are
`shards.image.geometry`'s. Bad data raises `SampleError(reason, detail)`, a counted skip (reasons:
docs/SHARDS.md, "Bad input"). Only the open and decode calls are classified so, MemoryError
included (the pixel cap bounds what a legitimate image allocates); the same exceptions from
our own resize or encode code propagate, as bugs.

Backends write the same geometry: `pillow`, and `fast` (libjpeg-turbo + OpenCV) for plain
JPEGs, which hands anything else, and any JPEG libjpeg-turbo decodes only with a warning, to
the Pillow path (`ProcessedImage.pillow_fallback`), so skip reasons match and no cut file
becomes a grey partial image. `auto` is resolved when the config is made
(`shards.image.policy.resolve_backend`), so the manifest records the backend that ran. JPEG
output carries restart markers (`jpeg_restarts`; docs/SHARDS.md, "Restart markers"), which
let the loader decode only the bands a crop needs. Speed and quality: docs/BENCHMARKS.md,
"Build: per-image step and quality".

`process_image` swaps process-wide warning filters (`warnings.catch_warnings`): call it from
one thread per process, as Ray tasks and pool workers do.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import math
import os
import stat
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from io import BytesIO
from types import ModuleType
from typing import Any

import numpy as np
from PIL import Image, ImageFile

from shards.flags import check_at_least, check_bytes, check_choice, check_int_at_least, refuse
from shards.image.bands import MIN_COLUMN_MCUS, restart_interval
from shards.image.geometry import DCT_SCALES, REDUCING_GAP, RESAMPLING, dct_scale
from shards.image.policy import (
    BACKENDS,
    FAST_HINT,
    FAST_JPEG_COLORSPACES,
    INPUT_FORMATS,
    TRANSPOSE,
    check_max_pixels,
    decode_jpeg_scaled,
    load_fast_backends,
    load_image,
    open_image,
    orient_array,
    read_jpeg_header,
    read_orientation,
    refuse_foreign_format,
    resolve_backend,
    to_rgb,
)
from shards.sample import SampleError
from shards.storage import (
    READ_SCHEMES,
    ObjectNotFoundError,
    RetryPolicy,
    ShardReadError,
    is_remote,
    local_path,
    read_bytes,
)
from shards.units import ByteSize

# Remote inputs get the shards' retry policy with a deadline sized for one image: 64 MiB
# (the largest input read) at 250 KB/s, retries included. A stalled server costs that
# input at most this long, then it is an `io_error` skip.
INPUT_RETRY = RetryPolicy(deadline=5 * 60.0)

RESIZE_POLICIES = ("shorter", "longer", "center-crop", "none")
# Where a JPEG output's restart intervals start (`ImageConfig.jpeg_restarts`), newest first:
# columns of about 64 px in rows of 384 px and more, whole rows below (the default);
# columns in every row; one interval per MCU row; no markers at all. Each older one is
# what builds started before the next existed wrote, so they resume byte for byte.
RESTART_LAYOUTS = ("columns", "columns-all", "rows", "none")
# The filters build-shards offers (`shards.image.geometry.RESAMPLING`): all but `nearest`, which
# aliases every downscale, a poor way to store a dataset.
RESAMPLE_CHOICES = ("bilinear", "bicubic", "lanczos")
# encoding -> shard field name / file extension
EXTENSIONS = {"jpeg": "jpg", "webp": "webp", "png": "png"}
_PIL_FORMAT = {"jpeg": "JPEG", "webp": "WEBP", "png": "PNG"}
# Largest side each encoder accepts; larger outputs are skipped instead of crashing the encoder.
# JPEG's 65535 px are 4096 MCUs a row: any restart interval fits DRI's 16 bits.
_MAX_OUTPUT_SIDE = {"jpeg": 65_535, "webp": 16_383, "png": 2**31 - 1}

# WebP method 4 is libwebp's default; method 2 encodes ~2.4x faster for ~0.3 dB less PSNR.
# PNG level 3 takes a third of level 6's time (10 vs 33 ms at 341x256) for files ~4% larger:
# PNG output is chosen for losslessness, not size.
_WEBP_METHOD = 4
_PNG_COMPRESS_LEVEL = 3
# Width of a 4:2:0 JPEG's MCU: one MCU row holds ceil(width / 16) MCUs.
_MCU_WIDTH = 16


@dataclass(frozen=True)
class ImageConfig:
    """How every input image is turned into a shard image.

    Attributes:
        image_size: target side in pixels; its meaning depends on `resize`.
        resize: `shorter`, `longer`, `center-crop` or `none` (docs/SHARDS.md, "Per image").
        encode: output encoding, `jpeg`, `webp` or `png`.
        quality: JPEG/WebP quality 1-100 (ignored for PNG).
        max_pixels: header pixel cap, checked before decoding; at most Pillow's
            `Image.MAX_IMAGE_PIXELS`.
        max_file_bytes: inputs larger than this are skipped unread (an int or a size
            text such as `"64MiB"`; `shards.units`).
        max_aspect: for `shorter`/`longer`, the long side is centre-cropped to at most this
            multiple of the short side.
        min_side: sources with a side below this are skipped as `too_small`.
        resample: `bilinear` (default, fast and antialiased), `bicubic` or `lanczos`.
        background: RGB colour that transparent pixels are composited onto.
        backend: `fast` (libjpeg-turbo + OpenCV for plain JPEGs, Pillow for the rest;
            needs `resample="bilinear"`), `pillow`, or `auto` (default): `fast` when the
            resample is bilinear and simplejpeg and OpenCV import, else `pillow`. `auto` is
            resolved when the config is made, so manifests and resume checks record the
            backend that ran.
        jpeg_restarts: where the restart intervals of JPEG output start
            (`RESTART_LAYOUTS`; docs/SHARDS.md, "Restart markers"), so the
            loader can decode only the rows, and columns, a crop needs. `columns`
            (default): `shards.image.bands.restart_interval(width)` MCUs (about 64 px; the
            whole row when the row's MCU count has no divisor in 4..8), and one interval
            per row in rows of fewer than `shards.image.bands.MIN_COLUMN_MCUS` MCUs (384 px),
            whose bands decode faster so. `columns-all`: column intervals in those rows
            too; `rows`: one interval per MCU row; `none`: no markers. The last three
            write the files of builds made before the one above them existed.
    """

    image_size: int = 256
    resize: str = "shorter"
    encode: str = "jpeg"
    quality: int = 90
    max_pixels: int = 64_000_000
    max_file_bytes: ByteSize = ByteSize(64 * 2**20)
    max_aspect: float = 20.0
    min_side: int = 8
    resample: str = "bilinear"
    background: tuple[int, int, int] = (255, 255, 255)
    backend: str = "auto"
    jpeg_restarts: str = "columns"

    def __post_init__(self) -> None:
        check_int_at_least(self, "image_size", 1)
        check_choice(self, "resize", RESIZE_POLICIES)
        check_choice(self, "encode", tuple(EXTENSIONS))
        check_int_at_least(self, "quality", 1)
        if self.quality > 100:
            raise refuse(self, "quality", f" must be in 1..100, got {self.quality!r}")
        check_int_at_least(self, "max_pixels", 1)
        try:
            check_max_pixels(self.max_pixels)
        except ValueError as error:
            raise refuse(self, "max_pixels", f" refused: {error}") from error
        check_bytes(self, "max_file_bytes", 1)
        check_at_least(self, "max_aspect", 1)
        check_int_at_least(self, "min_side", 1)
        check_choice(self, "resample", RESAMPLE_CHOICES)
        background = self.background
        if not (
            isinstance(background, tuple)
            and len(background) == 3
            and all(type(c) is int and 0 <= c <= 255 for c in background)
        ):
            raise refuse(
                self, "background", f" must be three integers in 0..255, got {background!r}"
            )
        check_choice(self, "jpeg_restarts", RESTART_LAYOUTS)
        check_choice(self, "backend", BACKENDS)
        bilinear = self.resample == "bilinear"
        if self.backend == "fast" and not bilinear:
            raise refuse(
                self,
                "backend",
                f" 'fast' resizes with OpenCV's bilinear filter, not {self.resample!r}; "
                "use resample='bilinear' (--resample bilinear) or backend='pillow'",
            )
        try:  # frozen: `auto` is resolved once, here, so manifests record what ran
            backend = resolve_backend(self.backend, fast_can_run=bilinear)
        except ImportError as error:
            raise refuse(
                self, "backend", f" 'fast': {FAST_HINT}, or use backend='pillow'"
            ) from error
        object.__setattr__(self, "backend", backend)


@dataclass(frozen=True)
class ProcessedImage:
    """One encoded output image and what we knew about its source.

    Attributes:
        data: the encoded image.
        ext: shard field name of the encoding (`jpg`, `webp`, `png`).
        width, height: output size.
        orig_width, orig_height: source size after EXIF orientation (upright).
        orig_format: Pillow's name of the source format (`JPEG`, `MPO`, `PNG`, ...).
        orig_mode: Pillow mode of the source (`RGB`, `CMYK`, `I;16`, ...).
        pillow_fallback: the `fast` backend handed this input to Pillow (not a plain
            JPEG libjpeg-turbo decodes without complaint); False for the `pillow` backend.
    """

    data: bytes
    ext: str
    width: int
    height: int
    orig_width: int
    orig_height: int
    orig_format: str
    orig_mode: str
    pillow_fallback: bool = False


@dataclass(frozen=True)
class ResizePlan:
    """Where `plan_resize` wants the pixels of a source to go.

    Attributes:
        size: output (width, height).
        box: (left, top, right, bottom) region of the source that fills the output.
    """

    size: tuple[int, int]
    box: tuple[int, int, int, int]


def read_source(
    path_or_url: str,
    max_bytes: int,
    confine_to: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> bytes:
    """Read one input, refusing files over `max_bytes`.

    Plain paths are read directly; anything with a scheme (`file://`, `s3://`,
    `https://`, ...) goes through `shards.storage` (`INPUT_RETRY`), which validates it.

    Args:
        confine_to: a resolved directory (`--confine-to-input`): a local path whose real
            path lies outside it is refused, checked here, when the file is opened, so
            a link that appeared after listing is caught too.
        storage_options: fsspec options of a remote input's store (`BuildConfig`); None
            takes the store's standard environment.

    Raises:
        SampleError: `missing` (absent or not a regular file), `too_large_file`, `empty`,
            `outside_input`, `io_error` (a remote read that failed past its retries).
        OSError: any other local I/O failure (permissions, disk): an environment error.
    """
    try:
        if is_remote(path_or_url):
            data = _read_url(path_or_url, max_bytes, storage_options)
        else:
            data = _read_local(local_path(path_or_url), max_bytes, confine_to)
    except (FileNotFoundError, NotADirectoryError) as error:
        raise SampleError(
            "missing", f"{path_or_url}: {error.strerror or error}; restore it and rerun"
        ) from error
    if len(data) > max_bytes:
        raise SampleError("too_large_file", f"more than {max_bytes} bytes")
    if not data:
        raise SampleError("empty", "0 bytes")
    return data


def _read_local(path: str, max_bytes: int, confine_to: str | None = None) -> bytes:
    flags = os.O_RDONLY | os.O_NONBLOCK  # a FIFO swapped in after the stat must not block
    if confine_to is not None:
        path = _confined_path(path, confine_to)
        flags |= os.O_NOFOLLOW  # the resolved path has no link; one appearing now fails
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        # Opening a FIFO or a device would block or never end.
        raise SampleError("missing", f"{path} is not a regular file")
    if info.st_size > max_bytes:
        raise SampleError("too_large_file", f"{info.st_size} bytes > {max_bytes}")
    try:
        with open(path, "rb", opener=functools.partial(_open_with, flags=flags)) as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise SampleError("missing", f"{path} is not a regular file")
            # Sized by the stat, not the cap: reading into a 64 MiB buffer for every input
            # costs ~0.1 ms an image. A file that grew since is read on to the cap + 1, so
            # the caller still sees it is too large.
            data = file.read(info.st_size + 1)
            if len(data) > info.st_size:
                data += file.read(max_bytes + 1 - len(data))
            return data
    except OSError as error:
        if confine_to is not None and error.errno == errno.ELOOP:
            raise SampleError(
                "outside_input", f"{path} became a symlink while it was opened; rerun"
            ) from error
        raise


def _open_with(path: str, default_flags: int, flags: int) -> int:
    # An `open` opener: our flags instead of the default ones (`os.open` fds are not inherited).
    return os.open(path, flags)


def _confined_path(path: str, root: str) -> str:
    """The real path of `path`, refused (`outside_input`) when it is not under `root`."""
    real = os.path.realpath(path)
    if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
        raise SampleError(
            "outside_input",
            f"{path} resolves to {real}, outside the input root {root} "
            "(--confine-to-input); point the link inside the root, or build without "
            "--confine-to-input to follow it",
        )
    return real


def _read_url(url: str, max_bytes: int, storage_options: Mapping[str, Any] | None) -> bytes:
    """A remote input, read as a shard is (`shards.storage`): retries, a deadline, redaction.

    A failure that outlasts the retries is this input's skip, never the build's end:
    `missing` when nothing is there, `io_error` (retried by a plain rerun) otherwise,
    both naming the redacted URL.
    """
    try:
        return read_bytes(
            url, max_bytes, INPUT_RETRY, storage_options=storage_options, schemes=READ_SCHEMES
        )
    except ObjectNotFoundError as error:
        raise SampleError(
            "missing", f"{error.url}: {error.reason}; restore it and rerun"
        ) from error
    except ShardReadError as error:
        raise SampleError(
            "io_error",
            f"{error.url}: {error.reason} ({error.attempts} attempt(s)); check the store or "
            "server and rerun (it is retried)",
        ) from error


def process_image(data: bytes, config: ImageConfig) -> ProcessedImage:
    """Turn one input's bytes into an upright, resized, re-encoded RGB image.

    Deterministic: the same bytes and config always give byte-identical output.

    Raises:
        SampleError: a data error; `.reason` is a slug of docs/SHARDS.md, "Bad input".
    """
    if not data:
        raise SampleError("empty", "0 bytes")
    if len(data) > config.max_file_bytes:
        raise SampleError("too_large_file", f"{len(data)} bytes > {config.max_file_bytes}")
    with warnings.catch_warnings():
        # Pillow's per-file complaints ("Corrupt EXIF data", ...) describe data we tolerate by
        # design; across 500k inputs they would only flood the worker logs.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.")
        refuse_foreign_format(data, INPUT_FORMATS)
        with open_image(data, config.max_pixels, INPUT_FORMATS) as source:
            _check_min_side(source.size, config)
            if config.backend == "fast":
                result = _process_fast(source, data, config)
                if result is not None:
                    return result
                fallback = _process_pillow(source, data, config)
                return dataclasses.replace(fallback, pillow_fallback=True)
            return _process_pillow(source, data, config)


def _process_pillow(
    source: ImageFile.ImageFile, data: bytes, config: ImageConfig
) -> ProcessedImage:
    """The Pillow path for an opened source whose header passed `open_image` and `_check_min_side`."""
    orig_format, orig_mode = source.format or "", source.mode
    width, height = source.size
    _draft(source, config)
    load_image(source, data)  # the first frame only: nothing here seeks
    orientation = read_orientation(source)
    orig_size = (height, width) if orientation >= 5 else (width, height)
    image = source.transpose(TRANSPOSE[orientation]) if orientation > 1 else source
    image = to_rgb(image, config.background)
    image = _resize(image, orig_size, config)
    return ProcessedImage(
        data=_encode(image, config),
        ext=EXTENSIONS[config.encode],
        width=image.width,
        height=image.height,
        orig_width=orig_size[0],
        orig_height=orig_size[1],
        orig_format=orig_format,
        orig_mode=orig_mode,
    )


def plan_resize(width: int, height: int, config: ImageConfig) -> ResizePlan:
    """Output size and source region for an upright `width` x `height` source.

    Symmetric in its axes: planning the transposed size gives the transposed plan.
    """
    size = config.image_size
    if config.resize == "none":
        return ResizePlan((width, height), (0, 0, width, height))
    if config.resize == "center-crop":
        side = min(width, height)
        return ResizePlan((size, size), _centered_box(width, height, side, side))
    crop_width, crop_height = _bound_aspect(width, height, config.max_aspect)
    box = _centered_box(width, height, crop_width, crop_height)
    pick = min if config.resize == "shorter" else max
    governing = pick(crop_width, crop_height)
    if governing <= size:  # never upscale: a small image stays small
        return ResizePlan((crop_width, crop_height), box)
    scale = size / governing
    out = (max(1, round(crop_width * scale)), max(1, round(crop_height * scale)))
    return ResizePlan(out, box)


def draft_request(width: int, height: int, config: ImageConfig) -> tuple[int, int] | None:
    """Size to pass to JPEG `draft` for a stored `width` x `height` source, or None.

    The request is the whole source scaled by the plan's largest factor, so after DCT
    scaling the planned box still holds at least as many pixels as the output: the final
    resize always downsamples. One factor for both axes makes the request the same whether
    or not EXIF orientation later swaps them, so it can be computed before decoding.
    """
    plan = plan_resize(width, height, config)
    left, top, right, bottom = plan.box
    factor = max(plan.size[0] / (right - left), plan.size[1] / (bottom - top))
    if factor > 1 / DCT_SCALES[-1]:  # DCT scaling divides by 2, 4 or 8: nothing to gain
        return None
    return math.ceil(width * factor), math.ceil(height * factor)


def _resize(image: Image.Image, orig_size: tuple[int, int], config: ImageConfig) -> Image.Image:
    """Apply the plan for the upright source size to `image`, which may be DCT-scaled."""
    plan = plan_resize(*orig_size, config)
    box: tuple[float, float, float, float] = plan.box
    if image.size != orig_size:
        sx, sy = image.width / orig_size[0], image.height / orig_size[1]
        box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    if plan.size == (box[2] - box[0], box[3] - box[1]) and all(
        float(edge).is_integer() for edge in box
    ):  # no scaling, at most a crop on whole pixels
        whole = (int(box[0]), int(box[1]), int(box[2]), int(box[3]))
        return image if whole == (0, 0, *image.size) else image.crop(whole)
    return image.resize(plan.size, RESAMPLING[config.resample], box=box, reducing_gap=REDUCING_GAP)


def _encode(image: Image.Image, config: ImageConfig) -> bytes:
    _check_output_size(image.width, image.height, config)
    image.info = {}  # nothing of the source's metadata (EXIF, ICC, XMP, comments) is written
    buffer = BytesIO()
    if config.encode == "jpeg":
        image.save(
            buffer,
            "JPEG",
            quality=config.quality,
            optimize=False,
            progressive=False,
            restart_marker_blocks=_restart_blocks(image.width, config),
        )
    elif config.encode == "webp":
        image.save(buffer, "WEBP", quality=config.quality, method=_WEBP_METHOD)
    else:
        image.save(buffer, "PNG", compress_level=_PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def _restart_blocks(width: int, config: ImageConfig) -> int:
    """MCUs per restart interval of a JPEG `width` px wide; 0 for no markers.

    Both encoders take this count, so they write the same bytes. One row's worth is what
    libjpeg's `restart_in_rows = 1` sets, so the files of builds without column intervals
    are unchanged. A JPEG's 65535 px are 4096 MCUs: any interval fits DRI's 16 bits.
    """
    layout = config.jpeg_restarts
    if layout == "none":
        return 0
    if layout == "rows":
        return -(-width // _MCU_WIDTH)  # one MCU row
    narrowest = MIN_COLUMN_MCUS if layout == "columns" else 0
    return restart_interval(width, _MCU_WIDTH, narrowest)


def _check_output_size(width: int, height: int, config: ImageConfig) -> None:
    limit = _MAX_OUTPUT_SIDE[config.encode]
    if max(width, height) > limit:
        raise SampleError(
            "too_many_pixels",
            f"output {width}x{height} exceeds the {config.encode} limit of {limit} px "
            "a side; use a resize policy other than `none`",
        )


def _bound_aspect(width: int, height: int, max_aspect: float) -> tuple[int, int]:
    """Shorten the long side to at most `max_aspect` times the short side."""
    limit = max(1, math.floor(min(width, height) * max_aspect))
    return min(width, limit), min(height, limit)


def _centered_box(
    width: int, height: int, crop_width: int, crop_height: int
) -> tuple[int, int, int, int]:
    left, top = (width - crop_width) // 2, (height - crop_height) // 2
    return left, top, left + crop_width, top + crop_height


def _check_min_side(size: tuple[int, int], config: ImageConfig) -> None:
    """The build's own size rule; the pixel cap was checked by `open_image`."""
    width, height = size
    if min(width, height) < config.min_side:
        raise SampleError("too_small", f"{width}x{height} has a side below {config.min_side}")


def _draft(source: ImageFile.ImageFile, config: ImageConfig) -> None:
    """Let libjpeg decode straight to a smaller size (1/2, 1/4, 1/8) when the output allows."""
    if source.format not in ("JPEG", "MPO"):
        return
    request = draft_request(*source.size, config)
    if request is not None:
        source.draft("RGB", request)  # "RGB" never changes an L or CMYK JPEG's mode


# --- The `fast` backend (see the module docstring) --------------------------------------------


def _process_fast(
    source: ImageFile.ImageFile, data: bytes, config: ImageConfig
) -> ProcessedImage | None:
    """The `fast` path for a plain JPEG; None hands the input to `_process_pillow`."""
    if source.format != "JPEG":
        return None
    header = read_jpeg_header(data)
    # libjpeg-turbo must see the size whose pixel count `open_image` capped, in a colour space
    # it converts as Pillow does (CMYK and YCCK stay with Pillow).
    if header is None or header[:2] != source.size or header[2] not in FAST_JPEG_COLORSPACES:
        return None
    simplejpeg, cv2 = load_fast_backends()
    width, height = source.size
    # Strict: a truncated file or any libjpeg warning gives None, and Pillow's path decides,
    # so skip reasons and tolerated quirks match the `pillow` backend.
    pixels = decode_jpeg_scaled(data, width, height, _dct_scale(width, height, config))
    if pixels is None:
        return None
    orientation = read_orientation(source)
    orig_size = (height, width) if orientation >= 5 else (width, height)
    pixels = _resize_array(cv2, orient_array(cv2, pixels, orientation), orig_size, config)
    out_height, out_width = pixels.shape[:2]
    _check_output_size(out_width, out_height, config)
    if config.encode == "jpeg":
        payload = _encode_jpeg_array(simplejpeg, cv2, pixels, config)
    else:
        payload = _encode(Image.fromarray(pixels), config)
    return ProcessedImage(
        data=payload,
        ext=EXTENSIONS[config.encode],
        width=out_width,
        height=out_height,
        orig_width=orig_size[0],
        orig_height=orig_size[1],
        orig_format=source.format,
        orig_mode=source.mode,
    )


def _encode_jpeg_array(
    simplejpeg: ModuleType, cv2: ModuleType, pixels: np.ndarray, config: ImageConfig
) -> bytes:
    """RGB pixels as the JPEG the Pillow path would write for them, restart markers and all.

    simplejpeg has no restart option; OpenCV's libjpeg-turbo with these settings writes
    Pillow's bytes (4:2:0, accurate DCT, baseline, standard tables, JFIF header, no
    metadata), and costs no more than simplejpeg did, the BGR copy included.
    """
    if config.jpeg_restarts == "none":
        # A build started before restart markers: its old encoder, so it resumes byte for byte.
        return simplejpeg.encode_jpeg(pixels, config.quality, "RGB", "420", fastdct=False)
    params = [
        cv2.IMWRITE_JPEG_QUALITY,
        config.quality,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR,
        cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
        cv2.IMWRITE_JPEG_PROGRESSIVE,
        0,
        cv2.IMWRITE_JPEG_OPTIMIZE,
        0,
        cv2.IMWRITE_JPEG_RST_INTERVAL,
        _restart_blocks(pixels.shape[1], config),
    ]
    ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(pixels, cv2.COLOR_RGB2BGR), params)
    if not ok:  # a failing encoder is a bug or the environment, not the input's fault
        raise RuntimeError(f"OpenCV could not encode a {pixels.shape[1]}x{pixels.shape[0]} JPEG")
    return encoded.tobytes()


def _dct_scale(width: int, height: int, config: ImageConfig) -> int:
    """The divisor (1, 2, 4 or 8) that Pillow's `draft` picks for `draft_request`."""
    request = draft_request(width, height, config)
    if request is None:
        return 1
    return dct_scale(min(width // request[0], height // request[1]))


def _resize_array(
    cv2: ModuleType, pixels: np.ndarray, orig_size: tuple[int, int], config: ImageConfig
) -> np.ndarray:
    """Apply the plan for the upright source size to upright, possibly DCT-scaled pixels.

    Returns a C-contiguous array, as the encoders need.
    """
    plan = plan_resize(*orig_size, config)
    height, width = pixels.shape[:2]
    sx, sy = width / orig_size[0], height / orig_size[1]
    left, top, right, bottom = plan.box
    crop = pixels[round(top * sy) : round(bottom * sy), round(left * sx) : round(right * sx)]
    crop_height, crop_width = crop.shape[:2]
    if (crop_width, crop_height) != plan.size:
        # Bilinear is not antialiased: past a factor of 2 it would alias, so huge sources that
        # DCT scaling could not bring within 2x of the output take the (slower) area filter.
        far = crop_width > 2 * plan.size[0] or crop_height > 2 * plan.size[1]
        interpolation = cv2.INTER_AREA if far else cv2.INTER_LINEAR_EXACT
        crop = cv2.resize(np.ascontiguousarray(crop), plan.size, interpolation=interpolation)
    return np.ascontiguousarray(crop)
