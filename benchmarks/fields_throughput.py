"""Loader throughput with extra fields (a caption and the JSON document) against image + class.

Both read the same shards in one run, interleaved round by round, so the ratio is what the
extra fields cost, not the machine's mood. The shards come from a real build of the sample
dataset whose input list carries a caption per image (`--fields text:txt`), so every sample
holds `jpg`, `cls`, `json` and `txt`.

    .venv/bin/python benchmarks/fields_throughput.py --workdir /tmp/fieldsbench --images 4000

Also times build-shards itself with and without the extra column (inline executor, same
inputs), for the build's side of the cost.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import describe_machine, markdown_table, median  # noqa: E402
from pipeline.config import Batching, Crop, Workers  # noqa: E402

PLAIN = ("image", "label")
EXTRA = ("image", "label", "txt", "json")


def caption(index: int) -> str:
    return f"a photo-like sample image number {index}, drawn for the fields benchmark"


def make_inputs(work: Path, images: int) -> Path:
    """The sample dataset and a JSONL list of (path, label, text) over it."""
    from preprocess.sample import make_sample

    source = work / "source"
    if not source.exists():
        make_sample(source, images, classes=10, seed=3, workers=2)
    listing = work / "pairs.jsonl"
    paths = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix != ".json")
    with listing.open("w") as out:
        for index, path in enumerate(paths):
            row = {"path": str(path.relative_to(work)), "label": path.parent.name}
            out.write(json.dumps({**row, "text": caption(index)}) + "\n")
    return listing


def build(listing: Path, output: Path, with_fields: bool) -> float:
    """One inline build of the list (tar only, 256 px); its wall time."""
    from preprocess.config import BuildConfig
    from preprocess.images import ImageConfig
    from preprocess.job import run_build

    config = BuildConfig(
        input=str(listing),
        output=str(output),
        image=ImageConfig(image_size=256),
        formats=("tar",),
        val_fraction=0.0,
        executor="inline",
        progress=False,
        overwrite=True,
        **({"fields": ("text:txt",)} if with_fields else {}),
    )
    started = time.perf_counter()
    run_build(config)
    return time.perf_counter() - started


def loader_rate(shards: Path, fields: tuple[str, ...], workers: int, warmup: int) -> float:
    """Images per second over one epoch, after `warmup` batches."""
    from pipeline.loader import LoaderConfig, build_loader

    loader = build_loader(
        LoaderConfig(
            source=str(shards),
            batch=Batching(size=256),
            crop=Crop(image_size=224),
            workers=Workers(count=workers),
            fields=fields,
            seed=0,
        )
    )
    count, started = 0, None
    for index, batch in enumerate(loader):
        if index == warmup:
            count, started = 0, time.perf_counter()
        count += batch[0].shape[0]
    return count / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--images", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    listing = make_inputs(args.workdir, args.images)
    shards = args.workdir / "shards"
    rows = {"build, image + class": [], "build, + caption column": []}
    build(listing, args.workdir / "plain", False)  # warm-up: imports, page cache
    for _ in range(args.rounds):
        rows["build, image + class"].append(
            args.images / build(listing, args.workdir / "plain", False)
        )
        rows["build, + caption column"].append(args.images / build(listing, shards, True))
    rates = {PLAIN: [], EXTRA: []}
    for _ in range(args.rounds):
        for fields in (PLAIN, EXTRA):
            rates[fields].append(loader_rate(shards, fields, args.workers, args.warmup))
    ratios = [extra / plain for plain, extra in zip(rates[PLAIN], rates[EXTRA], strict=True)]
    builds = [
        extra / plain
        for plain, extra in zip(
            rows["build, image + class"], rows["build, + caption column"], strict=True
        )
    ]
    table = [
        ["loader, image + label", f"{median(rates[PLAIN]):,.0f}", ""],
        ["loader, + txt + json", f"{median(rates[EXTRA]):,.0f}", f"{median(ratios):.3f}"],
        ["build, image + class", f"{median(rows['build, image + class']):,.0f}", ""],
        [
            "build, + caption column",
            f"{median(rows['build, + caption column']):,.0f}",
            f"{median(builds):.3f}",
        ],
    ]
    print(markdown_table(["what", "img/s (median)", "ratio (median of rounds)"], table))
    result = {
        "machine": describe_machine(("torch", "simplejpeg", "opencv-python-headless")),
        "loader": {"plain": rates[PLAIN], "extra": rates[EXTRA], "ratios": ratios},
        "build": {**rows, "ratios": builds},
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
