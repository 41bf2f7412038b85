"""Training recipes in the loader: DeiT's worker recipe ours against our plain loader and timm's.

    python benchmarks/recipe_loader.py photos --output W/photos [--count 6000]
    .venv/bin/preprocess build-shards --input W/photos --output W/photo-shards --formats tar
    python benchmarks/recipe_loader.py run --shards W/photo-shards [--rounds 5] \
        [--timm-python /tmp/shardpipe-timm-venv/bin/python] [--only NAME ...] \
        [--policies trivialaugment original 3a ...]

`photos` cuts photo-like JPEGs (~500 x 375, q90, 10 classes) out of the real photographs
that scikit-image's wheel ships (astronaut, coffee, chelsea, motorcycles, rocket, retina,
hubble, grass, gravel, brick) and matplotlib's grace_hopper.jpg: random crops of 15-60% of
a photo's area at a random aspect, flipped at random, so JPEG decode and the photometric
ops see natural image statistics (the synthetic sample's flat shapes make equalize and
JPEG entropy decoding unrealistically cheap). The wheel is fetched with `pip download`
once into the output's parent.

`run` times one epoch per contender per round, rounds in rotating order, 2 workers,
RandomResizedCrop 224 + flip into uint8 batches of 256 (last partial batch dropped):

- `ours plain`: `build_loader` with its defaults;
- `ours deit`: plus `Augment(auto_augment="rand-m9-mstd0.5-inc1")` in the workers;
- `ours deit+re`: plus random erasing 0.25, pixel mode, in the workers;
- `timm deit`: timm's own loader on the same shards (`create_dataset("wds/...")` +
  `create_loader(..., use_prefetcher=True, auto_augment="rand-m9-mstd0.5-inc1")`) in its
  own venv, iterating its DataLoader, so both ship uint8 batches (timm erases on the
  device in its prefetcher, so its erasing is not in this figure);
- `timm deit+re`: timm without the prefetcher, random erasing 0.25 pixel mode in its
  workers (float32 normalised tensors: what a timm user without CUDA gets).

Ratios are paired per round; the table gives the median ratio and the per-round min-max.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loader_baselines import BATCH_SIZE, CROP_SIZE, Measurement, cpu_seconds, time_epoch, with_cpu  # noqa: E402

PHOTOS = (
    "astronaut.png",
    "coffee.png",
    "chelsea.png",
    "motorcycle_left.png",
    "motorcycle_right.png",
    "rocket.jpg",
    "retina.jpg",
    "hubble_deep_field.jpg",
    "grass.png",
    "gravel.png",
    "brick.png",
)
DEIT = "rand-m9-mstd0.5-inc1"

# Runs inside timm's environment: of ours only loader_baselines (numpy, Pillow, torch), so
# both sides are timed by the same epoch timer.
TIMM_CHILD = """
import json, sys, time
from dataclasses import asdict
import torch
from timm.data import create_dataset, create_loader
sys.path.insert(0, sys.argv[5])  # benchmarks/: loader_baselines needs only numpy, Pillow, torch
from loader_baselines import cpu_seconds, time_epoch, with_cpu
root, seed, erase, warmup = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
torch.manual_seed(seed)
cpu_before, started = cpu_seconds(), time.perf_counter()
dataset = create_dataset("wds/shardpipe", root=root, split="train", is_training=True,
                         batch_size=256, seed=seed)
loader = create_loader(dataset, input_size=(3, 224, 224), batch_size=256, is_training=True,
                       use_prefetcher=not erase, auto_augment="rand-m9-mstd0.5-inc1",
                       re_prob=0.25 if erase else 0.0, re_mode="pixel", num_workers=2,
                       device=torch.device("cpu"), persistent_workers=False)
batches = loader if erase else loader.loader   # prefetcher mode: its DataLoader ships uint8
measurement = time_epoch(batches, "timm", warmup, started)
del batches, loader
print(json.dumps(asdict(with_cpu(measurement, cpu_before))))
"""


def make_photos(output: Path, count: int, seed: int) -> None:
    """`count` photo-like JPEGs in 10 class folders, cut from real photographs."""
    from PIL import Image, ImageOps

    sources = [Image.open(path).convert("RGB") for path in photo_files(output.parent)]
    rng = random.Random(seed)
    for index in range(count):
        photo = sources[index % len(sources)]
        width, height = photo.size
        area = rng.uniform(0.15, 0.6) * width * height
        aspect = rng.uniform(3 / 4, 4 / 3)
        w = min(width, round((area * aspect) ** 0.5))
        h = min(height, round((area / aspect) ** 0.5))
        x, y = rng.randint(0, width - w), rng.randint(0, height - h)
        crop = photo.crop((x, y, x + w, y + h))
        crop = ImageOps.mirror(crop) if rng.random() < 0.5 else crop
        size = (500, 375) if w >= h else (375, 500)
        folder = output / f"class{index % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        crop.resize(size, Image.BICUBIC).save(folder / f"{index:06d}.jpg", quality=90)


def photo_files(scratch: Path) -> list[Path]:
    """The photographs: scikit-image's wheel's data folder (downloaded once) and
    matplotlib's sample photo."""
    import matplotlib

    folder = scratch / "photo-originals"
    if not folder.exists():
        with tempfile.TemporaryDirectory() as download:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "-q",
                    "-d",
                    download,
                    "scikit-image",
                ],
                check=True,
            )
            wheel = next(Path(download).glob("scikit_image-*.whl"))
            folder.mkdir(parents=True)
            with zipfile.ZipFile(wheel) as archive:
                for name in PHOTOS:
                    (folder / name).write_bytes(archive.read(f"skimage/data/{name}"))
    hopper = Path(matplotlib.get_data_path()) / "sample_data" / "grace_hopper.jpg"
    return [folder / name for name in PHOTOS] + [hopper]


def run_ours(name: str, shards: Path, seed: int, warmup: int, augment) -> Measurement:
    from pipeline import Augment, Batching, Crop, LoaderConfig, Workers, build_loader

    cpu_before = cpu_seconds()
    import time

    started = time.perf_counter()
    config = LoaderConfig(
        source=str(shards),
        split="train",
        batch=Batching(size=BATCH_SIZE),
        crop=Crop(image_size=CROP_SIZE),
        workers=Workers(count=2),
        seed=seed,
        augment=augment if augment is not None else Augment(),
    )
    loader = build_loader(config)
    measurement = time_epoch(loader, name, warmup, started)
    WORKER_US[name].append(worker_us_per_image(loader.stats.workers.values()))
    del loader
    return with_cpu(measurement, cpu_before)


# per contender, per round: the workers' (decode, augment) wall us per image
WORKER_US: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)


def worker_us_per_image(workers) -> tuple[float, float]:
    """The workers' own clocks (`WorkerStats`): decode + augment, and augment alone, in us
    an image: what the recipe costs where it runs, beside the same worker's decodes."""
    workers = list(workers)
    samples = max(1, sum(w["samples"] for w in workers))
    decode = sum(w["decode_s"] for w in workers)
    augment = sum(w["augment_s"] for w in workers)
    return 1e6 * decode / samples, 1e6 * augment / samples


def run_timm(name: str, python: str, shards: Path, seed: int, warmup: int, erase: bool):
    child = subprocess.run(
        [
            python,
            "-c",
            TIMM_CHILD,
            str(shards),
            str(seed),
            "1" if erase else "0",
            str(warmup),
            str(Path(__file__).resolve().parent),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"{name} failed:\n{child.stderr[-3000:]}")
    return Measurement(**{**json.loads(lines[-1]), "name": name})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    photos = commands.add_parser("photos", help="make the photo-like source images")
    photos.add_argument("--output", type=Path, required=True)
    photos.add_argument("--count", type=int, default=6000)
    photos.add_argument("--seed", type=int, default=0)
    run = commands.add_parser("run", help="time the contenders")
    run.add_argument("--shards", type=Path, required=True)
    run.add_argument("--rounds", type=int, default=5)
    run.add_argument("--warmup", type=int, default=3)
    run.add_argument("--timm-python", default="/tmp/shardpipe-timm-venv/bin/python")
    run.add_argument("--only", nargs="*", help="contender names to run (default: all)")
    run.add_argument(
        "--policies",
        nargs="*",
        default=[],
        help="more `auto_augment` policies to time against our plain loader (trivialaugment, ...)",
    )
    args = parser.parse_args(argv)
    if args.command == "photos":
        make_photos(args.output, args.count, args.seed)
        return 0
    return time_contenders(args)


def _run_policy(name: str, shards: Path, warmup: int, augment, seed: int) -> Measurement:
    return run_ours(name, shards, seed, warmup, augment)


def time_contenders(args: argparse.Namespace) -> int:
    from pipeline import Augment

    contenders = {
        "ours plain": lambda s: run_ours("ours plain", args.shards, s, args.warmup, None),
        "ours deit": lambda s: run_ours(
            "ours deit", args.shards, s, args.warmup, Augment(auto_augment=DEIT)
        ),
        "ours deit+re": lambda s: run_ours(
            "ours deit+re",
            args.shards,
            s,
            args.warmup,
            Augment(auto_augment=DEIT, re_prob=0.25, re_mode="pixel"),
        ),
        "timm deit": lambda s: run_timm(
            "timm deit", args.timm_python, args.shards, s, args.warmup, False
        ),
        "timm deit+re": lambda s: run_timm(
            "timm deit+re", args.timm_python, args.shards, s, args.warmup, True
        ),
    }
    for policy in args.policies:  # other policies, each against our plain loader
        name = f"ours {policy}"
        contenders[name] = functools.partial(
            _run_policy, name, args.shards, args.warmup, Augment(auto_augment=policy)
        )
    names = [n for n in contenders if not args.only or n in args.only]
    names = list(dict.fromkeys(names + [f"ours {policy}" for policy in args.policies]))
    runs: list[dict[str, Measurement]] = []
    for index in range(args.rounds):
        shift = index % len(names)
        order = names[shift:] + names[:shift]
        results = {name: contenders[name](index) for name in order}
        runs.append(results)
        line = ", ".join(f"{n} {m.images_per_s:,.0f}" for n, m in results.items())
        print(f"round {index + 1}: {line} img/s", flush=True)
    pairs = [(f"ours {policy}", "ours plain") for policy in args.policies] + [
        ("ours deit", "ours plain"),
        ("ours deit", "timm deit"),
        ("ours deit+re", "ours plain"),
        ("ours deit+re", "timm deit+re"),
        ("ours deit+re", "timm deit"),
    ]
    print(f"\n{args.rounds} rounds, 2 workers; medians of ratios paired by round")
    print("| contender | against | wall img/s ratio (min-max) | img per CPU-s ratio (min-max) |")
    print("|---|---|---:|---:|")
    for left, right in pairs:
        if left not in names or right not in names:
            continue
        wall = [r[left].images_per_s / r[right].images_per_s for r in runs]
        cpu = [r[left].images_per_cpu_s / r[right].images_per_cpu_s for r in runs]
        print(
            f"| {left} | {right} | {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f})"
            f" | {statistics.median(cpu):.2f} ({min(cpu):.2f}-{max(cpu):.2f}) |"
        )
    for name in names:
        speeds = [r[name].images_per_s for r in runs]
        line = f"{name}: median {statistics.median(speeds):,.0f} img/s"
        if WORKER_US[name]:
            decode = statistics.median(d for d, _ in WORKER_US[name])
            augment = statistics.median(a for _, a in WORKER_US[name])
            line += (
                f"; in its workers, decode {decode:.0f} us an image, of it augment {augment:.0f}"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
