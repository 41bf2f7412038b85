"""Starting loader workers by fork or by spawn: how often each hangs, what each costs.

    python benchmarks/worker_start.py hazard [--starts 1500] [--spawn-starts 100] [--wait-s 5]
    python benchmarks/worker_start.py loader --shards W/photo-shards [--rounds 5]

`hazard`: two gloo ranks on this machine (CPU) each take a `DistributedDataParallel` step
and broadcast a buffer (what a trainer does before it evaluates), then start one child
the way a DataLoader starts a worker: `os.fork()` (PyTorch's default on Linux), or a
spawn context's process (what `Workers(start_method="auto")` does where
torch.distributed is initialized). A child that has not exited `--wait-s` seconds later
is counted as hung and killed. On Python up to 3.11 a forked child can block for good on
the interpreter's thread-list lock when a gloo thread enters Python at the moment of the
fork (python/cpython#112275); a spawned child runs no Python before its exec. Spawns
cost ~1 s each, hence fewer of them.

`loader`: one epoch of the loader's defaults (2 workers, persistent, batch 256, 224 px)
on the same shards with `Workers(start_method="fork")` and `"spawn"`, each in a fresh
process, rounds in rotating order: seconds to the first batch (the workers' start
included), img/s after the first three batches, paired per round (median ratio and the
per-round min-max), and the workers' and the main process's PSS at batch 15.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import median  # noqa: E402


def exit_at_once() -> None:
    """What each spawned child runs: nothing."""


def start_forked(wait_s: float) -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return True
        time.sleep(0.002)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return False


def start_spawned(wait_s: float) -> bool:
    child = multiprocessing.get_context("spawn").Process(target=exit_at_once)
    child.start()
    child.join(wait_s)
    if child.exitcode is None:
        child.kill()
        child.join()
        return False
    return True


def rank_main(rank: int, port: int, starts: int, wait_s: float, method: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 4))
    buffer = torch.zeros(3)
    start = start_forked if method == "fork" else start_spawned
    hung, began = 0, time.perf_counter()
    for _ in range(starts):
        model(torch.randn(8, 64)).sum().backward()
        dist.broadcast(buffer, 0)
        hung += not start(wait_s)
    out.put((rank, hung, time.perf_counter() - began))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(method: str, starts: int, wait_s: float) -> tuple[int, float]:
    """Hung children over both ranks, and the seconds a step and a start took."""
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    port = free_port()
    ranks = [
        context.Process(target=rank_main, args=(rank, port, starts, wait_s, method, out))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    results = [out.get() for _ in ranks]
    for process in ranks:
        process.join()
    return sum(r[1] for r in results), max(r[2] for r in results) / starts


# Run in a fresh process: one epoch with the start method asked, printed as one JSON line.
EPOCH = """
import json, sys, time
from pathlib import Path
from pipeline import Batching, LoaderConfig, Workers, build_loader

def worker_pids():  # this process's children but the resource tracker that spawn starts
    pids = []
    for task in Path("/proc/self/task").iterdir():
        pids += [int(pid) for pid in (task / "children").read_text().split()]
    tracker = b"from multiprocessing.resource_tracker"
    args = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\\0") for p in pids}
    return [p for p in pids if not any(a.startswith(tracker) for a in args[p])]


def pss_mib(pid):
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024

if __name__ == "__main__":
    shards, method = sys.argv[1], sys.argv[2]
    config = LoaderConfig(source=shards, split="train", batch=Batching(size=256),
                          workers=Workers(count=2, start_method=method))
    loader = build_loader(config)
    began = time.perf_counter()
    images, first, counted, since = 0, None, 0, None
    for index, (batch, labels) in enumerate(loader):
        images += len(labels)
        if first is None:
            first = time.perf_counter() - began
        if since is None and images > 3 * 256:
            counted, since = images, time.perf_counter()
        if index == 15:  # the workers' memory once warm
            pss = [pss_mib(pid) for pid in worker_pids()]
            main = pss_mib("self")
    seconds = time.perf_counter() - since
    img_s = (images - counted) / seconds
    print(json.dumps({"first_s": first, "img_s": img_s, "worker_pss": pss, "main_pss": main}))
"""


def loader_epoch(shards: Path, method: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", EPOCH, str(shards), method],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare_loader(shards: Path, rounds: int) -> None:
    methods = ("fork", "spawn")
    first: dict[str, list[float]] = {m: [] for m in methods}
    workers: dict[str, list[float]] = {m: [] for m in methods}
    main: dict[str, list[float]] = {m: [] for m in methods}
    ratios = []
    for index in range(rounds):
        order = methods if index % 2 == 0 else methods[::-1]
        got = {method: loader_epoch(shards, method) for method in order}
        for method in methods:
            first[method].append(got[method]["first_s"])
            workers[method] += got[method]["worker_pss"]
            main[method].append(got[method]["main_pss"])
        ratios.append(got["spawn"]["img_s"] / got["fork"]["img_s"])
        print(f"round {index + 1}: {json.dumps(got)}", flush=True)
    ratios.sort()
    print("| | fork | spawn |")
    print("|---|---:|---:|")
    print(
        f"| first batch, s (median) | {median(first['fork']):.2f} | {median(first['spawn']):.2f} |"
    )
    print(
        f"| img/s after 3 batches, spawn / fork | 1 | {median(ratios):.2f}x "
        f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |"
    )
    for name, values in (("a worker's PSS", workers), ("main PSS", main)):
        cells = " | ".join(f"{min(values[m]):.0f}-{max(values[m]):.0f}" for m in methods)
        print(f"| {name} at batch 15, MiB | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    hazard = commands.add_parser("hazard", help="hung children after DDP steps")
    hazard.add_argument("--starts", type=int, default=1500, help="forks per rank")
    hazard.add_argument("--spawn-starts", type=int, default=100, help="spawns per rank")
    hazard.add_argument("--wait-s", type=float, default=5.0)
    loader = commands.add_parser("loader", help="a loader epoch under each start method")
    loader.add_argument("--shards", type=Path, required=True)
    loader.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.command == "loader":
        compare_loader(args.shards, args.rounds)
        return
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, 2 gloo ranks")
    print("| start | children started | hung | ms a step + start |")
    print("|---|---:|---:|---:|")
    for method, starts in (("fork", args.starts), ("spawn", args.spawn_starts)):
        hung, each = measure(method, starts, args.wait_s)
        print(f"| {method} | {2 * starts} | {hung} | {each * 1000:.1f} |", flush=True)


if __name__ == "__main__":
    main()
