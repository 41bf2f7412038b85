"""A `Field` reads any member or column by name: img2dataset's Parquet and tars as they are.

The Parquet is written as img2dataset's `ParquetSampleWriter` writes it (its schema, a
`pyarrow.ParquetWriter` with default options, 100-row writes, failed downloads kept as
rows with a null `jpg`); the tars as its `WebDatasetSampleWriter` lays them out
(`000000000.jpg`, `.txt`, `.json`) and as webdataset's `TarWriter` writes a `caption`
member, which sorts before `jpg`. Mapped members are decoded only as their field's
kind: pickle-bearing names stay unreadable, caps apply before bytes are read.
"""

from __future__ import annotations

import io
import json
import pickle
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from pipeline.config import Batching
from shards.errors import ReadLimits, UsageError
from shards.formats import get_format
from shards.parquet import iter_parquet_samples
from shards.sample import (
    Field,
    MissingFieldError,
    member_caps,
    missing_field_hint,
    read_fields,
    resolve_fields,
    skip_budget_hint,
)
from shards.tar import count_tar_samples, iter_tar_samples
from tests.pipeline.conftest import loader_for

CAPTION = Field("txt", "text", source="caption")
# img2dataset's Parquet columns, in its order and types (the downloader's schema, then
# the `jpg` binary column that `ParquetSampleWriter` appends).
IMG2DATASET_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("caption", pa.string()),
        ("url", pa.string()),
        ("status", pa.string()),
        ("error_message", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_width", pa.int32()),
        ("original_height", pa.int32()),
        ("exif", pa.string()),
        ("sha256", pa.string()),
        ("jpg", pa.binary()),
    ]
)
ROWS = 130  # two writes of img2dataset's 100-row buffer
FAILED = frozenset((7, 64))  # downloads that failed: rows with a null jpg


def jpeg(index: int) -> bytes:
    pixels = np.random.default_rng(index).integers(0, 255, (40, 48, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG")
    return buffer.getvalue()


def caption_of(index: int) -> str:
    return f"a photo number {index} – ünïcödé"


def img2dataset_row(index: int) -> dict:
    ok = index not in FAILED
    image = jpeg(index) if ok else None
    return {
        "key": f"{index:09d}",
        "caption": caption_of(index),
        "url": f"http://127.0.0.1:8000/images/{index}.jpg",
        "status": "success" if ok else "failed_to_download",
        "error_message": None if ok else "HTTP Error 404: Not Found",
        "width": 48 if ok else None,
        "height": 40 if ok else None,
        "original_width": 480 if ok else None,
        "original_height": 400 if ok else None,
        "exif": "{}" if ok else None,
        "sha256": None,
        "jpg": image,
    }


def write_img2dataset_parquet(path) -> None:
    """As img2dataset's `BufferedParquetWriter`: `Table.from_pydict` every 100 rows."""
    writer = pq.ParquetWriter(str(path), IMG2DATASET_SCHEMA)
    for first in range(0, ROWS, 100):
        rows = [img2dataset_row(i) for i in range(first, min(ROWS, first + 100))]
        buffer = {name: [row[name] for row in rows] for name in IMG2DATASET_SCHEMA.names}
        writer.write_table(pa.Table.from_pydict(buffer, IMG2DATASET_SCHEMA))
    writer.close()


@pytest.fixture(scope="module")
def img2dataset_parquet(tmp_path_factory):
    path = tmp_path_factory.mktemp("img2dataset") / "00000.parquet"
    write_img2dataset_parquet(path)
    return path


def test_img2dataset_parquet_streams_with_one_mapped_field(img2dataset_parquet):
    loader = loader_for(
        str(img2dataset_parquet), train=False, batch=Batching(size=16), fields=("image", CAPTION)
    )
    texts = Counter()
    for images, captions, keys in loader:
        assert images.shape[1:] == (3, 32, 32) and images.float().std() > 5
        assert len(captions) == len(keys)
        texts.update(captions)
    expected = Counter(caption_of(i) for i in range(ROWS) if i not in FAILED)
    assert texts == expected  # every downloaded row once, with its own caption
    assert loader.stats.skipped == {"null_cell": len(FAILED)}  # failed downloads: counted


def test_mapped_parquet_columns_decode_as_their_field_kind(img2dataset_parquet):
    fields = resolve_fields(
        (
            "image",
            CAPTION,
            Field("status", "text", source="status"),
            Field("width", "weight", source="width"),
            Field("height", "label", source="height"),
            Field("exif", "json", source="exif"),
        )
    )
    loader = loader_for(
        str(img2dataset_parquet), train=False, batch=Batching(size=8), fields=fields
    )
    images, captions, status, widths, heights, exif, keys = next(iter(loader))
    assert status == ["success"] * 8 and exif == [{}] * 8
    assert widths.tolist() == [48.0] * 8 and heights.tolist() == [40] * 8
    assert set(captions) <= {caption_of(i) for i in range(ROWS)}


def test_mapped_parquet_cells_are_the_bytes_a_tar_member_would_hold(img2dataset_parquet):
    fields = frozenset(("jpg", "caption", "width", "error_message"))
    samples = list(iter_parquet_samples(str(img2dataset_parquet), "x.parquet", 6, 9, fields=fields))
    good, failed, after = samples
    assert good["caption"] == caption_of(6).encode("utf-8") and good["width"] == b"48"
    assert "error_message" not in good  # a null mapped cell: the sample lacks it
    assert failed["__error__"].reason == "null_cell"  # the null jpg of a failed download
    assert after["jpg"] == jpeg(8) and "url" not in after  # not asked for: not read


def test_an_oversized_mapped_cell_is_a_counted_skip_of_its_field(img2dataset_parquet):
    fields = resolve_fields(("image", Field("txt", "text", source="caption", max_bytes=32)))
    limits = ReadLimits(member_caps=member_caps(fields))
    url = str(img2dataset_parquet)
    samples = list(iter_parquet_samples(url, url, 0, 12, fields=read_fields(fields), limits=limits))
    # The captions of rows 0-9 take 32 bytes of UTF-8, those of rows 10 and 11 take 33.
    assert [len(caption_of(i).encode()) for i in (9, 10)] == [32, 33]
    assert [s["caption"] for s in samples if "__error__" not in s] == [
        caption_of(i).encode() for i in range(10) if i not in FAILED
    ]
    reasons = [(s["__key__"][-2:], s["__error__"].reason) for s in samples if "__error__" in s]
    assert reasons == [("07", "null_cell"), ("10", "bad_text"), ("11", "bad_text")]


def write_members(path, members: list[tuple[str, bytes]]) -> None:
    """A tar of the members in the order given, as `tarfile` writes them."""
    import tarfile

    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def img2dataset_tar(path, indices) -> None:
    """As img2dataset's `WebDatasetSampleWriter`: jpg, txt and a json of the row's meta."""
    members = []
    for index in indices:
        row = img2dataset_row(index)
        if row["jpg"] is None:
            continue  # failed downloads have no members, only a parquet row
        meta = {k: v for k, v in row.items() if k != "jpg"}
        key = row["key"]
        members += [
            (f"{key}.jpg", row["jpg"]),
            (f"{key}.json", json.dumps(meta, indent=4).encode()),
            (f"{key}.txt", row["caption"].encode()),
        ]
    write_members(path, members)


def test_img2dataset_tars_stream_captions_and_metadata(tmp_path):
    img2dataset_tar(tmp_path / "00000.tar", range(0, 20))
    img2dataset_tar(tmp_path / "00001.tar", range(20, 40))
    loader = loader_for(
        str(tmp_path / "{00000..00001}.tar"),
        train=False,
        batch=Batching(size=8),
        fields=("image", "txt", Field("meta", "json", source="json")),
    )
    seen = Counter()
    for _images, captions, metas, keys in loader:
        assert [m["key"] for m in metas] == list(keys)
        assert captions == [caption_of(int(k)) for k in keys]
        assert all(m["status"] == "success" for m in metas)
        seen.update(keys)
    assert seen == Counter(f"{i:09d}" for i in range(40) if i not in FAILED)


def caption_tar(path, indices) -> None:
    """webdataset's own `TarWriter`: members in name order, so `caption` precedes `jpg`."""
    wds = pytest.importorskip("webdataset")
    with wds.TarWriter(str(path)) as writer:
        for index in indices:
            writer.write(
                {"__key__": f"{index:09d}", "jpg": jpeg(index), "caption": caption_of(index)}
            )


def test_a_caption_member_before_the_image_is_read_into_its_sample(tmp_path):
    caption_tar(tmp_path / "00000.tar", range(24))
    fields = resolve_fields(("image", CAPTION))
    url = str(tmp_path / "00000.tar")
    with open(url, "rb") as stream:
        names = [m.name for m in __import__("tarfile").open(fileobj=stream)][:2]
    assert names == ["000000000.caption", "000000000.jpg"]  # the order the reader meets
    loader = loader_for(url, train=False, batch=Batching(size=6), fields=fields)
    seen = Counter()
    for _images, captions, keys in loader:
        assert captions == [caption_of(int(k)) for k in keys]
        seen.update(keys)
    assert seen == Counter(f"{i:09d}" for i in range(24))


def test_mapped_members_never_change_what_counts_as_a_sample(tmp_path):
    path = tmp_path / "x.tar"
    write_members(
        path,
        [
            ("a.caption", b"for a"),
            ("a.jpg", b"A"),
            ("orphan.caption", b"a group with no allowlisted member is no sample"),
            ("b.jpg", b"B"),
            ("b.caption", b"for b"),
            ("c.caption", b"dropped: d comes next"),
            ("d.jpg", b"D"),
        ],
    )
    fields = frozenset(("jpg", "caption"))
    with open(path, "rb") as stream:
        assert count_tar_samples(stream, "x.tar") == 3
    with open(path, "rb") as stream:
        samples = list(iter_tar_samples(stream, "x.tar", fields=fields))
    assert [(s["__key__"], s.get("caption")) for s in samples] == [
        ("a", b"for a"),
        ("b", b"for b"),
        ("d", None),
    ]
    with open(path, "rb") as stream:  # a window: indices are the same whatever is read
        window = list(iter_tar_samples(stream, "x.tar", 1, 2, fields=fields))
    assert [(s["__key__"], s["caption"]) for s in window] == [("b", b"for b")]


def test_a_mapped_member_over_its_cap_is_passed_over_unread(tmp_path):
    big = b"x" * 50_000
    path = tmp_path / "x.tar"
    write_members(path, [("a.caption", big), ("a.jpg", b"A"), ("b.jpg", b"B"), ("b.caption", big)])
    fields = resolve_fields(("image", Field("txt", "text", source="caption", max_bytes=100)))
    limits = ReadLimits(member_caps=member_caps(fields))

    class Recording(io.BytesIO):
        largest = 0

        def read(self, size=-1):
            data = super().read(size)
            Recording.largest = max(Recording.largest, len(data))
            return data

    stream = Recording(path.read_bytes())
    a, b = iter_tar_samples(stream, "x.tar", fields=read_fields(fields), limits=limits)
    assert a["__error__"].reason == b["__error__"].reason == "bad_text"
    assert "Field.max_bytes" in str(a["__error__"]) and "jpg" not in a
    assert Recording.largest < len(big)  # the caption's bytes were seeked over


def test_a_duplicate_mapped_member_is_a_bad_shard(tmp_path):
    path = tmp_path / "x.tar"
    write_members(path, [("a.caption", b"1"), ("a.caption", b"2"), ("a.jpg", b"A")])
    with open(path, "rb") as stream, pytest.raises(Exception, match="duplicate_field"):
        list(iter_tar_samples(stream, "x.tar", fields=frozenset(("jpg", "caption"))))


class Planted:
    """A pickle that would leave a file behind if anything unpickled it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("name", ["pth", "pyd", "pickle", "pkl", "PTH", "npy"])
def test_pickle_bearing_members_stay_unreadable_whatever_the_field(tmp_path, name):
    marker = tmp_path / "unpickled"
    planted = pickle.dumps(Planted(str(marker)))
    path = tmp_path / "x.tar"
    write_members(path, [("a.jpg", jpeg(0)), (f"a.{name}", planted), ("a.txt", b"hi")])
    for kind in ("text", "json", "weight"):
        with pytest.raises(UsageError, match="pickle"):
            Field("x", kind, source=name)
    with open(path, "rb") as stream, pytest.raises(UsageError, match="pickle"):
        list(iter_tar_samples(stream, "x.tar", fields=frozenset(("jpg", name))))
    with open(path, "rb") as stream:
        (sample,) = iter_tar_samples(stream, "x.tar")  # every allowlisted field: not it
    assert name not in sample and sample["txt"] == b"hi"
    assert not marker.exists()


@pytest.mark.parametrize("name", ["__error__", "__key__", "a.b", "../etc", "a/b", "", "x" * 65])
def test_member_names_that_are_paths_or_sample_entries_are_refused(name):
    with pytest.raises(UsageError, match="not a readable member name"):
        Field("x", "text", source=name)
    with pytest.raises(UsageError):
        list(iter_tar_samples(io.BytesIO(b""), "x.tar", fields=frozenset((name,))))


def test_an_image_field_reads_only_image_members():
    with pytest.raises(UsageError, match="an image field reads one of"):
        Field("image", "image", source="photo")
    assert Field("image", "image", source="jpeg").source == ("jpeg",)


def test_list_members_names_what_a_shard_holds(img2dataset_parquet, tmp_path):
    caption_tar(tmp_path / "x.tar", range(3))
    with open(tmp_path / "x.tar", "rb") as stream:
        assert get_format("tar").list_members(stream, "x.tar", ReadLimits()) == (
            "caption",
            "jpg",
        )
    with open(img2dataset_parquet, "rb") as stream:
        columns = get_format("parquet").list_members(stream, "x.parquet", ReadLimits())
    assert columns == tuple(IMG2DATASET_SCHEMA.names)


def test_the_missing_field_hint_names_the_field_the_members_and_the_field_to_write():
    hint = missing_field_hint(
        resolve_fields(("txt",))[0],
        ("key", "caption", "url", "status", "jpg", "width", "__key__"),
    )
    assert "\n" not in hint
    assert hint.startswith("field 'txt' reads member txt, which no sample has")
    assert "caption, jpg, key, status, url, width" in hint
    assert hint.endswith("write Field('txt', 'text', source='caption')")
    tags = Field("tags", "multi_label", source="labels", num_classes=5)
    assert "source='tags', num_classes=5)" in missing_field_hint(tags, ("jpg", "tags"))
    image = missing_field_hint(resolve_fields(("image",))[0], ("photo", "txt"))
    assert "rewrite the shards" in image
    assert "leave 'txt' out" in missing_field_hint(resolve_fields(("txt",))[0], ("jpg", "pth"))


def test_a_field_no_sample_has_is_refused_in_one_line_before_any_shard_is_read():
    from pipeline.loader import check_fields_fit
    from pipeline.sources import ResolvedSource

    source = ResolvedSource(shards=[], manifest_url="/data/manifest.json", label_mode="none")
    members = ("jpg", "json", "caption")
    with pytest.raises(UsageError) as refused:
        check_fields_fit(resolve_fields(("image", "txt")), source, members)
    assert str(refused.value) == (
        "/data/manifest.json: field 'txt' reads member txt, which no sample has; the samples "
        "have caption, jpg, json: to read caption as text, write "
        "Field('txt', 'text', source='caption')"
    )
    check_fields_fit(resolve_fields(("image", CAPTION, "json")), source, members)
    with pytest.raises(UsageError, match="no class labels"):
        check_fields_fit(resolve_fields(("image", "label")), source, members)


def test_the_skip_budget_hint_says_a_field_is_missing_only_when_that_is_every_skip():
    fields = resolve_fields(("image", "txt", "json"))
    members = ("caption", "jpg", "json")
    hint = skip_budget_hint(fields, {"no_text": 40}, members)
    assert hint == (
        "Every skip is a missing field: field 'txt' reads member txt, which no sample has; "
        "the samples have caption, jpg, json: to read caption as text, write "
        "Field('txt', 'text', source='caption')."
    )
    assert "member txt of field 'txt'" in skip_budget_hint(fields, {"no_text": 40})
    for mixed in ({"no_text": 40, "truncated": 1}, {"bad_text": 3}, {"no_label": 9}):
        assert "preprocess verify" in skip_budget_hint(fields, mixed, members)


def test_reading_a_field_no_sample_has_stops_naming_the_members_and_the_field_to_write(tmp_path):
    """Shards without a manifest are checked against their first shard's first sample
    before any worker starts: the line says the field is wrong (not the data)."""
    img2dataset_tar(tmp_path / "00000.tar", range(0, 20))
    with pytest.raises(MissingFieldError) as stopped:
        loader_for(
            str(tmp_path / "00000.tar"),
            fields=("image", Field("caption", "text", source="caption")),
        )
    message = str(stopped.value)
    assert "field 'caption' reads member caption, which no sample has" in message
    assert "the samples have jpg, json, txt" in message
    assert "write Field('caption', 'text', source='txt')" in message
    assert "preprocess verify" not in message
