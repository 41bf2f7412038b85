"""What `LoaderConfig(verify_checksums=True)` costs per image, local and over HTTP.

Builds a sample dataset once, then reads full epochs with checksums off and on,
interleaved round by round so both see the same machine, and reports the median
epoch time of each, the ratio and the cost per image. Run it on an idle machine:

    .venv/bin/python benchmarks/checksum_cost.py --images 4000 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import describe_machine, markdown_table, median  # noqa: E402
from pipeline.loader import LoaderConfig, build_loader  # noqa: E402
from preprocess.config import BuildConfig  # noqa: E402
from preprocess.images import ImageConfig  # noqa: E402
from preprocess.job import run_build  # noqa: E402
from preprocess.sample import make_sample  # noqa: E402
from tests.httpserver import LocalHTTPServer  # noqa: E402


def build_dataset(root: Path, images: int) -> Path:
    make_sample(root / "images", images, classes=10, seed=1, workers=2)
    config = BuildConfig(
        input=str(root / "images"),
        output=str(root / "shards"),
        image=ImageConfig(image_size=256),
        shard_size=500,
        val_fraction=0.0,
        formats=("tar",),
        executor="inline",
        progress=False,
    )
    run_build(config)
    return root / "shards"


def epoch_seconds(source: str, verify: bool, workers: int) -> tuple[float, int]:
    loader = build_loader(
        LoaderConfig(
            source=source,
            batch_size=128,
            image_size=160,
            num_workers=workers,
            verify_checksums=verify,
            epoch_rule="uneven",
            drop_last=False,
        )
    )
    started = time.perf_counter()
    samples = sum(len(labels) for _, labels in loader)
    return time.perf_counter() - started, samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        shards = build_dataset(Path(tmp), args.images)
        times: dict[tuple[str, bool], list[float]] = {}
        with LocalHTTPServer(shards) as base:
            sources = {"local": str(shards), "http": f"{base}/manifest.json"}
            for _ in range(args.rounds):
                for where, source in sources.items():
                    for verify in (False, True):
                        seconds, samples = epoch_seconds(source, verify, args.workers)
                        times.setdefault((where, verify), []).append(seconds)
    rows, results = [], {}
    for where in ("local", "http"):
        off, on = median(times[(where, False)]), median(times[(where, True)])
        per_image_us = (on - off) / samples * 1e6
        results[where] = {"off_s": off, "on_s": on, "ratio": on / off, "us_per_image": per_image_us}
        rows.append(
            [
                where,
                f"{samples / off:.0f}",
                f"{samples / on:.0f}",
                f"{on / off:.3f}",
                f"{per_image_us:.1f}",
            ]
        )
    print(json.dumps(describe_machine(["torch", "pillow"]), indent=1))
    print(
        markdown_table(
            ["shards", "img/s, off", "img/s, verify_checksums", "time ratio", "cost, us/image"],
            rows,
        )
    )
    if args.json:
        args.json.write_text(
            json.dumps({"results": results, "rounds": args.rounds, "images": samples}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
