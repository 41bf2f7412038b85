"""Remote reads, prefetch and the node-local cache: the loader over a slow HTTP server and a
slow S3-compatible store, against the same shards on local disk.

    python benchmarks/remote_loader.py --workdir DIR [--images 10000] [--shards SHARDS] \
        [--rounds 3] [--workers 2] [--delay-ms 50] [--mb-per-s 20]

Builds (once) DIR/source and its 256-px shards DIR/shards as `loader_throughput.py` does,
or takes `--shards`. A helper process serves them by a plain HTTP server with Range support
(tests/httpserver.py) and by a moto S3 server (tests/objectstore.py), each behind
`tests.slowproxy.SlowProxy` (`--delay-ms` before the first byte of every request, each connection
capped at `--mb-per-s`). Each round runs every contender, in an order that rotates each
round, for two epochs with the loader's defaults (`--workers` workers, RRC 224, batches of
256): local disk; each store with `cache_dir` (epoch 2 from the cache); each store with
`cache_limit` at half the dataset. Ratios are taken round by round against local disk in the
same epoch; the table gives their median and spread ((max - min) / median). Also reported:
bytes fetched per epoch (the loader's fetch stats), the longest batch wait after warm-up,
and the peak RSS (VmHWM) of the largest loader worker with prefetch on. Raw results go to
DIR/remote_loader.json.

When the loader has no `cache_dir` (a version before the shard cache), the stores run
without it and the script says so.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # tests.httpserver, tests.objectstore: the real servers

from common import (  # noqa: E402
    describe_machine,
    markdown_table,
    median,
    mib,
    process_cpu_seconds,
    spread,
    tree_pids,
)
from loader_throughput import prepare_data  # noqa: E402

from pipeline import Batching, Crop, LoaderConfig, ReadOptions, Workers, build_loader  # noqa: E402
from shards.errors import UsageError  # noqa: E402
from shards.manifest import read_manifest  # noqa: E402
from tests.slowproxy import SlowProxy  # noqa: E402

BATCH_SIZE = 256
CROP_SIZE = 224
EPOCHS = 2
BUCKET, PREFIX = "bench", "shards"
SERVE_TIMEOUT_S = 120
PACKAGES = ("torch", "moto", "s3fs", "numpy")


# --- the slow stores, in a helper process ---------------------------------------------------


def serve_stores(shards: str, delay_s: float, bytes_per_s: float, ready, stop) -> None:
    """HTTP and S3 servers over `shards`, each behind a SlowProxy, until `stop` is set.

    Runs in its own process so that the proxies' pacing threads do not share the loader's
    interpreter lock. Puts `{"http": base URL, "s3": endpoint}` on `ready`.
    """
    from tests.httpserver import LocalHTTPServer
    from tests.objectstore import MotoS3

    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    slow = {"delay_s": delay_s, "bytes_per_s": bytes_per_s}
    with LocalHTTPServer(shards) as http_base, MotoS3() as s3:
        s3.create_bucket(BUCKET)
        s3.upload_dir(shards, BUCKET, PREFIX)
        with SlowProxy(http_base, **slow) as http_url, SlowProxy(s3.endpoint, **slow) as s3_url:
            ready.put(
                {
                    "http": http_url,
                    "s3": s3_url,
                    "key": s3.access_key,
                    "secret": s3.secret_key,
                    "pid": os.getpid(),
                }
            )
            stop.wait()


class SlowStores:
    """The helper process running `serve_stores`; a context manager returning its URLs."""

    def __init__(self, shards: Path, delay_s: float, bytes_per_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.ready, self.stop = context.Queue(), context.Event()
        self.process = context.Process(
            target=serve_stores,
            args=(str(shards), delay_s, bytes_per_s, self.ready, self.stop),
            name="slow-stores",
            daemon=True,
        )

    def __enter__(self) -> dict:
        self.process.start()
        try:
            return self.ready.get(timeout=SERVE_TIMEOUT_S)
        except Exception:
            self.process.terminate()
            raise RuntimeError(
                f"the slow stores did not start within {SERVE_TIMEOUT_S} s; is moto[server] "
                "installed (pip install 'moto[server]')?"
            ) from None

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()


# --- contenders -----------------------------------------------------------------------------


def contenders(shards: Path, stores: dict, half: int, cache: bool) -> list[dict]:
    """Local disk, then each store with a whole cache and with one of `half` bytes."""
    s3_options = {"endpoint_url": stores["s3"], "key": stores["key"], "secret": stores["secret"]}
    remote = [
        ("http", f"{stores['http']}/manifest.json", None),
        ("s3", f"s3://{BUCKET}/{PREFIX}/manifest.json", s3_options),
    ]
    runs = [{"name": "local disk", "source": str(shards), "options": None, "cache": None}]
    for name, source, options in remote:
        runs.append({"name": name, "source": source, "options": options, "cache": "whole"})
    if cache:
        for name, source, options in remote:
            runs.append(
                {"name": f"{name}, half cache", "source": source, "options": options, "cache": half}
            )
    return runs


def supports_cache(shards: Path, scratch: Path) -> bool:
    """Whether this loader takes `cache_dir` (the shard cache may predate this script)."""
    try:
        LoaderConfig(source=str(shards), io=ReadOptions(cache_dir=str(scratch)))
    except (TypeError, UsageError):
        return False
    return True


def loader_config(run: dict, cache_dir: Path | None, workers: int, seed: int) -> LoaderConfig:
    """The loader's defaults but for the source and the cache."""
    extra = {}
    if run["options"] is not None:
        extra["storage_options"] = run["options"]
    if cache_dir is not None and run["cache"] is not None:
        extra["cache_dir"] = str(cache_dir)
        if run["cache"] != "whole":
            extra["cache_limit"] = run["cache"]
    return LoaderConfig(
        source=run["source"],
        batch=Batching(size=BATCH_SIZE),
        crop=Crop(image_size=CROP_SIZE),
        workers=Workers(count=workers, pin_memory=False),
        seed=seed,
        **extra,
    )


def run_contender(
    run: dict, cache_dir: Path | None, workers: int, seed: int, server_pid: int
) -> dict:
    """Two epochs of one contender: per epoch its rate, longest wait, fetch counts and the
    CPU seconds the store servers spent (they share this machine's cores with the
    loader); and the peak RSS of its largest worker."""
    before = set(tree_pids(os.getpid()))
    loader = build_loader(loader_config(run, cache_dir, workers, seed))
    epochs = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        server_before = process_cpu_seconds(server_pid)
        loader_before = loader_cpu_seconds(server_pid)
        measured = timed_epoch(loader, warmup=workers + 1)
        measured["server_cpu_s"] = process_cpu_seconds(server_pid) - server_before
        measured["loader_cpu_s"] = loader_cpu_seconds(server_pid) - loader_before
        measured["fetch"] = fetch_counts(loader)
        epochs.append(measured)
    workers_rss = [peak_rss(pid) for pid in set(tree_pids(os.getpid())) - before]
    del loader
    return {"name": run["name"], "epochs": epochs, "worker_peak_rss": max(workers_rss, default=0)}


def loader_cpu_seconds(server_pid: int) -> float:
    """CPU seconds of this process and its loader workers, the store servers left out."""
    servers = set(tree_pids(server_pid))
    return sum(process_cpu_seconds(pid) for pid in tree_pids(os.getpid()) if pid not in servers)


def timed_epoch(loader, warmup: int) -> dict:
    """Images/s after the first `warmup` batches, and the longest wait for a batch then."""
    iterator = iter(loader)
    count = images = 0
    warm_at = now = None
    longest = 0.0
    while True:
        before = time.perf_counter()
        batch = next(iterator, None)
        now = time.perf_counter()
        if batch is None:
            break
        count += 1
        if count == warmup:
            warm_at = now
        elif count > warmup:
            images += len(batch[1])
            longest = max(longest, now - before)
    if warm_at is None or not images:
        raise RuntimeError(
            f"only {count} batches, fewer than warm-up {warmup} + 1: use more --images"
        )
    return {"images_per_s": images / (now - warm_at), "longest_wait_s": longest, "batches": count}


def fetch_counts(loader) -> dict:
    """This epoch's fetch counters over all workers (the loader's `fetch` stats)."""
    summary = loader.stats.summary()
    if isinstance(summary.get("fetch"), dict):
        return dict(summary["fetch"])
    total: Counter = Counter()
    for worker in loader.stats.workers.values():
        for name, value in worker.get("fetch", {}).items():
            if name in ("budget", "ahead_peak"):
                total[name] = max(total[name], value)
            elif isinstance(value, (int, float)):
                total[name] += value
    return dict(total)


def peak_rss(pid: int) -> int:
    """VmHWM of one process in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# --- rounds and the report -----------------------------------------------------------------


def run_rounds(
    runs: list[dict], rounds: int, workers: int, scratch: Path, cache: bool, server_pid: int
) -> list:
    """Every contender once per round, in an order rotated by one each round."""
    results = []
    for number in range(rounds):
        order = runs[number % len(runs) :] + runs[: number % len(runs)]
        measured = {}
        for run in order:
            cache_dir = (
                scratch / f"round{number}-{run['name'].replace(', ', '-')}" if cache else None
            )
            print(f"round {number + 1}/{rounds}: {run['name']} ...", flush=True)
            measured[run["name"]] = run_contender(
                run, cache_dir, workers, seed=number, server_pid=server_pid
            )
            if cache_dir is not None:
                shutil.rmtree(cache_dir, ignore_errors=True)
        results.append(measured)
    return results


def ratio_cell(rounds: list[dict], name: str, epoch: int) -> str:
    """Median of the per-round ratios to local disk in `epoch`, with their spread."""
    ratios = [
        measured[name]["epochs"][epoch]["images_per_s"]
        / measured["local disk"]["epochs"][epoch]["images_per_s"]
        for measured in rounds
    ]
    return f"{median(ratios):.2f}x ({spread(ratios):.0%})"


def report_row(name: str, rounds: list[dict]) -> list[str]:
    """One contender's medians over the rounds, as table cells."""
    runs = [measured[name] for measured in rounds]
    rate = [epoch_median(runs, epoch, "images_per_s") for epoch in range(EPOCHS)]
    wait = [1000 * epoch_median(runs, epoch, "longest_wait_s") for epoch in range(EPOCHS)]
    return [
        name,
        f"{rate[0]:,.0f}",
        ratio_cell(rounds, name, 0),
        f"{rate[1]:,.0f}",
        ratio_cell(rounds, name, 1),
        mib(fetch_median(runs, 0, "bytes_fetched")),
        mib(fetch_median(runs, 1, "bytes_fetched")),
        f"{fetch_median(runs, 1, 'cache_hits'):.0f}",
        f"{wait[0]:.0f} / {wait[1]:.0f}",
        " / ".join(f"{epoch_median(runs, e, 'server_cpu_s'):.1f}" for e in range(EPOCHS)),
        " / ".join(f"{epoch_median(runs, e, 'loader_cpu_s'):.1f}" for e in range(EPOCHS)),
        mib(median([run["worker_peak_rss"] for run in runs])),
    ]


def epoch_median(runs: list[dict], epoch: int, key: str) -> float:
    return median([run["epochs"][epoch][key] for run in runs])


def fetch_median(runs: list[dict], epoch: int, key: str) -> float:
    return median([run["epochs"][epoch]["fetch"].get(key, 0) for run in runs])


def report(rounds: list[dict], dataset_bytes: int) -> str:
    header = [
        "contender",
        "epoch 1 img/s",
        "vs local (spread)",
        "epoch 2 img/s",
        "vs local (spread)",
        "MiB fetched, epoch 1",
        "MiB fetched, epoch 2",
        "cache hits (shard opens), epoch 2",
        "longest wait ms, e1 / e2",
        "store servers' CPU-s, e1 / e2",
        "loader CPU-s, e1 / e2",
        "peak worker RSS MiB",
    ]
    rows = [report_row(name, rounds) for name in rounds[0]]
    return (
        markdown_table(header, rows)
        + f"\n\nDataset (train tar shards): {mib(dataset_bytes)} MiB, half cache "
        f"{mib(dataset_bytes // 2)} MiB; medians over {len(rounds)} "
        "round(s); ratios are per round against local disk in the same epoch."
    )


def dataset_bytes(shards: Path) -> int:
    manifest = read_manifest(shards)
    return sum(Path(url).stat().st_size for url in manifest.shard_urls("train", "tar", str(shards)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--images", type=int, default=10_000, help="sample images to build")
    parser.add_argument("--shards", type=Path, help="existing 256-px shards instead of a build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="before each first byte")
    parser.add_argument("--mb-per-s", type=float, default=20.0, help="cap per connection")
    parser.add_argument("--executor", default="local", choices=("local", "ray"))
    parser.add_argument(
        "--only", action="append", help="run only this contender (repeat; local disk always)"
    )
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    shards = args.shards or prepare_data(args.workdir, args.images, args.executor)
    scratch = args.workdir / "remote-cache"
    scratch.mkdir(exist_ok=True)
    cache = supports_cache(shards, scratch)
    if not cache:
        print("this loader has no cache_dir: the stores run without a cache", flush=True)
    total = dataset_bytes(shards)
    with SlowStores(shards, args.delay_ms / 1000, args.mb_per_s * 1e6) as stores:
        runs = contenders(shards, stores, total // 2, cache)
        if args.only:
            runs = [r for r in runs if r["name"] == "local disk" or r["name"] in args.only]
        rounds = run_rounds(runs, args.rounds, args.workers, scratch, cache, stores["pid"])
    shutil.rmtree(scratch, ignore_errors=True)
    table = report(rounds, total)
    print(
        f"\n+{args.delay_ms:g} ms first byte, {args.mb_per_s:g} MB/s per connection, "
        f"{args.workers} workers, cache {'on' if cache else 'absent'}\n"
    )
    print(table)
    raw = {
        "machine": describe_machine(PACKAGES),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "cache": cache,
        "dataset_bytes": total,
        "rounds": rounds,
    }
    (args.workdir / "remote_loader.json").write_text(json.dumps(raw, indent=2))


if __name__ == "__main__":
    main()
