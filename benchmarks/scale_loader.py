"""The loader and its manifest at 10^6 to 10^9 samples: time to first batch, memory, planning.

Every dataset here is one real 1,000-sample tar shard, hard-linked under as many shard
names as the sample count needs (10^9 samples: 10^6 links, no extra disk), described by a
manifest written with the real writer. Each size is measured in a fresh child process:

* manifest: time and peak RSS growth to load it (`resolve_source`), in one child;
* loader: time to the first batch and peak RSS of the main process and of each of the
  2 DataLoader workers (sampled from /proc while the first batches arrive), in another
  child that holds nothing but the loader;
* planning: time for one worker's epoch plan (`plan_epoch(...).worker`) and the main process's
  `batches_remaining()`.

    .venv/bin/python benchmarks/scale_loader.py --exponents 6 7 8 9 --json /tmp/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHARD_SAMPLES = 1000
LINKS_PER_FILE = 60_000


def make_base_shard(work: Path) -> Path:
    """One real tar shard of 1,000 small JPEGs, built with the real build."""
    from preprocess.config import BuildConfig
    from preprocess.images import ImageConfig
    from preprocess.job import run_build
    from preprocess.sample import make_sample

    make_sample(work / "images", SHARD_SAMPLES, classes=10, seed=1, workers=2)
    config = BuildConfig(
        input=str(work / "images"),
        output=str(work / "base"),
        image=ImageConfig(image_size=64),
        shard_size=SHARD_SAMPLES,
        val_fraction=0.0,
        formats=("tar",),
        executor="inline",
        progress=False,
    )
    run_build(config)
    return work / "base"


def make_dataset(base: Path, directory: Path, shards: int) -> None:
    """`shards` hard links to the base shard and a manifest describing them all."""
    from shards.manifest import (
        FileInfo,
        Manifest,
        ShardInfo,
        ShardTable,
        SplitInfo,
        read_manifest,
        shard_name,
        write_manifest,
    )

    source = read_manifest(base)
    info = source.splits["train"].shards[0]
    assert info.samples == SHARD_SAMPLES, info
    directory.mkdir(parents=True)
    infos = []
    for index in range(shards):
        name = shard_name("train", index, "tar")
        if index % LINKS_PER_FILE == 0:  # a file takes at most 65,000 links on ext4
            shard_file = directory.parent / f"{directory.name}-copy{index // LINKS_PER_FILE}.tar"
            shutil.copyfile(base / info.files["tar"].name, shard_file)
        os.link(shard_file, directory / name)
        file = FileInfo(name, info.files["tar"].bytes, info.files["tar"].sha256)
        infos.append(ShardInfo(index, info.samples, {"tar": file}, list(info.class_counts)))
    table = ShardTable.from_infos("train", infos)
    counts = table.class_counts.totals(len(source.classes)).tolist()
    split = SplitInfo("train", table.total_samples(), table, counts)
    manifest = Manifest(
        classes=source.classes,
        image_field=source.image_field,
        formats=["tar"],
        splits={"train": split},
        config=source.config,
        inputs=split.samples,
        skipped={},
    )
    # Every size gets a side table, so every size pays pyarrow's Parquet reader start-up
    # (~33 MiB, once per process, the same for 10^3 rows as for 10^6): what is compared is
    # the growth with the shard count, not whether a reader was imported.
    write_manifest(directory, manifest, inline_max_shards=0)


# Peak RSS of this interpreter: VmHWM restarts at exec, unlike ru_maxrss, which a child
# inherits from the parent that built a million-shard manifest just before.
PEAK = r"""
def peak_bytes():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) * 1024
"""

# The manifest alone: load time and peak growth, then one worker's plan and the main
# process's batches_remaining().
MANIFEST_CHILD = (
    PEAK
    + r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import torch  # noqa: F401  (imports are not the manifest's cost)
from pipeline.config import Batching, Crop, Shuffle, Workers
from pipeline.loader import LoaderConfig, build_loader
from pipeline.epoch import plan_epoch
from pipeline.sources import resolve_source
after_imports = peak_bytes()
started = time.perf_counter()
source = resolve_source({directory!r}, "train")
manifest_s = time.perf_counter() - started
manifest_rss = peak_bytes() - after_imports
loader = build_loader(LoaderConfig(source={directory!r}, batch=Batching(size=256),
                                   crop=Crop(image_size=64), workers=Workers(count=2), seed=0))
part = loader.partition()
started = time.perf_counter()
plan = plan_epoch(source.counts, part, 0, 0, 0).worker(1)
plan_s = time.perf_counter() - started
started = time.perf_counter()
loader.batches_remaining()
remaining_s = time.perf_counter() - started
print(json.dumps(dict(samples=int(source.total_samples), shards=len(source.shards),
    manifest_s=manifest_s, manifest_rss=manifest_rss, plan_s=plan_s,
    plan_pieces=len(plan.parts[0].pieces), batches_remaining_s=remaining_s)))
os._exit(0)
"""
)

# The loader alone, in its own interpreter, so nothing else holds a shard table: time to
# the first batch and the peak RSS of the main process and of each worker.
LOADER_CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
from benchmarks.common import TreeMemorySampler
import torch  # noqa: F401
from pipeline.config import Batching, Crop, Shuffle, Workers
from pipeline.loader import LoaderConfig, build_loader
with TreeMemorySampler(os.getpid(), interval=0.05) as sampler:
    started = time.perf_counter()
    loader = build_loader(LoaderConfig(source={directory!r}, batch=Batching(size=256),
                                       crop=Crop(image_size=64), workers=Workers(count=2),
                                       seed=0, shuffle=Shuffle(buffer=2000, initial=500)))
    iterator = iter(loader)
    next(iterator)
    first_batch_s = time.perf_counter() - started
    for _ in range(3):
        next(iterator)
    sampler.sample()
peak = sampler.peak
print(json.dumps(dict(first_batch_s=first_batch_s, main_rss=peak.root_rss,
    worker_rss=peak.largest_child_rss)))
os._exit(0)
"""


def run_child(code: str, directory: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", code.format(root=str(ROOT), directory=str(directory))],
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(directory: Path) -> dict:
    """The manifest and planning figures, then the loader's, each in a fresh interpreter."""
    return {**run_child(MANIFEST_CHILD, directory), **run_child(LOADER_CHILD, directory)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exponents", type=int, nargs="+", default=[6, 7, 8, 9])
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--rounds", type=int, default=1, help="measure every size this many times, interleaved"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        base = make_base_shard(work)
        for exponent in args.exponents:
            make_dataset(base, work / f"e{exponent}", 10**exponent // SHARD_SAMPLES)
        rows = []
        for round_index in range(args.rounds):
            for exponent in args.exponents:
                row = {"round": round_index, **measure(work / f"e{exponent}")}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
