"""Region-of-interest decoding study (issue 10, item 5): what decoding less of each JPEG gives.

For random-resized-crop 224 on 256-px and 512-px shard images (the sample generator's
images, shorter side resized, encoded as build-shards does: quality 90, 4:2:0), every
variant below decodes the same crop boxes and flips (`FastRandomResizedCrop`'s draws) and
resizes them with the loader's own `resize_box`:

    fast             the loader's default: simplejpeg, DCT-scaled (1/2, 1/4, 1/8) when the
                     box is at least twice the output on both sides
    no-dct-scale     the same, always decoded at full size (what DCT scaling gives)
    dct-scale-n/8    DCT scaling by any n/8 that keeps the box >= the output (libjpeg's
                     other scaled IDCTs)
    fastdct, fastupsample, fast-flags
                     libjpeg-turbo's fast integer IDCT and/or plain chroma upsampling
    lossless-crop    TurboJPEG.crop (PyTurboJPEG, system libturbojpeg) to the box's MCU
                     rows and columns, then the same decode: less IDCT and colour work,
                     one more entropy decode and encode
    lossless-crop+fast-flags

simplejpeg and OpenCV have no region decode (OpenCV's IMREAD_REDUCED_* is DCT scaling
only); libjpeg-turbo's own crop/skip-scanline decode (`tj3SetCroppingRegion`) needs
libjpeg-turbo 3, which PyTurboJPEG 2.x requires and Debian 12 / Ubuntu 24.04 do not ship
(2.1.5), so the lossless-crop variants use PyTurboJPEG 1.x.

us/sample is CPU time of this one process (one thread): every round runs each variant once
over all samples, in a rotated order, and the table gives the median over rounds.
PSNR is against the exact path: a full-size decode (accurate IDCT, fancy upsampling), then
the same box resized by the same code; "all" pools the squared error of every sample,
"worst" is the lowest single sample.

    python benchmarks/roi_decode.py [--images 100] [--draws 2] [--rounds 3]

The lossless-crop rows need `apt-get install libturbojpeg0` and `pip install "PyTurboJPEG<2"`
(neither is a project dependency); without them those rows are left out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import describe_machine, markdown_table  # noqa: E402
from pipeline import fast_transforms  # noqa: E402
from pipeline.decode import draft_scale  # noqa: E402
from pipeline.fast_transforms import FastRandomResizedCrop, resize_box  # noqa: E402
from pipeline.transforms import SampleRandom  # noqa: E402
from preprocess.sample import render_image  # noqa: E402
from shards.imagedata import load_fast_backends  # noqa: E402

SIZE = 224
QUALITY = 90
# MCU width and height by simplejpeg's subsampling name: a lossless crop starts on these.
MCU = {"444": (8, 8), "422": (16, 8), "420": (16, 16), "440": (8, 16), "411": (32, 8)}
MCU_GRAY = (8, 8)

Box = tuple[float, float, float, float]
Case = Callable[[bytes, Box, bool, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Crop:
    """One sample: a JPEG and the box and flip the loader's crop drew for it."""

    data: bytes
    box: Box
    flip: bool
    key: str  # the SampleRandom seed that drew them


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    simplejpeg, cv2 = load_fast_backends()
    cropper, why = load_cropper()
    machine = describe_machine(["simplejpeg", "opencv-python-headless", "PyTurboJPEG"])
    print(", ".join(f"{k} {v}" for k, v in machine.items()))
    print(f"{args.images} images x {args.draws} crops per side, {args.rounds} rounds")
    if cropper is None:
        print(f"lossless-crop rows left out: {why}")
    rows = []
    for side in args.sides:
        crops = make_crops(side, args.images, args.draws)
        rows.extend(study(side, crops, build_cases(cropper), args.rounds))
    header = ["variant", "side", "us/sample", "vs fast", "PSNR all (dB)", "worst (dB)", "applies"]
    print(markdown_table(header, rows))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100, help="images per shard side")
    parser.add_argument("--draws", type=int, default=2, help="crops drawn per image")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--sides", type=int, nargs="+", default=[256, 512])
    return parser.parse_args(argv)


def load_cropper() -> tuple[object | None, str]:
    """PyTurboJPEG's `TurboJPEG`, or None and why not."""
    try:
        from turbojpeg import TurboJPEG
    except ImportError as error:
        return None, f"PyTurboJPEG is not installed ({error})"
    try:
        return TurboJPEG(), ""
    except (OSError, RuntimeError) as error:  # no libturbojpeg, or one of another API
        return None, f"libturbojpeg did not load ({error})"


def make_crops(side: int, images: int, draws: int) -> list[Crop]:
    """JPEGs at shorter side `side` and the loader's crop draws for each (seed 0, epoch 0)."""
    simplejpeg, _ = load_fast_backends()
    transform = FastRandomResizedCrop(size=SIZE)
    crops = []
    for index in range(images):
        _, image = render_image(index)
        image = image.convert("RGB")
        factor = side / min(image.size)
        size = (round(image.width * factor), round(image.height * factor))
        pixels = np.asarray(image.resize(size, Image.Resampling.LANCZOS))
        data = simplejpeg.encode_jpeg(pixels, QUALITY, "RGB", "420")
        for draw in range(draws):
            key = f"aug:0:0:{index:08d}:{draw}"  # the loader's seed string, epoch 0
            box, flip = transform.choose_crop(size[0], size[1], SampleRandom(key))
            crops.append(Crop(data, box, flip, key))
    return crops


def build_cases(cropper: object | None) -> dict[str, Case]:
    cases: dict[str, Case] = {
        "fast": partial(decode_case, scaling="pow2"),
        "no-dct-scale": partial(decode_case, scaling="none"),
        "dct-scale-n/8": partial(decode_case, scaling="eighths"),
        "fastdct": partial(decode_case, scaling="pow2", fastdct=True),
        "fastupsample": partial(decode_case, scaling="pow2", fastupsample=True),
        "fast-flags": partial(decode_case, scaling="pow2", fastdct=True, fastupsample=True),
    }
    if cropper is not None:
        cases["lossless-crop"] = partial(decode_case, scaling="pow2", cropper=cropper)
        cases["lossless-crop+fast-flags"] = partial(
            decode_case, scaling="pow2", fastdct=True, fastupsample=True, cropper=cropper
        )
    return cases


def decode_case(
    data: bytes,
    box: Box,
    flip: bool,
    out: np.ndarray,
    *,
    scaling: str,
    fastdct: bool = False,
    fastupsample: bool = False,
    cropper: object | None = None,
) -> np.ndarray:
    """Decode `box` of `data` at SIZE x SIZE into `out` as the variant says."""
    simplejpeg, _ = load_fast_backends()
    height, width, _, subsampling = simplejpeg.decode_jpeg_header(data)
    if cropper is not None:
        data, box, width, height = lossless_crop(cropper, data, box, width, height, subsampling)
    box_w, box_h = box[2] - box[0], box[3] - box[1]
    if scaling == "eighths":
        factor = eighths_factor(box_w, box_h)
    else:
        factor = 1 / (draft_scale(box_w, box_h, (SIZE, SIZE)) if scaling == "pow2" else 1)
    want = (math.ceil(height * factor), math.ceil(width * factor))  # libjpeg rounds up
    pixels = simplejpeg.decode_jpeg(
        data,
        "RGB",
        fastdct=fastdct,
        fastupsample=fastupsample,
        min_height=want[0],
        min_width=want[1],
    )
    if pixels.shape[:2] != want:
        raise AssertionError(f"asked libjpeg for {want}, got {pixels.shape[:2]}")
    # The exact DCT factor, as JpegCrop uses (the rounded-up size is not).
    scaled = (box[0] * factor, box[1] * factor, box[2] * factor, box[3] * factor)
    return resize_box(pixels, scaled, SIZE, "bilinear", flip, out)


def eighths_factor(box_w: float, box_h: float) -> float:
    """The smallest n/8 (n = 1..8) that keeps the box at least SIZE on both sides."""
    need = max(SIZE / box_w, SIZE / box_h)
    return max(1, min(8, math.ceil(8 * need - 1e-9))) / 8


def lossless_crop(
    cropper, data: bytes, box: Box, width: int, height: int, subsampling: str
) -> tuple[bytes, Box, int, int]:
    """The JPEG cut to the MCUs `box` touches (no pixel decoded), and the box within it."""
    mcu_w, mcu_h = MCU.get(subsampling, MCU_GRAY)
    left, top = int(box[0]) // mcu_w * mcu_w, int(box[1]) // mcu_h * mcu_h
    right, bottom = min(width, math.ceil(box[2])), min(height, math.ceil(box[3]))
    if (left, top, right, bottom) == (0, 0, width, height):
        return data, box, width, height
    # preserve=True keeps a region that starts on an MCU as it is (False trims the
    # image's partial last MCU, which a box at the right or bottom edge needs).
    cut = cropper.crop(data, left, top, right - left, bottom - top, preserve=True)
    moved = (box[0] - left, box[1] - top, box[2] - left, box[3] - top)
    return cut, moved, right - left, bottom - top


def exact(crop: Crop, out: np.ndarray) -> np.ndarray:
    """The reference: full-size decode, accurate IDCT and upsampling, the same resize."""
    simplejpeg, _ = load_fast_backends()
    pixels = simplejpeg.decode_jpeg(crop.data, "RGB")
    return resize_box(pixels, crop.box, SIZE, "bilinear", crop.flip, out)


def study(side: int, crops: list[Crop], cases: dict[str, Case], rounds: int) -> list[list]:
    """Rows of the table for one shard side: timing, PSNR and how often each variant applies."""
    check_fast_matches_the_loader(crops)
    out = np.empty((SIZE, SIZE, 3), np.uint8)
    reference = [exact(crop, np.empty_like(out)).astype(np.float64) for crop in crops]
    names = list(cases)
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(time_case(cases[name], crops, out))
    base = statistics.median(times["fast"])
    rows = []
    for name in names:
        errors = [
            float(np.mean((cases[name](c.data, c.box, c.flip, out) - ref) ** 2))
            for c, ref in zip(crops, reference, strict=True)
        ]
        us = statistics.median(times[name])
        rows.append(
            [
                name,
                side,
                f"{us:.0f}",
                f"{base / us:.2f}x",
                psnr(statistics.mean(errors)),
                psnr(max(errors)),
                applies(name, crops),
            ]
        )
    return rows


def time_case(case: Case, crops: list[Crop], out: np.ndarray) -> float:
    started = time.process_time()
    for crop in crops:
        case(crop.data, crop.box, crop.flip, out)
    return (time.process_time() - started) / len(crops) * 1e6


def check_fast_matches_the_loader(crops: list[Crop]) -> None:
    """The `fast` variant is the shipped path with exact chroma upsampling everywhere (the
    reference the flags are measured against): same pixels as `FastRandomResizedCrop` with
    `PLAIN_UPSAMPLING_WHEN_AVERAGED` off."""
    transform = FastRandomResizedCrop(size=SIZE)
    switch = fast_transforms.PLAIN_UPSAMPLING_WHEN_AVERAGED
    fast_transforms.PLAIN_UPSAMPLING_WHEN_AVERAGED = False
    try:
        for crop in crops[:20]:
            shipped = transform(crop.data, SampleRandom(crop.key))
            out = np.empty_like(shipped)
            mine = decode_case(crop.data, crop.box, crop.flip, out, scaling="pow2")
            if not np.array_equal(shipped, mine):
                raise AssertionError("the 'fast' variant no longer matches FastRandomResizedCrop")
    finally:
        fast_transforms.PLAIN_UPSAMPLING_WHEN_AVERAGED = switch


def psnr(mse: float) -> str:
    return "exact" if mse == 0 else f"{10 * math.log10(255**2 / mse):.1f}"


def applies(name: str, crops: list[Crop]) -> str:
    """How often the variant decodes less than the full image (a share of the samples)."""
    if name.startswith("lossless-crop"):
        kept = [crop_area(c) for c in crops]
        return f"{statistics.mean(kept):.0%} of pixels decoded"
    if name == "dct-scale-n/8":
        count = sum(eighths_factor(c.box[2] - c.box[0], c.box[3] - c.box[1]) < 1 for c in crops)
        return f"{count / len(crops):.0%} of samples"
    if name in ("no-dct-scale",):
        return "never"
    count = sum(
        draft_scale(c.box[2] - c.box[0], c.box[3] - c.box[1], (SIZE, SIZE)) > 1 for c in crops
    )
    return f"DCT scale on {count / len(crops):.0%}"


def crop_area(crop: Crop) -> float:
    """Fraction of the image's pixels a lossless crop to `crop.box`'s MCUs keeps (4:2:0)."""
    simplejpeg, _ = load_fast_backends()
    height, width, _, _ = simplejpeg.decode_jpeg_header(crop.data)
    left, top = int(crop.box[0]) // 16 * 16, int(crop.box[1]) // 16 * 16
    right, bottom = min(width, math.ceil(crop.box[2])), min(height, math.ceil(crop.box[3]))
    return (right - left) * (bottom - top) / (width * height)


if __name__ == "__main__":
    raise SystemExit(main())
