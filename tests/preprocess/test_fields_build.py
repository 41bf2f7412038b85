"""build-shards with extra columns: captions, metadata, weights, multi-label and label-free data.

Input lists (CSV, JSONL, Parquet) carry columns that become sample members (`txt`,
keys of `json`, `weight`, `labels`); both formats hold the same fields per key, stock
webdataset and HF datasets read them, our loader streams them, and bad rows are
counted skips with the loader's own reasons.
"""

from __future__ import annotations

import csv
import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.config import Batching, Resampled
from preprocess.cli import main
from preprocess.job import run_build
from preprocess.listing import InputError
from preprocess.plan import sample_key
from shards.errors import DEFAULT_LIMITS
from shards.formats import get_format
from shards.manifest import ManifestError, read_manifest
from shards.sample import ALLOWED_FIELDS, Field
from tests.conftest import shard_key, shard_path, small_build_config

TAG_NAMES = ("cat", "dog", "car", "tree", "sky")
COUNT = 48  # images used of the session's sample tree


def images_of(sample_dir: Path, count: int = COUNT) -> list[Path]:
    return sorted(sample_dir.rglob("*.*"))[:count]


def caption(index: int) -> str:
    return f'photo {index}: ünïcödé, "quoted", comma\nand a second line'


def tags(index: int) -> list[str]:
    draw = random.Random(index)
    return sorted(draw.sample(TAG_NAMES, draw.randrange(4)))


@pytest.fixture(scope="module")
def image_root(sample_dir, tmp_path_factory) -> tuple[Path, list[str]]:
    """A directory of images (relative paths returned) that list files sit beside."""
    root = tmp_path_factory.mktemp("fields") / "data"
    rels = []
    for index, path in enumerate(images_of(sample_dir)):
        rel = f"img/{index:03d}{path.suffix}"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / rel)
        rels.append(rel)
    return root, rels


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def read_all(out: Path, fmt: str) -> dict[str, dict]:
    """Every sample of every split in one format, by key (members as bytes)."""
    manifest = read_manifest(out)
    fields = ALLOWED_FIELDS
    if manifest.fields is not None and manifest.fields["label"] != "single":
        fields = ALLOWED_FIELDS - {"cls", "label"}  # asked for, a label column must exist
    samples = {}
    for split in manifest.splits:
        for url in manifest.shard_urls(split, fmt, str(out)):
            with open(url, "rb") as stream:
                for sample in get_format(fmt).iter_samples(stream, url, fields=fields):
                    assert "__error__" not in sample
                    samples[sample["__key__"]] = {
                        k: v for k, v in sample.items() if not k.startswith("__")
                    }
    return samples


@pytest.fixture(scope="module")
def captioned(image_root, tmp_path_factory):
    """A CSV with captions, JSON tags and weights, built into tar and Parquet."""
    root, rels = image_root
    rows = [
        [rel, f"c{i % 3}", caption(i), json.dumps(tags(i)), f"{i % 4 / 2}"]
        for i, rel in enumerate(rels)
    ]
    listing = write_csv(root / "captions.csv", ["path", "label", "caption", "tags", "w"], rows)
    out = tmp_path_factory.mktemp("captioned") / "out"
    config = small_build_config(listing, out, fields=("caption:txt", "tags:json", "w:weight"))
    return run_build(config), out, rels


def test_csv_columns_build_into_identical_fields_in_tar_and_parquet(captioned):
    summary, out, rels = captioned
    assert summary.manifest.written == len(rels) and not summary.manifest.skipped
    tar, parquet = read_all(out, "tar"), read_all(out, "parquet")
    assert tar == parquet  # the same members with the same bytes, key by key
    for index, rel in enumerate(rels):
        sample = tar[sample_key(rel)]
        assert set(sample) == {"jpg", "cls", "json", "txt", "weight"}
        assert sample["txt"].decode("utf-8") == caption(index)
        assert json.loads(sample["weight"]) == index % 4 / 2
        meta = json.loads(sample["json"])
        assert meta["tags"] == tags(index) and meta["source"] == rel
        assert summary.manifest.classes[int(sample["cls"])] == f"c{index % 3}"
    fields = summary.manifest.fields
    assert fields["label"] == "single"
    assert fields["columns"] == {"caption": "txt", "tags": "json", "w": "weight"}
    assert fields["members"] == {
        "cls": "label",
        "jpg": "image",
        "json": "json",
        "txt": "text",
        "weight": "weight",
    }
    # The typed Parquet columns: a string caption and a float weight.
    url = read_manifest(out).shard_urls("train", "parquet", str(out))[0]
    schema = pq.read_schema(url)
    assert schema.field("txt").type == pa.string() and schema.field("weight").type == pa.float64()


def test_stock_webdataset_and_hf_datasets_read_the_extra_fields(captioned, tmp_path):
    import datasets
    import webdataset as wds

    summary, out, rels = captioned
    manifest = read_manifest(out)
    expected = {sample_key(rel): index for index, rel in enumerate(rels)}
    tars = manifest.shard_urls("train", "tar", str(out))
    stock = list(wds.WebDataset(tars, shardshuffle=False, empty_check=False))
    assert len(stock) == manifest.splits["train"].samples
    for sample in stock:
        index = expected[sample["__key__"]]
        assert sample["txt"].decode("utf-8") == caption(index)
        assert json.loads(sample["json"])["tags"] == tags(index)
        assert float(sample["weight"]) == index % 4 / 2
    files = manifest.shard_urls("train", "parquet", str(out))
    ds = datasets.load_dataset(
        "parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf")
    )
    assert ds.features["txt"] == datasets.Value("string")
    assert ds.features["weight"] == datasets.Value("float64")
    for row in ds:
        index = expected[row["__key__"]]
        assert row["txt"] == caption(index) and row["weight"] == index % 4 / 2


def test_a_label_free_build_of_image_text_pairs_streams_every_sample_once(image_root, tmp_path):
    from tests.pipeline.conftest import loader_for

    root, rels = image_root
    rows = [{"path": rel, "text": caption(i)} for i, rel in enumerate(rels)]
    listing = write_jsonl(root / "pairs.jsonl", rows)
    out = tmp_path / "out"
    summary = run_build(
        small_build_config(listing, out, label="none", fields=("text:txt",), val_fraction=0.0)
    )
    manifest = summary.manifest
    assert manifest.classes == [] and manifest.fields["label"] == "none"
    assert "cls" not in manifest.fields["members"]
    assert read_all(out, "tar") == read_all(out, "parquet")
    assert all(
        "cls" not in s and "label" not in json.loads(s["json"])
        for s in read_all(out, "tar").values()
    )
    want = {sample_key(rel): caption(i) for i, rel in enumerate(rels)}
    for fmt in ("tar", "parquet"):
        loader = loader_for(
            out, format=fmt, fields=("image", "txt"), batch=Batching(size=8, drop_last=False)
        )
        seen = {}
        for images, texts, keys in loader:
            assert images.shape[0] == len(texts) == len(keys)
            for key, text in zip(keys, texts, strict=True):
                assert key not in seen
                seen[key] = text
        assert seen == want, fmt
    # Parquet without a label column counts (verify, sizing) like any other shard.
    url = manifest.shard_urls("train", "parquet", str(out))[0]
    with open(url, "rb") as stream:
        assert get_format("parquet").count_samples(stream, url, DEFAULT_LIMITS) > 0


def test_multi_label_round_trips_through_both_formats_hf_and_the_loader(image_root, tmp_path):
    import datasets

    from tests.pipeline.conftest import loader_for

    root, rels = image_root
    rows = [{"path": rel, "label": tags(i), "score": i / 10} for i, rel in enumerate(rels)]
    listing = write_jsonl(root / "tags.jsonl", rows)
    out = tmp_path / "out"
    config = small_build_config(listing, out, label="multi", fields=("score:json",))
    manifest = run_build(config).manifest
    classes = manifest.classes
    assert classes == sorted({name for i in range(len(rels)) for name in tags(i)})
    want = {sample_key(rel): [classes.index(n) for n in tags(i)] for i, rel in enumerate(rels)}
    tar, parquet = read_all(out, "tar"), read_all(out, "parquet")
    assert tar == parquet
    assert {key: json.loads(s["labels"]) for key, s in tar.items()} == want
    assert all("cls" not in s for s in tar.values())
    # Per-class counts of the written samples, per split, in the manifest's fields entry.
    for split, info in manifest.splits.items():
        assert info.class_counts == []
        keys = {key for key, s in tar.items() if json.loads(s["json"])["split"] == split}
        counts = [sum(c in want[k] for k in keys) for c in range(len(classes))]
        assert manifest.fields["label_counts"][split] == counts
    assert read_manifest(out).fields == manifest.fields
    files = manifest.shard_urls("train", "parquet", str(out))
    ds = datasets.load_dataset(
        "parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf")
    )
    assert ds.features["labels"] == datasets.List(datasets.ClassLabel(names=classes))
    assert {row["__key__"]: row["labels"] for row in ds} == {
        k: v for k, v in want.items() if k in set(ds["__key__"])
    }
    target = Field("labels", "multi_label", num_classes=len(classes))
    for fmt in ("tar", "parquet"):
        loader = loader_for(
            out, format=fmt, fields=("image", target), batch=Batching(size=8, drop_last=False)
        )
        for _, hot, keys in loader:
            for row, key in zip(hot.tolist(), keys, strict=True):
                assert [c for c, v in enumerate(row) if v] == want[key], fmt


def test_the_parquet_reader_takes_json_strings_for_labels_and_weight(tmp_path):
    from shards.parquet import iter_parquet_samples

    table = pa.table(
        {
            "__key__": ["a", "b"],
            "jpg": pa.array([b"x", b"y"], pa.binary()),
            "labels": ["[1, 2]", None],
            "weight": ["0.5", "2"],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    fields = frozenset(("jpg", "labels", "weight"))
    samples = list(iter_parquet_samples(str(tmp_path / "t.parquet"), "t.parquet", fields=fields))
    assert samples[0]["labels"] == b"[1, 2]" and samples[0]["weight"] == b"0.5"
    assert "labels" not in samples[1]  # a null cell is no member, as for json and txt


def test_bad_rows_are_counted_skips_with_the_loaders_reasons(image_root, tmp_path):
    root, rels = image_root
    bad = {
        rels[0]: ["", "0.5"],  # no caption
        rels[1]: ["x" * (2**20 + 1), "0.5"],  # over the 1 MiB cap
        rels[2]: ["fine", "-1"],  # a negative weight
        rels[3]: ["fine", "nan"],  # not JSON: a bad weight, as the loader counts it
        rels[4]: ["fine", "1e999"],  # infinite
    }
    rows = [[rel, *bad.get(rel, [f"caption {i}", "1"])] for i, rel in enumerate(rels)]
    listing = write_csv(root / "bad.csv", ["path", "caption", "w"], rows)
    out = tmp_path / "out"
    config = small_build_config(
        listing, out, label="none", fields=("caption:txt", "w:weight"), max_skip_fraction=0.5
    )
    manifest = run_build(config).manifest
    assert manifest.skipped == {"no_text": 1, "bad_text": 1, "bad_weight": 3}
    assert manifest.written == len(rels) - len(bad) and manifest.inputs == len(rels)
    errors = [json.loads(line) for line in (out / "errors.jsonl").read_text().splitlines()]
    assert {e["path"] for e in errors} == set(bad)
    assert all("bad.csv line" in e["detail"] and "rerun" in e["detail"] for e in errors)
    assert set(read_all(out, "tar")) == {sample_key(r) for r in rels if r not in bad}


def test_a_bad_column_declaration_is_one_clear_error_before_any_work(image_root, tmp_path, capsys):
    root, rels = image_root
    listing = write_csv(root / "plain.csv", ["path", "label"], [[rel, "a"] for rel in rels])
    out = tmp_path / "out"
    for fields, message in (
        ("caption", "write COLUMN:MEMBER"),
        ("caption:pkl", "member 'pkl' is not one of txt, json, weight"),
        ("a:txt,b:txt", "fills `txt` from two columns"),
        ("width:json", "already holds `width`"),
    ):
        argv = ["build-shards", "--input", str(listing), "--output", str(out), "--fields", fields]
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(InputError, match=r"has no `caption`.*--fields"):
        run_build(small_build_config(listing, out, fields=("caption:txt",)))
    with pytest.raises(InputError, match="ImageFolder tree, which has no columns"):
        run_build(small_build_config(root, out, label="multi"))
    assert not out.exists()


def built_names(out: Path) -> list[str]:
    """Every file a build wrote (its shards in their format directories too), but `_build/`."""
    names = (p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return sorted(name for name in names if not name.startswith("_build/"))


def test_same_inputs_and_options_give_byte_identical_shards_and_a_rebuilt_shard(
    captioned, image_root, tmp_path
):
    summary, out, _ = captioned
    root, _ = image_root
    again = tmp_path / "again"
    config = small_build_config(
        root / "captions.csv", again, fields=("caption:txt", "tags:json", "w:weight")
    )
    run_build(config)
    names = built_names(out)
    assert names == built_names(again) and shard_key("train", 1) in names
    for name in names:
        assert (out / name).read_bytes() == (again / name).read_bytes(), name
    # Resume: a lost shard and its marker are rebuilt byte for byte; the rest are kept.
    lost = shard_path(again, "train", 1)
    original = lost.read_bytes()
    lost.unlink()
    (again / "_build" / "train-000001.json").unlink()
    resumed = run_build(config)
    assert resumed.shards_built == 1 and lost.read_bytes() == original
    assert (again / "manifest.json").read_bytes() == (out / "manifest.json").read_bytes()


def test_the_manifest_fields_entry_is_validated(captioned):
    _, out, _ = captioned
    document = json.loads((out / "manifest.json").read_text())
    for change, where in (
        ({"members": {"pkl": "json"}}, "fields.members"),
        ({"label": "several"}, "fields.label"),
        ({"label_counts": {"train": [1]}}, "fields.label_counts"),
        ({"columns": {"caption": "labels"}}, "fields.columns"),
    ):
        broken = json.loads(json.dumps(document))
        broken["fields"].update(change)
        with pytest.raises(ManifestError, match=where.replace(".", r"\.")):
            read_manifest_text(broken)


def read_manifest_text(document: dict):
    from shards.manifest import Manifest

    return Manifest.from_json(json.dumps(document), "manifest.json")


def test_parquet_lists_carry_columns_of_every_type(image_root, tmp_path):
    """A Parquet input list: a list-typed label column and a struct json column."""
    root, rels = image_root
    table = pa.table(
        {
            "path": rels,
            "label": [tags(i) for i in range(len(rels))],
            "meta": [{"n": i, "odd": bool(i % 2)} for i in range(len(rels))],
            "caption": [caption(i) for i in range(len(rels))],
        }
    )
    pq.write_table(table, root / "list.parquet")
    out = tmp_path / "out"
    config = small_build_config(
        root / "list.parquet", out, label="multi", fields=("meta:json", "caption:txt")
    )
    manifest = run_build(config).manifest
    samples = read_all(out, "parquet")
    assert len(samples) == len(rels) == manifest.written
    for i, rel in enumerate(rels):
        sample = samples[sample_key(rel)]
        assert json.loads(sample["json"])["meta"] == {"n": i, "odd": bool(i % 2)}
        assert sample["txt"].decode() == caption(i)
        assert [manifest.classes[c] for c in json.loads(sample["labels"])] == tags(i)


def test_the_loader_refuses_a_label_the_manifest_says_the_dataset_lacks(image_root, tmp_path):
    from pipeline.loader import LoaderConfig, build_loader

    root, rels = image_root
    pairs = write_jsonl(root / "pairs2.jsonl", [{"path": r, "text": "a"} for r in rels])
    free = tmp_path / "free"
    run_build(small_build_config(pairs, free, label="none", fields=("text:txt",)))
    with pytest.raises(ValueError, match=r"no class labels \(built with --label none\)"):
        build_loader(LoaderConfig(source=str(free), batch=Batching(size=4)))
    tagged = write_jsonl(
        root / "tags2.jsonl", [{"path": r, "label": tags(i)} for i, r in enumerate(rels)]
    )
    multi = tmp_path / "multi"
    classes = run_build(small_build_config(tagged, multi, label="multi")).manifest.classes
    with pytest.raises(ValueError, match="holds multi-label targets"):
        build_loader(LoaderConfig(source=str(multi), batch=Batching(size=4)))
    # Asked for as they are, both load; multi-label class balance uses the label counts.
    build_loader(LoaderConfig(source=str(free), batch=Batching(size=4), fields=("image", "txt")))
    target = Field("labels", "multi_label", num_classes=len(classes))
    loader = build_loader(
        LoaderConfig(
            source=str(multi),
            batch=Batching(size=4),
            sampling=Resampled(epoch_samples=16, balance=True),
            fields=("image", target),
        )
    )
    counts = read_manifest(multi).fields["label_counts"]["train"]
    assert loader.settings.class_weights == tuple(1.0 / n if n else 0.0 for n in counts)
    assert sum(images.shape[0] for images, _ in loader) == 16


def test_train_on_a_multi_label_build_without_the_task_flag_is_one_line_naming_it(
    image_root, tmp_path, capsys
):
    from trainers.train import main

    root, rels = image_root
    tagged = write_jsonl(
        root / "tags3.jsonl", [{"path": r, "label": tags(i)} for i, r in enumerate(rels)]
    )
    out = tmp_path / "multi"
    run_build(small_build_config(tagged, out, label="multi"))
    argv = ["--train-shards", str(out), "--model", "cnn", "--device", "cpu", "--no-progress"]
    code = main([*argv, "--run-dir", str(tmp_path / "run"), "--no-tensorboard"])
    err = capsys.readouterr().err
    assert code == 1 and "pass --task multi-label" in err and "Traceback" not in err


def test_verify_checks_label_free_and_multi_label_builds_with_their_fields(image_root, tmp_path):
    from preprocess.verify import verify_directory, verify_fields

    root, rels = image_root
    rows = [{"path": r, "text": caption(i), "label": tags(i)} for i, r in enumerate(rels)]
    listing = write_jsonl(root / "both.jsonl", rows)
    free, multi = tmp_path / "free", tmp_path / "multi"
    run_build(small_build_config(listing, free, label="none", fields=("text:txt",)))
    run_build(small_build_config(listing, multi, label="multi", fields=("text:txt",)))
    for out in (free, multi):
        report = verify_directory(out)
        assert report.samples == len(rels) and not report.skipped
    # Verify decodes what each build wrote: the caption, and the label list when there is one.
    kinds = {f.name: f.kind for f in verify_fields(read_manifest(multi))}
    assert kinds["txt"] == "text" and kinds["labels"] == "multi_label" and "cls" not in kinds
    assert "labels" not in {f.name for f in verify_fields(read_manifest(free))}


def test_a_parquet_shard_whose_inputs_all_failed_keeps_the_builds_columns(image_root, tmp_path):
    import pyarrow.parquet as pq

    root, rels = image_root
    # Every input is missing, so every shard is written empty: its schema cannot come
    # from a first sample.
    rows = [{"path": f"gone-{i}.jpg", "label": "a", "text": "x"} for i in range(6)]
    listing = write_jsonl(root / "holes.jsonl", rows)
    out = tmp_path / "out"
    config = small_build_config(
        listing, out, fields=("text:txt",), shard_size=3, max_skip_fraction=1.0, val_fraction=0.0
    )
    manifest = run_build(config).manifest
    assert manifest.written == 0
    paths = manifest.shard_urls("train", "parquet", str(out))
    assert paths and all("txt" in pq.read_schema(path).names for path in paths)


def test_the_description_reaches_every_parquet_footer_ours_and_hfs(image_root, tmp_path):
    import pyarrow.parquet as pq

    from preprocess.cli import build_config_from_args, build_parser

    root, rels = image_root
    listing = write_jsonl(root / "desc.jsonl", [{"path": r, "label": "a"} for r in rels])
    out = tmp_path / "out"
    args = build_parser().parse_args(
        [
            "build-shards",
            "--input",
            str(listing),
            "--output",
            str(out),
            "--description",
            "sample photos, ten classes",
        ]
    )
    assert build_config_from_args(args).description == "sample photos, ten classes"
    config = small_build_config(listing, out, description="sample photos, ten classes")
    manifest = run_build(config).manifest
    files = manifest.shard_urls("train", "parquet", str(out))
    for path in files:
        metadata = pq.read_schema(path).metadata
        assert json.loads(metadata[b"shardpipe"])["description"] == "sample photos, ten classes"
        hf = json.loads(metadata[b"huggingface"])["info"]
        assert hf["description"] == "sample photos, ten classes"
    # A plain build's record has no description, so builds made before the option resume.
    assert "description" not in small_build_config(listing, out).output_shaping()
