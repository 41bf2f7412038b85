"""build-shards' driver at 10^4 to 10^7 inputs: peak memory and listing/planning time.

Each size is a CSV input list of fake paths (a `--dry-run` lists and plans without
opening an input; nothing makes it read the files), planned by the real CLI in a
fresh child process; its peak RSS (VmHWM) and wall time are recorded. The growth
per input between sizes is the figure the scale issue targets (< 50 bytes).

    .venv/bin/python benchmarks/scale_plan.py --exponents 4 5 6 7 --json /tmp/plan.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLASSES = 1000


def write_list(path: Path, inputs: int) -> None:
    with open(path, "w") as out:
        out.write("path,label\n")
        for index in range(inputs):
            out.write(f"images/c{index % CLASSES:04d}/img_{index:09d}.jpg,c{index % CLASSES:04d}\n")


CHILD = r"""
import sys
from preprocess.cli import main
code = main(sys.argv[1:])
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
print("PEAK", peak)
sys.exit(code)
"""


def plan(listing: Path, output: Path) -> dict:
    command = [sys.executable, "-c", CHILD, "build-shards", "--input", str(listing),
               "--output", str(output), "--shard-size", "1000", "--val-fraction", "0.01",
               "--dry-run"]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-2000:])
    peak = int(result.stdout.rsplit("PEAK", 1)[1].split()[0])
    return {"seconds": seconds, "peak_rss": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--exponents", type=int, nargs="+", default=[4, 5, 6, 7])
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        for exponent in args.exponents:
            listing = Path(tmp) / f"list{exponent}.csv"
            write_list(listing, 10**exponent)
            row = {"inputs": 10**exponent, **plan(listing, Path(tmp) / f"out{exponent}")}
            if rows:
                grown = row["peak_rss"] - rows[0]["peak_rss"]
                row["bytes_per_input"] = grown / (row["inputs"] - rows[0]["inputs"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            listing.unlink()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
