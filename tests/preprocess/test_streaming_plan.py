"""The streaming build plan: flat memory, exact shards, determinism, resume, and `--dry-run`."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import preprocess.plan
from preprocess.cli import main
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.listing import SourceItem
from preprocess.plan import build_plan, iter_sorted_bucket, order_hash, order_key, sample_key
from preprocess.ray_job import BuildError
from shards.manifest import read_manifest
from tests.conftest import small_build_config

SHARD_SIZE = 16
REPO = Path(__file__).resolve().parents[2]


def all_files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def write_list(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("path,label\n" + "".join(f"{rel},{label}\n" for rel, label in rows))
    return path


@pytest.fixture(scope="module")
def listed(sample_dir, tmp_path_factory) -> tuple[Path, list[tuple[str, str]]]:
    """A CSV input list over a copy of the sample images, and its rows (sorted)."""
    root = tmp_path_factory.mktemp("listed")
    rows = []
    for image in sorted(sample_dir.rglob("*")):
        if image.is_file():
            rel = image.relative_to(sample_dir)
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(image, root / rel)
            rows.append((rel.as_posix(), rel.parts[0]))
    return write_list(root / "list.csv", rows), rows


def config(input_path: Path, output: Path, **overrides):
    options = dict(image=ImageConfig(image_size=32), shard_size=SHARD_SIZE)
    options.update(overrides)
    return small_build_config(input_path, output, **options)


@pytest.fixture(scope="module")
def reference(listed, tmp_path_factory) -> Path:
    """An uninterrupted build of the list."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run_build(config(listed[0], out))
    return out


def manifest_without_input(out: Path) -> dict:
    document = json.loads((out / "manifest.json").read_text())
    document["config"].pop("input")
    return document


@pytest.mark.timeout(120)
def test_two_runs_and_any_listing_order_give_byte_identical_shards(listed, reference, tmp_path):
    list_file, rows = listed
    again = run_build(config(list_file, tmp_path / "again"))
    assert all_files(again.output) == all_files(reference)
    # The order comes from a keyed hash of each key, not from where a row is listed.
    shuffled = rows[:]
    random.Random(1).shuffle(shuffled)
    other = write_list(list_file.with_name("shuffled.csv"), shuffled)
    out = tmp_path / "shuffled"
    run_build(config(other, out))
    files, expected = all_files(out), all_files(reference)
    assert files.pop("manifest.json") != b"" and expected.pop("manifest.json") != b""
    assert files == expected
    assert manifest_without_input(out) == manifest_without_input(reference)
    # Shards hold exactly --shard-size inputs, but each split's last; the plan files
    # are gone once the manifest is written.
    manifest = read_manifest(reference)
    for split in manifest.splits.values():
        assert [s.samples for s in split.shards[:-1]] == [SHARD_SIZE] * (len(split.shards) - 1)
        assert 0 < split.shards[-1].samples <= SHARD_SIZE
    assert not (reference / "_build" / "plan").exists()


@pytest.mark.timeout(120)
def test_a_build_killed_after_some_shards_resumes_to_the_uninterrupted_output(
    listed, reference, tmp_path
):
    out = tmp_path / "killed"
    args = [
        "build-shards",
        f"--input={listed[0]}",
        f"--output={out}",
        "--image-size=32",
        f"--shard-size={SHARD_SIZE}",
        "--val-fraction=0.2",
        "--seed=3",
        "--row-group-size=16",
        "--executor=inline",
        "--no-progress",
    ]
    process = subprocess.Popen(
        [sys.executable, "-m", "preprocess.cli", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list((out / "_build").glob("*-*.json"))) < 3:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (out / "manifest.json").exists()
    assert (out / "_build" / "plan").is_dir()  # killed mid-build: its plan is still there
    committed = len(list((out / "_build").glob("*-*.json")))
    assert committed >= 3
    summary = run_build(config(listed[0], out))
    assert summary.shards_reused >= committed
    assert all_files(out) == all_files(reference)


def test_a_changed_input_list_is_refused_with_the_difference(listed, tmp_path):
    list_file, rows = listed
    out = tmp_path / "changed"
    run_build(config(list_file, out))
    fewer = write_list(list_file.with_name("fewer.csv"), rows[1:])
    with pytest.raises(BuildError, match=rf"inputs: {len(rows)} files -> {len(rows) - 1} files"):
        run_build(config(fewer, out))
    summary = run_build(config(fewer, out, overwrite=True))
    assert summary.manifest.inputs == len(rows) - 1


def test_a_build_started_by_an_older_version_is_refused_naming_the_plan_change(listed, tmp_path):
    out = tmp_path / "old"
    run_build(config(listed[0], out))
    record_path = out / "_build" / "config.json"
    record = json.loads(record_path.read_text())
    del record["plan_version"]  # as written before the streaming plan
    record_path.write_text(json.dumps(record))
    with pytest.raises(BuildError, match="older version") as info:
        run_build(config(listed[0], out))
    assert "plan version: 1 -> 2" in str(info.value) and "--overwrite" in str(info.value)
    assert "Rerun with the original options" not in str(info.value)
    assert run_build(config(listed[0], out, overwrite=True)).shards_reused == 0


def test_dry_run_prints_the_plan_and_writes_nothing_but_the_plan(listed, tmp_path, capsys):
    list_file, rows = listed
    out = tmp_path / "dry"
    args = ["build-shards", f"--input={list_file}", f"--output={out}", "--image-size=32"]
    args += [f"--shard-size={SHARD_SIZE}", "--val-fraction=0.2", "--seed=3", "--row-group-size=16"]
    assert main([*args, "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert [p.name for p in out.iterdir()] == ["_build"]
    assert [p.name for p in (out / "_build").iterdir()] == ["plan"]
    assert not list(out.rglob("*.tar")) and not list(out.rglob("*.parquet"))
    index = json.loads((out / "_build" / "plan" / "plan.json").read_text())
    assert index["inputs"] == len(rows) and sum(s[2] for s in index["shards"]) == len(rows)
    assert f"{len(rows)} inputs, 4 classes" in printed
    assert "class_003" in printed and "estimated bytes: tar ~" in printed
    assert "a new build" in printed
    # The real build takes the output the dry run used, builds what it announced,
    # and removes the plan files.
    summary = run_build(config(list_file, out))
    shards = sum(len(split.shards) for split in summary.manifest.splits.values())
    assert shards == len(index["shards"])
    assert not (out / "_build" / "plan").exists()
    assert main([*args, "--dry-run"]) == 0
    assert f"resumes the build there ({shards} of {shards} shards" in capsys.readouterr().out


def test_dry_run_of_paths_that_do_not_exist_and_of_a_tree_names_what_is_left_out(tmp_path, capsys):
    fake = write_list(
        tmp_path / "fake.csv", [(f"c{i % 3}/img_{i}.jpg", f"c{i % 3}") for i in range(50)]
    )
    out = tmp_path / "fake-out"
    assert main(["build-shards", f"--input={fake}", f"--output={out}", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "50 inputs, 3 classes" in printed
    assert "estimated bytes: unknown (none of the 50 probe inputs read: missing 50)" in printed
    assert sorted(p.name for p in (out / "_build" / "plan").iterdir()) == [
        "plan.json",
        "train.jsonl",
    ]
    args = ["build-shards", f"--input={fake}", f"--output={out}", "--dry-run", "--val-fraction=0.3"]
    assert main(args) == 0 and "val " in capsys.readouterr().out
    plan_files = sorted(p.name for p in (out / "_build" / "plan").iterdir())
    assert plan_files == ["plan.json", "train.jsonl", "val.jsonl"]
    assert main(args[:-1]) == 0  # the next plan replaces the last one entirely
    assert sorted(p.name for p in (out / "_build" / "plan").iterdir()) == [
        "plan.json",
        "train.jsonl",
    ]
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    shutil.copy(fake, tree / "a" / "x.jpg")
    (tree / "a" / "notes.txt").write_text("not an image")
    (tree / "stray.jpg").write_text("outside any class")
    (tree / "a" / "up").symlink_to(tree, target_is_directory=True)
    assert (
        main(["build-shards", f"--input={tree}", f"--output={tmp_path / 'o2'}", "--dry-run"]) == 0
    )
    printed = capsys.readouterr().out
    assert "not inputs: loop 1, no_class 1, other_suffix 1" in printed
    assert "a/up: loop:" in printed


def test_a_refused_input_list_or_output_leaves_nothing_behind(tmp_path, capsys):
    listing = write_list(tmp_path / "list.csv", [("a/x.jpg", "a"), ("a/./x.jpg", "a")])
    with pytest.raises(
        ValueError, match=r"list\.csv line 2 and .*line 3: duplicate path 'a/x.jpg'"
    ):
        run_build(config(listing, tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["build-shards", f"--input={listing}", f"--output={busy}", "--dry-run"]) == 1
    assert "not empty and holds no shard build" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def fake_items(count: int):
    for i in range(count):
        rel = f"class_{i % 100:03d}/{i:09d}.jpg"
        yield SourceItem(f"/data/{rel}", rel, f"class_{i % 100:03d}")


# Plans `count` fake inputs in a fresh process and prints its peak RSS in KiB.
_PLAN_AND_REPORT = """
import resource, sys
from preprocess.plan import build_plan
from tests.preprocess.test_streaming_plan import fake_items
count = int(sys.argv[1])
plan = build_plan(fake_items(count), 1000, 0.1, 0, sys.argv[2])
assert plan.inputs == count and sum(p.size for p in plan.shards) == count
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.timeout(120)
def test_planning_memory_does_not_grow_with_the_number_of_inputs(tmp_path):
    """Peak RSS planning 20k and 120k inputs: under 50 bytes more per input.

    Holding the inputs would cost ~300 bytes each (30 MB here); 20k is past the size
    where the spill's file buffers are full, so what remains is growth.
    """
    peaks = []
    for count in (20_000, 120_000):
        command = [sys.executable, "-c", _PLAN_AND_REPORT, str(count), str(tmp_path / str(count))]
        done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=100)
        assert done.returncode == 0, done.stderr
        peaks.append(int(done.stdout) * 1024)
    assert (peaks[1] - peaks[0]) / 100_000 < 50, peaks


def test_an_oversized_bucket_is_split_and_still_sorted(tmp_path, monkeypatch):
    keyed = order_key(5)
    records = []
    for i in range(2000):
        key = sample_key(f"c/{i}.jpg")
        # One bucket's worth: the top byte fixed, the rest of the hash as it falls.
        order = (7 << 56) | (order_hash(key, keyed) & ((1 << 56) - 1))
        records.append([order, key, "train", "c", f"c/{i}.jpg", f"/x/c/{i}.jpg", None])
    bucket = tmp_path / "007.jsonl"
    bucket.write_text("".join(json.dumps(r) + "\n" for r in records))
    monkeypatch.setattr(preprocess.plan, "MAX_BUCKET_BYTES", 16_000)
    assert bucket.stat().st_size > 16_000
    assert list(iter_sorted_bucket(bucket, 1)) == sorted(records)
    assert list(tmp_path.iterdir()) == []  # every bucket file is removed once read


def test_the_plan_is_the_same_in_memory_and_in_a_directory(tmp_path):
    in_memory = build_plan(fake_items(3000), 100, 0.2, 9)
    on_disk = build_plan(fake_items(3000), 100, 0.2, 9, tmp_path / "plan")
    assert in_memory.digest == on_disk.digest
    tasks = in_memory.tasks
    assert [t.samples for t in tasks] == [t.samples for t in on_disk.tasks]
    assert {s.rel for t in tasks for s in t.samples} == {i.rel for i in fake_items(3000)}
    assert build_plan(fake_items(3000), 100, 0.2, 10).digest != in_memory.digest  # seed
    assert build_plan(fake_items(3000), 50, 0.2, 9).digest != in_memory.digest  # shard size
