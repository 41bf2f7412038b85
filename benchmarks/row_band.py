"""What decoding only a crop's rows buys, per sample, in one process (CPU time).

Times the loader's random-resized crop (`FastRandomResizedCrop`, 224) on the JPEGs of a
build whose files carry a restart marker per MCU row (build-shards' default), three ways:
the plain limit loop (whole decode, OpenCV bilinear), the loader's crop with every JPEG
decoded whole (`band_decode` off), and the loader's crop as shipped (only the rows the box
needs). Interleaved rounds, medians. Also reports the share of rows a band decodes.

    python benchmarks/row_band.py --shards /tmp/loaderbench/shards [--images 800] [--rounds 5]
"""

from __future__ import annotations

import argparse
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

from pipeline.fast_transforms import FastRandomResizedCrop  # noqa: E402
from pipeline.transforms import SampleRandom  # noqa: E402
from shards.imagedata import read_jpeg_header  # noqa: E402
from shards.jpegband import crop_rows  # noqa: E402


class WholeDecode(FastRandomResizedCrop):
    band_decode = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True, help="a build-shards output")
    parser.add_argument("--images", type=int, default=800)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    jpegs = load_jpegs(args.shards)[: args.images]
    ours, whole, limit = FastRandomResizedCrop(224), WholeDecode(224), PlainFastCrop()
    slot = np.empty((224, 224, 3), np.uint8)

    def run_limit() -> None:
        rng = random.Random(0)
        for data in jpegs:
            limit(data, rng)

    def run(transform) -> None:
        for index, data in enumerate(jpegs):
            transform(data, SampleRandom(f"k{index}"), slot)

    cases = {
        "limit: whole decode, OpenCV bilinear": run_limit,
        "the loader's crop, whole decode": lambda: run(whole),
        "the loader's crop, rows only (shipped)": lambda: run(ours),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            started = time.process_time()
            case()
            times[name].append((time.process_time() - started) / len(jpegs) * 1e6)
    limit_us = statistics.median(times["limit: whole decode, OpenCV bilinear"])
    print(f"{len(jpegs)} JPEGs from {args.shards}, {args.rounds} interleaved rounds, medians")
    print("| per sample | us (CPU) | limit / this |\n|---|---:|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.0f} | {limit_us / median:.2f}x |")
    print(f"rows decoded by a band, mean: {rows_share(jpegs, ours):.0%} (guard rows included)")
    return 0


def rows_share(jpegs: list[bytes], transform: FastRandomResizedCrop) -> float:
    """Mean share of an image's rows the shipped crop decodes (1.0 where it cannot cut)."""
    shares = []
    for index, data in enumerate(jpegs):
        width, height, _ = read_jpeg_header(data)
        box, _ = transform.choose_crop(width, height, SampleRandom(f"k{index}"))
        band = crop_rows(data, int(box[1]), math.ceil(box[3]))  # DCT scale 1's guard
        shares.append(1.0 if band is None else band.height / height)
    return statistics.mean(shares)


if __name__ == "__main__":
    raise SystemExit(main())
