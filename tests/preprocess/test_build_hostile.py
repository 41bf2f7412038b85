"""build-shards on hostile and flaky trees: symlinks, loops, bad names, bad list rows, reruns.

Small trees of real JPEGs from the session's sample dataset, built in-process
(`executor="inline"`): the cases are about listing, reading and resuming, not throughput.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from preprocess.build import ShardJob, build_shard
from preprocess.cli import format_summary, main
from preprocess.config import BuildConfig
from preprocess.job import run_build
from preprocess.listing import InputError
from preprocess.plan import build_plan
from preprocess.sources import scan_sources
from tests.conftest import shard_files, small_build_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def jpegs(sample_dir) -> list[Path]:
    """A dozen real sample JPEGs to copy into trees."""
    return sorted(sample_dir.rglob("*.jpg"))[:12]


def fill(directory: Path, sources: list[Path], prefix: str = "img") -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, source in enumerate(sources):
        target = directory / f"{prefix}_{i}.jpg"
        shutil.copyfile(source, target)
        out.append(target)
    return out


def build(root: Path, out: Path, **overrides):
    options = {"val_fraction": 0.0, "max_skip_fraction": 1.0, **overrides}
    return run_build(small_build_config(root, out, **options))


def errors_of(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]


def written_sources(out: Path) -> set[str]:
    """The `source` of every sample in the tar shards."""
    import tarfile

    sources = set()
    for shard in shard_files(out, "tar"):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    sources.add(json.loads(tar.extractfile(member).read())["source"])
    return sources


def shard_bytes(out: Path) -> dict[str, bytes]:
    names = [*shard_files(out, "tar"), *shard_files(out, "parquet"), out / "manifest.json"]
    return {p.name: p.read_bytes() for p in sorted(names)}


@pytest.fixture
def link_tree(tmp_path, jpegs):
    """`tree/a` with a nested link inside the root, `tree/c` a class linked from outside."""
    tree, pool = tmp_path / "tree", tmp_path / "pool"
    fill(tree / "a", jpegs[:3])
    fill(tree / "b" / "deep", jpegs[3:5])
    (tree / "a" / "more").symlink_to(tree / "b" / "deep", target_is_directory=True)
    fill(pool / "c", jpegs[5:7])
    (tree / "c").symlink_to(pool / "c", target_is_directory=True)
    return tree


def test_directory_links_are_followed_and_counted_by_default(link_tree, tmp_path):
    summary = build(link_tree, tmp_path / "out")
    manifest = summary.manifest
    assert manifest.inputs == 9 and manifest.written == 9 and manifest.skipped == {}
    assert {"a/more/img_0.jpg", "a/more/img_1.jpg", "c/img_0.jpg"} <= written_sources(
        tmp_path / "out"
    )
    assert summary.links_followed == 2
    assert manifest.config["listing"] == {"links_followed": 2, "left_out": {}}
    assert "symlinks followed: 2" in format_summary(summary)


def test_confine_to_input_refuses_a_directory_link_outside_and_names_it(
    link_tree, tmp_path, capsys
):
    out = tmp_path / "out"
    code = main(
        ["build-shards", "--input", str(link_tree), "--output", str(out), "--confine-to-input"]
        + ["--executor", "inline", "--no-progress", "--image-size", "64", "--val-fraction", "0"]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "not inputs: outside_input 1" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == 7  # a/* and a/more/* (inside the root) and b/deep/*
    assert manifest["config"]["confine_to_input"] is True
    assert manifest["config"]["listing"]["left_out"] == {"outside_input": 1}
    (entry,) = errors_of(out)
    assert entry["path"] == "c" and entry["reason"] == "outside_input" and entry["shard"] is None
    assert str(tmp_path / "pool" / "c") in entry["detail"]
    assert not any(s.startswith("c/") for s in written_sources(out))
    # The option shapes the output, and is left out of the record when off so that
    # builds recorded before it existed still resume.
    assert "confine_to_input" not in BuildConfig(input="x", output="y").output_shaping()


def test_file_links_outside_are_refused_when_opened_also_after_listing(tmp_path, jpegs):
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    files = fill(tree / "a", jpegs[:4])
    secret = fill(outside, jpegs[4:5])[0]
    (tree / "a" / "linked.jpg").symlink_to(secret)
    summary = build(tree, tmp_path / "followed")
    assert summary.manifest.written == 5 and summary.links_followed == 1
    summary = build(tree, tmp_path / "confined", confine_to_input=True)
    assert summary.manifest.skipped == {"outside_input": 1}
    (entry,) = errors_of(tmp_path / "confined")
    assert entry["path"] == "a/linked.jpg" and entry["shard"] == "train-000000"

    # A link that appears between listing and reading: plan, swap, then run the task.
    listing = scan_sources(str(tree), confine=True)
    plan = build_plan(listing.items, 32, 0.0, 0)
    swapped = files[0]
    swapped.unlink()
    swapped.symlink_to(secret)
    config = small_build_config(tree, tmp_path / "task", confine_to_input=True)
    (task,) = plan.tasks
    job = ShardJob(
        output=str(tmp_path / "task"),
        shaping=config.output_shaping(),
        image=config.image,
        formats=("tar",),
        class_names=tuple(plan.classes),
        row_group_size=16,
        confine_root=listing.root,
    )
    result = build_shard(task, job)
    reasons = {skip.path: skip.reason for skip in result.skipped}
    assert reasons == {"a/img_0.jpg": "outside_input", "a/linked.jpg": "outside_input"}
    assert result.info.samples == 3
    free = dataclasses.replace(job, output=str(tmp_path / "task-free"), confine_root=None)
    unconfined = build_shard(task, free)
    assert unconfined.skipped == [] and unconfined.info.samples == 5


def test_symlink_loops_are_counted_named_and_never_followed(tmp_path, jpegs):
    tree = tmp_path / "tree"
    fill(tree / "a", jpegs[:2])
    (tree / "a" / "up").symlink_to(tree, target_is_directory=True)
    (tree / "a" / "self").symlink_to(".", target_is_directory=True)
    (tree / "a" / "root").symlink_to("/", target_is_directory=True)
    (tree / "a" / "spin.jpg").symlink_to("spin.jpg")
    summary = build(tree, tmp_path / "out")
    assert summary.manifest.inputs == 2 and summary.manifest.written == 2
    assert summary.left_out == {"loop": 4}
    named = {e["path"]: e["reason"] for e in errors_of(tmp_path / "out")}
    assert named == {"a/up": "loop", "a/self": "loop", "a/root": "loop", "a/spin.jpg": "loop"}


def test_every_unused_tree_entry_is_counted_by_reason(tmp_path, jpegs):
    tree = tmp_path / "tree"
    fill(tree / "a", jpegs[:2])
    (tree / "a" / "notes.txt").write_text("not an image")
    (tree / "a" / ".hidden.jpg").write_bytes(b"hidden")
    (tree / "a" / ".cache").mkdir()
    (tree / "stray.jpg").write_bytes(b"not in a class directory")
    os.mkfifo(tree / "a" / "pipe.jpg")
    summary = build(tree, tmp_path / "out")
    assert summary.manifest.inputs == 2
    assert summary.left_out == {"hidden": 2, "no_class": 1, "not_regular": 1, "other_suffix": 1}
    assert [e["path"] for e in errors_of(tmp_path / "out")] == ["a/pipe.jpg"]


def test_names_that_are_not_utf8_are_skipped_and_named(tmp_path, jpegs, capsys):
    tree = tmp_path / "tree"
    fill(tree / "a", jpegs[:3])
    bad_file = os.path.join(os.fsencode(tree / "a"), b"caf\xe9.jpg")
    bad_dir = os.path.join(os.fsencode(tree / "a"), b"dir\xff")
    os.mkdir(bad_dir)
    for target in (bad_file, os.path.join(bad_dir, b"x.jpg")):
        with open(target, "wb") as f:
            f.write(jpegs[3].read_bytes())
    out = tmp_path / "out"
    code = main(
        ["build-shards", "--input", str(tree), "--output", str(out), "--executor", "inline"]
        + ["--no-progress", "--image-size", "64", "--max-skip-fraction", "0.5"]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert "skipped bad_name: 1" in printed and "not inputs: bad_name 1" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == 4 and manifest["written"] == 3
    assert manifest["skipped"] == {"bad_name": 1}
    named = {e["path"]: e for e in errors_of(out)}
    assert set(named) == {"a/caf\\xe9.jpg", "a/dir\\xff"}
    assert "rename" in named["a/caf\\xe9.jpg"]["detail"]


def write_list(path: Path, rows: list[dict], kind: str) -> None:
    if kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["path", "label"])
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize(
    "kind, bad, where",
    [
        ("csv", "a/x\x00.jpg", "line 4"),
        ("jsonl", "a/\x07.jpg", "line 3"),
        ("parquet", "a/\n", "row 3"),
    ],
)
def test_a_list_row_with_nul_or_control_characters_is_refused_naming_the_row(
    tmp_path, jpegs, kind, bad, where
):
    files = fill(tmp_path / "a", jpegs[:3])
    rows = [{"path": f"a/{f.name}", "label": "x"} for f in files]
    rows.insert(2, {"path": bad, "label": "x"})
    listing = tmp_path / f"list.{kind}"
    write_list(listing, rows, kind)
    with pytest.raises(InputError, match="control character") as caught:
        build(listing, tmp_path / "out")
    assert f"{listing} {where}" in str(caught.value)
    assert "fix or remove this row" in str(caught.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("layout", ["list", "broken_link"])
def test_a_missing_input_restored_later_is_recovered_by_a_plain_rerun(tmp_path, jpegs, layout):
    tree = tmp_path / "tree"
    files = fill(tree / "a", jpegs[:6])
    victim = files[2]
    if layout == "list":
        source = tmp_path / "list.csv"
        write_list(source, [{"path": f"tree/a/{f.name}", "label": "a"} for f in files], "csv")
    else:  # an ImageFolder tree whose file is a link into a store that loses it
        source = tree
        store = tmp_path / "store"
        store.mkdir()
        shutil.move(victim, store / victim.name)
        victim.symlink_to(store / victim.name)
        victim = store / victim.name
    fresh = build(source, tmp_path / "fresh")
    assert fresh.manifest.written == 6
    away = tmp_path / "away.jpg"
    shutil.move(victim, away)
    out = tmp_path / "out"
    first = build(source, out)
    assert first.manifest.skipped == {"missing": 1}
    again = build(source, out)  # still missing: retried, nothing rebuilt
    assert (again.retried, again.recovered, again.shards_built) == (1, 0, 0)
    shutil.move(away, victim)
    rerun = build(source, out)
    assert (rerun.retried, rerun.recovered, rerun.shards_built) == (1, 1, 1)
    assert rerun.manifest.skipped == {} and rerun.manifest.written == 6
    assert "rerun: retried 1 skipped inputs, recovered 1" in format_summary(rerun)
    assert (out / "errors.jsonl").read_text() == ""
    assert shard_bytes(out) == shard_bytes(tmp_path / "fresh")


def test_markers_without_stat_fields_still_retry_environmental_skips(tmp_path, jpegs):
    files = fill(tmp_path / "tree" / "a", jpegs[:4])
    away = tmp_path / "away.jpg"
    shutil.move(files[0], away)
    rows = [{"path": f"tree/a/{f.name}", "label": "a"} for f in files]
    write_list(tmp_path / "list.csv", rows, "csv")
    out = tmp_path / "out"
    build(tmp_path / "list.csv", out)
    (marker,) = (out / "_build").glob("*-*.json")
    document = json.loads(marker.read_text())
    for skip in document["skipped"]:  # the marker of a build before this change
        del skip["size"], skip["mtime_ns"]
    marker.write_text(json.dumps(document, indent=1))
    shutil.move(away, files[0])
    rerun = build(tmp_path / "list.csv", out)
    assert (rerun.retried, rerun.recovered, rerun.manifest.written) == (1, 1, 4)


def test_a_corrupt_input_is_retried_only_once_its_size_or_mtime_changed(tmp_path, jpegs):
    tree = tmp_path / "tree"
    fill(tree / "a", jpegs[:4])
    corrupt = tree / "a" / "corrupt.jpg"
    good = jpegs[4].read_bytes()
    corrupt.write_bytes(good[: len(good) // 2])
    out = tmp_path / "out"
    first = build(tree, out)
    (reason,) = first.manifest.skipped
    assert reason not in ("missing", "unreadable", "io_error")
    second = build(tree, out)
    assert (second.retried, second.shards_built, second.shards_reused) == (0, 0, 1)
    stat = corrupt.stat()
    os.utime(corrupt, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched, same bytes
    touched = build(tree, out)
    assert (touched.retried, touched.recovered, touched.shards_built) == (1, 0, 1)
    assert build(tree, out).retried == 0  # the rebuilt marker records the new mtime
    corrupt.write_bytes(good)  # repaired
    repaired = build(tree, out)
    assert (repaired.retried, repaired.recovered) == (1, 1)
    assert repaired.manifest.written == 5 and repaired.manifest.skipped == {}


def test_an_unreadable_input_is_a_skip_and_is_recovered_once_readable(tmp_path, jpegs, monkeypatch):
    import builtins

    import preprocess.images

    files = fill(tmp_path / "tree" / "a", jpegs[:4])
    locked = str(files[1])

    def denying_open(path, *args, **kwargs):  # chmod 000 does not stop root, who runs CI
        if path == locked:
            raise PermissionError(13, "Permission denied", path)
        return builtins.open(path, *args, **kwargs)

    monkeypatch.setattr(preprocess.images, "open", denying_open, raising=False)
    out = tmp_path / "out"
    first = build(tmp_path / "tree", out)
    assert first.manifest.skipped == {"unreadable": 1}
    (entry,) = errors_of(out)
    assert locked in entry["detail"] and "permissions" in entry["detail"]
    monkeypatch.undo()
    rerun = build(tmp_path / "tree", out)
    assert (rerun.retried, rerun.recovered, rerun.manifest.written) == (1, 1, 4)


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_list_row_that_is_not_utf8_is_refused_naming_the_file_and_row(tmp_path, kind):
    listing = tmp_path / f"list.{kind}"
    row = b"a/caf\xe9.jpg,x\n" if kind == "csv" else b'{"path": "a/caf\xe9.jpg", "label": "x"}\n'
    head = b"path,label\na/ok.jpg,x\n" if kind == "csv" else b'{"path": "a/ok.jpg", "label": "x"}\n'
    listing.write_bytes(head + row)
    line = 3 if kind == "csv" else 2
    with pytest.raises(InputError, match=rf"list\.{kind} line {line}: path .*caf\\+xe9.*not UTF-8"):
        build(listing, tmp_path / "out")
