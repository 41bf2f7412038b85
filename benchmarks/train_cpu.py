"""A short CPU training run on the sample dataset: loss falls, val accuracy beats chance.

Makes sample images, builds 64-px shards (inline, no Ray), trains the built-in
CNN for a few epochs through `trainers.train.main`, and prints a markdown block
for docs/BENCHMARKS.md with images/s, the data-wait share and the verdict.

    python benchmarks/train_cpu.py [--images 2000] [--classes 10] [--epochs 4] [--workers 1]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from common import describe_machine

from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.sample import make_sample
from trainers.train import main as train_main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=64, help="stored and trained side, px")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--lr", type=float, default=0.8, help="at --lr-ref-batch 256")
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    return parser.parse_args(argv)


def build_dataset(root: Path, args: argparse.Namespace) -> tuple[Path, float]:
    started = time.perf_counter()
    make_sample(root / "images", args.images, classes=args.classes, seed=11)
    config = BuildConfig(
        input=str(root / "images"),
        output=str(root / "shards"),
        image=ImageConfig(image_size=args.image_size, resize="center-crop"),
        shard_size=250,
        val_fraction=0.2,
        seed=2,
        executor="inline",
        progress=False,
    )
    run_build(config)
    return root / "shards", time.perf_counter() - started


def train(shards: Path, run_dir: Path, args: argparse.Namespace) -> float:
    flags = {
        "train-shards": shards,
        "run-dir": run_dir,
        "model": args.model,
        "image-size": args.image_size,
        "batch-size": args.batch_size,
        "epochs": args.epochs,
        "workers": args.workers,
        "lr": args.lr,
        "device": "cpu",
        "log-every": 5,
    }
    argv = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
    started = time.perf_counter()
    code = train_main([*argv, "--no-progress"])
    if code != 0:
        raise SystemExit(f"training failed with exit code {code}")
    return time.perf_counter() - started


def report(run_dir: Path, args: argparse.Namespace, build_s: float, train_s: float) -> str:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    end = next(r for r in rows if r["kind"] == "end")
    figures = json.loads((run_dir / "config.json").read_text())
    first = next((r["first_batch_s"] for r in train if "first_batch_s" in r), float("nan"))
    machine = describe_machine(["torch"])
    lines = [
        f"### CPU training run (`benchmarks/train_cpu.py`, {time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {machine['nproc']} cores ({machine['cpu_model']}), {machine['memory_gib']} GiB, "
        f"Python {machine['python']}, torch {machine['torch']}, {args.threads} torch thread(s); "
        f"load average {os.getloadavg()[0]:.1f} at the end (a shared machine).",
        f"Data: {args.images} sample images, {args.classes} classes, {args.image_size} px shards "
        f"({figures['train_samples']} train / {figures['val_samples']} val), built in {build_s:.0f} s.",
        f"Run: `{args.model}` ({figures['parameters'] / 1e3:.0f} k parameters), batch {args.batch_size}, "
        f"{args.workers} loader worker(s), {args.epochs} epochs = {figures['total_steps']} optimizer steps, "
        f"peak lr {figures['lr_scaling']}, warmup {figures['warmup_steps']} steps; {train_s:.0f} s wall.",
        "",
        "| epoch | train loss (last row) | val loss | val accuracy |",
        "|---:|---:|---:|---:|",
    ]
    for evaluation in evals:
        last = [r for r in train if r["step"] <= evaluation["step"]][-1]
        lines.append(
            f"| {evaluation['epoch']} | {last['loss']:.3f} | {evaluation['val_loss']:.3f} | "
            f"{evaluation['val_accuracy']:.3f} |"
        )
    lines += [
        "",
        f"First logged train loss {train[0]['loss']:.3f}, last {train[-1]['loss']:.3f}; chance accuracy "
        f"{1 / args.classes:.2f}. Whole run: {end['images_per_s']:.0f} images/s, data wait "
        f"{end['data_wait_frac']:.0%} of step time, time to first batch {first:.2f} s.",
        f"Verdict: {end['verdict']}.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="train-cpu-") as scratch:
        root = Path(args.out) if args.out else Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        shards, build_s = build_dataset(root, args)
        run_dir = root / f"run-{time.strftime('%H%M%S')}"
        train_s = train(shards, run_dir, args)
        print(report(run_dir, args, build_s, train_s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
