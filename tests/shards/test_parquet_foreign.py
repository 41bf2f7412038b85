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
