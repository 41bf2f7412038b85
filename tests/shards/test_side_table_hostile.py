"""Hostile side tables (`_shards-<split>.parquet`): each is one `ManifestError` naming the file.

A side table is opened as a shard is (non-blocking, refused unless a regular file), every
error reading its bytes becomes a `ManifestError` raised from it, and its row count is
tied to its byte size before it is read. The tampered tables here are *resealed*: their
new size and sha256 are written into `manifest.json`, so only the table's own checks
stand between them and the loader.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.sources import resolve_source
from shards.manifest import (
    MANIFEST_NAME,
    MIN_TABLE_ROW_BYTES,
    Manifest,
    ManifestError,
    SideTableReader,
    encode_table,
    read_manifest,
    write_manifest,
)
from tests.shards.test_manifest_scale import synthetic_manifest, synthetic_table

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
TABLE = "_shards-train.parquet"
CHILD_DEADLINE_S = 30


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A 12-shard train split in a side table (two formats, class counts), no shard files."""
    directory = tmp_path_factory.mktemp("side")
    write_manifest(directory, synthetic_manifest(12), inline_max_shards=0)
    return directory


@pytest.fixture
def copy(dataset, tmp_path) -> Path:
    directory = tmp_path / "side"
    directory.mkdir()
    for path in dataset.iterdir():
        (directory / path.name).write_bytes(path.read_bytes())
    return directory


def reseal(directory: Path, data: bytes, **ref) -> None:
    """Write `data` as the train side table and record its size and sha256 (and `ref`)."""
    (directory / TABLE).write_bytes(data)
    path = directory / MANIFEST_NAME
    document = json.loads(path.read_text())
    entry = document["splits"]["train"]["table"]
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), **ref)
    path.write_text(json.dumps(document, indent=1))


def parquet_bytes(table: pa.Table, **options) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **options)
    return sink.getvalue().to_pybytes()


def refused(directory: Path) -> ManifestError:
    """The `ManifestError` of loading `directory`, checked to name the split and the file."""
    with pytest.raises(ManifestError) as caught:
        read_manifest(directory)
    error = caught.value
    assert type(error) is ManifestError
    assert error.field.startswith("splits.train"), str(error)
    assert TABLE in str(error), str(error)
    return error


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter with a deadline: a reader that blocks fails, never hangs."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=CHILD_DEADLINE_S,
        check=False,
    )


# --- not a regular file -------------------------------------------------------------------

READ_EVERY_WAY = """
import sys
from pipeline.sources import resolve_source
from preprocess.cli import main
from shards.manifest import ManifestError, read_manifest

directory = sys.argv[1]
for read in (read_manifest, lambda d: resolve_source(d, "train")):
    try:
        read(directory)
    except ManifestError as error:
        print("refused:", error)
    except OSError as error:  # the loader's opener refuses a FIFO manifest.json itself
        print("refused (OSError):", error)
print("info exit", main(["info", directory]))
print("index exit", main(["index", directory]))  # reads through the build's OutputStore
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", [TABLE, MANIFEST_NAME])
def test_a_fifo_in_place_of_a_manifest_file_is_refused_at_once(copy, name):
    (copy / name).unlink()
    os.mkfifo(copy / name)
    done = run_child(READ_EVERY_WAY, str(copy))  # raises TimeoutExpired if a read blocks
    refusals = [line for line in done.stdout.splitlines() if line.startswith("refused")]
    assert len(refusals) == 2, done.stdout + done.stderr
    if name == TABLE:  # read through our own side-table reader: a ManifestError both ways
        assert all(line.startswith("refused: ") for line in refusals), refusals
    assert all(name in line and "not a regular file" in line for line in refusals), refusals
    assert "info exit 1" in done.stdout and "not a regular file" in done.stderr, done.stderr
    assert "index exit 1" in done.stdout, done.stdout + done.stderr
    assert done.stderr.count("not a regular file") == 2, done.stderr


def test_a_directory_in_place_of_the_side_table_is_refused(copy):
    (copy / TABLE).unlink()
    (copy / TABLE).mkdir()
    error = refused(copy)
    assert "not a regular file" in str(error)


# --- resealed tampers: every reading error is one ManifestError from its cause --------------


def good_table(directory: Path) -> pa.Table:
    return pq.read_table(directory / TABLE)


def non_utf8_column_name(table: pa.Table) -> bytes:
    """A column name whose bytes are not UTF-8 (pyarrow raises UnicodeDecodeError on it)."""
    renamed = table.rename_columns([*table.column_names[:-1], "zzzzzzzzzzzz"])
    return parquet_bytes(renamed).replace(b"zzzzzzzzzzzz", b"\xff\xfezzzzzzzzzz")


def with_column(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    return table.set_column(table.column_names.index(name), name, array)


def garbled_footer(table: pa.Table) -> bytes:
    data = bytearray(parquet_bytes(table))
    footer = int.from_bytes(data[-8:-4], "little")
    for at in range(len(data) - 8 - footer, len(data) - 8, 7):
        data[at] ^= 0x5A
    return bytes(data)


def foreign_schema_metadata(table: pa.Table) -> bytes:
    """`ARROW:schema` metadata that is not an Arrow schema."""
    return parquet_bytes(table.replace_schema_metadata({"ARROW:schema": "bm90IGEgc2NoZW1h"}))


def lying_schema_metadata(table: pa.Table) -> bytes:
    """A real `ARROW:schema` of another table (samples as strings) over these columns."""
    other = pa.schema([pa.field("samples", pa.string()), *list(table.schema)[1:]])
    encoded = base64.b64encode(other.serialize().to_pybytes())
    return parquet_bytes(
        table.replace_schema_metadata({"ARROW:schema": encoded}), store_schema=False
    )


def shard_like_table(table: pa.Table) -> bytes:
    """A valid Parquet file that is not a side table: a shard's columns."""
    rows = len(table)
    keys = [f"k{i}" for i in range(rows)]
    return parquet_bytes(pa.table({"__key__": keys, "jpg": [b"x"] * rows, "cls": [0] * rows}))


def retyped(name: str, kind: pa.DataType):
    def change(table: pa.Table) -> bytes:
        return parquet_bytes(with_column(table, name, pa.array(table[name].to_pylist(), kind)))

    return change


def first_null(name: str):
    def change(table: pa.Table) -> bytes:
        values = table[name].to_pylist()
        return parquet_bytes(
            with_column(table, name, pa.array([None, *values[1:]], table[name].type))
        )

    return change


def null_class_entries(table: pa.Table) -> bytes:
    ids = [[None] * len(row) for row in table["class_ids"].to_pylist()]
    return parquet_bytes(with_column(table, "class_ids", pa.array(ids, pa.large_list(pa.int32()))))


TAMPERS = {
    "non-UTF-8 column name": non_utf8_column_name,
    "samples as int32": retyped("samples", pa.int32()),
    "sha256 as variable binary": retyped("tar_sha256", pa.binary()),
    "class_ids as list<int64>": retyped("class_ids", pa.large_list(pa.int64())),
    "missing samples": lambda table: parquet_bytes(table.drop_columns(["samples"])),
    "missing tar_bytes": lambda table: parquet_bytes(table.drop_columns(["tar_bytes"])),
    "null samples": first_null("samples"),
    "null sha256": first_null("parquet_sha256"),
    "null class id entries": null_class_entries,
    "truncated footer": lambda table: parquet_bytes(table)[:-20] + b"PAR1",
    "cut in half": lambda table: parquet_bytes(table)[: len(parquet_bytes(table)) // 2],
    "garbled footer": garbled_footer,
    "not a side table": shard_like_table,
    "not an ARROW:schema": foreign_schema_metadata,
    "another table's ARROW:schema": lying_schema_metadata,
}
# Tampers whose bytes pyarrow itself cannot read: the error must be raised from its cause.
UNREADABLE = {"non-UTF-8 column name", "truncated footer", "cut in half", "garbled footer"}


@pytest.mark.parametrize("name", TAMPERS)
def test_a_resealed_tampered_side_table_is_one_manifest_error_naming_it(copy, name):
    reseal(copy, TAMPERS[name](good_table(copy)))
    error = refused(copy)
    if name in UNREADABLE:
        assert "not a readable Parquet table" in str(error)
        assert isinstance(error.__cause__, (pa.ArrowException, OSError, ValueError))


def test_the_loaders_read_of_a_resealed_tamper_is_a_manifest_error_too(copy):
    reseal(copy, non_utf8_column_name(good_table(copy)))
    with pytest.raises(ManifestError, match="UnicodeDecodeError") as caught:
        resolve_source(str(copy), "train")
    assert TABLE in str(caught.value) and isinstance(caught.value.__cause__, UnicodeDecodeError)


# --- rows bounded by bytes ----------------------------------------------------------------

HUGE_ROWS = 2**26
CHUNK_ROWS = 2**21


def write_zero_table(path: Path, rows: int, formats=("tar", "parquet")) -> None:
    """`rows` shards of zero samples, zero bytes and zero digests, compressed: ~1.7 MB."""
    zeros = pa.array(np.zeros(CHUNK_ROWS, np.int64))
    digests = pa.FixedSizeBinaryArray.from_buffers(
        pa.binary(32), CHUNK_ROWS, [None, pa.py_buffer(np.zeros(CHUNK_ROWS * 32, np.uint8))]
    )
    columns = {"samples": zeros}
    for fmt in formats:
        columns.update({f"{fmt}_bytes": zeros, f"{fmt}_sha256": digests})
    chunk = pa.table(columns)
    with pq.ParquetWriter(path, chunk.schema, compression="zstd") as writer:
        for _ in range(rows // CHUNK_ROWS):
            writer.write_table(chunk, row_group_size=CHUNK_ROWS)


@pytest.fixture(scope="module")
def zero_table(tmp_path_factory) -> Path:
    """The dataset of the report: a train split of 2**26 zero-sample shards, resealed."""
    directory = tmp_path_factory.mktemp("zero")
    write_manifest(directory, synthetic_manifest(12), inline_max_shards=0)
    write_zero_table(directory / TABLE, HUGE_ROWS)
    data = (directory / TABLE).read_bytes()
    document = json.loads((directory / MANIFEST_NAME).read_text())
    train = document["splits"]["train"]
    train.update(samples=0, class_counts=[])
    train["table"].update(rows=HUGE_ROWS, bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    document["written"] = document["inputs"] = document["splits"]["val"]["samples"]
    (directory / MANIFEST_NAME).write_text(json.dumps(document, indent=1))
    return directory


MEASURE = """
import json, resource, sys, time
from pipeline.sources import resolve_source
from shards.manifest import ManifestError, read_manifest

def peak_mib():
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) / 1024

directory, how = sys.argv[1], sys.argv[2]
base, started = peak_mib(), time.perf_counter()
try:
    if how == "full":
        read_manifest(directory)
    else:  # the loader's read: one format, no digests, no class counts
        resolve_source(directory, "train", checksums=how == "loader+digests")
    outcome = "loaded"
except ManifestError as error:
    outcome = f"{error.field}: {error}"
print(json.dumps({"outcome": outcome, "seconds": time.perf_counter() - started,
                  "peak_mib": peak_mib() - base}))
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmHWM")
@pytest.mark.parametrize("how", ["full", "loader", "loader+digests"])
def test_a_small_table_claiming_2_26_rows_is_refused_before_it_is_read(zero_table, how):
    size = (zero_table / TABLE).stat().st_size
    assert size < 4 * 2**20  # the attack: a few MB that would cost GiB
    done = run_child(MEASURE, str(zero_table), how)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["outcome"].startswith("splits.train.table.rows: "), result
    assert TABLE in result["outcome"] or "side table" in result["outcome"], result
    assert result["peak_mib"] < 64 and result["seconds"] < 2, result


@pytest.mark.parametrize("formats", [("tar",), ("tar", "parquet")])
def test_our_own_tables_always_clear_the_row_bound_even_all_zero(formats):
    """The bound's premise: `encode_table` stores every shard's digests in 32 bytes each,
    so even a table of zeros (the best case for compression) has that many bytes a row."""
    rows = 5000
    table = synthetic_table("train", rows, 3)
    for columns in table.files.values():
        columns.digests.flags.writeable = True
        columns.digests[:] = 0
        columns.sizes.flags.writeable = True
        columns.sizes[:] = 0
    data = encode_table(table, formats)
    assert len(data) >= rows * MIN_TABLE_ROW_BYTES * len(formats)


def test_a_table_at_the_row_bound_loads_and_one_row_past_it_is_refused(copy):
    data = (copy / TABLE).read_bytes()
    rows = len(good_table(copy))
    assert rows <= len(data) // (2 * MIN_TABLE_ROW_BYTES)
    tight = data[: rows * 2 * MIN_TABLE_ROW_BYTES]  # a recorded size just at the bound
    document = json.loads((copy / MANIFEST_NAME).read_text())
    entry = document["splits"]["train"]["table"]
    entry["bytes"] = len(tight)
    text = json.dumps(document)
    with pytest.raises(ManifestError) as caught:  # passes the bound, fails the size check
        Manifest.from_json(text, copy / MANIFEST_NAME, read_table=SideTableReader(copy))
    assert caught.value.field == "splits.train.table"
    entry["bytes"] = len(tight) - 1
    with pytest.raises(ManifestError) as caught:
        Manifest.from_json(
            json.dumps(document), copy / MANIFEST_NAME, read_table=SideTableReader(copy)
        )
    assert caught.value.field == "splits.train.table.rows"
    assert read_manifest(copy).splits["train"].shards.rows == rows
