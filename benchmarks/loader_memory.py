"""Peak memory of the loader, main process and workers, for datasets of different sizes.

    python benchmarks/loader_memory.py --workdir DIR [--copies 10] [--shards BIG_DIR ...] \
        [--max-batches 30 | --epoch] [--workers 2] [--format tar]

Measures DIR/shards (the 10k set of `loader_throughput.py`, built if missing), a set of
`--copies` hard-linked copies of it under new shard names with its own manifest (10 copies:
100k samples), and any `--shards` directories (e.g. a 500k build). Each dataset runs in a
fresh process that reads the same number of batches, then reports VmHWM (peak RSS), VmRSS and
PSS of itself and of every child process, read from /proc. Also prints the size of the
per-epoch plan arrays a worker builds, traced with tracemalloc, for 10k to 1.28M samples.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

from loader_throughput import machine_info, prepare_data

from pipeline import Batching, LoaderConfig, Workers, build_loader
from pipeline.epoch import plan_epoch
from pipeline.plan import Partition
from shards.manifest import (
    FileInfo,
    Manifest,
    ShardInfo,
    SplitInfo,
    read_manifest,
    shard_name,
    write_manifest,
)

MIB = 2**20
PLAN_SIZES = (10_000, 100_000, 500_000, 1_281_167)  # the last: ImageNet-1k train


# --- datasets ------------------------------------------------------------------------------


def make_copies(shards: Path, copies: int) -> Path:
    """`copies` x the train shards of `shards`, hard-linked under new names, with a manifest.

    Positions are per shard, so a larger dataset needs more shards, not a longer list of
    the same ones: copy k of shard i becomes shard `k * count + i`.
    """
    out = shards.parent / f"{shards.name}_x{copies}"
    if (out / "manifest.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(shards)
    split = manifest.splits["train"]
    infos = []
    for copy in range(copies):
        for info in split.shards:
            index = copy * len(split.shards) + info.index
            files = {}
            for fmt, file in info.files.items():
                name = shard_name("train", index, fmt)
                target = out / name
                if not target.exists():
                    os.link(shards / file.name, target)
                files[fmt] = FileInfo(name, file.bytes, file.sha256)
            infos.append(ShardInfo(index, info.samples, files, info.class_counts))
    counts = [count * copies for count in split.class_counts]
    splits = {"train": SplitInfo("train", split.samples * copies, infos, counts)}
    skipped = {reason: n * copies for reason, n in manifest.skipped.items()}
    big = Manifest(
        manifest.classes,
        manifest.image_field,
        manifest.formats,
        splits,
        manifest.config,
        manifest.inputs * copies,
        skipped,
    )
    write_manifest(out, big)
    return out


# --- measuring one dataset (in a fresh process) --------------------------------------------


def proc_status(pid: int) -> dict[str, float]:
    """VmHWM (peak RSS), VmRSS and PSS of a process, in MiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS"):
            fields[name] = int(value.split()[0]) / 1024
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            fields["Pss"] = int(line.split()[1]) / 1024
    return fields


def children_of(pid: int) -> list[int]:
    """Direct children of `pid`, found by scanning /proc (no psutil needed)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # The command name may hold spaces and parentheses: fields start after the last ')'.
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid:
            found.append(int(entry.name))
    return sorted(found)


def is_python_fork(pid: int, own_cmdline: bytes) -> bool:
    """DataLoader workers are forks: same command line as us (unlike a resource tracker)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() == own_cmdline
    except OSError:
        return False


def measure(shards: str, workers: int, fmt: str, max_batches: int | None) -> dict:
    """Read `max_batches` batches (or an epoch) with 2 workers, then read /proc of the tree."""
    started = time.perf_counter()
    loader = build_loader(
        LoaderConfig(
            source=shards,
            format=fmt,
            batch=Batching(size=256),
            workers=Workers(count=workers),
            seed=0,
        )
    )
    batches = 0
    for _ in loader:
        batches += 1
        if max_batches is not None and batches >= max_batches:
            break
    # Persistent workers are still alive here (the loader holds them): read their peaks now.
    own = os.getpid()
    cmdline = Path("/proc/self/cmdline").read_bytes()
    workers_status = [proc_status(pid) for pid in children_of(own) if is_python_fork(pid, cmdline)]
    return {
        "shards": shards,
        "samples": loader.source.total_samples,
        "shard_files": len(loader.source.shards),
        "batches": batches,
        "seconds": time.perf_counter() - started,
        "main": proc_status(own),
        "workers": workers_status,
    }


def plan_peak_bytes(total: int, num_workers: int, shard_size: int = 1000) -> tuple[int, int]:
    """Peak bytes allocated while worker 0 plans an epoch of `total` samples, and pieces kept.

    Runs exactly what a worker role plans (`plan_epoch(...).worker`), on integers only.
    """
    counts = [shard_size] * (total // shard_size) + (
        [total % shard_size] if total % shard_size else []
    )
    part = Partition(1, num_workers, 256, True, "pad", 2000, 500)
    tracemalloc.start()
    plan = plan_epoch(counts, part, rank=0, seed=0, epoch=0).worker(0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak, len(plan.parts[0].pieces)


# --- driver --------------------------------------------------------------------------------


def run_measure(shards: Path, args: argparse.Namespace) -> dict:
    """One dataset in a fresh interpreter, so earlier runs do not inflate its peaks."""
    command = [
        sys.executable,
        __file__,
        "--measure",
        str(shards),
        "--workers",
        str(args.workers),
        "--format",
        args.format,
    ]
    if not args.epoch:
        command += ["--max-batches", str(args.max_batches)]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict]) -> None:
    print()
    print(
        "| dataset | samples | batches read | main peak RSS | main RSS now | workers peak RSS "
        "(sum, max) | workers PSS sum | main + workers PSS |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        main, workers = row["main"], row["workers"]
        peaks = [w["VmHWM"] for w in workers]
        pss = sum(w["Pss"] for w in workers)
        print(
            f"| {Path(row['shards']).name} | {row['samples']:,} | {row['batches']} "
            f"| {main['VmHWM']:.0f} MiB | {main['VmRSS']:.0f} MiB "
            f"| {sum(peaks):.0f}, {max(peaks, default=0):.0f} MiB | {pss:.0f} MiB "
            f"| {pss + main['Pss']:.0f} MiB |"
        )


def print_plan_sizes(workers: int) -> list[dict]:
    print()
    print(f"| samples | plan peak per worker ({workers} workers, 1 rank) | pieces kept |")
    print("|---:|---:|---:|")
    rows = []
    for total in PLAN_SIZES:
        peak, pieces = plan_peak_bytes(total, workers)
        rows.append({"samples": total, "peak_bytes": peak, "pieces": pieces})
        print(f"| {total:,} | {peak / MIB:.1f} MiB | {pieces} |")
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="holds shards/ of loader_throughput.py")
    parser.add_argument("--images", type=int, default=10_000, help="size of the base set")
    parser.add_argument("--copies", type=int, default=10, help="0: no copied set")
    parser.add_argument("--shards", type=Path, nargs="*", default=[], help="more shard sets")
    parser.add_argument("--max-batches", type=int, default=30)
    parser.add_argument("--epoch", action="store_true", help="read whole epochs instead")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--format", default="tar", choices=("tar", "parquet"))
    parser.add_argument("--executor", default="ray", choices=("ray", "inline"))
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one dataset, JSON out
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.measure:
        limit = None if args.epoch else args.max_batches
        print(json.dumps(measure(args.measure, args.workers, args.format, limit)))
        return 0
    datasets = list(args.shards)
    if args.workdir:
        base = prepare_data(args.workdir, args.images, args.executor)
        datasets = [base] + ([make_copies(base, args.copies)] if args.copies else []) + datasets
    if not datasets:
        raise SystemExit("give --workdir (builds the 10k set) and/or --shards DIR")
    print(json.dumps(machine_info()))
    rows = []
    for shards in datasets:
        rows.append(run_measure(shards, args))
        print(f"measured {shards}", flush=True)
    print_table(rows)
    plan = print_plan_sizes(args.workers)
    if args.workdir:
        out = args.workdir / f"loader_memory_{args.format}.json"
        out.write_text(json.dumps({"datasets": rows, "plan": plan}, indent=1))
        print(f"raw results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
