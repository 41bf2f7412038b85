"""`preprocess build-shards` end to end on real images: contract, determinism, resume, failures."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import webdataset as wds

from preprocess.cli import main
from preprocess.job import dispatch_order, run_build
from preprocess.plan import build_plan
from preprocess.ray_job import BuildError
from preprocess.sources import list_sources
from shards.manifest import read_manifest
from shards.parquet import iter_parquet_samples
from shards.tar import iter_tar_samples
from tests.conftest import (
    SAMPLE_CLASSES,
    SAMPLE_COUNT,
    shard_files,
    shard_key,
    shard_path,
    small_build_config,
)


def all_files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def read_split(directory: Path, split: str, fmt: str) -> list[tuple[str, bytes, bytes]]:
    manifest = read_manifest(directory)
    rows = []
    for url in manifest.shard_urls(split, fmt, str(directory)):
        reader = iter_tar_samples if fmt == "tar" else iter_parquet_samples
        with open(url, "rb") as stream:
            rows += [(s["__key__"], s["cls"], s[manifest.image_field]) for s in reader(stream, url)]
    return rows


def test_manifest_describes_every_input_once(built_shards):
    manifest = built_shards.manifest
    assert manifest.inputs == SAMPLE_COUNT
    assert manifest.written + sum(manifest.skipped.values()) == SAMPLE_COUNT
    assert manifest.classes == [f"class_{i:03d}" for i in range(SAMPLE_CLASSES)]
    assert set(manifest.splits) == {"train", "val"}
    val_share = manifest.splits["val"].samples / manifest.written
    assert 0.08 < val_share < 0.35
    for split in manifest.splits.values():
        assert sum(s.samples for s in split.shards) == split.samples
        assert sum(split.class_counts) == split.samples
        assert [s.index for s in split.shards] == list(range(len(split.shards)))
        assert all(s.samples <= 32 for s in split.shards)
        first = shard_key(split.name, 0)  # the pattern names the directory the shards are in
        assert split.patterns()["tar"].startswith(first.replace("000000.tar", "{000000.."))


def test_tar_and_parquet_hold_identical_samples(built_shards):
    out = built_shards.output
    for split in ("train", "val"):
        from_tar = read_split(out, split, "tar")
        assert from_tar == read_split(out, split, "parquet")
        assert len({key for key, _, _ in from_tar}) == len(from_tar)


def test_splits_are_disjoint_and_labels_match_class_dirs(built_shards):
    out = built_shards.output
    train = {k for k, _, _ in read_split(out, "train", "tar")}
    val = {k for k, _, _ in read_split(out, "val", "tar")}
    assert not train & val
    with open(shard_path(out, "train", 0, "parquet"), "rb") as f:
        table = pq.read_table(f, columns=["cls", "source"])
    for label, source in zip(
        table.column("cls").to_pylist(), table.column("source").to_pylist(), strict=True
    ):
        assert source.startswith(f"class_{label:03d}/")


def test_samples_are_shuffled_across_classes_within_shards(built_shards):
    labels = [int(c) for _, c, _ in read_split(built_shards.output, "train", "tar")]
    first_shard = labels[:32]
    assert len(set(first_shard)) == SAMPLE_CLASSES  # not one class per shard
    runs = sum(a != b for a, b in zip(labels, labels[1:], strict=False))
    assert runs > len(labels) / 2  # sorted input would give only SAMPLE_CLASSES - 1 changes


def test_stock_webdataset_reads_our_tars(built_shards):
    manifest = built_shards.manifest
    urls = manifest.shard_urls("train", "tar", str(built_shards.output))
    dataset = (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .decode("pil")
        .to_tuple("__key__", "jpg", "cls")
    )
    seen = list(dataset)
    assert len(seen) == manifest.splits["train"].samples
    key, image, label = seen[0]
    assert image.mode == "RGB" and min(image.size) == 64
    assert isinstance(label, int)


def test_images_are_resized_rgb_jpegs_with_metadata(built_shards):
    out = built_shards.output
    url = str(shard_path(out, "train", 0))
    with open(url, "rb") as stream:
        sample = next(iter_tar_samples(stream, url))
    meta = json.loads(sample["json"])
    assert sample["jpg"][:3] == b"\xff\xd8\xff"
    assert min(meta["width"], meta["height"]) == 64
    assert max(meta["orig_width"], meta["orig_height"]) >= 200
    assert meta["source"].startswith("class_") and meta["split"] == "train"


def test_build_is_deterministic_byte_for_byte(sample_dir, built_shards, tmp_path):
    again = run_build(small_build_config(sample_dir, tmp_path / "again"))
    assert all_files(again.output) == all_files(built_shards.output)


@pytest.mark.ray
@pytest.mark.slow
def test_ray_build_matches_inline_build(sample_dir, built_shards, tmp_path):
    import ray

    assert not ray.is_initialized()
    summary = run_build(small_build_config(sample_dir, tmp_path / "ray", executor="ray", workers=2))
    assert summary.shards_built == sum(len(s.shards) for s in summary.manifest.splits.values())
    assert all_files(summary.output) == all_files(built_shards.output)
    # The Ray the build started ends with it: left up, it would hold its processes and make
    # every later loader in this process spawn its workers (pipeline.worker_start).
    assert not ray.is_initialized()


def test_rerun_reuses_complete_shards_and_rebuilds_damaged_ones(sample_dir, built_shards, tmp_path):
    out = tmp_path / "resume"
    first = run_build(small_build_config(sample_dir, out))
    shard_path(out, "train", 1).write_bytes(b"garbage")  # damaged
    shard_path(out, "train", 2, "parquet").unlink()  # missing
    (out / "_build" / "val-000000.json").unlink()  # never committed
    (out / "manifest.json").unlink()
    second = run_build(small_build_config(sample_dir, out))
    assert second.shards_built == 3
    assert second.shards_reused == first.shards_built - 3
    assert all_files(out) == all_files(built_shards.output)


def test_changed_options_against_existing_output_are_refused_with_a_diff(
    sample_dir, built_shards, tmp_path
):
    out = tmp_path / "changed"
    run_build(small_build_config(sample_dir, out))
    with pytest.raises(BuildError, match=r"shard_size: 32 -> 16") as info:
        run_build(small_build_config(sample_dir, out, shard_size=16))
    assert "--overwrite" in str(info.value)
    rebuilt = run_build(small_build_config(sample_dir, out, shard_size=16, overwrite=True))
    assert all(s.samples <= 16 for s in rebuilt.manifest.splits["train"].shards)
    assert not list(out.rglob("*.tmp*")) and not list(out.rglob(".*"))


def test_output_holding_other_files_is_refused(sample_dir, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(BuildError, match="not empty"):
        run_build(small_build_config(sample_dir, out))
    with pytest.raises(BuildError):
        run_build(small_build_config(sample_dir, out, overwrite=True))
    assert (out / "precious.txt").read_text() == "keep me"


def test_disk_full_stops_the_job_and_leaves_no_partial_file(sample_dir, tmp_path, monkeypatch):
    import shards.tar

    original = shards.tar.TarShardWriter.write
    calls = {"n": 0}

    def failing_write(self, sample):
        calls["n"] += 1
        if calls["n"] > 40:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, sample)

    monkeypatch.setattr(shards.tar.TarShardWriter, "write", failing_write)
    out = tmp_path / "full"
    with pytest.raises(OSError, match="No space left"):
        run_build(small_build_config(sample_dir, out))
    names = sorted(p.name for p in out.rglob("*"))  # the format directories too
    assert "manifest.json" not in names
    assert not [n for n in names if n.startswith(".")]  # temp files removed
    markers = {p.stem for p in (out / "_build").glob("*-*.json")}
    shard_stems = {p.stem for p in shard_files(out, "tar")} | {
        p.stem for p in shard_files(out, "parquet")
    }
    assert shard_stems == markers  # every final-named file is a committed shard
    monkeypatch.undo()
    summary = run_build(small_build_config(sample_dir, out))
    assert summary.shards_reused == len(markers)


def _run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "preprocess.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


@pytest.mark.slow
def test_build_killed_midway_resumes_with_nothing_lost_or_doubled(
    sample_dir, built_shards, tmp_path
):
    out = tmp_path / "killed"
    args = [
        "build-shards",
        "--input",
        str(sample_dir),
        "--output",
        str(out),
        "--image-size",
        "64",
        "--shard-size",
        "32",
        "--val-fraction",
        "0.2",
        "--seed",
        "3",
        "--row-group-size",
        "16",
        "--executor",
        "inline",
        "--no-progress",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "preprocess.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list((out / "_build").glob("train-*.json"))) < 2:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "manifest.json").exists()
    for tar in shard_files(out, "tar"):  # anything under a final name is a complete tar
        with open(tar, "rb") as stream:
            list(iter_tar_samples(stream, str(tar)))
    committed = len(list((out / "_build").glob("*-*.json")))
    result = _run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert f"reused {committed}" in result.stdout
    assert all_files(out) == all_files(built_shards.output)


def test_cli_build_verify_info_and_console_script(sample_dir, tmp_path):
    out = tmp_path / "cli"
    code = main(
        [
            "build-shards",
            "--input",
            str(sample_dir),
            "--output",
            str(out),
            "--image-size",
            "48",
            "--shard-size",
            "100",
            "--executor",
            "inline",
            "--no-progress",
            "--formats",
            "tar",
        ]
    )
    assert code == 0
    manifest = read_manifest(out)
    assert manifest.formats == ["tar"] and not list(shard_files(out, "parquet"))
    assert main(["verify", str(out)]) == 0
    script = Path(sys.executable).parent / "preprocess"
    info = subprocess.run([str(script), "info", str(out)], capture_output=True, text=True)
    assert info.returncode == 0
    assert (
        f"written: {manifest.written}" in info.stdout
        and "train-{000000..000002}.tar" in info.stdout
    )


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing", "swap"])
def test_verify_names_the_first_bad_shard(built_shards, tmp_path, damage, capsys):
    out = tmp_path / "copy"
    out.mkdir()
    for name, data in all_files(built_shards.output).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data)
    target = shard_path(out, "train", 1)
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 3] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:-3000])
    elif damage == "missing":
        target.unlink()
    else:
        other = shard_path(out, "train", 2)
        a, b = target.read_bytes(), other.read_bytes()
        target.write_bytes(b)
        other.write_bytes(a)
    assert main(["verify", str(out)]) == 1
    assert "train-000001.tar" in capsys.readouterr().err


def test_small_shards_are_sent_last_and_results_keep_plan_order(sample_dir, tmp_path):
    plan = build_plan(list_sources(str(sample_dir)), 50, 0.2, 0)
    order = dispatch_order(plan.tasks)
    sizes = [len(task.samples) for task in order]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) > 1
    full = [t for t in plan.tasks if len(t.samples) == 50]
    assert order[: len(full)] == full  # equal shards keep their plan order
    summary = run_build(small_build_config(sample_dir, tmp_path / "o", shard_size=50))
    names = [
        (s.index, split) for split, info in summary.manifest.splits.items() for s in info.shards
    ]
    assert names == sorted(names, key=lambda pair: (pair[1], pair[0]))
