"""A two-source mix against one source: loader throughput, per-source counts, per-batch shares.

    python benchmarks/mixing.py --images 10000 --workdir DIR [--rounds 5] [--workers 2]

Builds DIR/source and DIR/shards (256 px, as `loader_throughput.py` does) once. The one
source is the train split's shards; the mix is the same shards as two datasets (the
first 70% of the shard files as `big`, the rest as `small`, each `repeat=1`), so both
read and decode the same samples an epoch and differ only by the mix. Each round runs
both for one epoch, in an order that rotates each round, random-resized-crop 224 into
uint8 batches of 256 with `--workers` workers. Prints the medians, the paired ratio
mix / single, and for the mix: each source's samples against its quota (exact) and the
spread of `small`'s count per batch (floor or ceil of its share). Raw results go to
DIR/mixing.json.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections import Counter
from pathlib import Path

from common import describe_machine
from loader_baselines import time_epoch
from loader_throughput import prepare_data, tar_urls

from pipeline import Batching, Crop, LoaderConfig, Source, Workers, build_loader

BATCH_SIZE = 256
SPLIT = 0.7  # share of the shard files that make the `big` source


def loader_config(source, workers: int, seed: int) -> LoaderConfig:
    """The same loader settings for both contenders; only `source` differs."""
    return LoaderConfig(
        source=source,
        batch=Batching(size=BATCH_SIZE),
        crop=Crop(image_size=224),
        workers=Workers(count=workers, pin_memory=False),
        seed=seed,
        with_keys=True,
    )


def mix_sources(shards: Path) -> list[Source]:
    urls = tar_urls(shards)
    cut = max(1, round(len(urls) * SPLIT))
    return [Source(urls[:cut], repeat=1, name="big"), Source(urls[cut:], repeat=1, name="small")]


class KeyCounter:
    """Wraps an epoch's batches: counts each batch's samples per source as it passes."""

    def __init__(self, loader) -> None:
        self.loader, self.per_batch = loader, []

    def __iter__(self):
        for batch in self.loader:
            self.per_batch.append(Counter(key.split("/", 1)[0] for key in batch[-1]))
            yield batch


def run_one(name: str, source, args: argparse.Namespace, seed: int) -> dict:
    loader = build_loader(loader_config(source, args.workers, seed))
    counted = KeyCounter(loader)
    measured = time_epoch(counted, name, args.warmup, time.perf_counter())
    row = {"name": name, "images_per_s": measured.images_per_s, "batches": measured.batches}
    if name == "mix":
        quotas = dict(zip(loader.source.names, loader.source.quotas, strict=True))
        delivered = sum(counted.per_batch, Counter())
        share = quotas["small"] / sum(quotas.values()) * BATCH_SIZE
        smalls = [batch["small"] for batch in counted.per_batch]
        # drop_last leaves out each epoch's last partial batch: the quota less those
        row.update(
            quotas=quotas,
            delivered=dict(delivered),
            dropped=sum(quotas.values()) - sum(delivered.values()),
            small_per_batch=[min(smalls), max(smalls)],
            small_share=[math.floor(share), math.ceil(share)],
        )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--executor", default="pool", choices=("pool", "ray", "inline"))
    args = parser.parse_args(argv)
    shards = prepare_data(args.workdir, args.images, args.executor)
    contenders = [("single", str(shards)), ("mix", mix_sources(shards))]
    rows = []
    for round_index in range(args.rounds):
        order = contenders[round_index % 2 :] + contenders[: round_index % 2]
        for name, source in order:
            row = run_one(name, source, args, seed=round_index)
            row["round"] = round_index
            rows.append(row)
            print(json.dumps(row), flush=True)
    rates = {n: [r["images_per_s"] for r in rows if r["name"] == n] for n, _ in contenders}
    by_round = {(r["round"], r["name"]): r["images_per_s"] for r in rows}
    ratios = [by_round[(i, "mix")] / by_round[(i, "single")] for i in range(args.rounds)]
    summary = {
        "machine": describe_machine(("torch",)),
        "rounds": rows,
        "median_images_per_s": {n: statistics.median(v) for n, v in rates.items()},
        "mix_over_single_median": statistics.median(ratios),
        "mix_over_single_range": [min(ratios), max(ratios)],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}, indent=2))
    (args.workdir / "mixing.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
