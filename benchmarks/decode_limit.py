"""Per-core throughput limit of the loader's per-sample work: decode, crop, resize, flip.

Compares a plain hand-written Pillow loop with `pipeline.transforms` on 256-px shard JPEGs,
shows what DCT-scaled decoding (`draft`) gives on 512 and 1024 px shards, and, where installed,
times simplejpeg and OpenCV alternatives. One process, one thread, CPU time: numbers are
per core, and stay meaningful on a machine shared with other jobs.

    python benchmarks/decode_limit.py [--images 500] [--repeats 5]

Run it again with pillow-simd installed in place of Pillow to time that.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from io import BytesIO
from pathlib import Path

import numpy as np
import PIL
from PIL import Image

from pipeline.decode import draft_scale
from pipeline.transforms import CenterCrop, RandomResizedCrop, sample_crop_box
from preprocess.sample import make_sample
from shards.sample import SampleError

SIZE = 224
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)

Case = Callable[[bytes, random.Random], object]


@dataclass(frozen=True)
class Result:
    """Median throughput of one case over all repeats."""

    name: str
    shard_side: int
    images_per_s: float
    spread: float  # (max - min) / median of the repeats' throughputs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"Pillow {PIL.__version__}, numpy {np.__version__}; {args.images} images, "
        f"median of {args.repeats} repeats, CPU time of one core"
    )
    if args.sources:
        sources = read_sources(Path(args.sources), args.images)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            sources = make_sources(Path(tmp), args.images)
    large = tuple(int(side) for side in args.large_sides.split(",") if side)
    shards = {side: shard_set(sources, side) for side in (256, *large)}
    cases = build_cases(large)
    results = [
        Result(name, side, rate, spread)
        for (name, side), (rate, spread) in measure(cases, shards, args.repeats).items()
    ]
    print_table(results)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=500, help="source images to generate")
    parser.add_argument("--repeats", type=int, default=5, help="passes over all images per case")
    parser.add_argument(
        "--sources",
        help="existing image tree (e.g. from `preprocess make-sample`) instead of a fresh one; "
        "needed where Pillow cannot write WEBP, as in a pillow-simd build without libwebp",
    )
    parser.add_argument(
        "--large-sides",
        default="512,1024",
        help="comma-separated larger shard sides for the draft comparison ('' for none)",
    )
    return parser.parse_args(argv)


def make_sources(root: Path, count: int) -> list[bytes]:
    """Photo-like source images of mixed formats and sizes (mostly ~500x375)."""
    make_sample(root / "images", count, classes=10, seed=0, workers=1)
    return [path.read_bytes() for path in sorted((root / "images").rglob("img_*"))]


def read_sources(root: Path, count: int) -> list[bytes]:
    return [path.read_bytes() for path in sorted(root.rglob("img_*"))[:count]]


def shard_set(sources: list[bytes], side: int) -> list[bytes]:
    """Shard JPEGs of every source this Pillow build can open."""
    shards = []
    for data in sources:
        try:
            shards.append(shard_jpeg(data, side))
        except OSError:  # e.g. a WEBP source under a Pillow built without libwebp
            continue
    if len(shards) < len(sources):
        print(f"{side} px: skipped {len(sources) - len(shards)} sources this Pillow cannot open")
    return shards


def shard_jpeg(data: bytes, side: int) -> bytes:
    """A shard image with shorter side exactly `side`, JPEG q90, as build-shards stores them.

    Unlike build-shards this also upscales, so that 512 and 1024 px stand in for shards
    built from larger sources.
    """
    with Image.open(BytesIO(data)) as source:
        image = source.convert("RGB")
    scale = side / min(image.size)
    size = (max(side, round(image.width * scale)), max(side, round(image.height * scale)))
    out = BytesIO()
    image.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0).save(out, "JPEG", quality=90)
    return out.getvalue()


def build_cases(large_sides: tuple[int, ...]) -> dict[tuple[str, int], Case]:
    """Every (name, shard side) to time; candidates only when their package is installed."""
    cases: dict[tuple[str, int], Case] = {
        ("plain Pillow loop (RRC + flip)", 256): plain_loop,
        ("plain Pillow loop, crop() then resize()", 256): partial(plain_loop, crop_first=True),
        ("decode only (open + load)", 256): decode_only,
        ("RandomResizedCrop", 256): RandomResizedCrop(size=SIZE),
        ("CenterCrop", 256): CenterCrop(size=SIZE),
    }
    for name, case in candidate_cases().items():
        cases[(name, 256)] = case
    # At 256 px neither transform ever drafts (no crop is 2x the output), so draft matters
    # only for larger shards.
    for side in large_sides:
        cases[("RandomResizedCrop", side)] = RandomResizedCrop(size=SIZE)
        cases[("RandomResizedCrop, draft off", side)] = RandomResizedCrop(size=SIZE, draft=False)
        cases[("CenterCrop", side)] = CenterCrop(size=SIZE)
        cases[("CenterCrop, draft off", side)] = CenterCrop(size=SIZE, draft=False)
    return cases


def measure(
    cases: dict[tuple[str, int], Case], shards: dict[int, list[bytes]], repeats: int
) -> dict[tuple[str, int], tuple[float, float]]:
    """Median images/s and relative spread per case.

    Cases take turns within each repeat, so a noisy neighbour on a shared machine slows
    all of them alike instead of one case's whole run.
    """
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for (name, side), case in cases.items():
            rates[(name, side)].append(time_pass(case, shards[side]))
    summary = {}
    for key, values in rates.items():
        median = statistics.median(values)
        summary[key] = (median, (max(values) - min(values)) / median)
    return summary


def time_pass(case: Case, images: list[bytes]) -> float:
    rng = random.Random(0)  # every case sees the same crop boxes and flips
    skipped = 0
    # CPU time of this process, not wall time: on a shared machine the wall clock also counts
    # the time other processes hold our core. Every case runs on one thread.
    start = time.process_time()
    for data in images:
        try:
            case(data, rng)
        except SampleError:
            skipped += 1
    elapsed = time.process_time() - start
    if skipped:
        raise RuntimeError(f"{skipped} of {len(images)} images failed; the benchmark is invalid")
    return len(images) / elapsed


def plain_loop(data: bytes, rng: random.Random, crop_first: bool = False) -> np.ndarray:
    """What one writes by hand: open, draft, crop + resize, flip, asarray. No checks."""
    image = Image.open(BytesIO(data))
    box = sample_crop_box(*image.size, SCALE, RATIO, rng)
    flip = rng.random() < 0.5
    scale = draft_scale(box[2] - box[0], box[3] - box[1], (SIZE, SIZE))
    if scale > 1:
        width, height = image.size
        extent = image.draft("RGB", (width // scale, height // scale))[1]
        f = extent[2] / width
        box = (box[0] * f, box[1] * f, box[2] * f, box[3] * f)
    if crop_first:
        out = image.crop(box).resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    else:
        out = image.resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


def decode_only(data: bytes, rng: random.Random) -> None:
    Image.open(BytesIO(data)).load()


def candidate_cases() -> dict[str, Case]:
    """Alternative decoders and resizers that are importable here (none in the project venv)."""
    cases: dict[str, Case] = {}
    try:
        import cv2
    except ImportError:
        cv2 = None
    if cv2 is not None:
        cv2.setNumThreads(1)  # per-core numbers; a DataLoader worker should do the same
        cases["Pillow decode + cv2.resize"] = PillowCv2()
        cases["cv2.imdecode + cv2.resize"] = Cv2Only()
    try:
        import simplejpeg
    except ImportError:
        simplejpeg = None
    if simplejpeg is not None:
        cases["simplejpeg decode only"] = SimpleJpegDecode()
        if cv2 is not None:
            cases["simplejpeg + cv2.resize"] = SimpleJpegCv2()
            cases["simplejpeg fastdct + cv2.resize"] = SimpleJpegCv2(fast=True)
        cases["simplejpeg + Pillow resize"] = SimpleJpegPillow()
    return cases


def crop_and_flip(rng: random.Random, width: int, height: int) -> tuple[tuple[int, ...], bool]:
    box = sample_crop_box(width, height, SCALE, RATIO, rng)
    return box, rng.random() < 0.5


def cv2_resize(pixels: np.ndarray, box: tuple[int, ...], flip: bool, factor: int = 1) -> np.ndarray:
    """Crop (a view, no copy), resize bilinearly and flip with OpenCV."""
    import cv2

    left, top, right, bottom = (round(v / factor) for v in box)
    out = cv2.resize(pixels[top:bottom, left:right], (SIZE, SIZE), interpolation=cv2.INTER_LINEAR)
    return cv2.flip(out, 1) if flip else out


class PillowCv2:
    """Pillow decodes, OpenCV resizes: the smallest change to the stack."""

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        image = Image.open(BytesIO(data))
        box, flip = crop_and_flip(rng, *image.size)
        return cv2_resize(np.asarray(image), box, flip)


class Cv2Only:
    """OpenCV decodes (libjpeg-turbo) and resizes; it decodes to BGR."""

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        import cv2

        pixels = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
        box, flip = crop_and_flip(rng, pixels.shape[1], pixels.shape[0])
        return cv2_resize(pixels, box, flip)


class SimpleJpegDecode:
    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        import simplejpeg

        return simplejpeg.decode_jpeg(data, colorspace="RGB")


class SimpleJpegCv2:
    """libjpeg-turbo straight to a numpy array, OpenCV for the resize."""

    def __init__(self, fast: bool = False) -> None:
        self.fast = fast

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        import simplejpeg

        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
        box, flip = crop_and_flip(rng, width, height)
        pixels = simplejpeg.decode_jpeg(
            data, colorspace="RGB", fastdct=self.fast, fastupsample=self.fast
        )
        return cv2_resize(pixels, box, flip)


class SimpleJpegPillow:
    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        import simplejpeg

        pixels = simplejpeg.decode_jpeg(data, colorspace="RGB")
        box, flip = crop_and_flip(rng, pixels.shape[1], pixels.shape[0])
        out = Image.fromarray(pixels).resize((SIZE, SIZE), Image.Resampling.BILINEAR, box=box)
        if flip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return np.asarray(out)


def print_table(results: list[Result]) -> None:
    """Markdown table; the plain loop on 256-px shards is the 1.00x reference."""
    reference = next(r.images_per_s for r in results if r.name.startswith("plain Pillow loop (RRC"))
    print()
    print("| case | shard side | img/s per core | ms/img | vs plain loop | spread |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.name} | {r.shard_side} | {r.images_per_s:,.0f} | {1000 / r.images_per_s:.2f} "
            f"| {r.images_per_s / reference:.2f}x | {r.spread:.0%} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
