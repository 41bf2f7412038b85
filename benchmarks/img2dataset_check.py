"""Check that the loader and `preprocess verify`, `info`, `index` read real img2dataset output.

img2dataset (1.47.0; it needs no torch) goes into an environment of its own (default
`/tmp/i2d-venv`, kept for reruns). This script writes `--count` images with our sample
generator, serves them from a local `http.server`, writes a `url,caption` CSV that also
holds three URLs that fail (a 404, a refused connection, an HTML page that is no
image), and runs img2dataset on it twice, `--output_format webdataset` and
`--output_format parquet` (16 samples a shard). Then, with this checkout:

* webdataset output (`00000.tar` + a status `00000.parquet` + `00000_stats.json` per
  shard): the folder alone is read as its tars (the status Parquet is no shard);
  `format="tar"`, fields `image`, `txt` and `Field("meta", "json", source="json")`
  read every success once; `preprocess verify`, `info`, `index` with `--format tar`;
  after `index`, 2 ranks get equal batches and together every sample once.
* parquet output: `format="parquet"`, fields `image` and
  `Field("txt", "text", source="caption")`; the failed downloads are rows with a null
  `jpg`: counted skips, not errors. `preprocess verify`, `info`, `index` on the folder.

It prints a markdown table (source, what was run, result, glue needed) and exits 0, or
prints one line starting `img2dataset_check: FAILED` and exits 1.

    .venv/bin/python benchmarks/img2dataset_check.py [--venv DIR] [--keep DIR] [--count N]

Not part of the test suite (installs a package, about a minute): `tests/test_clients.py`
runs it only when `SHARDPIPE_IMG2DATASET_CHECK=1`.
"""

from __future__ import annotations

import argparse
import csv
import functools
import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import venv
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VERSION = "1.47.0"
SHARD_SAMPLES = 16
BATCH_SIZE = 6
# What img2dataset is asked to do: small images, one process, no retries, no wandb.
OPTIONS = [
    "--input_format", "csv", "--url_col", "url", "--caption_col", "caption",
    "--image_size", "64", "--resize_mode", "keep_ratio",
    "--processes_count", "1", "--thread_count", "4",
    "--number_sample_per_shard", str(SHARD_SAMPLES),
    "--timeout", "5", "--retries", "0", "--enable_wandb", "False",
]  # fmt: skip


class CheckFailed(Exception):
    """One check did not hold; the message is the one line printed."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def make_env(directory: Path) -> Path:
    """The environment's python with img2dataset installed, and without torch."""
    python = directory / "bin" / "python"
    if not python.exists():
        venv.create(directory, with_pip=True)
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"img2dataset=={VERSION}"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    has_torch = subprocess.run(
        [str(python), "-m", "pip", "show", "-q", "torch"], capture_output=True, check=False
    )
    expect(has_torch.returncode != 0, f"img2dataset {VERSION} pulled in torch; pin it")
    return python


def closed_port() -> int:
    """A local port nothing listens on: a refused connection for img2dataset."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def serve(folder: Path) -> http.server.ThreadingHTTPServer:
    """`python -m http.server` on `folder`, in a thread, on a free local port."""
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def write_url_list(images: Path, base: str, listing: Path) -> int:
    """`url,caption` rows for every image and three that fail; returns the good count."""
    files = sorted(p for p in images.rglob("*") if p.is_file())
    rows = [
        (f"{base}/{p.relative_to(images).as_posix()}", f"a photo of {p.parent.name}") for p in files
    ]
    rows += [
        (f"{base}/no-such-image.jpg", "a 404"),
        (f"http://127.0.0.1:{closed_port()}/refused.jpg", "a refused connection"),
        (f"{base}/", "a directory listing, not an image"),
    ]
    with listing.open("w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["url", "caption"])
        writer.writerows(rows)
    return len(files)


def run_img2dataset(python: Path, listing: Path, output: Path, output_format: str) -> dict:
    """Run img2dataset; the sum of its `*_stats.json` counts (count, successes, ...)."""
    command = [
        str(python.parent / "img2dataset"), "--url_list", str(listing),
        "--output_folder", str(output), "--output_format", output_format, *OPTIONS,
    ]  # fmt: skip
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
    run = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    tail = (run.stdout + run.stderr).strip().splitlines()[-1:] or ["no output"]
    expect(run.returncode == 0, f"img2dataset {output_format} exited {run.returncode}: {tail[0]}")
    totals: Counter = Counter()
    for stats in sorted(output.glob("*_stats.json")):
        data = json.loads(stats.read_text())
        totals.update({k: data[k] for k in ("count", "successes", "failed_to_download")})
        totals.update({"failed_to_resize": data.get("failed_to_resize", 0), "shards": 1})
    expect(totals["shards"] > 0, f"img2dataset {output_format} wrote no *_stats.json in {output}")
    return dict(totals)


def preprocess(*args: str) -> tuple[int, str]:
    """One `preprocess` command as a user runs it: its exit code and its output."""
    command = [
        sys.executable,
        "-c",
        "import sys; from preprocess.cli import main; sys.exit(main())",
    ]
    run = subprocess.run([*command, *args], capture_output=True, text=True, check=False)
    return run.returncode, (run.stdout + run.stderr).strip()


def cli_ok(*args: str) -> str:
    """The output of a `preprocess` command that must succeed, as one line."""
    code, output = preprocess(*args)
    line = " / ".join(output.splitlines())
    expect(code == 0, f"`preprocess {' '.join(args)}` exited {code}: {line[:400]}")
    return line


def read_epoch(**options) -> tuple[list[list[str]], list, object]:
    """One epoch of a loader: keys per batch, every other field's values, the loader."""
    from pipeline.config import Batching, Crop, LoaderConfig, Workers
    from pipeline.loader import build_loader

    settings = dict(
        batch=Batching(size=BATCH_SIZE),
        crop=Crop(image_size=32),
        workers=Workers(count=0),
        with_keys=True,
    )
    loader = build_loader(LoaderConfig(**{**settings, **options}))
    batches, values = [], []
    for *fields, keys in loader:
        batches.append(list(keys))
        values.append(fields)
    return batches, values, loader


def check_webdataset(folder: Path, stats: dict) -> list[tuple[str, str, str, str]]:
    """The loader and the commands on img2dataset's webdataset output; the table's rows."""
    from shards.errors import UsageError
    from shards.sample import Field

    rows = []
    successes = stats["successes"]
    layout = f"{stats['shards']} x (`NNNNN.tar`, status `NNNNN.parquet`, `NNNNN_stats.json`)"
    try:
        plain, _, _ = read_epoch(source=str(folder), fields=("image", "txt"))
    except UsageError as error:
        plain = []
        expect(False, f"the loader refused the folder {folder} without a format: {error}")
    plain_keys = sum(len(batch) for batch in plain)
    expect(plain_keys == successes, f"folder alone: read {plain_keys}, not {successes}")
    fields = ("image", "txt", Field("meta", "json", source="json"))
    batches, values, loader = read_epoch(
        source=str(folder), format="tar", fields=fields, train=False
    )
    keys = Counter(k for batch in batches for k in batch)
    expect(sum(keys.values()) == successes, f"tar: read {sum(keys.values())}, not {successes}")
    expect(max(keys.values()) == 1, "tar: a sample was read twice in one epoch")
    pairs = [(t, m) for _, txts, metas in values for t, m in zip(txts, metas, strict=True)]
    expect(all(m["caption"] == t and m["status"] == "success" for t, m in pairs),
           "tar: a sample's json does not match its txt")  # fmt: skip
    rows.append((
        f"img2dataset {VERSION} `--output_format webdataset`: {layout}",
        "loader on the folder, no format",
        f"its tars, {plain_keys}/{successes} successes: the status Parquet files are no shards",
        "none",
    ))  # fmt: skip
    rows.append((
        f"img2dataset {VERSION} webdataset",
        "loader, `format=\"tar\"`, fields `image`, `txt`, `Field(\"meta\", \"json\", source=\"json\")`, 1 epoch",
        f"{successes}/{successes} successes once, each `meta` the sample's img2dataset record "
        f"({stats['count'] - successes} failures of {stats['count']} URLs not in the tars)",
        "`format=\"tar\"`",
    ))  # fmt: skip
    verify = cli_ok("verify", str(folder), "--format", "tar")
    expect(f"{successes} samples" in verify, f"verify counted otherwise: {verify}")
    info = cli_ok("info", str(folder), "--format", "tar")
    index = cli_ok("index", str(folder), "--format", "tar")
    expect((folder / "manifest.json").exists(), f"index wrote no {folder}/manifest.json")
    after = cli_ok("verify", str(folder))
    rows.append((
        f"img2dataset {VERSION} webdataset",
        "`preprocess verify DIR --format tar`, `info DIR --format tar`, `index DIR --format tar`, then `verify DIR`",
        f"verify: `{gist(verify)}`; info: `{gist(info)}`; index: `{gist(index)}`; "
        f"then verify: `{gist(after)}`",
        "`--format tar`",
    ))  # fmt: skip
    per_rank = []
    for rank in range(2):
        batches, _, _ = read_epoch(source=str(folder), fields=("image", "txt"), rank=rank,
                                   world_size=2, train=True)  # fmt: skip
        per_rank.append(batches)
    sizes = [[len(b) for b in batches] for batches in per_rank]
    expect(sizes[0] == sizes[1], f"after index, ranks got unequal batches: {sizes}")
    union = Counter(k for batches in per_rank for batch in batches for k in batch)
    expect(union == keys, f"after index, 2 ranks read {sum(union.values())} samples, "
           f"{len(union)} distinct, not each of the {successes} once")  # fmt: skip
    rows.append((
        f"img2dataset {VERSION} webdataset, indexed",
        f"loader on the folder (manifest now), 2 ranks, `train=True`, batch {BATCH_SIZE}",
        f"{len(sizes[0])} equal batches per rank ({sum(sizes[0])} samples each); "
        f"together every one of the {successes} once",
        "none",
    ))  # fmt: skip
    return rows


def check_parquet(folder: Path, stats: dict) -> list[tuple[str, str, str, str]]:
    """The loader and the commands on img2dataset's Parquet output; the table's rows."""
    from shards.sample import Field

    successes, failures = stats["successes"], stats["count"] - stats["successes"]
    fields = ("image", Field("txt", "text", source="caption"))
    batches, values, loader = read_epoch(
        source=str(folder), format="parquet", fields=fields, train=False
    )
    keys = Counter(k for batch in batches for k in batch)
    expect(sum(keys.values()) == successes, f"parquet: read {sum(keys.values())}, not {successes}")
    expect(max(keys.values()) == 1, "parquet: a sample was read twice in one epoch")
    captions = [t for _, txts in values for t in txts]
    expect(all(t.startswith("a photo of ") for t in captions), "parquet: a caption is wrong")
    skipped = loader.stats.skipped
    expect(dict(skipped) == {"null_cell": failures},
           f"parquet: skips {dict(skipped)}, not null_cell: {failures}")  # fmt: skip
    rows = [(
        f"img2dataset {VERSION} `--output_format parquet`: {stats['shards']} x (`NNNNN.parquet` "
        "with `caption`, `url`, `key`, status columns and `jpg`, `NNNNN_stats.json`)",
        "loader, `format=\"parquet\"`, fields `image`, `Field(\"txt\", \"text\", source=\"caption\")`, 1 epoch",
        f"{successes}/{successes} successes once with their captions; the {failures} failed "
        f"rows (null `jpg`) counted skips `null_cell: {failures}`",
        "`Field(\"txt\", \"text\", source=\"caption\")`",
    )]  # fmt: skip
    results = []
    for command in (("verify", str(folder)), ("info", str(folder)), ("index", str(folder))):
        code, output = preprocess(*command)
        results.append((command[0], code, " / ".join(output.splitlines())))
    for name, code, text in results:
        # verify counts a sample the loader skips as a decode failure and exits 1: here
        # exactly the failed downloads, by their reason, and nothing else.
        judged = (
            name == "verify" and f"would be skipped by the loader (null_cell: {failures})" in text
        )
        expect(code == 0 or judged, f"`preprocess {name} {folder}` exited {code}: {text[:300]}")
    rows.append((
        f"img2dataset {VERSION} parquet",
        "`preprocess verify DIR`, `info DIR`, `index DIR`",
        "; ".join(f"{name}: exit {code}, `{gist(text)}`" for name, code, text in results),
        "none",
    ))  # fmt: skip
    return rows


def gist(output: str) -> str:
    """A command's output cut for a table cell: no examples, no closing advice."""
    lines = output.split(" / ")
    output = next((line for line in lines if line.startswith("samples: ")), lines[0])
    for cut in ("; e.g.", "; run `preprocess index", "; wrote"):
        output = output.split(cut)[0]
    for prefix in ("preprocess verify: ", "verify: ", "index: "):
        output = output.removeprefix(prefix)
    return output[:200]


def table(rows: list[tuple[str, str, str, str]]) -> str:
    lines = ["| source | what was run | result | glue needed |", "| --- | --- | --- | --- |"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default="/tmp/i2d-venv", help="img2dataset's environment")
    parser.add_argument("--keep", help="work in this directory (empty or absent) and keep it")
    parser.add_argument("--count", type=int, default=60, help="images to serve")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from preprocess.sample import make_sample

    try:
        python = make_env(Path(args.venv))
        with tempfile.TemporaryDirectory(prefix="img2dataset-check-") as scratch:
            work = Path(args.keep) if args.keep else Path(scratch)
            work.mkdir(parents=True, exist_ok=True)
            images = work / "images"
            make_sample(images, args.count, classes=4, seed=3, workers=1)
            server = serve(images)
            try:
                listing = work / "urls.csv"
                good = write_url_list(images, f"http://127.0.0.1:{server.server_port}", listing)
                outputs = {}
                for name in ("webdataset", "parquet"):
                    outputs[name] = run_img2dataset(python, listing, work / name, name)
            finally:
                server.shutdown()
            for name, stats in outputs.items():
                expect(stats["successes"] == good and stats["count"] == good + 3,
                       f"img2dataset {name}: {stats}, expected {good} of {good + 3}")  # fmt: skip
            rows = check_webdataset(work / "webdataset", outputs["webdataset"])
            rows += check_parquet(work / "parquet", outputs["parquet"])
    except (CheckFailed, subprocess.CalledProcessError) as error:
        detail = (
            error.stderr.strip()[-300:]
            if isinstance(error, subprocess.CalledProcessError)
            else error
        )
        print(f"img2dataset_check: FAILED: {detail}")
        return 1
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
