"""build-shards on bad inputs and on manifest files: skip with a reason, count, never crash."""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from preprocess.cli import main
from preprocess.job import run_build
from preprocess.plan import sample_key
from preprocess.ray_job import BuildError
from preprocess.sources import InputError
from tests.conftest import shard_files, small_build_config
from tests.oddimages import make_odd_images


@pytest.fixture(scope="module")
def odd_tree(sample_dir, tmp_path_factory):
    """Good sample images plus every odd image, in two class directories."""
    root = tmp_path_factory.mktemp("odd") / "tree"
    shutil.copytree(sample_dir / "class_000", root / "good")
    expected = make_odd_images(root / "odd")
    (root / "odd" / ".hidden.jpg").write_bytes(b"ignored: hidden")
    (root / "odd" / "notes.txt").write_text("ignored: not an image suffix")
    (root / "stray.jpg").write_bytes(b"ignored: not inside a class directory")
    return root, expected


def test_every_bad_input_is_skipped_with_its_reason_and_nothing_is_lost(odd_tree, tmp_path):
    root, expected = odd_tree
    summary = run_build(small_build_config(root, tmp_path / "out", max_skip_fraction=1.0))
    manifest = summary.manifest
    good = len(list((root / "good").iterdir()))
    assert manifest.inputs == good + len(expected)  # hidden, .txt and stray files are not inputs
    assert manifest.written + sum(manifest.skipped.values()) == manifest.inputs
    want = Counter(reason for _, reason in expected.values() if reason)
    assert manifest.skipped == dict(want)
    errors = [
        json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()
    ]
    by_path = {e["path"]: e["reason"] for e in errors}
    for path, reason in expected.values():
        rel = f"odd/{path.name}"
        assert by_path.get(rel) == reason, rel
    assert main(["verify", str(tmp_path / "out")]) == 0


def test_skip_budget_fails_the_job_with_a_histogram_and_no_manifest(odd_tree, tmp_path):
    root, _ = odd_tree
    out = tmp_path / "out"
    with pytest.raises(BuildError, match=r"over --max-skip-fraction 1\.0%.*truncated: \d+"):
        run_build(small_build_config(root, out))
    assert not (out / "manifest.json").exists()
    assert (out / "errors.jsonl").read_text().count("\n") > 10
    # Raising the budget reuses every finished shard.
    summary = run_build(small_build_config(root, out, max_skip_fraction=1.0))
    assert summary.shards_built == 0 and summary.shards_reused > 0


def write_manifest(path, rows, kind):
    if kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet"])
def test_manifest_input_with_split_column_and_missing_files(sample_dir, tmp_path, kind):
    files = sorted(sample_dir.rglob("*.*"))[:60]
    rows = [
        {
            "path": str(f.relative_to(sample_dir)),
            "label": "cat" if i % 2 else "dog",
            "split": "test" if i < 10 else "train",
        }
        for i, f in enumerate(files)
    ]
    rows.append({"path": "class_000/does-not-exist.jpg", "label": "cat", "split": "train"})
    manifest_path = sample_dir / f"list-{kind}.{kind}"
    try:
        write_manifest(manifest_path, rows, kind)
        summary = run_build(
            small_build_config(manifest_path, tmp_path / "out", max_skip_fraction=0.5)
        )
    finally:
        manifest_path.unlink()
    manifest = summary.manifest
    assert manifest.classes == ["cat", "dog"]
    assert set(manifest.splits) == {"test", "train"}
    assert manifest.splits["test"].samples == 10
    assert manifest.skipped == {"missing": 1}
    assert manifest.inputs == 61


@pytest.mark.parametrize(
    "bad_path, message",
    [("../outside.jpg", "escapes"), ("/etc/passwd", "relative"), ("http://x/y.jpg", "relative")],
)
def test_manifest_paths_escaping_the_root_are_refused_up_front(tmp_path, bad_path, message):
    listing = tmp_path / "list.csv"
    listing.write_text(f"path,label\n{bad_path},a\n")
    with pytest.raises(InputError, match=message):
        run_build(small_build_config(listing, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_duplicate_manifest_rows_and_escaping_symlinks_are_refused(sample_dir, tmp_path):
    """Duplicates are refused up front; a link out of the root only under --confine-to-input."""
    one = next(sample_dir.rglob("*.jpg"))
    rel = one.relative_to(sample_dir)
    listing = sample_dir / "dupes.csv"
    listing.write_text(f"path,label\n{rel},a\n./{rel},a\n")
    try:
        with pytest.raises(InputError, match="duplicate"):
            run_build(small_build_config(listing, tmp_path / "out"))
    finally:
        listing.unlink()
    tree = tmp_path / "tree" / "cls"
    tree.mkdir(parents=True)
    shutil.copy(one, tree / "real.jpg")
    (tree / "link.jpg").symlink_to("/etc/hostname")
    config = small_build_config(
        tmp_path / "tree", tmp_path / "out2", confine_to_input=True, max_skip_fraction=1.0
    )
    summary = run_build(config)
    assert summary.manifest.skipped == {"outside_input": 1} and summary.manifest.written == 1


def test_numeric_labels_sort_as_numbers_and_keys_are_path_hashes(sample_dir, tmp_path):
    files = sorted(sample_dir.rglob("*.jpg"))[:12]
    listing = sample_dir / "numeric.jsonl"
    listing.write_text(
        "".join(
            json.dumps({"path": str(f.relative_to(sample_dir)), "label": [2, 10, 1][i % 3]}) + "\n"
            for i, f in enumerate(files)
        )
    )
    try:
        summary = run_build(small_build_config(listing, tmp_path / "out", val_fraction=0.0))
    finally:
        listing.unlink()
    assert summary.manifest.classes == ["1", "2", "10"]
    key = sample_key(str(files[0].relative_to(sample_dir)))
    assert len(key) == 16 and "." not in key


def test_empty_input_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty" / "cls").mkdir(parents=True)
    code = main(
        [
            "build-shards",
            "--input",
            str(tmp_path / "empty"),
            "--output",
            str(tmp_path / "o"),
            "--executor",
            "inline",
            "--no-progress",
        ]
    )
    assert code == 1
    assert "no images found" in capsys.readouterr().err


def test_inputs_in_an_object_store_are_listed_through_fsspec(sample_dir, built_shards, tmp_path):
    import fsspec

    memory = fsspec.filesystem("memory")
    for path in sorted(sample_dir.rglob("*")):
        if path.is_file():
            memory.pipe(f"/images/{path.relative_to(sample_dir).as_posix()}", path.read_bytes())
    memory.pipe("/images/.hidden/x.jpg", b"ignored")
    memory.pipe("/images/class_000/notes.txt", b"ignored")
    try:
        summary = run_build(small_build_config("memory://images", tmp_path / "out"))
        assert summary.manifest.inputs == built_shards.manifest.inputs
        listing = "path,label\nclass_000/img_0000000.jpg,a\n../escape.jpg,a\n"
        memory.pipe("/lists/bad.csv", listing.encode())
        with pytest.raises(InputError, match="inside the list's prefix"):
            run_build(small_build_config("memory://lists/bad.csv", tmp_path / "out2"))
        with pytest.raises(InputError, match="not supported"):
            run_build(small_build_config("ftp://host/images", tmp_path / "out3"))
    finally:
        memory.rm("/images", recursive=True)
        memory.rm("/lists", recursive=True)
    built = built_shards.output
    shards = [*shard_files(built, "tar"), *shard_files(built, "parquet")]
    assert len(shards) == 2 * sum(len(s.shards) for s in built_shards.manifest.splits.values())
    for shard in shards:
        name = shard.relative_to(built)
        assert (tmp_path / "out" / name).read_bytes() == shard.read_bytes(), name
