"""What a new user hit (issue 31, item 6), each run as the user ran it.

Every test here runs the user's own command (a CLI's `main([...])`, a `LoaderConfig` as a
notebook writes it) on data shaped like theirs (img2dataset's tars and Parquet, the
README's quick-start build) and checks the line they get back, and that the hint in it
works when pasted.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.cli import main as pipeline_main
from pipeline.config import Batching, Crop, LoaderConfig, Workers
from pipeline.loader import build_loader
from preprocess.cli import main as preprocess_main
from preprocess.sample import make_sample
from preprocess.worker_shards import CLIENT_WORKERS
from shards.errors import UsageError
from shards.manifest import read_manifest
from shards.sample import Field, MissingFieldError
from tests.httpserver import LocalHTTPServer
from tests.pipeline.test_field_mapping import FAILED, ROWS, write_img2dataset_parquet
from trainers.train import main as train_main

REPO = Path(__file__).resolve().parents[1]
I2D_SHARDS, I2D_SAMPLES = 2, 6


def jpeg_bytes(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (24, 28, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def add_member(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))


def write_img2dataset_tars(folder, status_parquet: bool = True):
    """img2dataset's webdataset output: `00000.tar` of `000000000.jpg/.txt/.json`, and
    (`status_parquet`) its status `00000.parquet` and `00000_stats.json` beside each."""
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(I2D_SHARDS):
        rows = []
        with tarfile.open(folder / f"{shard:05d}.tar", "w", format=tarfile.GNU_FORMAT) as archive:
            for i in range(I2D_SAMPLES):
                key = f"{shard:05d}{i:04d}"
                meta = {"key": key, "caption": f"a photo {key}", "url": f"http://x/{key}.jpg"}
                add_member(archive, f"{key}.jpg", jpeg_bytes(shard * 100 + i))
                add_member(archive, f"{key}.txt", meta["caption"].encode())
                add_member(archive, f"{key}.json", json.dumps(meta).encode())
                rows.append({**meta, "status": "success", "error_message": None})
        if status_parquet:
            pq.write_table(pa.Table.from_pylist(rows), folder / f"{shard:05d}.parquet")
            (folder / f"{shard:05d}_stats.json").write_text(json.dumps({"count": I2D_SAMPLES}))
    return folder


@pytest.fixture(scope="module")
def i2d_tars(tmp_path_factory):
    return write_img2dataset_tars(tmp_path_factory.mktemp("i2d") / "out")


@pytest.fixture(scope="module")
def i2d_parquet(tmp_path_factory):
    folder = tmp_path_factory.mktemp("i2d-parquet") / "out"
    folder.mkdir()
    write_img2dataset_parquet(folder / "00000.parquet")
    return folder


def loader_config(source, batch: int = 4, workers: int = 0, **options) -> LoaderConfig:
    return LoaderConfig(
        source=str(source),
        train=False,
        batch=Batching(size=batch),
        crop=Crop(image_size=16),
        workers=Workers(count=workers),
        **options,
    )


def pasted_fields(message: str) -> tuple:
    """The `fields=(...)` a message suggests, evaluated as a user pasting it would."""
    match = re.search(r"fields=(\(.*?\)\)?)(?: \(Field: shards.sample\))?$", message)
    assert match, message
    return eval(match.group(1), {"Field": Field})  # noqa: S307 - our own message


def first_batch_fields(config: LoaderConfig) -> int:
    images, *rest = next(iter(build_loader(config)))
    assert images.shape[1:] == (3, 16, 16)
    return len(rest)


# --- label-free data: one line before any worker starts, with a hint that works -------------


def test_label_free_tars_are_one_line_before_workers_and_its_hint_reads_them(i2d_tars):
    config = loader_config(f"{i2d_tars}/*.tar", workers=2)
    started = time.monotonic()
    with pytest.raises(MissingFieldError) as refused:
        build_loader(config)  # no worker has started: the first shard was read here
    assert time.monotonic() - started < 5
    message = str(refused.value)
    assert "\n" not in message and "00000.tar" in message
    assert "hold no class labels" in message and "Field('label'" not in message
    fields = pasted_fields(message)
    assert fields == ("image", "txt")
    assert first_batch_fields(loader_config(f"{i2d_tars}/*.tar", fields=fields)) == 1


def test_label_free_parquet_names_its_caption_column_and_the_hint_reads_it(i2d_parquet):
    with pytest.raises(MissingFieldError) as refused:
        build_loader(loader_config(i2d_parquet))
    message = str(refused.value)
    assert "caption" in message and "max_skip_fraction" not in message
    fields = pasted_fields(message)
    assert fields == ("image", Field("txt", "text", source="caption"))
    loader = build_loader(loader_config(i2d_parquet, fields=fields, batch=16))
    captions = [text for _, texts in loader for text in texts]
    assert len(captions) == ROWS - len(FAILED)


def test_train_on_label_free_tars_is_one_line_in_flags_not_a_worker_traceback(
    i2d_tars, tmp_path, capsys
):
    args = ["--train-shards", str(i2d_tars), "--format", "tar", "--num-classes", "10"]
    args += ["--model", "cnn", "--image-size", "16", "--batch-size", "4", "--epochs", "1"]
    args += ["--workers", "2", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    assert train_main([*args, "--no-progress"]) == 1
    # The first run in a process also logs its counting pass over these manifest-less
    # shards (once per process, `pipeline.sources.log_counting_pass`); the refusal itself
    # is one line, the last, and nothing is a traceback.
    err = capsys.readouterr().err.strip().splitlines()
    notes = [line for line in err[:-1] if "shards without a manifest: counted" not in line]
    assert not notes and not any("Traceback" in line for line in err), err
    assert str(i2d_tars) in err[-1] and "jpg, json, txt and no cls or label" in err[-1]
    assert "--label-field" in err[-1] and "Field(" not in err[-1]


# --- a small build's splits against the workers of readers that split by shard -------------


def test_a_small_build_says_its_splits_starve_workers_and_the_size_it_names_fixes_it(
    tmp_path, capsys
):
    make_sample(tmp_path / "images", 80, classes=4, seed=3, workers=1)
    build = ["build-shards", "--input", str(tmp_path / "images"), "--val-fraction", "0.1"]
    build += ["--executor", "inline", "--no-progress", "--image-size", "32"]
    assert preprocess_main([*build, "--output", str(tmp_path / "one")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("few shards"))
    assert "train 1 shard, val 1 shard" in line and "create_loader" in line
    size = re.search(r"--shard-size (\d+)", line).group(1)
    assert preprocess_main(["info", str(tmp_path / "one")]) == 0
    assert line in capsys.readouterr().out.splitlines()  # info says it too
    assert preprocess_main([*build, "--output", str(tmp_path / "many"), "--shard-size", size]) == 0
    assert "few shards" not in capsys.readouterr().out
    manifest = read_manifest(str(tmp_path / "many"))
    assert all(len(split.shards) >= CLIENT_WORKERS for split in manifest.splits.values())


# --- img2dataset's folder, and hints that work when pasted ----------------------------------


def test_an_img2dataset_folder_is_its_tars_for_verify_info_index_and_the_loader(tmp_path, capsys):
    folder = write_img2dataset_tars(tmp_path / "out")
    assert preprocess_main(["verify", str(folder)]) == 0
    assert "2 tar shards without a manifest, 12 samples" in capsys.readouterr().out
    assert preprocess_main(["info", str(folder)]) == 0
    assert f"run `preprocess index {folder}` to save" in capsys.readouterr().out
    config = loader_config(folder, fields=("image", "txt"))
    assert sum(len(texts) for _, texts in build_loader(config)) == I2D_SHARDS * I2D_SAMPLES
    assert preprocess_main(["index", str(folder)]) == 0
    assert preprocess_main(["verify", str(folder)]) == 0
    assert "OK: 2 shards" in capsys.readouterr().out


def test_the_index_command_verify_and_info_print_runs_as_pasted_on_a_mixed_folder(tmp_path, capsys):
    folder = write_img2dataset_tars(tmp_path / "mixed", status_parquet=False)
    write_img2dataset_parquet(folder / "other.parquet")  # shards of another format beside
    for command in ("verify", "info"):
        assert preprocess_main([command, str(folder), "--format", "tar"]) == 0
        pasted = re.search(r"run `(preprocess index [^`]+)`", capsys.readouterr().out).group(1)
        assert pasted == f"preprocess index {folder} --format tar"
    assert preprocess_main(shlex.split(pasted)[1:]) == 0
    assert read_manifest(str(folder)).splits["train"].samples == I2D_SHARDS * I2D_SAMPLES


def test_verify_on_img2dataset_parquet_names_the_flag_that_accepts_its_failed_rows(
    tmp_path, capsys
):
    folder = tmp_path / "out"
    folder.mkdir()
    write_img2dataset_parquet(folder / "00000.parquet")
    for indexed in (False, True):  # before `preprocess index` and after
        assert preprocess_main(["verify", str(folder)]) == 1
        err = capsys.readouterr().err
        assert f"null_cell: {len(FAILED)}" in err and "--accept-failed-rows" in err
        assert preprocess_main(["verify", str(folder), "--accept-failed-rows"]) == 0
        out = capsys.readouterr().out
        assert f"{ROWS} samples" in out and f"accepted {len(FAILED)} rows with a null" in out
        if not indexed:
            assert preprocess_main(["index", str(folder)]) == 0
    broken = tmp_path / "broken"  # a bad image is still a failure with the flag
    broken.mkdir()
    table = pq.read_table(folder / "00000.parquet")
    images = table.column("jpg").to_pylist()
    images[0] = b"not an image"
    table = table.set_column(table.schema.get_field_index("jpg"), "jpg", pa.array(images))
    pq.write_table(table, broken / "00000.parquet")
    assert preprocess_main(["verify", str(broken), "--accept-failed-rows"]) == 1


# --- img2dataset's inputs: its url,caption list, and its tars given to build-shards ---------


def test_an_img2dataset_url_caption_list_builds_with_the_flags_its_refusal_names(tmp_path, capsys):
    make_sample(tmp_path / "images", 12, classes=2, seed=4, workers=1)
    images = sorted((tmp_path / "images").rglob("*.jpg"))
    server = LocalHTTPServer(tmp_path / "images")
    with server as base_url:
        rows = [
            {
                "url": f"{base_url}/{p.relative_to(tmp_path / 'images').as_posix()}",
                "caption": f"c{i}",
            }
            for i, p in enumerate(images)
        ]
        listing = tmp_path / "urls.parquet"
        pq.write_table(pa.Table.from_pylist(rows), listing)
        build = ["build-shards", "--input", str(listing), "--output", str(tmp_path / "out")]
        build += ["--executor", "inline", "--no-progress", "--image-size", "32"]
        assert preprocess_main(build) == 1
        err = capsys.readouterr().err
        assert "no `label`" in err and "`path`" not in err.split("it has no")[1]
        flags = shlex.split(re.search(r"builds with (--label none[^;]*);", err).group(1))
        assert flags == ["--label", "none", "--fields", "caption:txt"]
        assert preprocess_main([*build, *flags]) == 0
    loader = build_loader(loader_config(tmp_path / "out", fields=("image", "txt")))
    assert sorted(text for _, texts in loader for text in texts) == sorted(
        r["caption"] for r in rows
    )


def test_build_shards_on_a_folder_of_tars_points_to_index_and_the_loader(tmp_path, capsys):
    folder = write_img2dataset_tars(tmp_path / "tars")
    build = ["build-shards", "--input", str(folder), "--output", str(tmp_path / "out")]
    assert preprocess_main([*build, "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "2 tar shard files" in err
    pasted = re.search(r"`(preprocess index [^`]+)`", err).group(1)
    assert preprocess_main(shlex.split(pasted)[1:]) == 0
    assert read_manifest(str(folder)).splits["train"].samples == I2D_SHARDS * I2D_SAMPLES


# --- inspect-shuffle with a run's settings on a small dataset --------------------------------


def test_inspect_shuffle_that_would_deliver_nothing_says_the_batch_size_that_does(tmp_path, capsys):
    make_sample(tmp_path / "images", 80, classes=4, seed=3, workers=1)
    build = ["build-shards", "--input", str(tmp_path / "images"), "--output", str(tmp_path / "out")]
    assert preprocess_main([*build, "--executor", "inline", "--no-progress"]) == 0
    capsys.readouterr()
    inspect = ["inspect-shuffle", str(tmp_path / "out"), "--split", "train", "--workers", "8"]
    inspect += ["--world-size", "8", "--shuffle-buffer", "2000"]  # LOADER.md's, before
    assert pipeline_main([*inspect, "--batch-size", "256"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "deliver no batch of 256" in err
    size = re.search(r"--batch-size (\d+) or fewer", err).group(1)
    assert pipeline_main([*inspect, "--batch-size", size]) == 0
    samples = int(re.search(r"(\d+) samples/epoch", capsys.readouterr().out).group(1))
    assert samples > 0


# --- a notebook: a loader fails, the next one starts workers ---------------------------------

NOTEBOOK = """
import gc, os, sys
from pipeline import Batching, Crop, LoaderConfig, Workers, build_loader
from shards.sample import Field

def cell(fields):  # one notebook cell; the notebook keeps its error (sys.last_value)
    config = LoaderConfig(source=sys.argv[1], batch=Batching(size=8), crop=Crop(image_size=16),
                          fields=fields, workers=Workers(count=2))
    try:
        return sum(1 for _ in build_loader(config))
    except Exception as error:
        sys.last_value = error

gc.disable()  # the failed cell's error becomes garbage only when the next error replaces it
cell(("image", Field("meta", "json", source="cls")))  # a class id is no JSON object: it fails
sys.last_value = None
# A worker forked for the next loader collects what it inherited, as a busy one would.
os.register_at_fork(after_in_child=lambda: (gc.enable(), gc.collect()))
print("batches", cell(("image", "label")))
"""


def test_a_loader_after_a_failed_one_prints_no_child_process_assertion(tmp_path):
    make_sample(tmp_path / "images", 48, classes=2, seed=5, workers=1)
    build = ["build-shards", "--input", str(tmp_path / "images"), "--output", str(tmp_path / "out")]
    assert preprocess_main([*build, "--executor", "inline", "--no-progress"]) == 0
    run = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "batches 6" in run.stdout
    assert "can only test a child process" not in run.stderr
    assert "Exception ignored" not in run.stderr


# --- `train` writing to a log file ---------------------------------------------------------


def test_train_into_a_log_file_says_how_it_goes_every_log_every_steps(tmp_path):
    make_sample(tmp_path / "images", 80, classes=4, seed=3, workers=1)
    build = ["build-shards", "--input", str(tmp_path / "images"), "--output", str(tmp_path / "out")]
    assert preprocess_main([*build, "--executor", "inline", "--no-progress"]) == 0
    train = [str(REPO / ".venv" / "bin" / "train"), "--train-shards", str(tmp_path / "out")]
    train += ["--model", "cnn", "--image-size", "16", "--batch-size", "8", "--epochs", "1"]
    train += ["--workers", "0", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
    with open(tmp_path / "train.log", "w") as log_file:  # `train ... > train.log 2>&1`
        subprocess.run(
            [*train, "--log-every", "3"], stdout=log_file, stderr=subprocess.STDOUT, check=True
        )
    steps = re.findall(
        r"INFO step (\d+) \(epoch 0\): loss [\d.]+, lr", (tmp_path / "train.log").read_text()
    )
    assert [int(s) for s in steps] == [3, 6, 9, 10]  # 80 images, batch 8: every 3rd and the last


def test_train_from_http_logs_bytes_fetched_then_cache_hits(tmp_path):
    make_sample(tmp_path / "images", 48, classes=2, seed=3, workers=1)
    build = ["build-shards", "--input", str(tmp_path / "images"), "--output", str(tmp_path / "out")]
    build += [
        "--executor",
        "inline",
        "--no-progress",
        "--shard-size",
        "12",
        "--val-fraction",
        "0.25",
    ]
    assert preprocess_main(build) == 0
    with LocalHTTPServer(tmp_path / "out") as base_url:
        train = [
            str(REPO / ".venv" / "bin" / "train"),
            "--train-shards",
            f"{base_url}/manifest.json",
        ]
        train += ["--model", "cnn", "--image-size", "16", "--batch-size", "8", "--epochs", "2"]
        train += ["--workers", "0", "--device", "cpu", "--run-dir", str(tmp_path / "run")]
        train += ["--cache-dir", str(tmp_path / "cache"), "--val-shards", str(tmp_path / "out")]
        run = subprocess.run(train, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = re.findall(
        r"epoch fetch: (\d+) remote shards fetched \(([\d.]+) MiB\), (\d+) cache hits", run.stderr
    )
    assert len(lines) == 2, run.stderr[-3000:]
    (fetched, mib, hits), (fetched_again, _, hits_again) = lines
    assert int(fetched) == 3 and float(mib) > 0 and int(hits) == 0  # 36 train images, 12 a shard
    assert int(fetched_again) == 0 and int(hits_again) == 3  # the second epoch: the cache


# --- the README's first command, run again; make-sample's progress ---------------------------


def test_make_sample_rerun_keeps_the_same_sample_and_says_so(tmp_path, capsys):
    command = ["make-sample", "--output", str(tmp_path / "sample"), "--count", "60"]
    command += ["--workers", "1", "--overwrite"]  # as the README's first command
    assert preprocess_main(command) == 0
    assert capsys.readouterr().out.startswith("wrote 60 images")
    files = sorted((tmp_path / "sample").rglob("*.*"))
    stamps = [path.stat().st_mtime_ns for path in files]
    assert preprocess_main(command) == 0
    assert capsys.readouterr().out.startswith(f"kept {tmp_path / 'sample'}: it holds this sample")
    assert [path.stat().st_mtime_ns for path in files] == stamps  # nothing drawn again
    assert preprocess_main([*command, "--seed", "1"]) == 0  # another sample: drawn
    assert capsys.readouterr().out.startswith("wrote 60 images")
    (tmp_path / "sample" / "class_000" / "extra.jpg").write_bytes(b"x")
    assert preprocess_main([*command, "--seed", "1"]) == 1  # a tree holding more: refused


def test_make_sample_into_a_log_file_says_how_far_it_is(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("preprocess.progress.PROGRESS_EVERY_S", 0.0)  # a line every chunk
    command = ["make-sample", "--output", str(tmp_path / "sample"), "--count", "200"]
    assert preprocess_main([*command, "--workers", "1"]) == 0
    lines = re.findall(r"make-sample: (\d+) of 200 images", capsys.readouterr().err)
    assert [int(n) for n in lines] == [64, 128, 192, 200]
    assert (
        preprocess_main([*command, "--workers", "1", "--overwrite", "--seed", "2", "--no-progress"])
        == 0
    )
    assert "of 200 images" not in capsys.readouterr().err


# A stand-in for the venv's python: `-c` checks pass (torch and our packages import),
# `-m pip install` prints what pip prints while it fetches, and every call is recorded.
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls"
if [ "$1" = "-c" ]; then echo 2.13.0; exit 0; fi
if [ "$1 $2 $3" = "-m pip install" ]; then
  echo "Obtaining file:///repo"
  echo "Collecting numpy>=1.26 (from shardpipe==0.1)"
  echo "  Downloading numpy-2.3.0-cp311-cp311-manylinux_2_28_x86_64.whl (16.6 MB)"
  echo "Collecting pillow>=10 (from shardpipe==0.1)"
  echo "Installing collected packages: numpy, pillow, shardpipe"
  echo "Successfully installed numpy-2.3.0 pillow-11.0 shardpipe-0.1"
fi
"""


def test_ci_setup_says_what_it_fetches_and_a_rerun_installs_nothing(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "setup").write_text((REPO / ".ci" / "setup").read_text())
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)

    def setup() -> tuple[str, list[str]]:
        (tmp_path / ".venv" / "calls").write_text("")
        run = subprocess.run(
            ["bash", ".ci/setup"], cwd=tmp_path, capture_output=True, text=True, check=True
        )
        return run.stdout, (tmp_path / ".venv" / "calls").read_text().splitlines()

    out, calls = setup()
    assert "setup:   fetching numpy>=1.26" in out and "setup:   fetching pillow>=10" in out
    assert "setup:   installing the packages fetched" in out and "Downloading" not in out
    assert any(call.startswith("-m pip install") for call in calls)
    out, calls = setup()  # the README's first command, run again
    assert "pyproject.toml unchanged): nothing to do" in out
    assert not any("-m pip" in call for call in calls)
    with open(tmp_path / "pyproject.toml", "a") as changed:
        changed.write("\n# a new dependency\n")
    out, calls = setup()
    assert "fetching numpy" in out and any("pip install" in call for call in calls)


def test_hf_reads_tar_labels_as_ints_and_the_cast_the_doc_gives_names_them(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    make_sample(tmp_path / "images", 24, classes=3, seed=3, workers=1)
    build = ["build-shards", "--input", str(tmp_path / "images"), "--output", str(tmp_path / "out")]
    assert preprocess_main([*build, "--executor", "inline", "--no-progress"]) == 0
    parquet = datasets.load_dataset(
        str(tmp_path / "out" / "parquet"), cache_dir=str(tmp_path / "hf")
    )
    tar = datasets.load_dataset(str(tmp_path / "out" / "tar"), cache_dir=str(tmp_path / "hf"))
    classes = read_manifest(str(tmp_path / "out")).classes
    assert parquet["train"].features["cls"] == datasets.ClassLabel(names=classes)
    assert tar["train"].features["cls"] == datasets.Value("int64")  # as CLIENTS.md says
    named = tar["train"].cast_column("cls", datasets.ClassLabel(names=classes))  # its cast
    assert named.features["cls"].names == classes
    assert sorted(named["cls"]) == sorted(parquet["train"]["cls"])


# --- naming the datasets of a mix on the command line ----------------------------------------


def test_train_names_the_datasets_of_a_mix_as_given(tmp_path):
    for place in ("a", "b"):  # two builds named alike: `out1`, `out2` unless named
        make_sample(tmp_path / place / "images", 24, classes=2, seed=3, workers=1)
        build = ["build-shards", "--input", str(tmp_path / place / "images")]
        build += ["--output", str(tmp_path / place / "out"), "--val-fraction", "0.25"]
        assert preprocess_main([*build, "--executor", "inline", "--no-progress"]) == 0
    train = [str(REPO / ".venv" / "bin" / "train")]
    train += ["--train-shards", f"web={tmp_path / 'a' / 'out'}"]
    train += ["--train-shards", f"curated={tmp_path / 'b' / 'out'}"]
    train += ["--val-shards", str(tmp_path / "a" / "out"), "--model", "cnn", "--image-size", "16"]
    train += ["--batch-size", "6", "--epochs", "1", "--workers", "0", "--device", "cpu"]
    train += ["--run-dir", str(tmp_path / "run")]
    run = subprocess.run(train, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "samples an epoch: web 20, curated 20" in run.stderr, run.stderr[-2000:]
    assert re.search(r"epoch sources: curated 18 samples .*, web 18 samples", run.stderr)


def test_a_label_none_build_read_with_the_default_fields_suggests_fields_that_read_it(tmp_path):
    make_sample(tmp_path / "images", 24, classes=2, seed=3, workers=1)
    flat = tmp_path / "flat"  # a folder of images without classes
    flat.mkdir()
    for image in (tmp_path / "images").rglob("*.jpg"):
        image.rename(flat / image.name)
    build = ["build-shards", "--input", str(flat), "--output", str(tmp_path / "out")]
    assert (
        preprocess_main([*build, "--label", "none", "--executor", "inline", "--no-progress"]) == 0
    )
    with pytest.raises(UsageError) as refused:
        build_loader(loader_config(tmp_path / "out"))
    message = str(refused.value)
    assert "no class labels (built with --label none)" in message
    fields = pasted_fields(message)
    assert "txt" not in fields  # these shards hold no text: ('image', 'txt') would be refused
    assert first_batch_fields(loader_config(tmp_path / "out", fields=fields)) == 0
