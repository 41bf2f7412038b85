"""Scale run of `preprocess build-shards`: wall time, peak memory of the whole process tree, disk.

Runs the real CLI as a child process (its workers, a local pool or Ray, start under
it, so they are in its tree) and samples RSS/PSS of every process in the tree.
Usage:
    python benchmarks/scale_build.py --input /data/sample500k --output /data/shards500k --formats tar
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    Stopwatch,
    TreeMemorySampler,
    describe_machine,
    directory_bytes,
    free_disk_bytes,
    gib,
    mib,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--formats", default="tar")
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument("--result", default=None, help="write the JSON result here")
    args = parser.parse_args()
    command = [
        sys.executable,
        "-m",
        "preprocess.cli",
        "build-shards",
        "--input",
        args.input,
        "--output",
        args.output,
        "--formats",
        args.formats,
        "--shard-size",
        str(args.shard_size),
        "--no-progress",
    ]
    free_before = free_disk_bytes(Path(args.output).parent)
    clock = Stopwatch()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with TreeMemorySampler(process.pid, interval=1.0) as sampler:
        output, _ = process.communicate()
    seconds = clock.seconds
    manifest = json.loads((Path(args.output) / "manifest.json").read_text())
    result = {
        "machine": describe_machine(["pillow", "ray", "pyarrow"]),
        "command": " ".join(command),
        "returncode": process.returncode,
        "inputs": manifest["inputs"],
        "written": manifest["written"],
        "skipped": manifest["skipped"],
        "seconds": seconds,
        "images_per_s": manifest["inputs"] / seconds,
        "input_bytes": directory_bytes(args.input),
        "output_bytes": directory_bytes(args.output),
        "free_disk_before": free_before,
        "peak_tree_rss": sampler.peak.tree_rss,
        "peak_tree_pss": sampler.peak.tree_pss,
        "peak_driver_rss": sampler.peak.root_rss,
        "peak_largest_child_rss": sampler.peak.largest_child_rss,
        "cli_output_tail": output[-2000:],
    }
    if args.result:
        Path(args.result).write_text(json.dumps(result, indent=1))
    print(output[-1500:])
    print(
        f"{result['inputs']} inputs in {seconds:.0f} s ({result['images_per_s']:.0f} img/s); "
        f"inputs {gib(result['input_bytes'])}, output {gib(result['output_bytes'])}; "
        f"peak tree PSS {mib(result['peak_tree_pss'])}, RSS {mib(result['peak_tree_rss'])}, "
        f"driver {mib(result['peak_driver_rss'])}, largest child {mib(result['peak_largest_child_rss'])}"
    )
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
