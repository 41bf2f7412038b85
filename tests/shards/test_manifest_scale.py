"""Manifests of many shards load in bounded time and memory: a 200k-shard version-2
manifest written by `write_manifest` loads in a subprocess under a memory cap.

Run as a script to measure loading 10^4, 10^5 and 10^6 shards (each in a fresh
process: time, and peak RSS above the process after its imports):

    .venv/bin/python -m tests.shards.test_manifest_scale [--shards 10000 100000 1000000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from shards.manifest import (
    MANIFEST_NAME,
    ClassCounts,
    FileColumns,
    Manifest,
    ShardTable,
    SplitInfo,
    write_manifest,
)

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
CLASSES = 16
CLASSES_PER_SHARD = 4
FORMATS = ("tar", "parquet")
# The child's peak RSS above its imports for 200k shards: the full read holds ~20 MB of
# columns and ~45 MB of class counts, the loader's read ~10 MB. One ShardInfo per shard,
# as before, took ~300 MiB here.
RSS_CAP_MIB = 160


def synthetic_table(split: str, shards: int, seed: int) -> ShardTable:
    """A split of `shards` shards, as a build of that size would assemble (no files)."""
    rng = np.random.default_rng(seed)
    samples = rng.integers(900, 1001, shards, dtype=np.int64)
    files = {
        fmt: FileColumns(
            samples * per_sample + rng.integers(0, 512, shards),
            rng.integers(0, 256, (shards, 32), dtype=np.uint8),
        )
        for fmt, per_sample in zip(FORMATS, (1536, 1200), strict=True)
    }
    # Each shard holds CLASSES_PER_SHARD classes: the first takes what the others leave.
    classes = np.sort(
        np.argsort(rng.random((shards, CLASSES)), axis=1)[:, :CLASSES_PER_SHARD], axis=1
    ).astype(np.int32)
    counts = np.full((shards, CLASSES_PER_SHARD), 1, np.int64)
    counts[:, 1:] = rng.integers(1, 200, (shards, CLASSES_PER_SHARD - 1))
    counts[:, 0] = samples - counts[:, 1:].sum(axis=1)
    indptr = np.arange(shards + 1, dtype=np.int64) * CLASSES_PER_SHARD
    class_counts = ClassCounts(
        np.ones(shards, bool), indptr, classes.reshape(-1), counts.reshape(-1)
    )
    return ShardTable(split, shards, FORMATS, samples, files, class_counts, CLASSES)


def synthetic_manifest(shards: int) -> Manifest:
    """`shards` train shards and a 1% val split, with class counts."""
    splits = {}
    for name, count, seed in (("train", shards, 1), ("val", max(1, shards // 100), 2)):
        table = synthetic_table(name, count, seed)
        totals = table.class_counts.totals(CLASSES).tolist()
        splits[name] = SplitInfo(name, table.total_samples(), table, totals)
    written = sum(split.samples for split in splits.values())
    classes = [f"class_{i:03d}" for i in range(CLASSES)]
    config = {"seed": 0, "shard_size": 1000}
    return Manifest(classes, "jpg", list(FORMATS), splits, config, written, {})


# --- the child: load, check, measure --------------------------------------------------------

# Peak RSS is read from VmHWM: `ru_maxrss` survives execve on Linux, so a child of a
# large parent would start at the parent's peak. Both are in KiB.
CHILD = """
import json, pickle, resource, sys, time
import numpy as np
from pipeline.sources import resolve_source
from shards.manifest import read_manifest

def peak_kib():
    try:
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

directory, mode = sys.argv[1], sys.argv[2]
base = peak_kib()
started = time.perf_counter()
if mode == "loader":
    source = resolve_source(directory, "train")
    loaded = time.perf_counter() - started
    spec = source.shards[len(source.shards) // 2]
    result = {
        "shards": len(source.shards),
        "samples": source.total_samples,
        "counts_dtype": str(source.counts.dtype),
        "counts_sum": int(source.counts.sum()),
        "middle": [spec.url.rsplit("/", 1)[1], spec.samples, spec.sha256, spec.bytes],
        "pickled": len(pickle.dumps(source.shards)),
    }
else:
    manifest = read_manifest(directory)
    loaded = time.perf_counter() - started
    table = manifest.splits["train"].shards
    info = table[len(table) // 2]
    result = {
        "shards": len(table),
        "samples": manifest.splits["train"].samples,
        "written": manifest.written,
        "middle": [info.files["tar"].name, info.samples, info.files["tar"].sha256,
                   info.files["tar"].bytes, info.class_counts],
    }
result["seconds"] = loaded
result["rss_mib"] = (peak_kib() - base) / 1024
print(json.dumps(result))
"""


def load_in_child(directory: Path, mode: str) -> dict:
    """Load the manifest in a fresh interpreter; its result (and peak RSS) as a dict."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(directory), mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A 200k-shard version-2 manifest written by the real writer."""
    directory = tmp_path_factory.mktemp("scale")
    manifest = synthetic_manifest(200_000)
    write_manifest(directory, manifest)
    return directory, manifest


def test_a_200k_shard_manifest_goes_to_a_side_table(big):
    directory, _ = big
    document = json.loads((directory / MANIFEST_NAME).read_text())
    train = document["splits"]["train"]
    assert document["version"] == 2 and "shards" not in train
    assert train["table"]["name"] == "_shards-train.parquet" and train["table"]["rows"] == 200_000
    # The 2,000 val shards stay inline (at most INLINE_MAX_SHARDS): ~600 bytes a shard.
    assert len(document["splits"]["val"]["shards"]) == 2_000
    assert (directory / MANIFEST_NAME).stat().st_size < 2_000 * 700


@pytest.mark.parametrize("mode", ["loader", "full"])
def test_a_200k_shard_manifest_loads_under_a_memory_cap_with_the_right_counts(big, mode):
    directory, manifest = big
    table = manifest.splits["train"].shards
    middle = len(table) // 2
    expected = manifest.splits["train"].samples
    result = load_in_child(directory, mode)
    assert result["shards"] == 200_000 and result["samples"] == expected
    name, samples, sha256, size = result["middle"][:4]
    assert name == f"train-{middle:06d}.tar" and samples == int(table.samples[middle])
    assert size == int(table.files["tar"].sizes[middle])
    if mode == "loader":
        assert sha256 is None  # the loader leaves the digests unread unless it verifies
        assert result["counts_dtype"] == "int64" and result["counts_sum"] == expected
        assert result["pickled"] < 20 * 200_000  # arrays (8 + 8 bytes a shard), not objects
    else:
        assert sha256 == table.files["tar"].sha256(middle)
        assert result["written"] == manifest.written
        assert result["middle"][4] == table.class_counts.row(middle, CLASSES)
    assert result["rss_mib"] < RSS_CAP_MIB, result


# --- script mode: the measurements ---------------------------------------------------------


def measure(shards: int, workdir: Path) -> list[dict]:
    directory = workdir / f"shards-{shards}"
    directory.mkdir(parents=True, exist_ok=True)
    write_manifest(directory, synthetic_manifest(shards))
    side = sum(p.stat().st_size for p in directory.glob("_shards-*.parquet"))
    rows = []
    for mode in ("loader", "full"):
        result = load_in_child(directory, mode)
        rows.append({"shards": shards, "mode": mode, "side_mib": side / 2**20, **result})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    import tempfile

    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        print("shards     read     seconds  peak RSS MiB  side tables MiB")
        for shards in args.shards:
            for row in measure(shards, Path(workdir)):
                print(
                    f"{row['shards']:>9,}  {row['mode']:<7} {row['seconds']:8.2f}  "
                    f"{row['rss_mib']:12.1f}  {row['side_mib']:15.1f}"
                )


if __name__ == "__main__":
    main()
