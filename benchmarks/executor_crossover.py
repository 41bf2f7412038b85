"""Build time on the local pool against Ray by build size: where `--executor auto` should switch.

Each build runs in a fresh process (`preprocess build-shards`), so Ray's start-up counts
as a user pays it. Prints one row per size and the crossover: the smallest size at which
Ray is no slower, or, when none is, the size from which Ray's measured start-up would be
`preprocess.pool.RAY_START_SHARE` of a build at the measured local rate (the rule
`--executor auto` follows, `preprocess.pool.ray_min_inputs`).

    .venv/bin/python benchmarks/executor_crossover.py --sizes 200,1000,4000
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from preprocess.pool import RAY_START_SHARE
from preprocess.sample import make_sample


def timed_build(images: Path, output: Path, executor: str, workers: int) -> float:
    """Wall seconds of one build from a fresh process."""
    command = [sys.executable, "-m", "preprocess.cli", "build-shards", "--input", str(images),
               "--output", str(output), "--executor", executor, "--workers", str(workers),
               "--no-progress", "--shard-size", "100"]  # fmt: skip
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def ray_start_s() -> float:
    """Seconds to import Ray and start a local one, in a fresh process."""
    code = (
        "import time,os; t=time.perf_counter(); import ray; "
        "ray.init(address='local', num_cpus=os.cpu_count(), include_dashboard=False, "
        "logging_level='ERROR'); print(time.perf_counter()-t)"
    )
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200,1000,4000", help="comma-separated image counts")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    start = ray_start_s()
    print(f"ray start (import + ray.init, fresh process): {start:.1f} s; {args.workers} workers")
    print(f"{'images':>8} {'local s':>9} {'ray s':>9} {'ray/local':>10}")
    crossover, rate = None, None
    with tempfile.TemporaryDirectory(prefix="crossover-") as scratch:
        for size in sizes:
            images = Path(scratch) / f"images-{size}"
            make_sample(images, size, classes=10, seed=0, workers=args.workers)
            local = timed_build(images, Path(scratch) / f"local-{size}", "local", args.workers)
            ray = timed_build(images, Path(scratch) / f"ray-{size}", "ray", args.workers)
            rate = size / local
            print(f"{size:>8} {local:>9.1f} {ray:>9.1f} {ray / local:>10.2f}")
            if crossover is None and ray <= local:
                crossover = size
    if crossover is not None:
        print(f"crossover: Ray is no slower from {crossover} images")
    else:
        needed = start / RAY_START_SHARE * rate
        print(
            f"crossover: none measured; at {rate:.0f} images/s locally "
            f"({rate / args.workers:.0f} per CPU), Ray's start-up is {RAY_START_SHARE:.0%} of "
            f"a build from {needed:.0f} images"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
