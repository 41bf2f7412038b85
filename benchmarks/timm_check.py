"""Check that timm reads a build-shards output through `_info.json`, in timm's own environment.

timm needs torchvision, which pins another torch than ours (`torch==2.14.1
torchvision==0.29.1`, a multi-GB CUDA build), so this script makes a virtual
environment of its own (default `/tmp/shardpipe-timm-venv`, kept for reruns),
builds a small dataset with this checkout (the default `by_format` layout), and runs
`timm.data.create_dataset("wds/...", root=OUT, split=...)` there for `train`,
`val` and `validation`, iterating each split whole, then `create_loader(...,
num_workers=2)` over `train` (3 shards) as a training script would. It prints one JSON
line per run and exits 1 when one is missing samples or fails.

    .venv/bin/python benchmarks/timm_check.py [--venv DIR] [--keep OUT]

Not part of the test suite (minutes, gigabytes): `tests/test_clients.py` runs it
only when `SHARDPIPE_TIMM_CHECK=1`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PACKAGES = ["torch==2.14.1", "torchvision==0.29.1", "timm", "webdataset"]

# Runs inside timm's environment: nothing of ours is imported there.
CHILD = """
import json, sys
from timm.data import create_dataset
root = sys.argv[1]
for split in ("train", "val", "validation"):
    try:
        dataset = create_dataset("wds/shardpipe", root=root, split=split, is_training=False,
                                 batch_size=1)
        seen = 0
        labels = set()
        for image, target in dataset:
            seen += 1
            labels.add(int(target))
            image.size  # a decoded PIL image
        print(json.dumps({"split": split, "samples": seen, "expected": len(dataset),
                          "labels": sorted(labels)}))
    except Exception as error:  # report every split, then fail in the parent
        print(json.dumps({"split": split, "error": f"{type(error).__name__}: {error}"}))
# As a training script runs it: timm's create_loader with 2 workers, each given whole
# shards (a split with fewer shards than workers would wait forever on the idle one).
from timm.data import create_loader
dataset = create_dataset("wds/shardpipe", root=root, split="train", is_training=False,
                         batch_size=8)
loader = create_loader(dataset, input_size=(3, 64, 64), batch_size=8, is_training=False,
                       num_workers=2, use_prefetcher=False)
seen = sum(len(target) for _, target in loader)
print(json.dumps({"split": "train (create_loader, 2 workers)", "samples": seen,
                  "expected": len(dataset), "labels": []}))
"""


def make_env(directory: Path) -> Path:
    """The environment's python, with timm installed (once)."""
    python = directory / "bin" / "python"
    if not python.exists():
        venv.create(directory, with_pip=True)
    probe = subprocess.run([str(python), "-c", "import timm, torchvision"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
    return python


def build_sample(output: Path) -> None:
    from preprocess.config import BuildConfig
    from preprocess.images import ImageConfig
    from preprocess.job import run_build
    from preprocess.sample import make_sample

    make_sample(output.parent / "images", 96, classes=4, seed=1, workers=1)
    config = BuildConfig(
        input=str(output.parent / "images"),
        output=str(output),
        image=ImageConfig(image_size=64),
        shard_size=24,
        val_fraction=0.25,
        executor="inline",
        progress=False,
    )
    run_build(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default="/tmp/shardpipe-timm-venv", help="timm's environment")
    parser.add_argument("--keep", help="build into this directory and keep it")
    args = parser.parse_args(argv)
    python = make_env(Path(args.venv))
    with tempfile.TemporaryDirectory(prefix="timm-check-") as scratch:
        output = Path(args.keep) if args.keep else Path(scratch) / "out"
        build_sample(output)
        run = subprocess.run(
            [str(python), "-c", CHILD, str(output)], capture_output=True, text=True, check=False
        )
    versions = subprocess.run(
        [str(python), "-c", "import timm, torch; print(timm.__version__, torch.__version__)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    print(f"timm, torch: {versions}")
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    for result in results:
        print(json.dumps(result))
    if run.returncode != 0 or len(results) != 4:
        print(run.stderr[-4000:], file=sys.stderr)
        return 1
    ok = all("error" not in r and r["samples"] == r["expected"] > 0 for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
