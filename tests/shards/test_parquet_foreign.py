"""Parquet other tools wrote, at its most hostile (issue 29): odd label types, repeated
keys and pages whose size only shows once they are decompressed."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shards.parquet import iter_parquet_samples

pytestmark = pytest.mark.timeout(120)


def parquet_bytes(table: pa.Table, **options) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(table, buffer, **options)
    return buffer.getvalue()


def read(data: bytes, url: str = "mem.parquet", **options) -> list[dict]:
    return list(iter_parquet_samples(io.BytesIO(data), url, **options))


# --- a label past int64 ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, bad, names",
    [
        (pa.uint64(), 2**64 - 1, 4),
        (pa.uint32(), 2**32 - 1, 4),
        (pa.int8(), -128, 4),
        (pa.int8(), 127, 300),  # more classes than the type can hold: none is out of range
        (pa.uint8(), 255, 300),
    ],
)
def test_a_label_cell_past_int64_is_one_bad_label_skip_and_the_good_rows_are_delivered(
    kind, bad, names
):
    """Issue 29: a uint64 `label` holding 2^64 - 1 refused the whole shard as bad_data."""
    features = {"image": {"_type": "Image"}, "label": {"_type": "ClassLabel", "names": []}}
    features["label"]["names"] = [f"c{index}" for index in range(names)]
    table = pa.table(
        {"image": [bytes([i]) * 8 for i in range(5)], "label": pa.array([1, 2, bad, 0, 3], kind)}
    )
    metadata = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    samples = read(parquet_bytes(table.replace_schema_metadata(metadata), row_group_size=2))
    assert [s["image"][0] for s in samples] == [0, 1, 2, 3, 4]
    assert [s["label"] for s in samples if "__error__" not in s][:2] == [b"1", b"2"]
    if 0 <= bad < names:
        assert samples[2]["label"] == str(bad).encode() and "__error__" not in samples[2]
        return
    assert [s["label"] for s in samples if "__error__" not in s] == [b"1", b"2", b"0", b"3"]
    error = samples[2]["__error__"]
    assert error.reason == "bad_label" and f"class {bad}," in str(error)
    assert "label" not in samples[2]


# --- a repeated key ----------------------------------------------------------------------------


def keyed(keys: list, row_group_size: int | None = None) -> bytes:
    images = [bytes([row]) * 4 for row in range(len(keys))]
    table = pa.table({"__key__": keys, "jpg": images, "cls": [0] * len(keys)})
    return parquet_bytes(table, row_group_size=row_group_size)


@pytest.mark.parametrize("row_group_size", [None, 1, 2, 4])
def test_every_row_of_a_file_repeating_keys_is_delivered_under_a_distinct_key(row_group_size):
    """Issue 29: `k1, k1, k2, k2, k1, k3` lost 5 of its 6 rows as `non_adjacent_key`."""
    samples = read(keyed(["k1", "k1", "k2", "k2", "k1", "k3"], row_group_size))
    assert [s["jpg"][0] for s in samples] == [0, 1, 2, 3, 4, 5]
    assert [s["__key__"] for s in samples] == [
        "k1",
        "k1-000000001",
        "k2",
        "k2-000000003",
        "k1-000000004",
        "k3",
    ]
    assert [s.get("__repeated_key__") for s in samples] == [None, "k1", None, "k2", "k1", None]
    assert not any("__error__" in s for s in samples)


def test_a_made_key_never_takes_a_key_already_read_and_a_window_renames_what_it_sees():
    samples = read(keyed(["a", "a", "a-000000001", None, "a-000000001"]))
    got = [s["__key__"] for s in samples]
    assert got == ["a", "a-000000001", "a-000000001-000000002", "<row 3>", "a-000000001-000000004"]
    assert samples[3]["__error__"].reason == "null_cell"  # a null key is no repeat
    assert len(set(got)) == len(got)
    # A window reads only its own rows: a repeat of a key before it keeps its key there.
    window = read(keyed(["k1", "k1", "k2", "k2", "k1", "k3"], 2), start=2, stop=6)
    assert [s["__key__"] for s in window] == ["k2", "k2-000000003", "k1", "k3"]


# --- a page-size bomb --------------------------------------------------------------------------

# Written in a child process, so the test's own process never holds the cell.
WRITE_BOMB = """
import sys
import pyarrow as pa, pyarrow.parquet as pq
path, size = sys.argv[1], int(sys.argv[2])
cell = pa.py_buffer(bytes(size))  # zeros: a few KB of zstd
images = pa.Array.from_buffers(pa.binary(), 1, [None, pa.array([0, size], pa.int32()).buffers()[1], cell])
table = pa.table({"__key__": ["bomb"], "jpg": images, "cls": [0]})
pq.write_table(table, path, compression="zstd")
"""
READ_PEAK = """
import resource, sys
from shards.errors import ReadLimits, ShardError
from shards.parquet import iter_parquet_samples
limits = ReadLimits(row_group_bytes=int(sys.argv[2]), member_bytes=int(sys.argv[2]))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    outcome = f"read {len(list(iter_parquet_samples(sys.argv[1], sys.argv[1], limits=limits)))}"
except ShardError as error:
    outcome = f"{error.reason}: {error}"
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(grown // 1024, outcome)
"""


def _zigzag_varint(value: int, width: int) -> bytes:
    value *= 2  # zigzag of a non-negative value
    return bytes(((value >> 7 * i) & 0x7F) | (0x80 if i < width - 1 else 0) for i in range(width))


def write_bomb(path, cell_bytes: int, claimed: int = 1000) -> int:
    """A Parquet file of one zstd cell of `cell_bytes` zeros whose footer says its row
    group takes `claimed` bytes (the issue's: 600 MB in 21,819 bytes); returns its size."""
    subprocess.run([sys.executable, "-c", WRITE_BOMB, str(path), str(cell_bytes)], check=True)
    data = path.read_bytes()
    true_size = pq.ParquetFile(path).metadata.row_group(0).total_byte_size
    width = 1
    while (true_size * 2) >> (7 * width):
        width += 1
    # RowGroup.total_byte_size: field 2, an i64 (header 0x16), a zigzag varint.
    honest = b"\x16" + _zigzag_varint(true_size, width)
    assert data.count(honest) == 1
    path.write_bytes(data.replace(honest, b"\x16" + _zigzag_varint(claimed, width)))
    assert pq.ParquetFile(path).metadata.row_group(0).total_byte_size == claimed
    return len(data)


def test_a_page_that_decompresses_past_the_row_group_cap_is_refused_before_it_is(tmp_path):
    """Issue 29: 600 MB of zstd in a 22 KB file, its footer saying 1,000 bytes, peaked at
    2 GB. Here 48 MiB against a 4 MiB cap, in a child process that measures its peak."""
    path = tmp_path / "bomb.parquet"
    assert write_bomb(path, 48 * 2**20) < 64 * 2**10
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    result = subprocess.run(
        [sys.executable, "-c", READ_PEAK, str(path), str(4 * 2**20)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    grown_mib, outcome = result.stdout.split(" ", 1)
    assert outcome.startswith("bad_data: ") and str(path) in outcome, outcome
    assert re.search(r"decompress to at least 503316\d\d bytes .* footer says", outcome)
    assert int(grown_mib) < 16, result.stdout  # before: 48 MiB decompressed, then copied


@pytest.mark.parametrize("command", ["verify", "index"])
def test_verify_and_index_refuse_a_page_bomb_in_one_line_naming_the_file(tmp_path, capsys, command):
    """Issue 29: `preprocess index` exited 0 and wrote a manifest for the 600 MB bomb."""
    from preprocess.cli import main

    folder = tmp_path / "foreign"
    folder.mkdir()
    write_bomb(folder / "bomb.parquet", 129 * 2**20)  # past the default 128 MiB cap
    assert main([command, str(folder)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bomb.parquet" in err and "bad_data" in err, err
    assert "decompress to at least" in err and "ReadLimits.row_group_bytes" in err
    assert not (folder / "manifest.json").exists()


@pytest.mark.parametrize("version", ["1.0", "2.0"])
@pytest.mark.parametrize("compression", ["zstd", "snappy", "none"])
def test_the_page_walk_reads_every_header_pyarrow_writes(version, compression):
    """A walk that stopped early would let a bomb through: it must see every page."""
    from shards.parquet.pages import iter_page_sizes

    table = pa.table(
        {
            "__key__": [f"k{i % 700}" for i in range(3000)],  # a dictionary page
            "jpg": [bytes([i % 251]) * (i % 97) for i in range(3000)],
            "labels": [[i, i + 1] for i in range(3000)],
            "weight": [None if i % 5 else 0.5 for i in range(3000)],
        }
    )
    data = parquet_bytes(
        table,
        data_page_version=version,
        compression=compression,
        data_page_size=4096,
        row_group_size=1500,
        write_page_index=True,
    )
    meta = pq.ParquetFile(io.BytesIO(data)).metadata
    for group in range(meta.num_row_groups):
        for column in range(meta.num_columns):
            chunk = meta.row_group(group).column(column)
            start = chunk.dictionary_page_offset or chunk.data_page_offset
            sizes = list(iter_page_sizes(data[start : start + chunk.total_compressed_size]))
            assert len(sizes) >= 2, chunk.path_in_schema
            headers = chunk.total_uncompressed_size - sum(sizes)
            assert 0 < headers <= 64 * len(sizes), chunk.path_in_schema
