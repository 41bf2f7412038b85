"""What mixup and cutmix cost per batch: `pipeline.MixupCutmix` on a 256 x 3 x 224 x 224 batch.

Times one `mix(images, labels)` call (draws, pixels in place, soft targets for 1,000
classes) per case: mixup, cutmix, both (switch 0.5) per batch, and both per pair and per
element; beside them the normalisation `CudaPrefetcher` already does to the same batch
(uint8 -> float32, minus mean, over std), the yardstick for "how much does mixing add".
The batch is refilled from a pristine copy before every call, outside the timed region
(mixing works in place), after one untimed call of each case. Cases run in a rotating order each round; the table gives the
median milliseconds per batch over rounds, its spread ((max - min) / median), the
microseconds per image and the ratio to the normalisation. On CUDA each call is timed
between synchronisations.

    python benchmarks/mixup_cost.py [--device cpu|cuda] [--rounds 7] [--calls 5] [--threads N]
    python benchmarks/mixup_cost.py --smoke   # a tiny batch, one round: does it run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import describe_machine, markdown_table, spread  # noqa: E402

from pipeline.mixup import MixupCutmix  # noqa: E402
from pipeline.prefetch import CudaPrefetcher  # noqa: E402

CLASSES = 1000
CASES = {
    "mixup 0.8, per batch": dict(mixup_alpha=0.8, cutmix_alpha=0.0, mode="batch"),
    "cutmix 1.0, per batch": dict(mixup_alpha=0.0, cutmix_alpha=1.0, mode="batch"),
    "mixup 0.8 / cutmix 1.0, per batch": dict(mixup_alpha=0.8, cutmix_alpha=1.0, mode="batch"),
    "mixup 0.8 / cutmix 1.0, per pair": dict(mixup_alpha=0.8, cutmix_alpha=1.0, mode="pair"),
    "mixup 0.8 / cutmix 1.0, per element": dict(mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem"),
}
NORMALISE = "normalise (what CudaPrefetcher does anyway)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=256, help="images per batch")
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    parser.add_argument("--rounds", type=int, default=7, help="rounds over every case")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per case and round")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--smoke", action="store_true", help="batch 8 of 32 px, one round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.size, args.rounds, args.calls = 8, 32, 1, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timings = measure(device, args.batch, args.size, args.rounds, args.calls)
    print(report(timings, args, device))
    return 0


def measure(
    device: torch.device, batch: int, size: int, rounds: int, calls: int
) -> dict[str, list[float]]:
    """Seconds per call of every case, one median per round."""
    generator = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (batch, 3, size, size), dtype=torch.uint8, generator=generator)
    raw = raw.to(device)
    pristine = CudaPrefetcher([], device).normalize(raw)
    labels = torch.randint(0, CLASSES, (batch,), generator=generator).to(device)
    images = pristine.clone()
    runs: dict[str, Callable[[], object]] = {
        NORMALISE: lambda: CudaPrefetcher([], device).normalize(raw),
    }
    for name, settings in CASES.items():
        mix = MixupCutmix(**settings, label_smoothing=0.1, num_classes=CLASSES)
        runs[name] = lambda mix=mix: mix(images, labels)
    names = list(runs)
    for name in names:  # first calls pay for allocations and lazy initialisation
        images.copy_(pristine)
        timed(runs[name], device)
    timings: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = []
            for _ in range(calls):
                images.copy_(pristine)
                seconds.append(timed(runs[name], device))
            timings[name].append(statistics.median(seconds))
    return timings


def timed(call: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def report(timings: dict[str, list[float]], args: argparse.Namespace, device: torch.device) -> str:
    base = statistics.median(timings[NORMALISE])
    rows = []
    for name, values in timings.items():
        middle = statistics.median(values)
        rows.append(
            [
                name,
                f"{middle * 1e3:.2f}",
                f"{spread(values):.2f}",
                f"{middle * 1e6 / args.batch:.1f}",
                f"{middle / base:.2f}x",
            ]
        )
    machine = describe_machine(["torch"])
    head = (
        f"batch {args.batch} x 3 x {args.size} x {args.size} float32 on {device}, "
        f"{torch.get_num_threads()} torch threads, {args.rounds} rounds x {args.calls} calls; "
        f"{machine['cpu_model']}, torch {machine['torch']}"
    )
    header = ["case", "ms / batch", "spread", "us / image", "x normalise"]
    return head + "\n\n" + markdown_table(header, rows)


if __name__ == "__main__":
    sys.exit(main())
