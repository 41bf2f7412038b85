"""The moonshot alone: our loader's defaults against the full-decode fast limit, finely paired.

`loader_throughput.py` runs ~25 contenders a round, so one round takes minutes and this
shared host's speed drifts by 15-25% within it: a 2-5% difference cannot be read from it.
Here only the few contenders that decide the moonshot run, one epoch each, in rounds of a
few seconds whose order rotates, and every ratio is paired within its round:

- ours: `build_loader` with its defaults (2 workers) on the build's shards;
- the fast limit (simplejpeg decode + OpenCV bilinear, no antialiasing, in as many processes
  as ours has workers, up to the cores) on the same JPEGs, and on the JPEGs of `--baseline-shards` builds of the same images (a build
  without restart markers decodes whole fastest: the strictest limit).

Both wall-clock img/s (ours timed after one batch per worker, as in loader_throughput.py)
and images per CPU-second (ours with its start-up included, which only counts against it)
are reported, as medians of the paired ratios.

    python benchmarks/moonshot.py --shards W/shards512 --baseline-shards W/shards512-nomarkers \
        [--rounds 9] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loader_throughput import OurLoader, PlainFastCrop, PlainLoop, load_jpegs  # noqa: E402

OURS = "ours, defaults"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True, help="a build-shards output")
    parser.add_argument("--baseline-shards", type=Path, action="append", default=[])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    # The limit runs as many processes as ours has workers, up to the cores.
    processes = min(args.workers, os.cpu_count() or 1)
    contenders = [
        OurLoader(OURS, args.shards, workers=args.workers),
        PlainLoop(
            f"limit, {args.shards.name}", load_jpegs(args.shards), PlainFastCrop(), processes
        ),
    ]
    for baseline in args.baseline_shards:
        jpegs = load_jpegs(baseline)
        contenders.append(PlainLoop(f"limit, {baseline.name}", jpegs, PlainFastCrop(), processes))
    runs: list[dict] = []
    for index in range(args.rounds):
        shift = index % len(contenders)
        order = contenders[shift:] + contenders[:shift]  # rotate who goes first
        results = {c.name: c.run(seed=index, warmup=args.warmup) for c in order}
        runs.append(results)
        line = ", ".join(f"{name} {m.images_per_s:,.0f}" for name, m in results.items())
        print(f"round {index + 1}: {line} img/s", flush=True)
    print(f"\n{args.rounds} rounds, {args.workers} workers; medians of ratios paired by round")
    print("| ours against | wall img/s ratio (min-max) | img per CPU-s ratio (min-max) |")
    print("|---|---:|---:|")
    for contender in contenders[1:]:
        wall = [r[OURS].images_per_s / r[contender.name].images_per_s for r in runs]
        cpu = [r[OURS].images_per_cpu_s / r[contender.name].images_per_cpu_s for r in runs]
        print(
            f"| {contender.name} | {statistics.median(wall):.3f} "
            f"({min(wall):.2f}-{max(wall):.2f}) | {statistics.median(cpu):.3f} "
            f"({min(cpu):.2f}-{max(cpu):.2f}) |"
        )
    for contender in contenders:
        speeds = [r[contender.name].images_per_s for r in runs]
        print(f"{contender.name}: median {statistics.median(speeds):,.0f} img/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
