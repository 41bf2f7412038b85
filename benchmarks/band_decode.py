"""What decoding only a crop's band buys, per sample, in one process (CPU time).

Times the loader's random-resized crop (`FastRandomResizedCrop`, 224) on the JPEGs of one or
more builds of the same images (build-shards' default, whose restart intervals are about
64 px of a row; `--jpeg-restarts rows`, one interval per row; `--jpeg-restarts none`),
three ways each: the plain limit loop (whole decode, OpenCV bilinear), the loader's crop
with every JPEG decoded whole (`band_decode` off), and the loader's crop as shipped (only
the restart intervals the box needs). All builds in every round, interleaved by chunks of 50 images; medians of the rounds.
Also reports the mean share of an image's pixels a band decodes, and the files' size.

    python benchmarks/band_decode.py --shards /tmp/loaderbench/shards512 \
        --shards /tmp/loaderbench/shards512-rows [--images 800] [--rounds 5] \
        [--baseline-jpegband OLD/shards/image/bands.py]

`--baseline-jpegband` adds a fourth case: the shipped crop with `crop_band` taken from another
copy of `shards/image/bands.py` (say `git show REV:shards/image/bands.py > /tmp/old.py`), run in
the same rounds and chunks, so a change to the band code is measured side by side.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loader_throughput import PlainFastCrop, load_jpegs  # noqa: E402

import pipeline.fast_transforms as fast_transforms  # noqa: E402
from pipeline.fast_transforms import FastRandomResizedCrop  # noqa: E402
from pipeline.transforms import SampleRandom  # noqa: E402
from shards.image.bands import crop_band  # noqa: E402
from shards.image.policy import read_jpeg_header  # noqa: E402

LIMIT = "limit: whole decode, OpenCV bilinear"
WHOLE = "the loader's crop, whole decode"
SHIPPED = "the loader's crop, band only (shipped)"
BASELINE = "the loader's crop, band only (baseline band code)"
CHUNK = 50  # images per case before the next case runs


class WholeDecode(FastRandomResizedCrop):
    band_decode = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shards", type=Path, action="append", required=True, help="a build-shards output"
    )
    parser.add_argument("--images", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--baseline-jpegband", type=Path, help="another shards/image/bands.py to compare with"
    )
    args = parser.parse_args(argv)
    shipped_band = fast_transforms.crop_band
    baseline_band = load_crop_band(args.baseline_jpegband) if args.baseline_jpegband else None
    builds = {path.name: load_jpegs(path)[: args.images] for path in args.shards}
    ours, whole, limit = FastRandomResizedCrop(224), WholeDecode(224), PlainFastCrop()
    slot = np.empty((224, 224, 3), np.uint8)

    def run_limit(jpegs: list[bytes], first: int) -> None:
        rng = random.Random(first)
        for data in jpegs:
            limit(data, rng)

    def run(transform, jpegs: list[bytes], first: int, band=shipped_band) -> None:
        fast_transforms.crop_band = band
        for index, data in enumerate(jpegs, first):
            transform(data, SampleRandom(f"k{index}"), slot)

    cases = {}
    for name in builds:
        cases[(name, LIMIT)] = run_limit
        cases[(name, WHOLE)] = functools.partial(run, whole)
        cases[(name, SHIPPED)] = functools.partial(run, ours)
        if baseline_band is not None:
            cases[(name, BASELINE)] = functools.partial(run, ours, band=baseline_band)
    # Every case runs on the same chunk of images before the next chunk starts, so the host's
    # drift (15-25% within minutes here) falls on all of them alike.
    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(args.rounds):
        spent = dict.fromkeys(cases, 0.0)
        for first in range(0, args.images, CHUNK):
            for key, case in cases.items():
                started = time.process_time()
                case(builds[key[0]][first : first + CHUNK], first)
                spent[key] += time.process_time() - started
        for key, seconds in spent.items():
            times[key].append(seconds / args.images * 1e6)
    first_limit = statistics.median(times[(next(iter(builds)), LIMIT)])
    print(f"{args.images} JPEGs of each build, {args.rounds} interleaved rounds, medians")
    print(
        f"| build | per sample | us (CPU) | {next(iter(builds))} limit / this |\n"
        "|---|---|---:|---:|"
    )
    for (build, name), values in times.items():
        median = statistics.median(values)
        print(f"| {build} | {name} | {median:.0f} | {first_limit / median:.2f}x |")
    for build, jpegs in builds.items():
        share = band_share(jpegs, ours)
        size = statistics.mean(len(data) for data in jpegs)
        print(
            f"{build}: a band decodes {share:.0%} of the pixels (guards included); {size:,.0f} B a JPEG"
        )
    return 0


def load_crop_band(path: Path):
    """`crop_band` of another copy of `shards/image/bands.py`."""
    spec = importlib.util.spec_from_file_location("baseline_jpegband", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.crop_band


def band_share(jpegs: list[bytes], transform: FastRandomResizedCrop) -> float:
    """Mean share of an image's pixels the shipped crop decodes (1.0 where it cannot cut)."""
    shares = []
    for index, data in enumerate(jpegs):
        width, height, _ = read_jpeg_header(data)
        box, _ = transform.choose_crop(width, height, SampleRandom(f"k{index}"))
        edges = (int(box[0]), int(box[1]), math.ceil(box[2]), math.ceil(box[3]))
        band = crop_band(data, *edges)  # DCT scale 1's guard
        shares.append(1.0 if band is None else band.width * band.height / (width * height))
    return statistics.mean(shares)


if __name__ == "__main__":
    raise SystemExit(main())
