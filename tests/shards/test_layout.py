"""The `by_format` layout (`OUT/tar/`, `OUT/parquet/`, the default), the flat one of
earlier builds (still written on request, read and resumed), and the client index files (timm's `_info.json`, wids indexes) made from the manifest.

Each directory is opened by its path alone with the real clients (pyarrow.dataset,
polars, duckdb, HF datasets, wids); our loader, verify, info, `preprocess index`
and a rerun read both layouts; the manifest's name rules keep every shard inside
the output.
"""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as pads
import pytest

from pipeline import Batching, Crop, LoaderConfig, Workers, build_loader
from pipeline.sources import resolve_source
from preprocess.cli import main as preprocess_main
from preprocess.commit import rewrite_client_files
from preprocess.job import run_build
from preprocess.output import DEFAULT_LAYOUT
from preprocess.ray_job import BuildError
from preprocess.sample import make_sample
from preprocess.verify import describe, verify_directory
from shards.clients import INFO_NAME, SIZES_NAME, client_files, wids_index_name
from shards.manifest import (
    LAYOUT_BY_FORMAT,
    LAYOUT_FLAT,
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    read_manifest,
)
from tests.conftest import small_build_config

COUNT, CLASSES = 48, 3


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """A small ImageFolder tree, with two files left out for their suffix."""
    root = tmp_path_factory.mktemp("layout") / "images"
    make_sample(root, COUNT, classes=CLASSES, seed=4, workers=1)
    first_class = sorted(p for p in root.iterdir() if p.is_dir())[0]
    (first_class / "notes.txt").write_text("not an image")
    (first_class / "scan.tga").write_bytes(b"\0" * 64)
    return root


def build(images: Path, output: Path, layout: str | None = None):
    return run_build(small_build_config(images, output, shard_size=16, layout=layout))


@pytest.fixture(scope="module")
def by_format(images, tmp_path_factory):
    """A build with no layout asked for, so by_format: (summary, output directory)."""
    output = tmp_path_factory.mktemp("by-format") / "out"
    return build(images, output), output


@pytest.fixture(scope="module")
def flat(images, tmp_path_factory):
    """A flat build (the layout of every earlier build): (summary, output directory)."""
    output = tmp_path_factory.mktemp("flat") / "out"
    return build(images, output, LAYOUT_FLAT), output


def output_files(output: Path) -> dict[str, bytes]:
    return {
        p.relative_to(output).as_posix(): p.read_bytes()
        for p in sorted(output.rglob("*"))
        if p.is_file() and not p.relative_to(output).as_posix().startswith("_build/")
    }


# --- the layout on disk -------------------------------------------------------------------


def test_by_format_is_the_default_and_puts_each_format_in_a_directory_of_its_own(by_format):
    assert DEFAULT_LAYOUT == LAYOUT_BY_FORMAT
    assert small_build_config("in", "out").layout is None  # a rerun keeps its build's
    summary, out = by_format
    manifest = summary.manifest
    assert {p.name for p in (out / "tar").iterdir()} == {
        f"{split}-{i:06d}.tar" for split, s in manifest.splits.items() for i in range(len(s.shards))
    } | {SIZES_NAME}
    assert all(p.suffix == ".parquet" for p in (out / "parquet").iterdir())
    assert len(list((out / "parquet").iterdir())) == len(list((out / "tar").iterdir())) - 1
    document = json.loads((out / MANIFEST_NAME).read_text())
    assert (document["version"], document["layout"]) == (3, LAYOUT_BY_FORMAT)
    assert document["splits"]["train"]["patterns"]["tar"].startswith("tar/train-{000000..")
    assert document["splits"]["train"]["shards"][0]["files"]["parquet"]["name"] == (
        "parquet/train-000000.parquet"
    )
    assert read_manifest(out) == manifest


def test_a_flat_manifest_is_still_version_2_without_a_layout(flat):
    summary, out = flat
    document = json.loads((out / MANIFEST_NAME).read_text())
    assert document["version"] == 2 and "layout" not in document
    assert (out / "train-000000.tar").is_file() and not (out / "tar").exists()
    assert read_manifest(out).layout == LAYOUT_FLAT


# --- real clients open a format directory by its path ---------------------------------------


def test_dataframe_tools_open_the_parquet_directory_with_no_glob(by_format):
    summary, out = by_format
    path = str(out / "parquet")
    written = summary.manifest.written
    assert pads.dataset(path).count_rows() == written
    assert pl.scan_parquet(path).select(pl.len()).collect().item() == written
    query = f"SELECT count(*), count(DISTINCT cls) FROM read_parquet('{path}')"
    assert duckdb.sql(query).fetchall() == [(written, CLASSES)]


def test_hf_datasets_loads_both_directories_with_train_and_validation(by_format):
    datasets = pytest.importorskip("datasets")
    summary, out = by_format
    splits = summary.manifest.splits
    expected = {"train": splits["train"].samples, "validation": splits["val"].samples}
    parquet = datasets.load_dataset(str(out / "parquet"))
    assert {name: len(part) for name, part in parquet.items()} == expected  # val -> validation
    assert parquet["train"].features["cls"].names == summary.manifest.classes
    tar = datasets.load_dataset(str(out / "tar"))
    assert {name: len(part) for name, part in tar.items()} == expected


def test_wids_reads_every_sample_through_the_index(by_format, tmp_path):
    wids = pytest.importorskip("wids")
    summary, out = by_format
    for split, info in summary.manifest.splits.items():
        dataset = wids.ShardListDataset(
            str(out / wids_index_name(split)), cache_dir=str(tmp_path / "cache")
        )
        keys = [dataset[i]["__key__"] for i in range(len(dataset))]
        assert len(keys) == len(set(keys)) == info.samples
        ours = resolve_source(out, split)
        assert len(dataset) == ours.total_samples


def test_timm_info_lists_every_shard_with_its_count(by_format):
    summary, out = by_format
    info = json.loads((out / INFO_NAME).read_text())
    manifest = summary.manifest
    assert info["num_classes"] == CLASSES and info["classes"] == manifest.classes
    for split, part in manifest.splits.items():
        entry = info["splits"][split]
        assert entry["name"] == split and entry["num_samples"] == part.samples
        assert entry["filenames"] == part.shards.names("tar")
        assert all((out / name).is_file() for name in entry["filenames"])
        assert sum(entry["shard_lengths"]) == part.samples
    validation = info["splits"]["validation"]  # timm's default --val-split
    assert validation["filenames"] == info["splits"]["val"]["filenames"]


# --- our own tools on both layouts ------------------------------------------------------------


def loader_keys(source, split="train") -> list[str]:
    config = LoaderConfig(
        source=str(source) if isinstance(source, Path) else source,
        split=split,
        batch=Batching(size=8),
        crop=Crop(image_size=32),
        workers=Workers(count=0),
        seed=1,
        train=False,
        with_keys=True,
    )
    return sorted(key for _, _, keys in build_loader(config) for key in keys)


def test_the_loader_reads_either_layout_by_directory_format_directory_or_urls(by_format, flat):
    (_, new), (_, old) = by_format, flat
    expected = loader_keys(old)
    assert loader_keys(new) == expected
    assert loader_keys(new / "parquet") == expected  # the format directory, its manifest above
    urls = sorted(str(p) for p in (new / "tar").glob("train-*.tar"))
    resolved = resolve_source(urls, "train")
    assert resolved.classes == read_manifest(new).classes  # from the manifest above tar/
    assert resolved.shards.sha256(0) is not None  # counts and checksums from it, not counted
    assert loader_keys(urls) == expected


def test_verify_and_info_read_both_layouts(by_format, flat):
    for _, out in (by_format, flat):
        report = verify_directory(out, check_images=False)
        assert report.samples == read_manifest(out).written
    text = describe(read_manifest(by_format[1]))
    assert "layout: by_format (tar/, parquet/" in text
    assert "tar: tar/train-{000000.." in text
    assert ".txt: 1" in text and ".tga: 1" in text


def test_a_rerun_keeps_the_layout_and_every_file_byte_identical(images, by_format, flat):
    for (_, out), layout in ((by_format, LAYOUT_BY_FORMAT), (flat, LAYOUT_FLAT)):
        before = output_files(out)
        again = build(images, out)  # no layout asked: the build's own
        assert again.shards_built == 0 and again.manifest.layout == layout
        assert output_files(out) == before
    with pytest.raises(BuildError, match="holds a flat build.*without --layout.*--overwrite"):
        build(images, flat[1], LAYOUT_BY_FORMAT)


def test_the_layout_is_not_an_output_shaping_option():
    config = small_build_config("in", "out", layout=LAYOUT_FLAT)
    assert config.output_shaping() == small_build_config("in", "out").output_shaping()
    assert "layout" not in config.output_shaping()  # old build records still match
    with pytest.raises(
        ValueError, match=r"BuildConfig\.layout 'tar' is not one of flat, by_format"
    ):
        small_build_config("in", "out", layout="tar")


def test_a_flat_build_recorded_before_layouts_existed_resumes_flat(images, tmp_path):
    out = tmp_path / "out"
    build(images, out, LAYOUT_FLAT)
    record_path = out / "_build" / "config.json"
    record = json.loads(record_path.read_text())
    del record["layout"]  # what builds made before the option wrote
    record_path.write_text(json.dumps(record))
    before = output_files(out)
    (out / MANIFEST_NAME).unlink()  # as if it had been interrupted before shard 1
    (out / "_build" / "train-000001.json").unlink()
    again = build(images, out)  # no layout asked, and the default is by_format
    assert (again.shards_built, again.manifest.layout) == (1, LAYOUT_FLAT)
    assert output_files(out) == before and not (out / "tar").exists()


def test_overwrite_replaces_a_by_format_build_with_a_flat_one(images, tmp_path):
    out = tmp_path / "out"
    build(images, out, LAYOUT_BY_FORMAT)
    config = small_build_config(images, out, shard_size=16, overwrite=True, layout=LAYOUT_FLAT)
    run_build(config)
    names = set(output_files(out))
    assert not any(name.startswith(("tar/", "parquet/")) for name in names)
    assert "train-000000.tar" in names and INFO_NAME in names


# --- the listing's counts by suffix ----------------------------------------------------------


def test_files_left_out_for_their_suffix_are_counted_in_summary_and_manifest(by_format, capsys):
    summary, out = by_format
    assert summary.left_out_suffixes == {".tga": 1, ".txt": 1}
    assert summary.left_out_suffixes_line.startswith(".tga: 1 (TGA")
    listing = json.loads((out / MANIFEST_NAME).read_text())["config"]["listing"]
    assert listing["left_out_suffixes"] == {".tga": 1, ".txt": 1}
    assert read_manifest(out).left_out_suffixes == {".tga": 1, ".txt": 1}
    from preprocess.cli import format_summary

    assert "files left out by extension: .tga: 1 (TGA" in format_summary(summary)


@pytest.mark.parametrize(
    "value, field",
    [
        ([".txt"], "config.listing.left_out_suffixes"),
        ({".txt": -1}, 'config.listing.left_out_suffixes[".txt"]'),
        ({".txt": "3"}, 'config.listing.left_out_suffixes[".txt"]'),
        ({".txt": True}, 'config.listing.left_out_suffixes[".txt"]'),
    ],
)
def test_a_bad_left_out_suffixes_block_is_a_manifest_error(flat, value, field):
    document = json.loads((flat[1] / MANIFEST_NAME).read_text())
    document["config"]["listing"]["left_out_suffixes"] = value
    with pytest.raises(ManifestError) as caught:
        Manifest.from_json(json.dumps(document), "shards/manifest.json")
    assert caught.value.field == field
    assert "shards/manifest.json" in str(caught.value)


# --- `preprocess index` -------------------------------------------------------------------------


def test_index_rewrites_the_client_files_byte_identical_without_a_shard(by_format, tmp_path):
    summary, out = by_format
    copy = tmp_path / "copy"
    copy.mkdir()
    # Only the manifest is copied: no shard is there to open, and the index needs none.
    (copy / MANIFEST_NAME).write_bytes((out / MANIFEST_NAME).read_bytes())
    assert preprocess_main(["index", str(copy)]) == 0
    for name, data in client_files(summary.manifest):
        assert (copy / name).read_bytes() == data == (out / name).read_bytes()


def test_index_writes_client_files_for_an_old_flat_output(flat, tmp_path):
    summary, out = flat
    for name in (INFO_NAME, wids_index_name("train"), wids_index_name("val"), SIZES_NAME):
        (out / name).unlink()
    written = rewrite_client_files(str(out))
    assert written == [INFO_NAME, wids_index_name("train"), wids_index_name("val"), SIZES_NAME]
    info = json.loads((out / INFO_NAME).read_text())
    assert info["splits"]["train"]["filenames"][0] == "train-000000.tar"


def test_index_of_a_directory_without_a_manifest_is_one_line(tmp_path, capsys):
    assert preprocess_main(["index", str(tmp_path)]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "no manifest at" in error and "build-shards" in error


# --- the manifest's name rules --------------------------------------------------------------


def renamed(out: Path, name: str, version: int | None = None) -> str:
    document = json.loads((out / MANIFEST_NAME).read_text())
    document["splits"]["train"]["shards"][0]["files"]["tar"]["name"] = name
    if version is not None:
        document["version"] = version
        document.pop("layout", None) if version < 3 else document.setdefault("layout", "flat")
    return json.dumps(document)


@pytest.mark.parametrize(
    "name, problem",
    [
        ("tar/../train-000000.tar", "is a path"),
        ("tar/sub/train-000000.tar", "is a path"),
        ("parquet/train-000000.tar", "is a path"),
        ("/tmp/train-000000.tar", "is a path"),
        ("tar/.train-000000.tar", "starts with '.'"),
        ("tar\\train-000000.tar", "is a path"),
        ("s3:/tar/train-000000.tar", "is a path"),
    ],
)
def test_a_shard_name_may_carry_only_its_own_format_directory(by_format, name, problem):
    with pytest.raises(ManifestError, match=problem) as caught:
        Manifest.from_json(renamed(by_format[1], name), "m.json")
    assert caught.value.field == "splits.train.shards[0].files.tar.name"


def test_a_format_directory_in_a_name_needs_version_3(flat):
    with pytest.raises(ManifestError, match="is a path") as caught:
        Manifest.from_json(renamed(flat[1], "tar/train-000000.tar", version=2), "m.json")
    assert caught.value.field == "splits.train.shards[0].files.tar.name"
    # A version-3 flat manifest may name a file in its format's directory explicitly.
    manifest = Manifest.from_json(renamed(flat[1], "tar/train-000000.tar", version=3), "m.json")
    assert manifest.shard_table("train", "tar").name(0, "tar") == "tar/train-000000.tar"


def test_version_3_names_its_layout(by_format):
    document = json.loads((by_format[1] / MANIFEST_NAME).read_text())
    for value in ("flat/", None, 3):
        document["layout"] = value
        with pytest.raises(ManifestError) as caught:
            Manifest.from_json(json.dumps(document), "m.json")
        assert caught.value.field == "layout"
    del document["layout"]
    with pytest.raises(ManifestError, match="is missing") as caught:
        Manifest.from_json(json.dumps(document), "m.json")
    document["version"], document["layout"] = 2, LAYOUT_BY_FORMAT
    with pytest.raises(ManifestError, match="not a manifest field"):
        Manifest.from_json(json.dumps(document), "m.json")


def build_shards_args(images: Path, out: Path) -> list[str]:
    args = ["build-shards", "--input", str(images), "--output", str(out), "--image-size", "48"]
    return [*args, "--shard-size", "16", "--executor", "inline", "--no-progress"]


def test_build_shards_writes_by_format_by_default_through_the_command_line(
    images, tmp_path, capsys
):
    out = tmp_path / "out"
    args = build_shards_args(images, out)
    assert preprocess_main(args) == 0
    printed = capsys.readouterr().out
    assert "files left out by extension: .tga: 1" in printed
    assert f"for timm, wids and open_clip: {INFO_NAME}, train.wids.json" in printed
    assert (out / "tar" / "train-000000.tar").is_file()
    assert read_manifest(out).layout == LAYOUT_BY_FORMAT
    assert preprocess_main([*args, "--layout", "by_format"]) == 0  # asked for: the same
    assert "nothing to do" in capsys.readouterr().out
    assert preprocess_main([*args, "--layout", "flat"]) == 1  # another layout: refused
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "holds a by_format build" in error
    assert "without --layout" in error and str(out) in error
    assert preprocess_main(["index", str(out)]) == 0
    assert f"index: wrote {INFO_NAME}, train.wids.json" in capsys.readouterr().out


def test_build_shards_layout_flat_through_the_command_line(images, tmp_path, capsys):
    out = tmp_path / "out"
    args = build_shards_args(images, out)
    assert preprocess_main([*args, "--layout", "flat"]) == 0
    assert (out / "train-000000.tar").is_file() and not (out / "tar").exists()
    assert read_manifest(out).layout == LAYOUT_FLAT
    capsys.readouterr()
    assert preprocess_main(args) == 0  # a rerun without --layout keeps the build's own
    assert "nothing to do" in capsys.readouterr().out
    dry = preprocess_main([*args, "--layout", "by_format", "--dry-run"])
    assert dry == 0 and "refused" in capsys.readouterr().out  # the dry run says so too
    with pytest.raises(SystemExit) as exited:  # the switch the option replaced is gone
        preprocess_main([*args, "--format-dirs"])
    assert exited.value.code == 2
    assert "--format-dirs" in capsys.readouterr().err
