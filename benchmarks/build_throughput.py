"""Throughput of `preprocess build-shards` beside the plain-loop limit, img2dataset's resizer
and the `fast` backend, measured side by side in one run on the same sample images and cores;
plus 1 -> 2 Ray worker scaling, peak memory against dataset size, disk use and image quality.

    python benchmarks/build_throughput.py --images 10000 --workdir /tmp/bt
    python benchmarks/build_throughput.py --images 500000 --workdir DIR --formats tar \\
        --skip-scale --repeats 1 --cleanup

Every case does the same job: shorter side to 256 px, JPEG quality 90. Cases run in rounds
(each case once per round) so that load from other users of the machine hits all of them
alike; figures are medians over rounds, and ratios compare medians of the same run. CPU
seconds (all processes of a case, Ray's included) are reported beside wall-clock time: on a
shared machine images per CPU-second move much less than images per second.

img2dataset's `Resizer` runs in a virtualenv of its own, since its pins (opencv < 5,
albumentations < 2, webdataset < 0.3) clash with ours:

    python3.11 -m venv /tmp/i2d-venv && /tmp/i2d-venv/bin/pip install img2dataset==1.47.0

Without it, or without the `fast` extra, those cases are reported as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from io import BytesIO
from pathlib import Path

import numpy as np
from common import (
    Stopwatch,
    TreeMemorySampler,
    child_report,
    describe_machine,
    directory_bytes,
    free_disk_bytes,
    gib,
    markdown_table,
    median,
    mib,
    spread,
    tree_cpu_by_process,
)
from PIL import Image

from preprocess.images import ImageConfig, plan_resize, process_image
from shards.image.policy import fast_backend_available
from shards.sample import SampleError

SIZE = 256
QUALITY = 90
CHUNK = 64  # images per pool task
# Disk estimates: make-sample writes ~69 KB per image; a 256-px q90 output is ~19 KB per format.
SOURCE_BYTES_PER_IMAGE = 75_000
OUTPUT_BYTES_PER_IMAGE = 25_000
DISK_RESERVE = 2 * 2**30
QUALITY_IMAGES = 200
DEFAULT_I2D_PYTHON = "/tmp/i2d-venv/bin/python"
PACKAGES = ("pillow", "numpy", "ray", "pyarrow", "simplejpeg", "opencv-python-headless")


@dataclass(frozen=True)
class Case:
    """One thing to measure: a pool of plain loops, img2dataset's resizer, or a build."""

    name: str
    kind: str  # "pool", "i2d" or "build"
    processes: int  # pool processes or Ray workers
    repeats: int
    images: str = "loop"  # which file list: "single" (1-process subset), "loop", "all", "scale"
    work: str = ""  # pool: plain-bilinear, plain-lanczos, pillow, fast
    formats: tuple[str, ...] = ("tar",)
    backend: str = "pillow"


@dataclass
class Result:
    """Every repeat of one case; builds also keep memory, disk and start-up figures."""

    case: Case
    images: int = 0
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    startup_s: list[float] = field(default_factory=list)
    memory: list[dict] = field(default_factory=list)
    cpu_split: list[dict] = field(default_factory=list)
    output_bytes: dict[str, int] = field(default_factory=dict)
    skipped_inputs: int = 0
    note: str = ""

    @property
    def rate(self) -> float:
        """Median images per wall-clock second."""
        return self.images / median(self.wall_s) if self.wall_s else float("nan")

    @property
    def cpu_rate(self) -> float:
        """Median images per CPU-second over all processes of the case."""
        return self.images / median(self.cpu_s) if self.cpu_s else float("nan")


# --- Work done inside pool processes (module-level: they are pickled to spawned workers) ---


def shorter_side_size(width: int, height: int, side: int = SIZE) -> tuple[int, int]:
    """Output size for `shorter side to side`, never upscaling."""
    scale = side / min(width, height)
    if scale >= 1:
        return width, height
    return max(1, round(width * scale)), max(1, round(height * scale))


def plain_resize(path: str, resample: Image.Resampling) -> bytes:
    """The plain loop: open, draft, resize shorter side to 256, encode; no checks at all."""
    with Image.open(path) as image:
        size = shorter_side_size(*image.size)
        image.draft("RGB", size)
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        out = rgb.resize(size, resample, reducing_gap=2.0)
    buffer = BytesIO()
    out.save(buffer, "JPEG", quality=QUALITY)
    return buffer.getvalue()


def plain_chunk(paths: list[str], resample: Image.Resampling) -> tuple[int, float]:
    """Run the plain loop over `paths`; return (images, CPU seconds)."""
    start = time.process_time()
    for path in paths:
        plain_resize(path, resample)
    return len(paths), time.process_time() - start


def process_chunk(paths: list[str], config: ImageConfig) -> tuple[int, float]:
    """Run build-shards' per-image step (`process_image`) over `paths`, without a framework."""
    start = time.process_time()
    for path in paths:
        with open(path, "rb") as file:
            data = file.read()
        with contextlib.suppress(SampleError):  # skips are counted by the builds
            process_image(data, config)
    return len(paths), time.process_time() - start


def pool_worker(case: Case) -> partial:
    """The picklable chunk function of a pool case."""
    if case.work == "plain-bilinear":
        return partial(plain_chunk, resample=Image.Resampling.BILINEAR)
    if case.work == "plain-lanczos":
        return partial(plain_chunk, resample=Image.Resampling.LANCZOS)
    return partial(process_chunk, config=ImageConfig(backend=case.work))


def run_pool(worker: partial, paths: list[str], processes: int) -> tuple[float, float]:
    """Time `worker` over `paths` in a spawn pool; return (wall s, summed worker CPU s)."""
    chunks = [paths[i : i + CHUNK] for i in range(0, len(paths), CHUNK)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        # Warm-up: imports, lazily loaded codecs and first-call costs stay out of the timing.
        pool.map(worker, [paths[i : i + 4] for i in range(0, 4 * processes, 4)], chunksize=1)
        watch = Stopwatch()
        done = pool.map(worker, chunks, chunksize=1)
        wall = watch.seconds
    return wall, sum(cpu for _, cpu in done)


# --- img2dataset's resizer, run in its own virtualenv ---------------------------------------

I2D_CHILD = r'''
"""Times img2dataset's Resizer on a file list (written by build_throughput.py)."""
import importlib.metadata, importlib.util, io, json, multiprocessing, os, sys, time

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")
RESIZER = None


def load_resizer_module():
    # img2dataset/__init__ imports its whole downloader (ray, wandb, ...); resizer.py stands alone.
    spec = importlib.util.find_spec("img2dataset")
    path = os.path.join(list(spec.submodule_search_locations)[0], "resizer.py")
    module_spec = importlib.util.spec_from_file_location("img2dataset_resizer", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def init(size, quality):
    global RESIZER
    RESIZER = load_resizer_module().Resizer(
        image_size=size, resize_mode="keep_ratio", resize_only_if_bigger=True,
        encode_quality=quality,
    )


def run(paths):
    start, errors = time.process_time(), 0
    for path in paths:
        with open(path, "rb") as file:
            errors += RESIZER(io.BytesIO(file.read()))[-1] is not None
    return len(paths), time.process_time() - start, errors


def main():
    job = json.loads(sys.argv[1])
    with open(job["list"]) as file:
        paths = file.read().splitlines()
    if job.get("quality_out"):
        init(job["size"], job["quality"])
        for index, path in enumerate(paths):
            with open(path, "rb") as file:
                data = RESIZER(io.BytesIO(file.read()))[0]
            with open(os.path.join(job["quality_out"], f"{index}.jpg"), "wb") as out:
                out.write(data or b"")
        return
    chunks = [paths[i : i + 64] for i in range(0, len(paths), 64)]
    context = multiprocessing.get_context("fork")
    with context.Pool(job["processes"], init, (job["size"], job["quality"])) as pool:
        pool.map(run, [paths[:4]] * job["processes"], chunksize=1)
        start = time.perf_counter()
        done = pool.map(run, chunks, chunksize=1)
        wall = time.perf_counter() - start
    import cv2
    print(json.dumps({
        "wall_s": wall, "cpu_s": sum(d[1] for d in done), "errors": sum(d[2] for d in done),
        "img2dataset": importlib.metadata.version("img2dataset"), "opencv": cv2.__version__,
        "albumentations": importlib.metadata.version("albumentations"),
    }))


if __name__ == "__main__":
    main()
'''


def i2d_available(python: str) -> str | None:
    """None when img2dataset's resizer imports under `python`, else why not."""
    if not Path(python).exists():
        return f"{python} not found (see the module docstring to create it)"
    probe = (
        "import importlib.util, cv2, albumentations; assert importlib.util.find_spec('img2dataset')"
    )
    run = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    return None if run.returncode == 0 else f"img2dataset does not import: {run.stderr[-300:]}"


def run_i2d(python: str, script: Path, file_list: Path, processes: int) -> dict:
    """One timed pass of img2dataset's Resizer; returns the child's JSON report."""
    job = {"list": str(file_list), "processes": processes, "size": SIZE, "quality": QUALITY}
    run = subprocess.run(
        [python, str(script), json.dumps(job)], capture_output=True, text=True, check=True
    )
    return json.loads(run.stdout.strip().splitlines()[-1])


# --- build-shards, in a spawned child so its process tree can be measured -------------------


@dataclass(frozen=True)
class BuildJob:
    """What one build child does."""

    input: str
    output: str
    workers: int
    formats: tuple[str, ...]
    backend: str


def build_child(job: BuildJob, results: multiprocessing.Queue) -> None:
    """Start a local Ray of `job.workers` CPUs, warm it, run one build, report on `results`."""
    import ray

    from preprocess.config import BuildConfig
    from preprocess.job import run_build
    from preprocess.pool import warm_worker as warm_function
    from preprocess.ray_job import BuildError

    watch = Stopwatch()
    # address="local": always a fresh Ray of our own, never another user's cluster.
    ray.init(address="local", num_cpus=job.workers, include_dashboard=False, logging_level="ERROR")
    # Import the image stack in each prestarted worker before the clock starts.
    ray.get([ray.remote(warm_function).remote() for _ in range(4 * job.workers)])
    startup = watch.seconds
    config = BuildConfig(
        input=job.input,
        output=job.output,
        image=ImageConfig(backend=job.backend),
        formats=job.formats,
        workers=job.workers,
        progress=False,
    )
    cpu_before, build = tree_cpu_by_process(os.getpid()), Stopwatch()
    try:
        summary = run_build(config)
    except BuildError as error:
        results.put({"error": str(error)})
        return
    wall = build.seconds
    cpu_split = split_cpu(os.getpid(), cpu_before, tree_cpu_by_process(os.getpid()))
    report = {
        "wall_s": wall,
        "cpu_s": sum(cpu_split.values()),
        "cpu_split": cpu_split,
        "startup_s": startup,
        "images": summary.images_processed,
        "skipped": sum(summary.manifest.skipped.values()),
        "output_bytes": summary.bytes_by_format,
    }
    ray.shutdown()
    results.put(report)


def split_cpu(
    driver: int, before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    """CPU seconds between two readings, by role: driver, Ray workers, raylet+GCS, the rest."""
    split = dict.fromkeys(("driver", "workers", "raylet+gcs", "other"), 0.0)
    for pid, (name, seconds) in after.items():
        used = seconds - before.get(pid, (name, 0.0))[1]
        if pid == driver:
            split["driver"] += used
        elif name == "ray::IDLE" or name.startswith("ray::build"):
            split["workers"] += used
        elif name in ("raylet", "gcs_server"):
            split["raylet+gcs"] += used
        else:
            split["other"] += used
    return split


def run_build_case(job: BuildJob) -> tuple[dict, dict]:
    """Run one build child while sampling its process tree; return (report, memory peak)."""
    shutil.rmtree(job.output, ignore_errors=True)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=build_child, args=(job, results))
    child.start()
    with TreeMemorySampler(child.pid) as sampler:
        report = child_report(child, results)
        if report is None:
            report = {"error": f"build child exited with code {child.exitcode}"}
    child.join()
    shutil.rmtree(job.output, ignore_errors=True)
    return report, asdict(sampler.peak)


# --- Sources, file lists, disk ----------------------------------------------------------------


def ensure_sample(root: Path, count: int) -> Path:
    """`count` make-sample images under `root`, generated once and reused afterwards."""
    from preprocess.sample import make_sample

    done = root.with_name(root.name + ".done")
    if done.exists() and json.loads(done.read_text()).get("count") == count:
        return root
    print(f"generating {count} sample images in {root} ...", flush=True)
    summary = make_sample(root, count, classes=10, seed=0, workers=None, overwrite=True)
    done.write_text(json.dumps({"count": count, "seconds": summary.wall_s}))
    return root


def ensure_hardlinked(source: Path, root: Path, copies: int) -> Path:
    """A dataset of `copies` hard links to every image of `source`: more inputs, no more disk."""
    done = root.with_name(root.name + ".done")
    if done.exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    for class_dir in sorted(p for p in source.iterdir() if p.is_dir()):
        target = root / class_dir.name
        target.mkdir(parents=True)
        for image in class_dir.iterdir():
            for copy in range(copies):
                os.link(image, target / f"{image.stem}_c{copy}{image.suffix}")
    done.write_text("{}")
    return root


def list_images(root: Path) -> list[str]:
    return sorted(str(p) for p in root.glob("*/*") if p.is_file())


def write_list(path: Path, paths: list[str]) -> Path:
    path.write_text("\n".join(paths) + "\n")
    return path


def check_disk(workdir: Path, images: int, have_sources: bool, args: argparse.Namespace) -> None:
    """Refuse to start when the sources and the largest build output would not fit."""
    formats = max(len(f) for f in format_sets(args))
    outputs = images * OUTPUT_BYTES_PER_IMAGE * formats
    if not args.skip_scale and args.memory_scale > 1:
        outputs = max(outputs, images * args.memory_scale * OUTPUT_BYTES_PER_IMAGE)
    sources = 0 if have_sources else images * SOURCE_BYTES_PER_IMAGE
    need = int((sources + outputs) * 1.1) + DISK_RESERVE
    free = free_disk_bytes(workdir)
    print(f"disk: need ~{gib(need)} GiB in {workdir}, {gib(free)} GiB free", flush=True)
    if free < need:
        raise SystemExit(
            f"not enough free disk in {workdir}: about {gib(need)} GiB needed "
            f"({gib(sources)} GiB of sources, {gib(outputs)} GiB of shards, "
            f"{gib(DISK_RESERVE)} GiB reserve), {gib(free)} GiB free. Free some space or pass "
            "a --workdir on a larger disk."
        )


def format_sets(args: argparse.Namespace) -> list[tuple[str, ...]]:
    if args.formats:
        return [tuple(f.strip() for f in args.formats.split(",") if f.strip())]
    return [("tar",), ("tar", "parquet")]


# --- Image quality against a LANCZOS reference -------------------------------------------------


def quality_files(paths: list[str], count: int) -> list[str]:
    """Up to `count` plain RGB JPEGs without EXIF rotation, evenly spread over `paths`."""
    chosen = []
    for path in paths[:: max(1, len(paths) // (4 * count))]:
        with Image.open(path) as image:
            plain = image.format == "JPEG" and image.mode == "RGB"
            if plain and image.getexif().get(0x0112, 1) == 1:
                chosen.append(path)
        if len(chosen) == count:
            break
    return chosen


def lanczos_reference(path: str) -> np.ndarray:
    """Full decode (no DCT scaling), LANCZOS to the planned size, not encoded: the reference."""
    with Image.open(path) as image:
        rgb = image.convert("RGB")
    size = plan_resize(*rgb.size, ImageConfig()).size
    return np.asarray(rgb.resize(size, Image.Resampling.LANCZOS), dtype=np.float64)


def psnr(reference: np.ndarray, image: np.ndarray) -> float:
    mse = float(np.mean((reference - image) ** 2))
    return 10 * math.log10(255.0**2 / mse) if mse > 0 else float("inf")


def ssim(reference: np.ndarray, image: np.ndarray) -> float:
    """Mean SSIM of the luma planes (Gaussian window 11, sigma 1.5, as Wang et al. 2004)."""
    luma = np.array([0.299, 0.587, 0.114])
    x, y = reference @ luma, image @ luma
    kernel = np.exp(-0.5 * ((np.arange(11) - 5) / 1.5) ** 2)
    kernel /= kernel.sum()
    mx, my = _blur(x, kernel), _blur(y, kernel)
    sxx, syy = _blur(x * x, kernel) - mx**2, _blur(y * y, kernel) - my**2
    sxy = _blur(x * y, kernel) - mx * my
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    index = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx**2 + my**2 + c1) * (sxx + syy + c2))
    return float(index.mean())


def _blur(plane: np.ndarray, kernel: np.ndarray) -> np.ndarray:
    """Separable 'valid' convolution of a 2-D plane with a 1-D kernel."""
    n = len(kernel)
    rows = sum(k * plane[i : plane.shape[0] - n + 1 + i] for i, k in enumerate(kernel))
    return sum(k * rows[:, i : rows.shape[1] - n + 1 + i] for i, k in enumerate(kernel))


def decode_rgb(data: bytes) -> np.ndarray:
    with Image.open(BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.float64)


def measure_quality(files: list[str], env: Env) -> dict[str, dict]:
    """PSNR and SSIM of each method's JPEG output against the LANCZOS reference."""
    methods = {
        "build-shards, pillow bilinear (default)": ImageConfig(),
        "build-shards, pillow lanczos": ImageConfig(resample="lanczos"),
    }
    if env.fast_ok:
        methods["build-shards, fast backend"] = ImageConfig(backend="fast")
    outputs: dict[str, list[bytes]] = {name: [] for name in methods}
    for path in files:
        data = Path(path).read_bytes()
        for name, config in methods.items():
            outputs[name].append(process_image(data, config).data)
    if env.i2d_note is None:
        outputs["img2dataset Resizer (INTER_AREA)"] = i2d_outputs(files, env)
    references = [lanczos_reference(path) for path in files]
    return {name: score(references, datas) for name, datas in outputs.items()}


def i2d_outputs(files: list[str], env: Env) -> list[bytes]:
    out = env.workdir / "quality-i2d"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    file_list = write_list(env.workdir / "quality-files.txt", files)
    job = {"list": str(file_list), "size": SIZE, "quality": QUALITY, "quality_out": str(out)}
    subprocess.run([env.i2d_python, str(env.i2d_script), json.dumps(job)], check=True)
    datas = [(out / f"{index}.jpg").read_bytes() for index in range(len(files))]
    shutil.rmtree(out)
    return datas


def score(references: list[np.ndarray], datas: list[bytes]) -> dict:
    psnrs, ssims, other_size = [], [], 0
    for reference, data in zip(references, datas, strict=True):
        image = decode_rgb(data) if data else None
        if image is None or image.shape != reference.shape:
            other_size += 1  # img2dataset rounds some sizes differently; not comparable
            continue
        psnrs.append(psnr(reference, image))
        ssims.append(ssim(reference, image))
    return {
        "images": len(psnrs),
        "other_size": other_size,
        "psnr_mean_db": float(np.mean(psnrs)) if psnrs else float("nan"),
        "psnr_min_db": float(np.min(psnrs)) if psnrs else float("nan"),
        "ssim_mean": float(np.mean(ssims)) if ssims else float("nan"),
    }


# --- The run ------------------------------------------------------------------------------------


@dataclass
class Env:
    """Where things are for one run."""

    workdir: Path
    roots: dict[str, Path]  # file-list name -> dataset root (for builds)
    lists: dict[str, list[str]]  # file-list name -> image paths
    list_files: dict[str, Path]
    fast_ok: bool
    i2d_python: str
    i2d_note: str | None
    i2d_script: Path


def case_label(case: Case) -> str:
    if case.kind != "build":
        return f"{case.name}, {case.processes} proc"
    scale = " (memory scale)" if case.images == "scale" else ""
    workers = f"{case.processes} worker{'s' if case.processes > 1 else ''}"
    return f"build-shards {case.backend}, {'+'.join(case.formats)}, {workers}{scale}"


def build_cases(args: argparse.Namespace, fast_ok: bool) -> list[Case]:
    repeats = args.repeats
    cases = [
        Case("plain loop bilinear", "pool", 1, repeats, "single", "plain-bilinear"),
        Case("plain loop bilinear", "pool", 2, repeats, "loop", "plain-bilinear"),
        Case("plain loop lanczos", "pool", 2, 1, "loop", "plain-lanczos"),
        Case("process_image pillow", "pool", 2, repeats, "loop", "pillow"),
        Case("img2dataset Resizer", "i2d", 1, repeats, "single"),
        Case("img2dataset Resizer", "i2d", 2, repeats, "loop"),
        Case("process_image fast", "pool", 1, repeats, "single", "fast"),
        Case("process_image fast", "pool", 2, repeats, "loop", "fast"),
    ]
    for formats in format_sets(args):
        cases.append(Case("build", "build", 2, repeats, "all", formats=formats))
        if not args.skip_scale:
            cases.append(Case("build", "build", 1, 1, "all", formats=formats))
    first = format_sets(args)[0]
    cases.append(Case("build", "build", 2, repeats, "all", formats=first, backend="fast"))
    if not args.skip_scale and args.memory_scale > 1:
        cases.append(Case("build", "build", 2, 1, "scale", formats=first))
    return [c for c in cases if fast_ok or "fast" not in (c.work, c.backend)]


def measure_once(result: Result, env: Env) -> None:
    """One repeat of one case, appended to `result`."""
    case = result.case
    if case.kind == "pool":
        paths = env.lists[case.images]
        wall, cpu = run_pool(pool_worker(case), paths, case.processes)
        result.images = len(paths)
    elif case.kind == "i2d":
        report = run_i2d(
            env.i2d_python, env.i2d_script, env.list_files[case.images], case.processes
        )
        wall, cpu = report["wall_s"], report["cpu_s"]
        result.images = len(env.lists[case.images])
        result.note = f"img2dataset {report['img2dataset']}, OpenCV {report['opencv']}, albumentations {report['albumentations']}; {report['errors']} errors"
    else:
        job = BuildJob(
            str(env.roots[case.images]),
            str(env.workdir / "shards"),
            case.processes,
            case.formats,
            case.backend,
        )
        report, peak = run_build_case(job)
        if "error" in report:
            result.note = f"failed: {report['error']}"
            return
        wall, cpu = report["wall_s"], report["cpu_s"]
        result.images = report["images"]
        result.skipped_inputs = report["skipped"]
        result.startup_s.append(report["startup_s"])
        result.output_bytes = report["output_bytes"]
        result.memory.append(peak)
        result.cpu_split.append(report["cpu_split"])
    result.wall_s.append(wall)
    result.cpu_s.append(cpu)


def measure_all(cases: list[Case], env: Env, partial_json: Path) -> list[Result]:
    """Run every case once per round, rounds interleaving the cases.

    What has been measured so far is rewritten to `partial_json` after every case, so a long
    run that is stopped still leaves its figures.
    """
    results = [Result(case) for case in cases]
    for result in results:
        if result.case.kind == "i2d" and env.i2d_note:
            result.note = f"skipped: {env.i2d_note}"
    for round_index in range(max(case.repeats for case in cases)):
        for result in results:
            if round_index >= result.case.repeats or result.note.startswith(("skipped", "failed")):
                continue
            measure_once(result, env)
            if result.wall_s:
                print(
                    f"round {round_index + 1}: {case_label(result.case)}: "
                    f"{result.images / result.wall_s[-1]:.0f} img/s, "
                    f"{result.images / result.cpu_s[-1]:.0f} img/CPU-s",
                    flush=True,
                )
            partial_json.write_text(json.dumps([result_json(r) for r in results], indent=1))
    return results


def result_json(result: Result) -> dict:
    return {
        **asdict(result),
        "label": case_label(result.case),
        "rate": result.rate,
        "cpu_rate": result.cpu_rate,
    }


# --- Ratios against the targets, and the report -------------------------------------------------


def find(results: list[Result], label: str) -> Result | None:
    for result in results:
        if case_label(result.case) == label and result.wall_s:
            return result
    return None


def ratio_rows(results: list[Result], args: argparse.Namespace) -> list[dict]:
    """Each ratio of the issue's targets, measured side by side in this run."""
    specs = []
    for formats in format_sets(args):
        joined = "+".join(formats)
        build = f"build-shards pillow, {joined}, 2 workers"
        specs += [
            (f"build ({joined}) / plain loop, 2 cores", build, "plain loop bilinear, 2 proc", 0.85),
            (f"build ({joined}) / img2dataset, 2 cores", build, "img2dataset Resizer, 2 proc", 1.0),
            (
                f"build ({joined}) 2 workers / 1 worker",
                build,
                build.replace("2 workers", "1 worker"),
                None,
            ),
        ]
    first = "+".join(format_sets(args)[0])
    specs += [
        (
            "fast path / img2dataset, 2 cores",
            "process_image fast, 2 proc",
            "img2dataset Resizer, 2 proc",
            1.5,
        ),
        (
            "fast path / img2dataset, 1 core",
            "process_image fast, 1 proc",
            "img2dataset Resizer, 1 proc",
            1.5,
        ),
        (
            f"build fast ({first}) / img2dataset, 2 cores",
            f"build-shards fast, {first}, 2 workers",
            "img2dataset Resizer, 2 proc",
            1.5,
        ),
        (
            "process_image pillow / plain loop, 2 cores",
            "process_image pillow, 2 proc",
            "plain loop bilinear, 2 proc",
            None,
        ),
        (
            "plain loop 2 / 1 processes",
            "plain loop bilinear, 2 proc",
            "plain loop bilinear, 1 proc",
            None,
        ),
    ]
    rows = []
    for name, top, bottom, target in specs:
        a, b = find(results, top), find(results, bottom)
        if a is None or b is None:
            continue
        wall, cpu = a.rate / b.rate, a.cpu_rate / b.cpu_rate
        met = None if target is None else (wall >= target, cpu >= target)
        rows.append({"ratio": name, "wall": wall, "cpu": cpu, "target": target, "met": met})
    return rows


def pool_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        if r.case.kind == "build":
            continue
        if not r.wall_s:
            rows.append([case_label(r.case), r.case.processes, "-", "-", "-", "-", "-", r.note])
            continue
        rows.append([
            case_label(r.case), r.case.processes, r.images, f"{median(r.wall_s):.1f}",
            f"{r.rate:.0f}", f"{r.rate / r.case.processes:.0f}", f"{r.cpu_rate:.0f}",
            f"{spread(r.wall_s):.2f}",
        ])  # fmt: skip
    header = [
        "case",
        "processes",
        "images",
        "wall s",
        "img/s",
        "img/s per process",
        "img per CPU-s",
        "spread",
    ]
    return markdown_table(header, rows)


def build_table(results: list[Result]) -> str:
    rows = []
    for r in results:
        if r.case.kind != "build":
            continue
        if not r.wall_s:
            rows.append([case_label(r.case), *["-"] * 10, r.note])
            continue
        peak = {key: max(m[key] for m in r.memory) for key in r.memory[0]}
        rows.append([
            case_label(r.case), r.images, f"{median(r.wall_s):.1f}", f"{r.rate:.0f}",
            f"{r.rate / r.case.processes:.0f}", f"{r.cpu_rate:.0f}", f"{median(r.startup_s):.1f}",
            mib(peak["tree_pss"]), mib(peak["tree_rss"]), mib(peak["root_rss"]),
            mib(peak["largest_child_rss"]), mib(sum(r.output_bytes.values())),
        ])  # fmt: skip
    header = [
        "build", "images", "run_build s", "img/s", "img/s per worker", "img per CPU-s",
        "Ray start s", "peak PSS MiB", "peak RSS MiB", "driver RSS MiB", "largest process MiB",
        "output MiB",
    ]  # fmt: skip
    return markdown_table(header, rows)


def cpu_split_table(results: list[Result]) -> str:
    """Where each build's CPU time went, and the rate per CPU-second of its workers alone."""
    rows = []
    for r in results:
        if r.case.kind != "build" or not r.cpu_split:
            continue
        total = {key: sum(split[key] for split in r.cpu_split) for key in r.cpu_split[0]}
        whole = sum(total.values())
        rows.append([
            case_label(r.case), *(f"{100 * total[key] / whole:.0f}%" for key in total),
            f"{r.images * len(r.cpu_split) / total['workers']:.0f}",
        ])  # fmt: skip
    header = ["build", "driver", "workers", "raylet+gcs", "other", "img per worker CPU-s"]
    return markdown_table(header, rows)


def ratio_table(rows: list[dict]) -> str:
    def verdict(row: dict) -> str:
        # Wall-clock is what the targets mean; per CPU-second survives a shared machine's noise.
        if row["met"] is None:
            return "-"
        return {
            (True, True): "met",
            (False, False): "NOT met",
            (True, False): "met by wall-clock only",
            (False, True): "met per CPU-second only",
        }[tuple(row["met"])]

    body = [
        [row["ratio"], f"{row['wall']:.2f}", f"{row['cpu']:.2f}",
         "-" if row["target"] is None else f">= {row['target']}", verdict(row)]
        for row in rows
    ]  # fmt: skip
    return markdown_table(["ratio", "wall-clock", "per CPU-second", "target", "verdict"], body)


def quality_table(quality: dict[str, dict]) -> str:
    body = [
        [name, q["images"], f"{q['psnr_mean_db']:.2f}", f"{q['psnr_min_db']:.2f}", f"{q['ssim_mean']:.4f}"]
        for name, q in quality.items()
    ]  # fmt: skip
    return markdown_table(
        ["method (JPEG q90 output)", "images", "PSNR mean dB", "PSNR min dB", "SSIM mean"], body
    )


def render(report: dict, results: list[Result], ratios: list[dict]) -> str:
    machine = ", ".join(f"{k} {v}" for k, v in report["machine"].items())
    parts = [
        f"Machine: {machine}",
        f"Sources: {report['images']} make-sample images, {gib(report['source_bytes'])} GiB; "
        f"1-process cases use {report['single_images']}, 2-process cases {report['loop_images']}; "
        f"median of up to {report['repeats']} rounds; total {report['total_s']:.0f} s",
        "", pool_table(results), "", build_table(results), "", cpu_split_table(results),
        "", ratio_table(ratios),
    ]  # fmt: skip
    if report.get("quality"):
        parts += ["", quality_table(report["quality"])]
    return "\n".join(parts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10_000, help="sample images to build")
    parser.add_argument("--workdir", required=True, help="holds sources, shards and results")
    parser.add_argument(
        "--formats", default=None, help="only this set, e.g. `tar` (default: tar, then tar,parquet)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds (median taken)")
    parser.add_argument(
        "--single-images", type=int, default=3000, help="images for 1-process cases"
    )
    parser.add_argument(
        "--loop-images", type=int, default=20_000, help="images for 2-process cases"
    )
    parser.add_argument(
        "--memory-scale",
        type=int,
        default=4,
        help="memory run on this many times the images (hard links)",
    )
    parser.add_argument(
        "--skip-scale",
        action="store_true",
        help="skip the 1-worker builds and the memory-scale build",
    )
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--i2d-python", default=DEFAULT_I2D_PYTHON)
    parser.add_argument(
        "--cleanup", action="store_true", help="delete the generated source images at the end"
    )
    return parser.parse_args(argv)


def prepare_env(args: argparse.Namespace, workdir: Path, sources: Path) -> Env:
    every = list_images(sources)
    roots, lists = {"all": sources}, {"all": every}
    lists["loop"] = evenly(every, args.loop_images)
    lists["single"] = evenly(every, args.single_images)
    if not args.skip_scale and args.memory_scale > 1:
        scaled = workdir / f"images-{args.images}-x{args.memory_scale}"
        roots["scale"] = ensure_hardlinked(sources, scaled, args.memory_scale)
    list_files = {
        name: write_list(workdir / f"files-{name}.txt", paths) for name, paths in lists.items()
    }
    script = workdir / "i2d_child.py"
    script.write_text(I2D_CHILD)
    return Env(
        workdir, roots, lists, list_files, fast_backend_available(), args.i2d_python,
        i2d_available(args.i2d_python), script,
    )  # fmt: skip


def evenly(paths: list[str], count: int) -> list[str]:
    """`count` paths spread evenly over `paths` (all of them when there are fewer)."""
    if count >= len(paths):
        return paths
    step = len(paths) / count
    return [paths[int(i * step)] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    watch = Stopwatch()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sources = workdir / f"images-{args.images}"
    check_disk(workdir, args.images, sources.with_name(sources.name + ".done").exists(), args)
    ensure_sample(sources, args.images)
    env = prepare_env(args, workdir, sources)
    partial_json = workdir / f"results-{args.images}.partial.json"
    results = measure_all(build_cases(args, env.fast_ok), env, partial_json)
    quality = {}
    if not args.skip_quality:
        quality = measure_quality(quality_files(env.lists["loop"], QUALITY_IMAGES), env)
    ratios = ratio_rows(results, args)
    report = {
        "machine": describe_machine(PACKAGES),
        "images": args.images,
        "single_images": len(env.lists["single"]),
        "loop_images": len(env.lists["loop"]),
        "repeats": args.repeats,
        "source_bytes": directory_bytes(sources),
        "results": [result_json(r) for r in results],
        "ratios": ratios,
        "quality": quality,
        "total_s": watch.seconds,
    }
    text = render(report, results, ratios)
    (workdir / f"results-{args.images}.json").write_text(json.dumps(report, indent=1))
    (workdir / f"results-{args.images}.md").write_text(text + "\n")
    print(text)
    if args.cleanup:
        for root in {*env.roots.values()}:
            shutil.rmtree(root, ignore_errors=True)
            root.with_name(root.name + ".done").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
