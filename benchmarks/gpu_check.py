"""Device check for a lent GPU machine: the loader + `CudaPrefetcher` on real shards, end to end.

Builds a few hundred sample images into 256-px shards, then for 1, 2, 4 and 8 workers runs
`build_loader(pin_memory=True, persistent_workers=True)` wrapped in `CudaPrefetcher` for
three epochs and checks: every sample exactly once per epoch, a new order every epoch (the
epoch reaches persistent workers), no "pin memory thread exited" or other loader error at
epoch boundaries (also under `prefetch_factor=8`, pytorch#47445), batches on the device with
the right dtype and layout, GPU normalization equal to the CPU formula, the side stream made
once, and no skipped samples. It measures images/s and the per-batch data wait (a data-bound
loop: nothing but the loader runs) and prints a JSON summary and a markdown table. Exits 1
on any failed check. Under 3 minutes on an H200 host; without CUDA it runs a degraded CPU
pass (fewer images and workers, CPU normalization, no pinning) to check the script itself.

    python benchmarks/gpu_check.py [--images 512] [--workers 1,2,4,8] [--json-out FILE]

Run the GPU unit tests too: `pytest -m gpu tests/pipeline/test_prefetch.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pipeline.config import Batching, Crop, ReadOptions, Shuffle, Workers
from pipeline.loader import LoaderConfig, ShardLoader, build_loader
from pipeline.prefetch import CudaPrefetcher
from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.sample import make_sample

EPOCHS = 3  # epoch 0 includes worker start-up; epochs 1-2 are measured
CHECKED_BATCHES = 2  # per epoch, compared against the CPU formula


@dataclass
class CaseResult:
    """One loader configuration: throughput, waits, and what failed."""

    workers: int
    prefetch_factor: int
    batches_per_epoch: int
    images_per_s: float = 0.0
    wait_ms_mean: float = 0.0
    wait_ms_p95: float = 0.0
    first_batch_s: float = 0.0
    failures: list[str] = field(default_factory=list)


class RecordingLoader:
    """Passes a loader's batches through, keeping CPU copies of the first few of each epoch."""

    def __init__(self, loader: ShardLoader, keep: int) -> None:
        self.loader = loader
        self.keep = keep
        self.kept: list[tuple[torch.Tensor, list[str]]] = []

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple]:
        self.kept = []
        for batch in self.loader:
            if len(self.kept) < self.keep:
                self.kept.append((batch[0].clone(), list(batch[2])))
            yield batch


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"mode: {'cuda' if cuda else 'cpu (degraded: no CUDA)'}; {machine_line()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        source = build_dataset(Path(tmp), args.images)
        keys = all_keys(source, args)
        cases = [(w, 2) for w in args.workers] + [(max(args.workers), 8)]
        results = [
            run_case(source, keys, workers, factor, device, args) for workers, factor in cases
        ]
    summary = {
        "machine": machine_info(),
        "device": str(device),
        "cases": [asdict(r) for r in results],
    }
    print(json.dumps(summary, indent=2))
    print(markdown_table(results))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    failures = [f"workers={r.workers}: {f}" for r in results for f in r.failures]
    for failure in failures:
        print(f"FAILED {failure}", file=sys.stderr)
    print("gpu_check: " + ("FAILED" if failures else "all checks passed"))
    return 1 if failures else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512 if cuda else 96)
    parser.add_argument("--workers", default="1,2,4,8" if cuda else "1,2")
    parser.add_argument("--batch-size", type=int, default=32 if cuda else 16)
    parser.add_argument("--image-size", type=int, default=224 if cuda else 64)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    args.workers = [int(w) for w in args.workers.split(",")]
    return args


def build_dataset(root: Path, images: int) -> Path:
    """Sample images -> 256-px tar shards, built inline (no Ray)."""
    started = time.perf_counter()
    workers = min(8, os.cpu_count() or 1)
    make_sample(root / "images", images, classes=10, seed=1, workers=workers)
    config = BuildConfig(
        input=str(root / "images"),
        output=str(root / "shards"),
        image=ImageConfig(image_size=256),
        shard_size=64,
        formats=("tar",),
        executor="inline",
        progress=False,
    )
    summary = run_build(config)
    print(
        f"built {summary.manifest.splits['train'].samples} samples into shards in "
        f"{time.perf_counter() - started:.1f}s",
        flush=True,
    )
    return summary.output


def loader_config(source: Path, workers: int, factor: int, args, pin: bool) -> LoaderConfig:
    return LoaderConfig(
        source=str(source),
        batch=Batching(size=args.batch_size, drop_last=False, epoch_rule="uneven"),
        shuffle=Shuffle(buffer=256, initial=64),
        crop=Crop(image_size=args.image_size),
        workers=Workers(count=workers, pin_memory=pin, persistent=True, prefetch_factor=factor),
        io=ReadOptions(timeout=120.0 if workers else 0.0),
        seed=5,
        # exactly once per epoch, so coverage is checkable
        with_keys=True,
        # A hung worker fails the check instead of using up the machine's time. (The
        # DataLoader refuses a timeout without workers.)
    )


def all_keys(source: Path, args) -> Counter:
    """Every key of the split once: one in-process epoch of the same loader."""
    loader = build_loader(loader_config(source, 0, 2, args, pin=False))
    return Counter(key for _, _, keys in loader for key in keys)


def run_case(
    source: Path, expected: Counter, workers: int, factor: int, device, args
) -> CaseResult:
    """Three epochs through the prefetcher; checks and measurements of one configuration."""
    loader = build_loader(loader_config(source, workers, factor, args, pin=device.type == "cuda"))
    recorder = RecordingLoader(loader, CHECKED_BATCHES)
    prefetcher = CudaPrefetcher(recorder, device, channels_last=True)
    stream = prefetcher.stream
    result = CaseResult(workers, factor, len(loader))
    orders, rates, waits = [], [], []
    for epoch in range(EPOCHS):
        try:
            keys, epoch_waits, elapsed, outputs = run_epoch(prefetcher, device, result)
        except RuntimeError as error:  # "Pin memory thread exited unexpectedly", worker deaths
            result.failures.append(f"epoch {epoch}: {type(error).__name__}: {error}")
            return result
        check_epoch(epoch, keys, expected, recorder, outputs, result)
        orders.append(keys)
        if epoch == 0:
            result.first_batch_s = loader.stats.first_batch_s or 0.0
        else:
            rates.append(len(keys) / elapsed)
            waits += epoch_waits
    if len({tuple(k) for k in orders}) != EPOCHS:
        result.failures.append("two epochs had the same order: the epoch did not reach workers")
    if prefetcher.stream is not stream:
        result.failures.append("the prefetch stream was replaced")
    if sum(loader.stats.skipped.values()):
        result.failures.append(f"samples skipped: {dict(loader.stats.skipped)}")
    result.images_per_s = statistics.mean(rates)
    result.wait_ms_mean = 1000 * statistics.mean(waits)
    result.wait_ms_p95 = 1000 * sorted(waits)[int(0.95 * (len(waits) - 1))]
    print(
        f"workers={workers} prefetch_factor={factor}: {result.images_per_s:.0f} img/s", flush=True
    )
    return result


def run_epoch(prefetcher: CudaPrefetcher, device, result: CaseResult):
    """One epoch; returns keys in order, per-batch waits, seconds, and the first outputs."""
    keys, waits, outputs = [], [], []
    iterator = iter(prefetcher)
    started = time.perf_counter()
    while True:
        waited = time.perf_counter()
        batch = next(iterator, None)
        waits.append(time.perf_counter() - waited)
        if batch is None:
            waits.pop()
            break
        images, labels, batch_keys = batch
        check_batch(images, labels, device, result)
        if len(outputs) < CHECKED_BATCHES:
            outputs.append(images.float().cpu())
        keys += batch_keys
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return keys, waits, time.perf_counter() - started, outputs


def check_batch(images: torch.Tensor, labels: torch.Tensor, device, result: CaseResult) -> None:
    problems = []
    if images.device.type != device.type or labels.device.type != device.type:
        problems.append(f"batch on {images.device}/{labels.device}, not {device}")
    if images.dtype != torch.float32 or labels.dtype != torch.int64:
        problems.append(f"dtypes {images.dtype}/{labels.dtype}")
    if not images.is_contiguous(memory_format=torch.channels_last):
        problems.append("images are not channels_last")
    if problems and not result.failures:
        result.failures += problems


def check_epoch(epoch, keys, expected: Counter, recorder, outputs, result: CaseResult) -> None:
    if Counter(keys) != expected:
        missing = sum((expected - Counter(keys)).values())
        extra = sum((Counter(keys) - expected).values())
        result.failures.append(f"epoch {epoch}: {missing} samples missing, {extra} extra")
    for (raw, raw_keys), out in zip(recorder.kept, outputs, strict=False):
        (reference, _, _), *_ = list(CudaPrefetcher([(raw, torch.zeros(1), raw_keys)], "cpu"))
        error = (out - reference).abs().max().item()
        if error > 1e-5:
            result.failures.append(f"epoch {epoch}: GPU normalization differs by {error:.2e}")
            return


def markdown_table(results: list[CaseResult]) -> str:
    lines = [
        "| workers | prefetch_factor | batches/epoch | images/s | wait ms (mean) | wait ms (p95) "
        "| first batch s | checks |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.workers} | {r.prefetch_factor} | {r.batches_per_epoch} | {r.images_per_s:.0f} "
            f"| {r.wait_ms_mean:.2f} | {r.wait_ms_p95:.2f} | {r.first_batch_s:.2f} "
            f"| {'FAIL' if r.failures else 'ok'} |"
        )
    return "\n".join(lines)


def machine_info() -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def machine_line() -> str:
    info = machine_info()
    return f"{info.get('gpu', 'no GPU')}, {info['cpus']} CPUs, torch {info['torch']}"


if __name__ == "__main__":
    sys.exit(main())
