"""Parquet shards other tools read as they are, and Parquet other tools wrote, read by us.

Our shards go through the real clients (pyarrow, polars, duckdb, Hugging Face
datasets) with no cast or option; Parquet written by HF datasets (image as the
`{bytes, path}` struct, `label`, no `__key__`) goes through our registry reader.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from preprocess.build import ShardJob, build_shard
from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.output import DEFAULT_LAYOUT
from preprocess.plan import build_plan
from preprocess.sample import make_sample
from preprocess.sources import list_sources
from shards.errors import ReadLimits, ShardError
from shards.formats import get_format
from shards.parquet import FORMAT_VERSION, ParquetShardWriter, synthetic_key_prefix
from shards.sample import IMAGE_FIELDS, check_key
from tests.conftest import shard_files

PARQUET = get_format("parquet")
TAR = get_format("tar")
DESCRIPTION = "Synthetic test images, four classes"
COUNT, CLASSES = 40, 4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Shards built task by task with class names and a description: (dir, classes, files)."""
    root = tmp_path_factory.mktemp("clients")
    make_sample(root / "images", COUNT, classes=CLASSES, seed=5, workers=1)
    plan = build_plan(list_sources(str(root / "images")), 16, 0.25, 0)
    config = BuildConfig(
        input=str(root / "images"),
        output=str(root / "out"),
        image=ImageConfig(image_size=48),
        row_group_size=8,
    )
    job = ShardJob(
        output=str(root / "out"),
        shaping=config.output_shaping(),
        image=config.image,
        formats=("tar", "parquet"),
        class_names=tuple(plan.classes),
        row_group_size=8,
        description=DESCRIPTION,
        layout=DEFAULT_LAYOUT,
    )
    for task in plan.tasks:
        build_shard(task, job)
    files = [str(p) for p in shard_files(root / "out", "parquet")]
    assert len(files) >= 3
    return root / "out", list(plan.classes), files


def our_rows(files: list[str]) -> list[tuple[str, int, bytes, dict]]:
    """(key, label, image bytes, json) of every row, read by our registry reader."""
    rows = []
    for url in files:
        for sample in PARQUET.iter_samples(url, url):
            meta = json.loads(sample["json"])
            rows.append((sample["__key__"], int(sample["cls"]), sample["jpg"], meta))
    return rows


def test_every_parquet_shard_carries_our_metadata_and_hf_features(built):
    _, classes, files = built
    for path in files:
        metadata = pq.read_schema(path).metadata
        # Class names are written twice, not three times (no pyarrow copy of the schema).
        assert set(metadata) == {b"shardpipe", b"huggingface"}
        ours = json.loads(metadata[b"shardpipe"])
        split = Path(path).name.split("-")[0]
        assert ours == {
            "format_version": FORMAT_VERSION,
            "key_field": "__key__",
            "image_field": "jpg",
            "label_field": "cls",
            "class_names": classes,
            "num_classes": len(classes),
            "description": DESCRIPTION,
            "split": split,
        }
        features = json.loads(metadata[b"huggingface"])["info"]["features"]
        assert features["jpg"] == {"_type": "Image"}
        assert features["cls"] == {"_type": "ClassLabel", "names": classes}
        assert features["__key__"] == {"_type": "Value", "dtype": "string"}


def test_tar_and_parquet_shards_hold_the_same_samples(built):
    out, _, files = built
    from_parquet = [(key, label, image) for key, label, image, _ in our_rows(files)]
    from_tar = []
    for url in sorted(str(p) for p in shard_files(out, "tar")):
        with open(url, "rb") as stream:
            from_tar += [
                (s["__key__"], int(s["cls"]), s["jpg"]) for s in TAR.iter_samples(stream, url)
            ]
    assert from_parquet == from_tar and len(from_tar) == COUNT


def test_pyarrow_reads_keys_labels_images_and_class_names(built):
    _, classes, files = built
    rows = our_rows(files)
    table = pq.read_table(files)
    assert table.num_rows == COUNT
    assert table.column("__key__").to_pylist() == [row[0] for row in rows]
    assert table.column("cls").to_pylist() == [row[1] for row in rows]
    images = table.column("jpg").combine_chunks().field("bytes").to_pylist()
    assert images == [row[2] for row in rows]
    assert table.column("jpg").null_count == 0
    assert json.loads(table.schema.metadata[b"shardpipe"])["class_names"] == classes


def test_polars_reads_a_file_list_and_a_glob(built):
    out, _, files = built
    rows = our_rows(files)
    frame = pl.read_parquet(files)
    assert frame.height == COUNT
    assert frame["__key__"].to_list() == [row[0] for row in rows]
    assert frame["cls"].to_list() == [row[1] for row in rows]
    assert frame["jpg"].struct.field("bytes").to_list() == [row[2] for row in rows]
    lazy = pl.scan_parquet(str(Path(files[0]).parent / "*.parquet"))
    counts = lazy.group_by("cls").len().sort("cls").collect()
    expected = [sum(row[1] == c for row in rows) for c in range(CLASSES)]
    assert counts["len"].to_list() == expected


def test_duckdb_counts_and_selects_image_bytes(built):
    _, _, files = built
    rows = our_rows(files)
    with duckdb.connect() as con:
        total, keys, low, high = con.execute(
            "SELECT count(*), count(DISTINCT __key__), min(cls), max(cls) FROM read_parquet(?)",
            [files],
        ).fetchone()
        assert (total, keys, low, high) == (COUNT, COUNT, 0, CLASSES - 1)
        key, label, image, _ = rows[5]
        found = con.execute(
            "SELECT cls, jpg.bytes FROM read_parquet(?) WHERE __key__ = ?", [files, key]
        ).fetchall()
    assert found == [(label, image)]


@pytest.mark.timeout(120)
def test_hf_datasets_loads_class_labels_and_images_with_no_cast(built, tmp_path):
    import datasets

    _, classes, files = built
    rows = our_rows(files)
    ds = datasets.load_dataset(
        "parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf")
    )
    assert isinstance(ds.features["cls"], datasets.ClassLabel)
    assert ds.features["cls"].names == classes
    assert isinstance(ds.features["jpg"], datasets.Image)
    assert ds["__key__"] == [row[0] for row in rows]
    assert ds["cls"] == [row[1] for row in rows]
    first = ds[0]["jpg"]
    assert isinstance(first, Image.Image)
    assert first.size == (rows[0][3]["width"], rows[0][3]["height"])
    streamed = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    assert streamed.features["cls"].names == classes
    sample = next(iter(streamed))
    assert sample["__key__"] == rows[0][0] and sample["jpg"].size == first.size


def write_ours(samples, **metadata) -> bytes:
    buffer = io.BytesIO()
    writer = ParquetShardWriter(buffer, "jpg", 4, **metadata)
    for sample in samples:
        writer.write(sample)
    writer.close()
    return buffer.getvalue()


def test_same_samples_and_metadata_give_the_same_bytes():
    samples = [
        {"__key__": f"k{i}", "jpg": bytes([i]) * 50, "cls": b"1", "json": b'{"split": "train"}'}
        for i in range(9)
    ]
    first = write_ours(samples, class_names=["a", "b"], description="d", split="train")
    assert write_ours(samples, class_names=["a", "b"], description="d", split="train") == first
    other = write_ours(samples, class_names=["a", "c"], description="d", split="train")
    assert other != first
    assert pq.read_table(io.BytesIO(other)).equals(pq.read_table(io.BytesIO(first)))
    # Without class names the label column is declared a plain integer.
    plain = json.loads(pq.read_schema(io.BytesIO(write_ours(samples))).metadata[b"huggingface"])
    assert plain["info"]["features"]["cls"] == {"_type": "Value", "dtype": "int64"}


def test_class_names_past_the_cap_leave_the_shard_and_hf_reads_it_alone():
    """Issue 29: every shard carried every class name twice, however many and long."""
    import datasets

    from shards.parquet.schema import CLASS_NAMES_IN_SHARD_BYTES

    sample = {"__key__": "k", "jpg": b"x", "cls": b"299", "json": b"{}"}
    names = [f"{index:03d}" + "x" * 997 for index in range(300)]
    assert len(json.dumps(names)) > CLASS_NAMES_IN_SHARD_BYTES
    data = write_ours([sample], class_names=names)
    assert len(data) < 4096
    schema = pq.read_schema(io.BytesIO(data))
    feature = datasets.Features.from_arrow_schema(schema)["cls"]
    assert feature == datasets.Value("int64")  # the names: the manifest's `classes`
    read = list(PARQUET.iter_samples(io.BytesIO(data), "mem.parquet"))
    assert read[0]["cls"] == b"299" and "__error__" not in read[0]
    over = list(
        PARQUET.iter_samples(
            io.BytesIO(write_ours([{**sample, "cls": b"300"}], class_names=names)), "m"
        )
    )
    assert over[0]["__error__"].reason == "bad_label"


# --- Parquet written by Hugging Face datasets ------------------------------------------------


def jpeg(shade: int, size=(10, 6)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (shade, 40, 90)).save(buffer, "JPEG")
    return buffer.getvalue()


def hf_parquet(path: Path, images: list, labels: list[int], column: str = "image") -> Path:
    """A Parquet file written by HF datasets: `Image` struct column, ClassLabel `label`."""
    import datasets

    ds = datasets.Dataset.from_dict({column: images, "label": labels})
    ds = ds.cast_column(column, datasets.Image())
    ds = ds.cast_column("label", datasets.ClassLabel(names=["cat", "dog", "eel"]))
    ds.to_parquet(str(path), batch_size=4)
    return path


HF_COLUMNS = [
    "jpg",
    pytest.param(
        "image",
        marks=pytest.mark.skipif(
            "image" not in IMAGE_FIELDS, reason="shards.sample.IMAGE_FIELDS lacks `image`"
        ),
    ),
]


@pytest.mark.parametrize("column", HF_COLUMNS)
def test_hf_written_parquet_streams_with_made_keys_labels_and_bytes(tmp_path, column):
    images = [jpeg(20 * i) for i in range(10)]
    labels = [i % 3 for i in range(10)]
    path = hf_parquet(tmp_path / "train-00000-of-00001.parquet", images, labels, column)
    schema = pq.read_schema(path)
    assert schema.field(column).type == pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    assert "__key__" not in schema.names
    fields = frozenset({column, "cls", "label"})
    samples = list(PARQUET.iter_samples(str(path), str(path), fields=fields))
    assert [s[column] for s in samples] == images
    assert [s["label"] for s in samples] == [str(label).encode() for label in labels]
    keys = [s["__key__"] for s in samples]
    prefix = synthetic_key_prefix(str(path))  # the stem, then a digest of the directory
    assert prefix.startswith("train-00000-of-00001-")
    assert keys == [f"{prefix}-{i:09d}" for i in range(10)]
    assert all(check_key(key) for key in keys) and not any("__error__" in s for s in samples)
    # Keys are the row index: a window reads the same keys, and counting agrees.
    with open(path, "rb") as stream:
        window = list(PARQUET.iter_samples(stream, str(path), 3, 7))
    assert [s["__key__"] for s in window] == keys[3:7]
    assert PARQUET.count_samples(str(path), str(path), ReadLimits()) == 10
    # Nothing asked for but the keys: still one sample per row.
    listed = list(PARQUET.iter_samples(str(path), str(path), fields=frozenset()))
    assert [s["__key__"] for s in listed] == keys


def test_hf_image_held_only_as_a_path_is_a_counted_skip_and_the_path_is_never_opened(tmp_path):
    import datasets
    from datasets.table import embed_table_storage

    secret = tmp_path / "secret.jpg"
    secret.write_bytes(jpeg(200))
    ds = datasets.Dataset.from_dict({"jpg": [str(secret)] * 3, "label": [0, 1, 2]})
    ds = ds.cast_column("jpg", datasets.Image())
    ds.to_parquet(str(tmp_path / "paths.parquet"))
    secret.write_bytes(b"changed after writing: a reader that opened the path would see this")
    samples = list(PARQUET.iter_samples(str(tmp_path / "paths.parquet"), "paths.parquet"))
    assert len(samples) == 3 and all("jpg" not in s for s in samples)
    error = samples[1]["__error__"]
    assert error.reason == "null_cell"
    assert "paths.parquet" in str(error) and "never opened" in str(error)
    assert "embed_table_storage" in str(error)
    # The advice in the message works: embedded, the bytes are read.
    secret.write_bytes(jpeg(200))
    embedded = ds.with_format("arrow").map(embed_table_storage, batched=True)
    embedded.to_parquet(str(tmp_path / "embedded.parquet"))
    again = list(PARQUET.iter_samples(str(tmp_path / "embedded.parquet"), "embedded.parquet"))
    assert [s["jpg"] for s in again] == [jpeg(200)] * 3


def test_caps_hold_for_struct_image_cells_and_row_groups(tmp_path):
    images = [jpeg(10), b"x" * 5000, jpeg(30)]
    path = hf_parquet(tmp_path / "hf.parquet", images, [0, 1, 2], "jpg")
    limits = ReadLimits(member_bytes=4000)
    samples = list(
        PARQUET.iter_samples(str(path), "hf.parquet", fields=frozenset({"jpg"}), limits=limits)
    )
    assert samples[1]["__error__"].reason == "member_too_large" and "jpg" not in samples[1]
    assert [samples[0]["jpg"], samples[2]["jpg"]] == [images[0], images[2]]
    with pytest.raises(ShardError) as info:
        list(PARQUET.iter_samples(str(path), "hf.parquet", limits=ReadLimits(row_group_bytes=1000)))
    assert info.value.reason == "row_group_too_large" and "hf.parquet" in str(info.value)


def write_table(columns: dict) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table(columns), buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (pa.array([{"path": "a.jpg"}], pa.struct([("path", pa.string())])), "'bytes'"),
        (pa.array([{"bytes": "text"}], pa.struct([("bytes", pa.string())])), "'bytes'"),
        (pa.array([[b"x"]], pa.list_(pa.binary())), "HF's Image"),
    ],
)
def test_image_columns_of_other_shapes_are_schema_errors(image, message):
    data = write_table({"jpg": image, "cls": [1]})
    with pytest.raises(ShardError) as info:
        list(PARQUET.iter_samples(io.BytesIO(data), "odd.parquet"))
    assert info.value.reason == "schema" and message in str(info.value)
    assert "odd.parquet" in str(info.value)


def test_a_label_asked_for_that_no_column_holds_is_a_schema_error_naming_both():
    data = write_table({"jpg": [b"x"]})
    with pytest.raises(ShardError) as info:
        list(
            PARQUET.iter_samples(io.BytesIO(data), "u.parquet", fields=frozenset({"cls", "label"}))
        )
    assert info.value.reason == "schema"
    assert "'cls' or 'label'" in str(info.value)
