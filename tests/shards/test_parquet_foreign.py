"""Parquet other tools wrote, at its most hostile (issue 29): odd label types, repeated
keys and pages whose size only shows once they are decompressed."""

from __future__ import annotations

import io
import json

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
