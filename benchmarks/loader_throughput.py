"""Loader throughput side by side: our loader vs the per-core limit, stock webdataset, a naive
ImageFolder DataLoader, MosaicML streaming, LitData and NVIDIA DALI (CPU), on the same 256-px
sample images.

    python benchmarks/loader_throughput.py --images 10000 --workdir DIR \
        [--repeats 3] [--warmup 3] [--peer-python /tmp/peer-venv/bin/python] \
        [--plot docs/loader_throughput.png]

Builds DIR/source (`make_sample`) and DIR/shards (`build-shards`, 256 px, tar + Parquet) once,
then runs every contender for one epoch per repeat, round-robin, and prints medians. Every
contender does random-resized-crop 224 + flip into uint8 batches of 256 (dropping the last
partial batch) with 2 worker processes unless its name says otherwise. Raw results go to
DIR/loader_throughput.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from io import BytesIO
from pathlib import Path

import numpy as np
import torch
from common import describe_machine
from loader_baselines import (
    BATCH_SIZE,
    CROP_SIZE,
    Measurement,
    NaiveImageFolder,
    PilRandomResizedCrop,
    cpu_seconds,
    time_epoch,
    with_cpu,
)
from PIL import Image
from torch.utils.data import DataLoader

from pipeline import Batching, Crop, LoaderConfig, Workers, build_loader
from pipeline.decode import draft_scale
from pipeline.transforms import sample_crop_box
from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.sample import make_sample
from shards.manifest import read_manifest
from shards.tar import iter_tar_samples

HERE = Path(__file__).resolve().parent
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
PEER_TIMEOUT_S = 600
# Names of the contenders the targets compare (see `print_targets`).
OURS = "ours, tar, 2 workers"
OURS_1 = "ours, tar, 1 worker"
OURS_8 = "ours, tar, 8 workers"
OURS_PILLOW = "ours, Pillow path (backend='pillow'), tar, 2 workers"
FAST_LIMIT_1 = "limit: simplejpeg + cv2 loop, 1 process"
LIMIT = "limit: plain Pillow loop, 2 processes"
LIMIT_1 = "limit: plain Pillow loop, 1 process"
FAST_LIMIT = "limit: simplejpeg + cv2 loop, 2 processes"
SAME_FILTER_LIMIT_1 = "limit: the loader's crop, whole decode, 1 process"
SAME_FILTER_LIMIT = "limit: the loader's crop, whole decode, 2 processes"
WDS = "stock webdataset"
NAIVE = "naive ImageFolder on source files"
# Versions recorded with every run.
PACKAGES = ("torch", "pillow", "numpy", "webdataset", "simplejpeg", "opencv-python-headless")


# --- data ----------------------------------------------------------------------------------


def prepare_data(workdir: Path, images: int, executor: str, side: int = 256) -> Path:
    """Make (once) `images` sample images and their `side`-px shards; the shard directory."""
    source = workdir / "source"
    shards = workdir / ("shards" if side == 256 else f"shards{side}")
    if (shards / "manifest.json").exists():
        return shards
    if len(list(source.rglob("img_*"))) != images:
        print(f"making {images} sample images in {source} ...", flush=True)
        make_sample(source, images, classes=10, seed=0, workers=2, overwrite=True)
    print(f"building {side}-px shards in {shards} ({executor}) ...", flush=True)
    config = BuildConfig(
        input=str(source),
        output=str(shards),
        image=ImageConfig(image_size=side),
        shard_size=1000,
        executor=executor,
        workers=2,
        progress=False,
    )
    summary = run_build(config)
    print(f"built {summary.manifest.written} samples in {summary.seconds:.0f} s", flush=True)
    if executor == "ray":
        import ray

        ray.shutdown()  # its idle workers and daemons would compete with the loaders
    return shards


def tar_urls(shards: Path) -> list[str]:
    manifest = read_manifest(shards)
    return manifest.shard_urls("train", "tar", str(shards))


def load_jpegs(shards: Path) -> list[bytes]:
    """Every sample's JPEG bytes, read from the tar shards into memory (not timed)."""
    jpegs = []
    for url in tar_urls(shards):
        with open(url, "rb") as stream:
            jpegs += [sample["jpg"] for sample in iter_tar_samples(stream, url)]
    return jpegs


# --- contenders ----------------------------------------------------------------------------


@dataclass(frozen=True)
class OurLoader:
    """`build_loader` as a user calls it, with the defaults (shuffle buffer 2000, initial 500)."""

    name: str
    shards: Path
    workers: int
    fmt: str = "tar"
    transform: Callable | None = None
    backend: str = "auto"

    def run(self, seed: int, warmup: int) -> Measurement:
        cpu_before = cpu_seconds()
        started = time.perf_counter()
        config = LoaderConfig(
            source=str(self.shards),
            split="train",
            format=self.fmt,
            batch=Batching(size=BATCH_SIZE),
            crop=Crop(image_size=CROP_SIZE, transform=self.transform, backend=self.backend),
            workers=Workers(count=self.workers),
            seed=seed,
        )
        loader = build_loader(config)
        # Every worker's first batch arrives at about the same time; batches made before the
        # timed window opens would count for free, so the window opens after one per worker.
        measurement = time_epoch(loader, self.name, max(warmup, self.workers + 1), started)
        samples = max(1, loader.stats.samples)
        if self.backend == "auto":
            print(
                f"  {self.name}: Pillow fallbacks {loader.stats.pillow_fallbacks} of "
                f"{samples} samples ({loader.stats.pillow_fallbacks / samples:.2%})",
                flush=True,
            )
        del loader
        return with_cpu(measurement, cpu_before)


@dataclass(frozen=True)
class StockWebDataset:
    """webdataset's documented pipeline with Pillow decoding and the torchvision-like crop."""

    name: str
    urls: list[str]
    workers: int = 2

    def run(self, seed: int, warmup: int) -> Measurement:
        import webdataset as wds

        cpu_before = cpu_seconds()
        started = time.perf_counter()
        dataset = (
            wds.WebDataset(
                self.urls, shardshuffle=len(self.urls), nodesplitter=wds.split_by_node, seed=seed
            )
            .shuffle(1000)
            .decode("pil")
            .to_tuple("jpg", "cls")
            .map_tuple(PilRandomResizedCrop(CROP_SIZE), int)
            .batched(BATCH_SIZE, partial=False)
        )
        loader = wds.WebLoader(dataset, batch_size=None, num_workers=self.workers)
        measurement = time_epoch(loader, self.name, warmup, started)
        del loader, dataset
        return with_cpu(measurement, cpu_before)


@dataclass(frozen=True)
class NaiveLoader:
    """A map-style ImageFolder over the source files through a standard DataLoader."""

    name: str
    root: Path
    workers: int = 2

    def run(self, seed: int, warmup: int) -> Measurement:
        cpu_before = cpu_seconds()
        started = time.perf_counter()
        dataset = NaiveImageFolder(self.root, PilRandomResizedCrop(CROP_SIZE))
        loader = DataLoader(
            dataset,
            batch_size=BATCH_SIZE,
            shuffle=True,
            num_workers=self.workers,
            drop_last=True,
            generator=torch.Generator().manual_seed(seed),
        )
        measurement = time_epoch(loader, self.name, warmup, started)
        del loader, dataset
        return with_cpu(measurement, cpu_before)


@dataclass(frozen=True)
class PeerLoader:
    """MosaicML streaming, LitData or DALI, run by `loader_baselines.py` in their own venv."""

    name: str
    peer: str
    python: str
    workdir: Path
    options: tuple[str, ...] = ()  # for both actions, e.g. DALI's `--shards`

    def command(self, action: str, *extra: str) -> list[str]:
        script = str(HERE / "loader_baselines.py")
        workdir = ("--workdir", str(self.workdir))
        return [self.python, script, action, self.peer, *workdir, *self.options, *extra]

    def convert(self) -> None:
        subprocess.run(self.command("convert"), check=True, timeout=PEER_TIMEOUT_S)

    def run(self, seed: int, warmup: int) -> Measurement:
        done = subprocess.run(
            self.command("run", "--seed", str(seed), "--warmup", str(warmup)),
            check=True,
            capture_output=True,
            text=True,
            timeout=PEER_TIMEOUT_S,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        result["name"] = self.name
        return Measurement(**result)


@dataclass(frozen=True)
class PlainLoop:
    """The per-core limit: decode and crop in-memory JPEGs in a loop, in 1 or more processes."""

    name: str
    jpegs: list[bytes] = field(repr=False)
    crop: Callable
    processes: int = 1

    def run(self, seed: int, warmup: int) -> Measurement:
        context = multiprocessing.get_context("fork")  # children inherit the JPEGs, unpickled
        cpu_before = cpu_seconds()
        queue = context.Queue()
        barrier = context.Barrier(self.processes)
        workers = [
            context.Process(target=loop_part, args=(self, index, seed, barrier, queue))
            for index in range(self.processes)
        ]
        for worker in workers:
            worker.start()
        parts = [queue.get(timeout=PEER_TIMEOUT_S) for _ in workers]
        for worker in workers:
            worker.join()
        start, end = min(p[0] for p in parts), max(p[1] for p in parts)
        images = sum(p[2] for p in parts)
        measurement = Measurement(self.name, images, end - start, epoch_images=images)
        return with_cpu(measurement, cpu_before)


def loop_part(loop: PlainLoop, index: int, seed: int, barrier, queue) -> None:
    """One process of a `PlainLoop`: every `processes`-th JPEG, timed after a common start."""
    rng = random.Random(f"{seed}:{index}")
    jpegs = loop.jpegs[index :: loop.processes]
    barrier.wait()
    start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    for data in jpegs:
        loop.crop(data, rng)
    queue.put((start, time.perf_counter(), len(jpegs)))


def plain_pillow_crop(data: bytes, rng: random.Random) -> np.ndarray:
    """What one writes by hand with Pillow: open, draft, crop + resize, flip, asarray. No checks."""
    image = Image.open(BytesIO(data))
    box = sample_crop_box(*image.size, SCALE, RATIO, rng)
    flip = rng.random() < 0.5
    scale = draft_scale(box[2] - box[0], box[3] - box[1], (CROP_SIZE, CROP_SIZE))
    if scale > 1:
        width, height = image.size
        extent = image.draft("RGB", (width // scale, height // scale))[1]
        f = extent[2] / width
        box = (box[0] * f, box[1] * f, box[2] * f, box[3] * f)
    out = image.resize((CROP_SIZE, CROP_SIZE), Image.Resampling.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return np.asarray(out)


class PlainFastCrop:
    """The same by hand with simplejpeg and OpenCV (no DCT scaling: 256-px shards never need it)."""

    def __init__(self) -> None:
        import cv2
        import simplejpeg

        cv2.setNumThreads(1)
        self.cv2, self.simplejpeg = cv2, simplejpeg

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        height, width, _, _ = self.simplejpeg.decode_jpeg_header(data)
        left, top, right, bottom = sample_crop_box(width, height, SCALE, RATIO, rng)
        flip = rng.random() < 0.5
        pixels = self.simplejpeg.decode_jpeg(data, colorspace="RGB")
        out = self.cv2.resize(
            pixels[top:bottom, left:right],
            (CROP_SIZE, CROP_SIZE),
            interpolation=self.cv2.INTER_LINEAR,
        )
        return self.cv2.flip(out, 1) if flip else out


class WholeDecodeCrop:
    """The loader's own crop (same boxes, filters, antialiasing) with every JPEG decoded whole:
    the full-decode limit for the loader's output, where the plain loop's bilinear is not."""

    def __init__(self) -> None:
        from pipeline.fast_transforms import FastRandomResizedCrop

        class WholeDecode(FastRandomResizedCrop):
            band_decode = False

        self.crop = WholeDecode(CROP_SIZE)

    def __call__(self, data: bytes, rng: random.Random) -> np.ndarray:
        return self.crop(data, rng)


def build_contenders(args: argparse.Namespace, shards: Path) -> list:
    """Every contender, in the round-robin order of a repeat."""
    jpegs = load_jpegs(shards)
    # The defaults (backend "auto": libjpeg-turbo + OpenCV, Pillow per sample where they
    # cannot decode) with 1, 2 and 8 workers; the Pillow path as it was the default before.
    contenders: list = [
        OurLoader(OURS_1, shards, workers=1),
        OurLoader(OURS, shards, workers=2),
        OurLoader(OURS_8, shards, workers=8),
        OurLoader("ours, Parquet, 2 workers", shards, workers=2, fmt="parquet"),
        OurLoader(OURS_PILLOW, shards, workers=2, backend="pillow"),
        PlainLoop(LIMIT_1, jpegs, plain_pillow_crop, processes=1),
        PlainLoop(LIMIT, jpegs, plain_pillow_crop, processes=2),
        PlainLoop(FAST_LIMIT_1, jpegs, PlainFastCrop()),
        PlainLoop(FAST_LIMIT, jpegs, PlainFastCrop(), processes=2),
        PlainLoop(SAME_FILTER_LIMIT_1, jpegs, WholeDecodeCrop()),
        PlainLoop(SAME_FILTER_LIMIT, jpegs, WholeDecodeCrop(), processes=2),
        StockWebDataset(WDS, tar_urls(shards)),
        NaiveLoader(NAIVE, args.workdir / "source"),
    ]
    for baseline in args.baseline_shards:  # the same images built another way
        label, baseline_jpegs = baseline.name, load_jpegs(baseline)
        contenders += [
            OurLoader(f"ours, 1 worker, {label}", baseline, workers=1),
            OurLoader(f"ours, 2 workers, {label}", baseline, workers=2),
            PlainLoop(f"{FAST_LIMIT_1}, {label}", baseline_jpegs, PlainFastCrop()),
            PlainLoop(f"{FAST_LIMIT}, {label}", baseline_jpegs, PlainFastCrop(), processes=2),
        ]
    contenders += peer_contenders(args, shards)
    return contenders


def peer_contenders(args: argparse.Namespace, shards: Path) -> list[PeerLoader]:
    """MosaicML streaming, LitData and DALI where their venv has them; conversions are cached.

    Each reads (or converts) the tar shards of this run (`--side`).
    """
    if not args.peer_python or not Path(args.peer_python).exists():
        print(f"peer loaders skipped: no python at {args.peer_python!r}")
        return []
    options = ("--shards", str(shards))
    candidates = [
        PeerLoader(name, peer, args.peer_python, args.workdir, options)
        for peer, name in (("mds", "MosaicML streaming (MDS)"), ("litdata", "LitData"))
    ]
    version = dali_version(args.peer_python)
    if version:
        name = f"NVIDIA DALI {version} (CPU)"
        candidates.append(PeerLoader(name, "dali", args.peer_python, args.workdir, options))
    peers = []
    for contender in candidates:
        try:
            contender.convert()
        except (subprocess.SubprocessError, OSError) as error:
            print(f"{contender.name} skipped: conversion failed: {error}")
            continue
        peers.append(contender)
    return peers


def dali_version(python: str) -> str | None:
    """DALI's major.minor version in the peers' venv, or None (and why) where it does not import."""
    probe = subprocess.run(
        [python, "-c", "import nvidia.dali; print(nvidia.dali.__version__)"],
        capture_output=True,
        text=True,
        timeout=PEER_TIMEOUT_S,
    )
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no error output"])[-1]
        print(f"NVIDIA DALI skipped: it does not import in {python}: {reason}")
        return None
    return ".".join(probe.stdout.strip().split(".")[:2])


# --- running and reporting -----------------------------------------------------------------


def run_all(contenders: list, repeats: int, warmup: int) -> dict[str, list[Measurement]]:
    """Round-robin: each repeat runs every contender once, so load spikes hit all alike.

    Each repeat starts a further part of the way round (0, 1/3 and 2/3 of the list with 3
    repeats), so no contender is always the one that runs right after the peers'
    subprocesses: in a fixed order our default ran first every time and measured 0.75x its
    limit in a run where the nearly identical shards-rows build measured 0.95x.
    """
    results: dict[str, list[Measurement]] = {c.name: [] for c in contenders}
    for repeat in range(repeats):
        shift = repeat * len(contenders) // max(1, repeats)
        for contender in contenders[shift:] + contenders[:shift]:
            try:
                measurement = contender.run(seed=repeat, warmup=warmup)
            except (subprocess.SubprocessError, RuntimeError, OSError) as error:
                print(f"  {contender.name}: FAILED: {describe(error)}", flush=True)
                continue
            finally:
                gc.collect()  # shut down the finished loader's worker processes now
            results[contender.name].append(measurement)
            print(
                f"  repeat {repeat + 1}: {contender.name}: {measurement.images_per_s:,.0f} img/s",
                flush=True,
            )
    return results


def describe(error: Exception) -> str:
    stderr = getattr(error, "stderr", None)
    tail = stderr.strip().splitlines()[-3:] if stderr else []
    return " | ".join([str(error), *tail])


def median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def paired_ratio(results: dict, numerator: str, denominator: str, metric: str) -> float | None:
    """Median over repeats of the ratio within each repeat (measured minutes apart, not hours)."""
    pairs = zip(results.get(numerator, []), results.get(denominator, []), strict=False)
    values = [(getattr(a, metric), getattr(b, metric)) for a, b in pairs]
    ratios = [a / b for a, b in values if a is not None and b]
    return statistics.median(ratios) if ratios else None


def print_table(results: dict[str, list[Measurement]]) -> None:
    """Medians per contender; ratios are paired per repeat against the three references."""
    print()
    print(
        "| contender | img/s | min-max | img per CPU-s | first batch s "
        "| wait/batch ms (median, p95) | vs limit | vs webdataset | vs naive |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, runs in results.items():
        if not runs:
            print(f"| {name} | failed | | | | | | | |")
            continue
        rates = [m.images_per_s for m in runs]
        per_cpu = median_of([m.images_per_cpu_s for m in runs])
        first = median_of([m.first_batch_s for m in runs])
        wait = median_of([m.wait_ms_median for m in runs])
        p95 = median_of([m.wait_ms_p95 for m in runs])
        ratios = [paired_ratio(results, name, ref, "images_per_s") for ref in (LIMIT, WDS, NAIVE)]
        print(
            f"| {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f}-{max(rates):,.0f} "
            f"| {fmt(per_cpu, '{:,.0f}')} | {fmt(first, '{:.2f}')} "
            f"| {'' if wait is None else f'{wait:.0f}, {p95:.0f}'} "
            f"| {' | '.join(fmt(r, '{:.2f}x') for r in ratios)} |"
        )


def fmt(value: float | None, pattern: str) -> str:
    return "" if value is None else pattern.format(value)


TARGETS = (
    (OURS, WDS, 2.8, "defaults >= 2.8x stock webdataset"),
    (OURS, FAST_LIMIT, 0.90, "defaults >= 90% of the fast per-sample limit, 2 cores"),
    (OURS_1, FAST_LIMIT_1, 0.90, "defaults >= 90% of the fast limit, 1 worker / 1 process"),
    (OURS, SAME_FILTER_LIMIT, 1.0, "defaults above the whole-decode limit of the same crop"),
    (OURS, LIMIT, 1.0, "defaults above the Pillow per-sample limit"),
    (OURS_PILLOW, LIMIT, 0.90, "Pillow path >= 90% of the Pillow limit"),
    (OURS, NAIVE, 2.5, ">= 2.5x the naive baseline"),
    (OURS, FAST_LIMIT, 1.0, "moonshot: defaults above the full-decode fast limit"),
)


def targets(results: dict[str, list[Measurement]]) -> list[tuple[str, str, float, str]]:
    """`TARGETS`, and the moonshot against the fast limit on each baseline build's JPEGs
    (a build without restart markers decodes whole fastest: the strictest limit)."""
    prefix = f"{FAST_LIMIT}, "
    extra = [
        (OURS, name, 1.0, f"moonshot: defaults above the fast limit on {name[len(prefix) :]}")
        for name in results
        if name.startswith(prefix)
    ]
    return [*TARGETS, *extra]


def print_targets(results: dict[str, list[Measurement]]) -> list[dict]:
    """Each target as a paired ratio of wall-clock img/s, and of img per CPU-second."""
    verdicts = []
    print()
    print("| target | ratio (wall img/s) | met? | ratio (img per CPU-s) | met? |")
    print("|---|---:|---|---:|---|")
    for numerator, denominator, goal, label in targets(results):
        wall = paired_ratio(results, numerator, denominator, "images_per_s")
        cpu = paired_ratio(results, numerator, denominator, "images_per_cpu_s")
        if wall is None:
            print(f"| {label} | not measured | | | |")
            continue
        cpu_met = "" if cpu is None else ("yes" if cpu >= goal else "no")
        print(
            f"| {label} | {wall:.2f} | {'yes' if wall >= goal else 'no'} "
            f"| {fmt(cpu, '{:.2f}')} | {cpu_met} |"
        )
        verdicts.append({"target": label, "goal": goal, "wall_ratio": wall, "cpu_ratio": cpu})
    return verdicts


def machine_info() -> dict:
    """What the numbers were measured on: cores, CPU, memory, load, versions (common's harness)."""
    machine: dict = describe_machine(PACKAGES)
    machine["loadavg"] = os.getloadavg()
    return machine


def plot(results: dict[str, list[Measurement]], path: Path) -> None:
    """Two bar charts: wall-clock img/s (min-max whiskers) and img per CPU-second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, runs in results.items() if runs]
    colours = ["tab:green" if n.startswith("limit") else "tab:gray" for n in names]
    colours = [
        "tab:blue" if n.startswith("ours") else c for n, c in zip(names, colours, strict=True)
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.42 * len(names) + 1.8), sharey=True)
    panels = (
        ("images_per_s", "images/s, wall clock (median; whiskers min-max)"),
        ("images_per_cpu_s", "images per CPU-second of all its processes (median)"),
    )
    for ax, (metric, label) in zip(axes, panels, strict=True):
        values = [[getattr(m, metric) or 0.0 for m in results[n]] for n in names]
        medians = [statistics.median(v) for v in values]
        low = [m - min(v) for m, v in zip(medians, values, strict=True)]
        high = [max(v) - m for m, v in zip(medians, values, strict=True)]
        ax.barh(names, medians, xerr=[low, high], color=colours, capsize=3)
        for name, style in ((LIMIT, "--"), (FAST_LIMIT, ":")):
            if results.get(name):
                limit = statistics.median(getattr(m, metric) or 0.0 for m in results[name])
                ax.axvline(limit, ls=style, c="k", lw=1)
        ax.set_xlabel(label)
    axes[0].invert_yaxis()
    fig.suptitle("Loader throughput: 256-px shards, RRC 224 + flip, batch 256, 2 shared cores")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot written to {path}")


def load_results(path: Path) -> dict[str, list[Measurement]]:
    """Results of an earlier run, from its JSON record."""
    record = json.loads(path.read_text())
    return {n: [Measurement(**m) for m in runs] for n, runs in record["results"].items()}


# --- where the loader's time goes besides decoding ---------------------------------------


def collate_costs(repeats: int = 6) -> dict[str, float]:
    """CPU ms per batch of 256 224-px images for ways of making the uint8 NCHW batch.

    The DataLoader moves every tensor a worker yields into shared memory (a copy) unless it
    is there already; fresh pages cost a page fault each, which dominates these copies.
    """
    import cv2

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (CROP_SIZE, CROP_SIZE, 3), np.uint8) for _ in range(BATCH_SIZE)]

    def stack_permute_contiguous() -> torch.Tensor:
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()

    def then_shared_memory() -> torch.Tensor:
        return stack_permute_contiguous().share_memory_()

    def stack_only_channels_last() -> torch.Tensor:
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).share_memory_()

    def shared_prealloc_split() -> torch.Tensor:
        batch = torch.empty((BATCH_SIZE, 3, CROP_SIZE, CROP_SIZE), dtype=torch.uint8)
        planes = batch.share_memory_().numpy()
        for index, image in enumerate(images):
            cv2.split(image, [planes[index, 0], planes[index, 1], planes[index, 2]])
        return batch

    cases = {
        "np.stack + permute().contiguous() (now)": stack_permute_contiguous,
        "  ... + DataLoader's move to shared memory (now, total)": then_shared_memory,
        "np.stack, NHWC kept (channels_last=True), + move": stack_only_channels_last,
        "preallocated shared-memory NCHW + cv2.split per image": shared_prealloc_split,
    }
    reference = stack_permute_contiguous()
    costs = {}
    for name, make in cases.items():
        assert torch.equal(make(), reference)
        started = time.process_time()
        for _ in range(repeats):
            make()
        costs[name] = 1000 * (time.process_time() - started) / repeats
    return costs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000, help="sample images to build")
    parser.add_argument("--workdir", type=Path, required=True, help="data and results (reused)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3, help="batches excluded from img/s")
    parser.add_argument("--executor", default="auto", choices=("auto", "local", "ray", "inline"))
    parser.add_argument(
        "--side", type=int, default=256, help="shorter side of the shard images (256 or 512)"
    )
    parser.add_argument("--peer-python", default="/tmp/peer-venv/bin/python")
    parser.add_argument("--only", help="name prefixes of the contenders to run, separated by |")
    parser.add_argument(
        "--baseline-shards",
        type=Path,
        action="append",
        default=[],
        help="another build of the same images (e.g. --jpeg-restarts none): our loader and the "
        "fast limit loop on it too (repeatable)",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    parser.add_argument(
        "--collate-costs", action="store_true", help="only time ways of building a batch"
    )
    parser.add_argument("--from-json", type=Path, help="re-report (and re-plot) a saved run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.collate_costs:
        for name, ms in collate_costs().items():
            print(f"| {name} | {ms:.0f} ms |")
        return 0
    if args.from_json:
        results = load_results(args.from_json)
        print_table(results)
        print_targets(results)
        if args.plot:
            plot(results, args.plot)
        return 0
    args.workdir.mkdir(parents=True, exist_ok=True)
    shards = prepare_data(args.workdir, args.images, args.executor, args.side)
    contenders = build_contenders(args, shards)
    if args.only:
        prefixes = tuple(args.only.split("|"))
        contenders = [c for c in contenders if c.name.startswith(prefixes)]
    machine = machine_info()
    print(json.dumps(machine))
    results = run_all(contenders, args.repeats, args.warmup)
    machine["loadavg_after"] = os.getloadavg()
    print_table(results)
    verdicts = print_targets(results)
    record = {
        "machine": machine,
        "args": {k: str(v) for k, v in vars(args).items()},
        "results": {n: [asdict(m) for m in runs] for n, runs in results.items()},
        "targets": verdicts,
    }
    out = args.workdir / f"loader_throughput_{args.side}.json"
    out.write_text(json.dumps(record, indent=1))
    print(f"raw results in {out}")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
