"""build-shards end to end against its per-image limit, in one short interleaved run.

    python benchmarks/build_limit.py [--images 1000] [--rounds 3] [--workers 2]

The limit is a plain fast loop (simplejpeg decode with DCT scaling, OpenCV resize,
simplejpeg encode; Pillow for what is not a plain JPEG) over the same files in `--workers`
warm processes: no tar, no checks, no Ray, start-up excluded. Beside it: build-shards'
own per-image step (`process_image`) in the same pool, and build-shards end to end
(`run_build` from call to return: listing, planning, executor start, encode, commit) with
the default executor (`auto`: the local pool here) and with `--executor ray` (the old
default, Ray started by the build). Tar only, shorter side 256, JPEG q90, `--shard-size`
100 so 1,000 images make 10 shards. Each round runs every case once, so load from other
users of the machine hits all alike; figures are medians over rounds, ratios compare
medians of this run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import shutil
import statistics
import sys
import time
from functools import partial
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import child_report  # noqa: E402

SIZE = 256
QUALITY = 90
CHUNK = 25  # images per pool task of the loops


def shorter_side(width: int, height: int) -> tuple[int, int]:
    """Output size for `shorter side to SIZE`, never upscaling (as the build does)."""
    scale = SIZE / min(width, height)
    if scale >= 1:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def plain_fast(data: bytes) -> bytes:
    """Decode (DCT-scaled), resize and encode one image with no checks at all."""
    import cv2
    import numpy as np
    import simplejpeg

    if simplejpeg.is_jpeg(data):
        with contextlib.suppress(ValueError):
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            size = shorter_side(width, height)
            pixels = simplejpeg.decode_jpeg(
                data, colorspace="RGB", min_width=size[0], min_height=size[1]
            )
            if pixels.shape[1] != size[0] or pixels.shape[0] != size[1]:
                far = pixels.shape[1] > 2 * size[0]
                interpolation = cv2.INTER_AREA if far else cv2.INTER_LINEAR
                pixels = cv2.resize(pixels, size, interpolation=interpolation)
            return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), QUALITY, "RGB", "420")
    return plain_pillow(data)


def plain_pillow(data: bytes) -> bytes:
    from PIL import Image

    with Image.open(BytesIO(data)) as image:
        size = shorter_side(*image.size)
        image.draft("RGB", size)
        rgb = image.convert("RGB")
        out = rgb.resize(size, Image.Resampling.BILINEAR)
    buffer = BytesIO()
    out.save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def build_step(data: bytes) -> bytes | None:
    """build-shards' own per-image step, without the framework around it."""
    from preprocess.images import ImageConfig, process_image
    from shards.sample import SampleError

    try:
        return process_image(data, ImageConfig(image_size=SIZE, quality=QUALITY)).data
    except SampleError:
        return None


def run_chunk(paths: list[str], step: str) -> int:
    work = plain_fast if step == "plain" else build_step
    for path in paths:
        work(Path(path).read_bytes())
    return len(paths)


def time_loop(pool, paths: list[str], step: str) -> float:
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    began = time.perf_counter()
    done = sum(pool.map(partial(run_chunk, step=step), chunks, chunksize=1))
    assert done == len(paths)
    return time.perf_counter() - began


def build_child(args: dict, results) -> None:
    """One build in a fresh process (no Ray, no pool left from another case)."""
    from preprocess.config import BuildConfig
    from preprocess.images import ImageConfig
    from preprocess.job import run_build

    config = BuildConfig(
        input=args["input"],
        output=args["output"],
        image=ImageConfig(image_size=SIZE, quality=QUALITY),
        formats=("tar",),
        shard_size=args["shard_size"],
        executor=args["executor"],
        workers=args["workers"],
        progress=False,
    )
    began = time.perf_counter()
    summary = run_build(config)
    wall = time.perf_counter() - began
    results.put(
        {
            "wall_s": wall,
            "images": summary.images_processed,
            "executor": summary.executor,
            "phases": summary.phases,
            "tail_idle_s": summary.tail_idle_s,
        }
    )


def time_build(source: Path, out: Path, executor: str, args: argparse.Namespace) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    job = {
        "input": str(source),
        "output": str(out),
        "executor": executor,
        "workers": args.workers,
        "shard_size": args.shard_size,
    }
    began = time.perf_counter()
    child = context.Process(target=build_child, args=(job, results))
    child.start()
    report = child_report(child, results)
    if report is None:
        raise SystemExit(f"the {executor} build child died (exit code {child.exitcode})")
    child.join()
    report["process_s"] = time.perf_counter() - began  # with interpreter start and imports
    shutil.rmtree(out, ignore_errors=True)
    return report


def i2d_runner(args: argparse.Namespace, workdir: Path, paths: list[str]):
    """A call timing img2dataset's Resizer on `paths` in `--workers` processes, or None."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from build_throughput import I2D_CHILD, i2d_available, run_i2d, write_list

    problem = i2d_available(args.i2d_python)
    if problem is not None:
        print(f"img2dataset skipped: {problem}")
        return None
    script = workdir / "i2d_child.py"
    script.write_text(I2D_CHILD)
    file_list = write_list(workdir / "files.txt", paths)
    return partial(run_i2d, args.i2d_python, script, file_list, args.workers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--workdir", default="/tmp/build_limit")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument(
        "--i2d-python",
        default="/tmp/i2d-venv/bin/python",
        help="img2dataset 1.47's venv (see build_throughput.py); its Resizer runs in the "
        "same rounds when present",
    )
    args = parser.parse_args(argv)

    from preprocess.sample import make_sample

    workdir = Path(args.workdir)
    source = workdir / f"images-{args.images}"
    if not (source / ".done").exists():
        make_sample(source, args.images, classes=10, seed=0, overwrite=True)
        (source / ".done").write_text("")
    paths = sorted(str(p) for p in source.glob("*/*") if p.is_file())
    cases = ("plain loop", "process_image loop", "build default", "build --executor ray")
    i2d = i2d_runner(args, workdir, paths)
    if i2d is not None:
        cases += ("img2dataset Resizer",)
    walls: dict[str, list[float]] = {case: [] for case in cases}
    builds: dict[str, list[dict]] = {case: [] for case in ("build default", "build --executor ray")}
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        pool.map(partial(run_chunk, step="plain"), [paths[:8]] * args.workers)  # warm
        pool.map(partial(run_chunk, step="build"), [paths[:8]] * args.workers)
        for round_ in range(args.rounds):
            walls["plain loop"].append(time_loop(pool, paths, "plain"))
            walls["process_image loop"].append(time_loop(pool, paths, "build"))
            for case, executor in (("build default", "auto"), ("build --executor ray", "ray")):
                report = time_build(source, workdir / "out", executor, args)
                walls[case].append(report["wall_s"])
                builds[case].append(report)
            if i2d is not None:
                walls["img2dataset Resizer"].append(i2d()["wall_s"])
            line = ", ".join(f"{c} {walls[c][-1]:.2f} s" for c in cases)
            print(f"round {round_ + 1}: {line}", flush=True)
    report_table(walls, builds, len(paths), args)
    if args.json:
        Path(args.json).write_text(json.dumps({"walls": walls, "builds": builds}, indent=1))
    return 0


def report_table(walls: dict, builds: dict, images: int, args: argparse.Namespace) -> None:
    limit = statistics.median(walls["plain loop"])
    print(
        f"\n{images} images, {args.workers} processes, shard size {args.shard_size}, "
        f"median of {args.rounds} interleaved rounds\n"
    )
    print("| case | wall s | img/s | vs plain loop | phases (median s) |")
    print("|---|---:|---:|---:|---|")
    for case, values in walls.items():
        wall = statistics.median(values)
        phases = ""
        if case in builds:
            names = builds[case][0]["phases"]
            medians = {n: statistics.median(b["phases"][n] for b in builds[case]) for n in names}
            idle = statistics.median(b["tail_idle_s"] for b in builds[case])
            process = statistics.median(b["process_s"] for b in builds[case])
            phases = (
                ", ".join(f"{n} {v:.2f}" for n, v in medians.items())
                + f"; idle at end {idle:.2f} worker-s; process {process:.2f}"
            )
        print(f"| {case} | {wall:.2f} | {images / wall:.0f} | {limit / wall:.2f}x | {phases} |")
    if "img2dataset Resizer" in walls:
        i2d = statistics.median(walls["img2dataset Resizer"])
        for case in ("build default", "build --executor ray"):
            ratio = i2d / statistics.median(walls[case])
            print(f"\n{case} / img2dataset Resizer ({args.workers} processes): {ratio:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
