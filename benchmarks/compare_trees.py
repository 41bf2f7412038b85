"""Two checkouts of this project side by side: loader and build throughput, paired per round.

A redesign must not cost speed, and "not slower" cannot be read off two runs made at
different times on a host whose speed drifts 15-25% within minutes. Here each round runs
both trees once, in an order that rotates, and the ratio is taken within the round:

- loader: one epoch of `loader_throughput.OurLoader` (the loader's defaults, 2 workers)
  from each tree's own `benchmarks/`, on the same shards, in a fresh process;
- build: `preprocess build-shards` of each tree on the same source images, timed end to end
  (start-up included), into a fresh output; every file both trees write must be
  byte-identical (a file only one writes, a new feature, is listed).

Each tree runs in its own folder under `PYTHONPATH=TREE`, which wins over the editable
install (`-m` and `-c` put the working folder first on `sys.path`, so it must be the tree;
the child asserts where `pipeline` came from). Make the other tree with
`git worktree add /tmp/before REV`.

    python benchmarks/compare_trees.py --before /tmp/before --after . \
        --shards W/shards --source W/source-3k --rounds 7
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import markdown_table, median  # noqa: E402

# Run in the child: one epoch of that tree's OurLoader, printed as one JSON line.
EPOCH = """
import json, sys
from pathlib import Path
tree, shards, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, tree + "/benchmarks")
import loader_throughput, pipeline, preprocess
assert pipeline.__file__.startswith(tree) and preprocess.__file__.startswith(tree), pipeline.__file__
m = loader_throughput.OurLoader("ours", Path(shards), workers=2).run(seed=seed, warmup=3)
print(json.dumps({"img_s": m.images / m.seconds, "img_cpu_s": m.epoch_images / m.cpu_s}))
"""


def run_epoch(tree: Path, shards: Path, seed: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, "-c", EPOCH, str(tree), str(shards), str(seed)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_build(tree: Path, source: Path, output: Path, flags: list[str]) -> float:
    shutil.rmtree(output, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "preprocess.cli", "build-shards", "--input", str(source)]
    started = time.perf_counter()
    subprocess.run(
        [*command, "--output", str(output), *flags],
        env=env,
        cwd=tree,
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def output_digests(output: Path) -> dict[str, str]:
    """sha256 of every file of a build but its scratch folder, by relative path."""
    return {
        str(path.relative_to(output)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(output.rglob("*"))
        if path.is_file() and "_build" not in path.parts
    }


def compare_outputs(before: dict[str, str], after: dict[str, str]) -> tuple[list[str], list[str]]:
    """Files both builds wrote whose bytes differ, and files only one of them wrote.

    A file only one tree writes is a feature (the after tree's `sizes.json` for
    open_clip, say), not a changed output; a shared file with other bytes is.
    """
    changed = sorted(name for name in before.keys() & after.keys() if before[name] != after[name])
    only = sorted(
        f"{name} (only {'before' if name in before else 'after'})"
        for name in before.keys() ^ after.keys()
    )
    return changed, only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--after", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--shards", type=Path, required=True, help="a build for the loader")
    parser.add_argument("--source", type=Path, help="images for the build (omit: no build)")
    parser.add_argument("--build-flags", default="--val-fraction 0.1 --image-size 256")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    ratios: dict[str, list[float]] = {"loader img/s": [], "loader img/CPU-s": [], "build time": []}
    rates: dict[str, list[float]] = {"before": [], "after": []}
    scratch = Path(tempfile.mkdtemp(prefix="compare-trees-"))
    changed: set[str] = set()
    only: set[str] = set()
    for index in range(args.rounds):
        order = list(trees) if index % 2 == 0 else list(reversed(trees))
        if args.source:
            seconds, digests = {}, {}
            for name in order:
                output = scratch / name
                seconds[name] = run_build(
                    trees[name], args.source, output, args.build_flags.split()
                )
                digests[name] = output_digests(output)
            round_changed, round_only = compare_outputs(digests["before"], digests["after"])
            changed.update(round_changed)
            only.update(round_only)
            ratios["build time"].append(seconds["after"] / seconds["before"])
        epochs = {name: run_epoch(trees[name], args.shards, index) for name in order}
        for name in trees:
            rates[name].append(epochs[name]["img_s"])
        ratios["loader img/s"].append(epochs["after"]["img_s"] / epochs["before"]["img_s"])
        ratios["loader img/CPU-s"].append(
            epochs["after"]["img_cpu_s"] / epochs["before"]["img_cpu_s"]
        )
        print(f"round {index}: " + json.dumps({k: v[-1] for k, v in ratios.items() if v}))
    shutil.rmtree(scratch, ignore_errors=True)
    rows = [
        [name, f"{median(values):.3f}", f"{min(values):.3f}-{max(values):.3f}"]
        for name, values in ratios.items()
        if values
    ]
    print(markdown_table(["after / before", "median", "min-max of rounds"], rows))
    print(
        f"loader before {median(rates['before']):,.0f} img/s, after {median(rates['after']):,.0f}"
    )
    if args.source:
        same = "DIFFERENT: " + ", ".join(sorted(changed)) if changed else "byte-identical"
        print(f"build files both trees write: {same}")
        if only:
            print("files one tree alone writes: " + ", ".join(sorted(only)))
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
