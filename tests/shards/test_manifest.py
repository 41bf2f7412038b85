"""manifest.json loading: a real build round-trips byte for byte; hostile manifests raise
one `ManifestError` that names the (redacted) file and the field, and nothing else."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pickle
import random
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from pipeline.sources import ResolvedSource, ShardSpecs, resolve_source
from preprocess.job import run_build
from preprocess.sample import make_sample
from shards.manifest import (
    LAYOUT_FLAT,
    MANIFEST_NAME,
    FileInfo,
    Manifest,
    ManifestError,
    ShardInfo,
    SideTableReader,
    SplitInfo,
    read_manifest,
    write_manifest,
)
from shards.manifest import parse as manifest_parse
from tests.conftest import small_build_config
from tests.httpserver import LocalHTTPServer

pytestmark = pytest.mark.timeout(60)

SECRET = "hunter2"
SOURCE = f"https://reader:{SECRET}@data.example/sets/a/manifest.json?X-Amz-Signature=s1gn4ture"
REDACTED = "https://***@data.example/sets/a/manifest.json?X-Amz-Signature=REDACTED"
SHARD0 = "splits.train.shards[0]"
SHARD1 = "splits.train.shards[1]"
TAR1 = f"{SHARD1}.files.tar"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A real dataset: 12 images in 3 classes, shards of 4, tar and Parquet.

    Flat on purpose: these are the rules of the version-2 manifest every earlier build
    wrote, which readers keep accepting; `tests/shards/test_layout.py` adds the rules
    of the default `by_format` layout (version 3).
    """
    root = tmp_path_factory.mktemp("manifest")
    make_sample(root / "images", 12, classes=3, seed=7, workers=1)
    config = small_build_config(root / "images", root / "out", shard_size=4, layout=LAYOUT_FLAT)
    run_build(config)
    return root / "out"


@pytest.fixture(scope="module")
def valid_text(built) -> str:
    return (built / MANIFEST_NAME).read_text("utf-8")


@pytest.fixture
def doc(valid_text) -> dict:
    """A fresh dict of the real manifest, for one test to mutate."""
    return json.loads(valid_text)


def load(text: str | bytes) -> Manifest:
    return Manifest.from_json(text, SOURCE)


def assert_rejected(text: str | bytes, field: str) -> ManifestError:
    """`text` raises exactly ManifestError naming the redacted source and `field`."""
    with pytest.raises(ManifestError) as caught:
        load(text)
    error = caught.value
    message = str(error)
    assert type(error) is ManifestError
    assert error.field == field, message
    assert message.startswith(f"{REDACTED}: {field}: "), message
    assert SECRET not in message and "s1gn4ture" not in message
    assert "build-shards" in message  # says what to do
    return error


# --- the real manifest ---------------------------------------------------------------------


def test_real_manifest_round_trips_byte_for_byte(built, valid_text):
    manifest = read_manifest(built)
    assert manifest.to_json() == valid_text
    assert load(valid_text.encode("utf-8")) == manifest
    assert manifest.written == 12 and manifest.formats == ["tar", "parquet"]
    rewritten = built.parent / "rewritten"
    rewritten.mkdir()
    write_manifest(rewritten, manifest)
    assert (rewritten / MANIFEST_NAME).read_text("utf-8") == valid_text
    for fmt in manifest.formats:
        for split in manifest.splits:
            urls = manifest.shard_urls(split, fmt, str(built))
            assert urls and all(u.startswith(f"{built}/") for u in urls)
            assert all((built / u.rsplit("/", 1)[1]).is_file() for u in urls)


def test_manifests_to_json_writes_without_optional_parts_still_load(doc):
    del doc["written"]
    del doc["splits"]["train"]["patterns"]
    del doc["splits"]["train"]["shards"][0]["class_counts"]
    doc["splits"]["val"]["shards"][0]["class_counts"] = []
    doc["splits"]["empty"] = {"samples": 0, "class_counts": [], "shards": []}
    manifest = load(json.dumps(doc))
    assert manifest.splits["train"].shards[0].class_counts == []
    assert manifest.splits["empty"].patterns() == {}
    assert load(manifest.to_json()) == manifest


def test_built_in_memory_manifest_round_trips():
    files = {
        "tar": FileInfo("train-000000.tar", 1024, "0" * 64),
        "parquet": FileInfo("train-000000.parquet", 900, "a" * 64),
    }
    split = SplitInfo("train", 2, [ShardInfo(0, 2, files, [2, 0])], [2, 0])
    config = {"seed": 3, "val_fraction": 0.2, "nested": {"a": [1, None, True]}}
    manifest = Manifest(
        ["a", "b"], "jpg", ["tar", "parquet"], {"train": split}, config, 3, {"x": 1}
    )
    text = manifest.to_json()
    assert load(text) == manifest and load(text).to_json() == text


def test_read_manifest_names_the_local_file_and_caps_its_size(built, tmp_path, monkeypatch):
    bad = tmp_path / MANIFEST_NAME
    bad.write_bytes(b'{"format": "shardpipe-manifest", "version": 1, "classes": [1]}')
    with pytest.raises(ManifestError, match=r"manifest\.json: classes\[0\]: ") as caught:
        read_manifest(tmp_path)
    assert caught.value.source == str(bad)
    monkeypatch.setattr(manifest_parse, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(ManifestError, match=r": \(file\): larger than 1000 bytes"):
        read_manifest(built)
    with pytest.raises(FileNotFoundError, match="did not finish"):
        read_manifest(tmp_path / "nothing")


def test_error_survives_pickling_with_its_fields():
    error = ManifestError(SOURCE, "splits.train.samples", "is -1")
    back = pickle.loads(pickle.dumps(error))
    assert (back.source, back.field, back.problem, str(back)) == (
        REDACTED,
        "splits.train.samples",
        "is -1",
        str(error),
    )
    assert isinstance(back, ValueError)


# --- hostile manifests: each mutates the real one ------------------------------------------


def set_path(doc: dict, path: str, value) -> None:
    """Set `a.b[2].c` in `doc`; `value is DELETE` deletes it."""
    parts = [
        int(p) if p.isdigit() else p for p in path.replace("[", ".").replace("]", "").split(".")
    ]
    target = doc
    for part in parts[:-1]:
        target = target[part]
    if value is DELETE:
        del target[parts[-1]]
    else:
        target[parts[-1]] = value


DELETE = object()
# (field to set, value, field the error must name)
FIELD_CASES = {
    # names that would open files outside the dataset's directory, or odd ones
    "parent escape": (f"{TAR1}.name", "../outside/secret.tar", f"{TAR1}.name"),
    "deep parent escape": (f"{TAR1}.name", "../../../../etc/hostname", f"{TAR1}.name"),
    "absolute path": (f"{TAR1}.name", "/etc/passwd", f"{TAR1}.name"),
    "absolute tar": (f"{TAR1}.name", "/tmp/x.tar", f"{TAR1}.name"),
    "scheme": (f"{TAR1}.name", "s3://other/x.tar", f"{TAR1}.name"),
    "scheme without slashes": (f"{TAR1}.name", "file:x.tar", f"{TAR1}.name"),
    "backslash": (f"{TAR1}.name", "..\\outside\\x.tar", f"{TAR1}.name"),
    "subdirectory": (f"{TAR1}.name", "sub/x.tar", f"{TAR1}.name"),
    "hidden": (f"{TAR1}.name", ".hidden.tar", f"{TAR1}.name"),
    "dot": (f"{TAR1}.name", ".", f"{TAR1}.name"),
    "dotdot": (f"{TAR1}.name", "..", f"{TAR1}.name"),
    "empty name": (f"{TAR1}.name", "", f"{TAR1}.name"),
    "NUL in name": (f"{TAR1}.name", "x\x00.tar", f"{TAR1}.name"),
    "newline in name": (f"{TAR1}.name", "x\n.tar", f"{TAR1}.name"),
    "long name": (f"{TAR1}.name", "x" * 300 + ".tar", f"{TAR1}.name"),
    "wrong suffix": (f"{TAR1}.name", "train-000001.parquet", f"{TAR1}.name"),
    "no suffix": (f"{TAR1}.name", "train-000001", f"{TAR1}.name"),
    "duplicate name": (f"{TAR1}.name", "train-000000.tar", f"{TAR1}.name"),
    "name not a string": (f"{TAR1}.name", 7, f"{TAR1}.name"),
    "name missing": (f"{TAR1}.name", DELETE, f"{TAR1}.name"),
    # counts
    "negative count": (f"{SHARD0}.samples", -1, f"{SHARD0}.samples"),
    "bool count": (f"{SHARD0}.samples", True, f"{SHARD0}.samples"),
    "float count": (f"{SHARD0}.samples", 4.0, f"{SHARD0}.samples"),
    "string count": (f"{SHARD0}.samples", "4", f"{SHARD0}.samples"),
    "null count": (f"{SHARD0}.samples", None, f"{SHARD0}.samples"),
    "huge count": (f"{SHARD0}.samples", 10**10, f"{SHARD0}.samples"),
    "count missing": (f"{SHARD0}.samples", DELETE, f"{SHARD0}.samples"),
    "shard count sums wrong": (f"{SHARD0}.samples", 3, f"{SHARD0}.class_counts"),
    "split count sums wrong": ("splits.train.samples", 11, "splits.train.samples"),
    "negative split count": ("splits.train.samples", -10, "splits.train.samples"),
    "index out of order": (f"{SHARD1}.index", 0, f"{SHARD1}.index"),
    "bool index": (f"{SHARD1}.index", True, f"{SHARD1}.index"),
    "string index": (f"{SHARD1}.index", "1", f"{SHARD1}.index"),
    "class_counts too short": ("splits.train.class_counts", [10], "splits.train.class_counts"),
    "class_counts bool": (f"{SHARD0}.class_counts", [True, 1, 2], f"{SHARD0}.class_counts[0]"),
    "class_counts negative": (f"{SHARD0}.class_counts", [-1, 3, 2], f"{SHARD0}.class_counts[0]"),
    "class_counts not a list": (f"{SHARD0}.class_counts", 4, f"{SHARD0}.class_counts"),
    "bytes negative": (f"{TAR1}.bytes", -1, f"{TAR1}.bytes"),
    "bytes string": (f"{TAR1}.bytes", "20480", f"{TAR1}.bytes"),
    "bytes huge": (f"{TAR1}.bytes", 2**60, f"{TAR1}.bytes"),
    "sha256 upper case": (f"{TAR1}.sha256", "A" * 64, f"{TAR1}.sha256"),
    "sha256 short": (f"{TAR1}.sha256", "a" * 63, f"{TAR1}.sha256"),
    "sha256 number": (f"{TAR1}.sha256", 0, f"{TAR1}.sha256"),
    "inputs wrong": ("inputs", 13, "inputs"),
    "inputs float": ("inputs", 12.0, "inputs"),
    "inputs missing": ("inputs", DELETE, "inputs"),
    "written wrong": ("written", 11, "written"),
    "skipped negative": ("skipped", {"decode_error": -1}, "skipped.decode_error"),
    "skipped odd reason": ("skipped", {"a b\n": "1"}, 'skipped["a b\\n"]'),
    "skipped list": ("skipped", [], "skipped"),
    # formats and files
    "unknown format": ("formats", ["tar", "zip"], "formats[1]"),
    "no formats": ("formats", [], "formats"),
    "format twice": ("formats", ["tar", "tar"], "formats[1]"),
    "formats a string": ("formats", "tar", "formats"),
    "file for an unknown format": (f"{SHARD1}.files.zip", {}, f"{SHARD1}.files.zip"),
    "file missing for a format": (f"{SHARD1}.files.parquet", DELETE, f"{SHARD1}.files"),
    "files a list": (f"{SHARD1}.files", [], f"{SHARD1}.files"),
    "file a string": (TAR1, "train-000001.tar", TAR1),
    "file with extra key": (f"{TAR1}.mode", 0o777, f"{TAR1}.mode"),
    # everything else
    "image field": ("image_field", "exe", "image_field"),
    "class not a string": ("classes", ["a", 1, "c"], "classes[1]"),
    "class twice": ("classes", ["a", "b", "a"], "classes[2]"),
    "classes a string": ("classes", "abc", "classes"),
    "format": ("format", "webdataset", "format"),
    "version": ("version", 4, "version"),
    "version bool": ("version", True, "version"),
    "version string": ("version", "1", "version"),
    "unknown top-level key": ("extra", 1, "extra"),
    "unknown shard key": (f"{SHARD0}.extra", 1, f"{SHARD0}.extra"),
    "splits a list": ("splits", [], "splits"),
    "split a list": ("splits.train", [], "splits.train"),
    "split name empty": ("splits.", {"samples": 0, "class_counts": [], "shards": []}, 'splits[""]'),
    "shards a dict": ("splits.train.shards", {}, "splits.train.shards"),
    "shard a list": (SHARD1, [], SHARD1),
    "patterns a list": ("splits.train.patterns", [], "splits.train.patterns"),
    "config a list": ("config", [], "config"),
    "config too deep": ("config", json.loads("[" * 40 + "]" * 40), "config"),
}


@pytest.mark.parametrize("case", FIELD_CASES.values(), ids=FIELD_CASES.keys())
def test_hostile_field_is_one_manifest_error_naming_source_and_field(doc, case):
    path, value, field = case
    if path == "splits.":
        doc["splits"][""] = value
    elif path == "config" and isinstance(value, list) and value:
        doc["config"]["deep"] = value
        field = "config.deep" + "[0]" * 31
    else:
        set_path(doc, path, value)
    error = assert_rejected(json.dumps(doc), field)
    if path == "version":
        assert "upgrade" in str(error)


def test_count_above_what_the_shard_file_can_hold_is_refused(doc):
    shard = doc["splits"]["train"]["shards"][0]
    capacity = shard["files"]["tar"]["bytes"] // 512  # a tar sample takes a header block
    shard["samples"] = capacity + 1
    error = assert_rejected(json.dumps(doc), f"{SHARD0}.samples")
    assert "more than a" in str(error)


def test_version_message_keeps_its_advice(doc):
    doc["version"] = 7
    message = str(assert_rejected(json.dumps(doc), "version"))
    assert "manifest version 7; this code reads versions 1, 2 and 3" in message
    assert "upgrade" in message


def test_split_class_counts_must_be_the_sums_of_the_shards(doc):
    counts = doc["splits"]["train"]["class_counts"]
    low, high = min(range(3), key=counts.__getitem__), max(range(3), key=counts.__getitem__)
    counts[low], counts[high] = counts[high], counts[low]  # same total, wrong per class
    assert_rejected(json.dumps(doc), f"splits.train.class_counts[{min(low, high)}]")


def marked(doc: dict, path: str, raw: str) -> str:
    """The manifest's text with the value at `path` replaced by raw JSON text."""
    set_path(doc, path, "@@MARK@@")
    return json.dumps(doc, indent=1).replace('"@@MARK@@"', raw)


TEXT_CASES = {
    "NaN count": (f"{SHARD0}.samples", "NaN", f"{SHARD0}.samples"),
    "Infinity bytes": (f"{TAR1}.bytes", "Infinity", f"{TAR1}.bytes"),
    "-Infinity in config": ("config.seed", "-Infinity", "config.seed"),
    "float overflowing to inf": ("config.seed", "1e999", "config.seed"),
    "duplicate format key": (
        f"{SHARD1}.files",
        '{"tar": {"name": "a.tar", "bytes": 1, "sha256": "%s"}, "tar": 1}' % ("0" * 64),
        f"{SHARD1}.files",
    ),
    "duplicate key in config": ("config", '{"seed": 1, "seed": 2}', "config"),
    "integer of 5000 digits": (f"{SHARD0}.samples", "1" * 5000, "(file)"),
    "deep nesting in config": ("config.seed", "[" * 100_000 + "]" * 100_000, "(file)"),
}


@pytest.mark.parametrize("case", TEXT_CASES.values(), ids=TEXT_CASES.keys())
def test_hostile_json_is_one_manifest_error(doc, case):
    path, raw, field = case
    assert_rejected(marked(doc, path, raw), field)


def test_duplicate_top_level_key_is_refused(valid_text):
    text = valid_text.replace('"version": 2,', '"version": 2,\n "version": 2,', 1)
    error = assert_rejected(text, "(top level)")
    assert '"version" more than once' in str(error)


WHOLE_FILE_CASES = {
    "deep list": "[" * 100_000 + "]" * 100_000,
    "deep object": '{"a":' * 100_000 + "1" + "}" * 100_000,
    "not JSON": "hello",
    "empty": "",
    "truncated": '{"format": "shardpipe-manifest", "vers',
    "byte order mark": "\ufeff{}",
    "invalid UTF-8": b'{"format": "shardpipe-manifest", "classes": ["\xff\xfe"]}',
    "UTF-16": '{"format": 1}'.encode("utf-16"),
    "trailing garbage": '{"format": "shardpipe-manifest"} x',
}


@pytest.mark.parametrize("text", WHOLE_FILE_CASES.values(), ids=WHOLE_FILE_CASES.keys())
def test_unreadable_file_is_one_manifest_error(text):
    assert_rejected(text, "(file)")


@pytest.mark.parametrize("top", ["[]", "NaN", "1", '"manifest"', "null", "true"])
def test_top_level_must_be_an_object(top):
    assert_rejected(top, "(top level)")


# --- seeded mutation fuzzing ---------------------------------------------------------------

HOSTILE_STRINGS = [
    "",
    ".",
    "..",
    "../x.tar",
    "/etc/passwd",
    "s3://b/x.tar",
    "x.tar",
    "x.parquet",
    "\x00",
    "\ud800",
    "tar",
    "parquet",
    "jpg",
    "a" * 70,
    "0" * 64,
    "shardpipe-manifest",
]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.choice([0, 1, -1, 2**31, 2**63, 10**10, 10**30, -(10**20)])
    if kind == 1:
        return rng.randrange(-5, 50)
    if kind == 2:
        return rng.choice([0.0, 1.5, -2.0, float("nan"), float("inf"), 1e300])
    if kind == 3:
        return rng.choice([True, False, None])
    if kind in (4, 5):
        return rng.choice(HOSTILE_STRINGS)
    if kind in (6, 7):
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["name", "bytes", "sha256", "samples", "index", "tar", "x"]
    return {rng.choice(keys): random_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def all_paths(value, prefix=()):
    """Every (container path, key) in a JSON document, in document order."""
    items = value.items() if isinstance(value, dict) else enumerate(value)
    for key, child in items:
        yield prefix, key
        if isinstance(child, (dict, list)):
            yield from all_paths(child, (*prefix, key))


def mutate(rng: random.Random, doc: dict) -> str | bytes:
    paths = list(all_paths(doc))
    prefix, key = rng.choice(paths)
    target = doc
    for part in prefix:
        target = target[part]
    if rng.random() < 0.25:
        del target[key]
    else:
        target[key] = random_value(rng)
    text = json.dumps(doc, indent=1)
    if rng.random() < 0.1:  # and sometimes damage the bytes themselves
        data = bytearray(text.encode("utf-8"))
        data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data[: rng.randrange(len(data) // 2, len(data) + 1)])
    return text


def assert_safe(manifest: Manifest) -> None:
    """What every manifest that loads promises the loader."""
    assert load(manifest.to_json()) == manifest
    names = [f.name for s in manifest.splits.values() for sh in s.shards for f in sh.files.values()]
    assert len(names) == len(set(names))
    for name in names:
        assert "/" not in name and "\\" not in name and ":" not in name
        assert not name.startswith(".") and name.isprintable()
    for split in manifest.splits.values():
        assert split.samples == sum(s.samples for s in split.shards)
        for shard in split.shards:
            assert type(shard.samples) is int and shard.samples >= 0
            assert all(
                shard.samples <= f.bytes // 512 or f.name.endswith(".parquet")
                for f in shard.files.values()
            )


@pytest.mark.parametrize("seed", range(4))
def test_mutated_manifests_load_safely_or_raise_one_manifest_error(valid_text, seed):
    rng = random.Random(seed)
    base = json.loads(valid_text)
    rejected = 0
    for _ in range(100):
        text = mutate(rng, copy.deepcopy(base))
        try:
            manifest = load(text)
        except ManifestError as error:
            rejected += 1
            assert type(error) is ManifestError
            assert str(error).startswith(f"{REDACTED}: {error.field}: ")
            assert SECRET not in str(error)
            continue
        assert_safe(manifest)
    assert rejected > 50  # the mutator does reach the checks


# --- version 2: side tables ----------------------------------------------------------------

TRAIN_TABLE = "_shards-train.parquet"


@pytest.fixture(scope="module")
def side_built(built, tmp_path_factory):
    """The real dataset with every split's shards in a side table (version 2)."""
    directory = tmp_path_factory.mktemp("side")
    for path in built.iterdir():
        if path.is_file() and path.name != MANIFEST_NAME:
            shutil.copy(path, directory / path.name)
    write_manifest(directory, read_manifest(built), inline_max_shards=0)
    return directory


@pytest.fixture
def side_copy(side_built, tmp_path):
    """A private copy of `side_built` for one test to damage."""
    directory = tmp_path / "side"
    shutil.copytree(side_built, directory)
    return directory


def load_side(directory) -> Manifest:
    text = (directory / MANIFEST_NAME).read_bytes()
    return Manifest.from_json(text, SOURCE, read_table=SideTableReader(directory))


def assert_side_rejected(directory, field: str) -> ManifestError:
    """Like `assert_rejected`, for a manifest whose side tables are in `directory`."""
    with pytest.raises(ManifestError) as caught:
        load_side(directory)
    error = caught.value
    message = str(error)
    assert type(error) is ManifestError
    assert error.field == field, message
    assert message.startswith(f"{REDACTED}: {field}: "), message
    assert SECRET not in message and "s1gn4ture" not in message
    assert "build-shards" in message
    return error


def edit_document(directory, change) -> None:
    path = directory / MANIFEST_NAME
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document, indent=1))


def rewrite_table(directory, change, split: str = "train") -> None:
    """Replace a side table by `change(table)` and record its new size and sha256."""
    path = directory / f"_shards-{split}.parquet"
    table = change(pq.read_table(path))
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    data = sink.getvalue().to_pybytes()
    path.write_bytes(data)

    def record(document):
        ref = document["splits"][split]["table"]
        ref["bytes"], ref["sha256"] = len(data), hashlib.sha256(data).hexdigest()

    edit_document(directory, record)


def with_column(name: str, values, kind=None):
    """A `rewrite_table` change setting (or adding) column `name`."""

    def change(table: pa.Table) -> pa.Table:
        array = pa.array(values, kind or table.schema.field(name).type)
        if name in table.column_names:
            return table.set_column(table.column_names.index(name), name, array)
        return table.append_column(name, array)

    return change


def test_side_tables_round_trip_and_are_written_before_the_manifest(built, side_built):
    inline, side = read_manifest(built), read_manifest(side_built)
    assert side == inline and side.complete
    document = json.loads((side_built / MANIFEST_NAME).read_text())
    train = document["splits"]["train"]
    assert document["version"] == 2 and "shards" not in train
    assert train["table"]["name"] == TRAIN_TABLE and train["table"]["rows"] == 3
    assert [name for name, _ in side.to_files(inline_max_shards=0)][-1] == MANIFEST_NAME
    # the in-memory form: arrays, file names derived, ShardInfo made on access
    table = side.splits["train"].shards
    assert table.samples.dtype == np.int64 and table.files["tar"].names is None
    assert table[1] == inline.splits["train"].shards[1] and table[-1].index == 2
    assert [s.files["tar"].name for s in table] == [f"train-{i:06d}.tar" for i in range(3)]


def test_side_table_writes_are_deterministic(side_built, tmp_path):
    manifest = read_manifest(side_built)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        write_manifest(tmp_path / name, manifest, inline_max_shards=0)
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes()
    assert (side_built / TRAIN_TABLE).read_bytes() == (tmp_path / "a" / TRAIN_TABLE).read_bytes()


def test_version_1_manifests_still_load_and_may_not_name_a_side_table(valid_text, side_built):
    v1 = valid_text.replace('"version": 2,', '"version": 1,', 1)
    assert load(v1) == load(valid_text)
    document = json.loads((side_built / MANIFEST_NAME).read_text())
    document["version"] = 1
    assert_rejected(json.dumps(document), "splits.train.table")


def test_pyarrow_dataset_discovery_ignores_the_side_table(side_built):
    dataset = pads.dataset(side_built, format="parquet", exclude_invalid_files=True)
    found = {Path(f).name for f in dataset.files}
    assert TRAIN_TABLE not in found and "train-000000.parquet" in found


def test_a_partial_read_loads_one_split_one_format_and_cannot_be_written(side_built):
    manifest = read_manifest(
        side_built, splits=["val"], formats=["parquet"], shard_class_counts=False
    )
    assert not manifest.complete
    train, val = manifest.splits["train"].shards, manifest.splits["val"].shards
    assert len(train) == 3 and not train.loaded
    with pytest.raises(ValueError, match="not read"):
        train.samples  # noqa: B018
    assert val.class_counts is None and list(val.files) == ["parquet"]
    with pytest.raises(ValueError, match="were not read"):
        manifest.shard_urls("val", "tar", "/x")
    with pytest.raises(ValueError, match="cannot be written back"):
        manifest.to_json()
    assert manifest.shard_urls("val", "parquet", "/x") == ["/x/val-000000.parquet"]


def test_a_side_table_without_a_reader_is_refused(side_built):
    with pytest.raises(ManifestError, match="no reader for side files") as caught:
        load((side_built / MANIFEST_NAME).read_bytes())
    assert caught.value.field == "splits.train.table" and "read_manifest" in str(caught.value)


def damage(directory, how: str) -> None:
    path = directory / TRAIN_TABLE
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif how == "replaced":
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "garbage":
        data = b"not parquet at all" * 1000  # past the row bound: parsed, and refused
        path.write_bytes(data)
        edit_document(
            directory,
            lambda d: d["splits"]["train"]["table"].update(
                bytes=len(data), sha256=hashlib.sha256(data).hexdigest()
            ),
        )


@pytest.mark.parametrize("how", ["missing", "truncated", "replaced", "garbage"])
def test_a_side_table_that_is_not_the_one_recorded_is_refused(side_copy, how):
    damage(side_copy, how)
    error = assert_side_rejected(side_copy, "splits.train.table")
    assert TRAIN_TABLE in str(error)


TRAIN = "splits.train"
TABLE_REF_CASES = {
    "name escapes": ("name", "../x.parquet", f"{TRAIN}.table.name"),
    "name absolute": ("name", "/etc/x.parquet", f"{TRAIN}.table.name"),
    "name not parquet": ("name", "_shards-train.json", f"{TRAIN}.table.name"),
    "name is a shard": ("name", "train-000000.parquet", f"{TRAIN}.shards[0].files.parquet.name"),
    "rows negative": ("rows", -1, f"{TRAIN}.table.rows"),
    "rows wrong": ("rows", 2, f"{TRAIN}.table"),
    "rows huge": ("rows", 2**40, f"{TRAIN}.table.rows"),
    "bytes string": ("bytes", "2000", f"{TRAIN}.table.bytes"),
    "bytes huge": ("bytes", 2**50, f"{TRAIN}.table.bytes"),
    "sha256 short": ("sha256", "0" * 63, f"{TRAIN}.table.sha256"),
    "extra key": ("mode", 1, f"{TRAIN}.table.mode"),
}


@pytest.mark.parametrize("case", TABLE_REF_CASES.values(), ids=TABLE_REF_CASES.keys())
def test_a_hostile_side_table_reference_is_refused(side_copy, case):
    key, value, field = case
    if key == "name" and value == "train-000000.parquet":
        (side_copy / TRAIN_TABLE).rename(side_copy / value)
        (side_copy / "train-000000.parquet").touch()  # a build's shard would be here
        data = (side_copy / value).read_bytes()
        edit_document(side_copy, lambda d: d["splits"]["train"]["table"].update(name=value))
        (side_copy / value).write_bytes(data)
    else:
        edit_document(side_copy, lambda d: d["splits"]["train"]["table"].__setitem__(key, value))
    assert_side_rejected(side_copy, field)


def test_a_split_with_both_shards_and_a_table_is_refused(side_copy, doc):
    shards = doc["splits"]["train"]["shards"]
    edit_document(side_copy, lambda d: d["splits"]["train"].__setitem__("shards", shards))
    assert_side_rejected(side_copy, TRAIN)


def only_class_counts(table: pa.Table, ids, counts) -> pa.Table:
    table = table.set_column(
        table.column_names.index("class_ids"), "class_ids", pa.array(ids, pa.large_list(pa.int32()))
    )
    return table.set_column(
        table.column_names.index("class_counts"),
        "class_counts",
        pa.array(counts, pa.large_list(pa.int64())),
    )


def class_rows(side_copy, row: int, ids, counts):
    """A change replacing row `row`'s sparse class counts."""
    table = pq.read_table(side_copy / TRAIN_TABLE)
    all_ids, all_counts = (
        table.column("class_ids").to_pylist(),
        table.column("class_counts").to_pylist(),
    )
    all_ids[row], all_counts[row] = ids, counts
    return partial(only_class_counts, ids=all_ids, counts=all_counts)


def test_table_column_cases(side_copy):
    """Each mutation of the side table is refused naming the shard and the field."""
    samples = pq.read_table(side_copy / TRAIN_TABLE).column("samples").to_pylist()
    cases = [
        (with_column("samples", [samples[0], -1, samples[2]]), f"{TRAIN}.shards[1].samples"),
        (with_column("samples", [samples[0], None, samples[2]]), f"{TRAIN}.shards[1].samples"),
        (with_column("samples", [samples[0], 10**6, samples[2]]), f"{TRAIN}.shards[1].samples"),
        (with_column("tar_bytes", [30720, -1, 30720]), f"{TRAIN}.shards[1].files.tar.bytes"),
        (with_column("tar_bytes", [30720, 2**50, 30720]), f"{TRAIN}.shards[1].files.tar.bytes"),
        (with_column("tar_sha256", [b"x" * 31] * 3, pa.binary(31)), f"{TRAIN}.table"),
        (with_column("tar_sha256", ["0" * 64] * 3, pa.string()), f"{TRAIN}.table"),
        (with_column("extra", [1, 2, 3], pa.int64()), f"{TRAIN}.table"),
        (lambda t: t.drop_columns(["parquet_sha256"]), f"{TRAIN}.table"),
        (lambda t: t.drop_columns(["class_counts"]), f"{TRAIN}.table"),
        (with_column("samples", [float(s) for s in samples], pa.float64()), f"{TRAIN}.table"),
        (
            with_column(
                "tar_name", ["train-000000.tar", "../x.tar", "train-000002.tar"], pa.string()
            ),
            f"{TRAIN}.shards[1].files.tar.name",
        ),
        (
            with_column("tar_name", ["a.tar", "a.tar", "c.tar"], pa.string()),
            f"{TRAIN}.shards[1].files.tar.name",
        ),
        (
            with_column("tar_name", ["a.tar", "b.tar", "val-000000.tar"], pa.string()),
            "splits.val.shards[0].files.tar.name",
        ),
    ]
    for change, field in cases:
        directory = side_copy.parent / f"case-{len(list(side_copy.parent.iterdir()))}"
        shutil.copytree(side_copy, directory)
        rewrite_table(directory, change)
        assert_side_rejected(directory, field)


def test_table_class_count_cases(side_copy):
    table = pq.read_table(side_copy / TRAIN_TABLE)
    ids, counts = table.column("class_ids")[1].as_py(), table.column("class_counts")[1].as_py()
    total = sum(counts)
    cases = [
        ([5], [total], f"{TRAIN}.shards[1].class_counts"),  # an unknown class
        ([0], [total + 1], f"{TRAIN}.shards[1].class_counts"),  # more than the shard holds
        ([0, 1], [total, 0], f"{TRAIN}.shards[1].class_counts"),  # a zero entry
        ([1, 0], [total - 1, 1], f"{TRAIN}.shards[1].class_counts"),  # out of order
        ([0, 0], [total - 1, 1], f"{TRAIN}.shards[1].class_counts"),  # twice
        ([0], [total - 1], f"{TRAIN}.shards[1].class_counts"),  # sums short
        (ids[::-1], counts[::-1], f"{TRAIN}.shards[1].class_counts"),
    ]
    # All of the shard in one class: the shard is consistent, the split's sums are not.
    one = 0 if ids != [0] else 1
    dense = [dict(zip(ids, counts, strict=True)).get(c, 0) for c in range(3)]
    moved = [total if c == one else 0 for c in range(3)]
    first = next(c for c in range(3) if dense[c] != moved[c])
    cases.append(([one], [total], f"{TRAIN}.class_counts[{first}]"))
    if len(ids) < 2:
        cases.pop(6)
    for new_ids, new_counts, field in cases:
        directory = side_copy.parent / f"case-{len(list(side_copy.parent.iterdir()))}"
        shutil.copytree(side_copy, directory)
        rewrite_table(directory, class_rows(directory, 1, new_ids, new_counts))
        assert_side_rejected(directory, field)


def test_table_totals_must_match_the_manifest(side_copy):
    samples = pq.read_table(side_copy / TRAIN_TABLE).column("samples").to_pylist()
    fewer = with_column("samples", [*samples[:2], samples[2] - 1])
    rewrite_table(side_copy, lambda t: fewer(t.drop_columns(["class_ids", "class_counts"])))
    assert_side_rejected(side_copy, f"{TRAIN}.samples")


def test_a_table_with_explicit_names_round_trips(side_copy):
    names = ["first.tar", "second.tar", "third.tar"]
    rewrite_table(side_copy, with_column("tar_name", names, pa.string()))
    manifest = load_side(side_copy)
    assert manifest.shard_urls("train", "tar", "/d") == [f"/d/{n}" for n in names]
    assert manifest.locate("second.tar", "tar") == ("train", 1)
    assert manifest.locate("train-000001.tar", "tar") is None
    assert manifest.locate("train-000001.parquet", "parquet") == ("train", 1)
    rewritten = side_copy.parent / "rewritten"
    rewritten.mkdir()
    write_manifest(rewritten, manifest, inline_max_shards=0)
    columns = pq.read_table(rewritten / TRAIN_TABLE).column_names
    assert "tar_name" in columns and "parquet_name" not in columns
    assert load_side(rewritten) == manifest


# --- the loader's view: ShardSpecs ---------------------------------------------------------


def test_the_loader_reads_a_side_table_locally_and_over_http(built, side_built):
    inline = resolve_source(str(built), "train", "parquet")
    local = resolve_source(str(side_built), "train", "parquet", checksums=True)
    assert isinstance(local.shards, ShardSpecs) and local.counts.dtype == np.int64
    assert not local.counts.flags.writeable
    assert [(s.samples, s.sha256, s.bytes) for s in local.shards] == [
        (s.samples, s.sha256, s.bytes) for s in inline.shards
    ]
    # Without checksums the side table's sha256 column stays unread; its own digest remains.
    lean = resolve_source(str(side_built), "train", "parquet")
    assert lean.shards.digests is None and {s.sha256 for s in lean.shards} == {None}
    assert [(s.samples, s.bytes) for s in lean.shards] == [
        (s.samples, s.bytes) for s in inline.shards
    ]
    recorded = json.loads((side_built / "manifest.json").read_text())["splits"]["train"]["table"]
    assert lean.shards.table_sha256 == local.shards.table_sha256 == recorded["sha256"]
    assert inline.shards.table_sha256 is None
    with LocalHTTPServer(side_built) as base:
        secret = base.replace("http://", f"http://reader:{SECRET}@")
        remote = resolve_source(f"{secret}/manifest.json?X-Amz-Signature=s1gn4ture", "val")
    assert remote.shards[0].url == f"{secret}/val-000000.tar"
    assert remote.total_samples == read_manifest(built).splits["val"].samples
    assert SECRET not in repr(remote.shards) and "***@" in repr(remote.shards)


def test_a_remote_side_table_larger_than_recorded_is_refused_without_secrets(side_copy):
    path = side_copy / TRAIN_TABLE
    path.write_bytes(path.read_bytes() + b"\0" * 1000)
    with LocalHTTPServer(side_copy) as base:
        secret = base.replace("http://", f"http://reader:{SECRET}@")
        with pytest.raises(ManifestError) as caught:
            resolve_source(f"{secret}/manifest.json?X-Amz-Signature=s1gn4ture", "train")
    message = str(caught.value)
    assert caught.value.field == "splits.train.table" and TRAIN_TABLE in message
    assert SECRET not in message and "s1gn4ture" not in message


def test_shard_urls_beside_a_side_table_manifest_get_its_checksums(side_built):
    urls = [str(side_built / "train-000001.tar"), str(side_built / "train-000002.tar")]
    source = resolve_source(urls, "train")
    table = read_manifest(side_built).splits["train"].shards
    assert [s.sha256 for s in source.shards] == [table.files["tar"].sha256(i) for i in (1, 2)]
    assert list(source.counts) == [int(table.samples[1]), int(table.samples[2])]


def test_shard_specs_index_slice_and_pickle_compactly(side_built):
    source = resolve_source(str(side_built), "train")
    specs = source.shards
    assert specs[-1] == specs[len(specs) - 1] and specs[-1].url.endswith("train-000002.tar")
    with pytest.raises(IndexError):
        specs[len(specs)]
    assert list(specs[1:]) == list(specs)[1:]
    back = pickle.loads(pickle.dumps(source))
    assert list(back.shards) == list(specs) and back.total_samples == source.total_samples
    assert back.shards.names is None  # names are derived, not pickled one by one
    assert ResolvedSource(list(specs)).shards == specs  # a list becomes ShardSpecs


def test_the_trainers_data_identity_is_the_one_of_every_spec(built, side_built):
    torch_run = pytest.importorskip("trainers.run")
    from trainers.config import Runtime, Schedule, TrainConfig

    config = TrainConfig(schedule=Schedule(batch_size=8, accum_steps=2), run=Runtime(seed=1))
    source = resolve_source(str(built), "train")  # inline: every shard's own sha256
    digest = hashlib.sha256()
    for spec in source.shards:  # the formula before the columns
        name = os.path.basename(spec.display)
        digest.update(f"{name}|{spec.samples}|{spec.sha256 or ''}\n".encode())
    identity = torch_run.data_identity(source, config, 1, 3)
    assert identity["train_data"].endswith(digest.hexdigest()[:16])
    assert identity["global_batch"] == 16 and identity["seed"] == 1
    assert identity["task"] == "single-label" and identity["num_classes"] == 3
    assert identity["model"] == config.model.model and identity["aug_repeats"] == 1
    # A side table: its checksum stands for the shards' digests, read or not.
    lean = resolve_source(str(side_built), "train")
    digest = hashlib.sha256(f"table {lean.shards.table_sha256}\n".encode())
    for spec in lean.shards:
        digest.update(f"{os.path.basename(spec.display)}|{spec.samples}|\n".encode())
    identity = torch_run.data_identity(lean, config, 1, 3)
    assert identity["train_data"].endswith(digest.hexdigest()[:16])
    checked = resolve_source(str(side_built), "train", checksums=True)
    assert torch_run.data_identity(checked, config, 1, 3) == identity
