"""Parquet shards holding the same samples, keys and bytes as the tar shards.

Columns: `__key__`, the image bytes (column named by its field, e.g. `jpg`),
`cls` (int64), `json` (the exact metadata document of the tar member) and
flattened metadata columns for querying with pyarrow, duckdb or polars. Row
groups are small so a reader streams one group at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from shards.sample import ALLOWED_FIELDS, IMAGE_FIELDS, Sample, check_key

ROW_GROUP_SIZE = 128
# Metadata fields copied out of the json document into typed columns.
METADATA_COLUMNS: dict[str, pa.DataType] = {
    "source": pa.string(),
    "split": pa.string(),
    "width": pa.int32(),
    "height": pa.int32(),
    "orig_width": pa.int32(),
    "orig_height": pa.int32(),
}


def shard_schema(image_field: str) -> pa.Schema:
    """The Parquet schema of a shard whose images are stored in `image_field`."""
    if image_field not in IMAGE_FIELDS:
        raise ValueError(f"image field must be one of {IMAGE_FIELDS}, got {image_field!r}")
    base = [
        pa.field("__key__", pa.string(), nullable=False),
        pa.field(image_field, pa.binary(), nullable=False),
        pa.field("cls", pa.int64(), nullable=False),
        pa.field("json", pa.string(), nullable=False),
    ]
    return pa.schema(base + [pa.field(n, t) for n, t in METADATA_COLUMNS.items()])


class ParquetShardWriter:
    """Buffers up to one row group of samples and writes it; deterministic output.

    Args:
        fileobj: a binary file opened for writing.
        image_field: the image column, same name as the tar member suffix.
        row_group_size: rows per row group; each group is a streaming unit for readers.
    """

    def __init__(self, fileobj: BinaryIO, image_field: str, row_group_size: int = ROW_GROUP_SIZE):
        self.image_field = image_field
        self.schema = shard_schema(image_field)
        self.row_group_size = row_group_size
        # Images are already compressed: storing them uncompressed saves CPU on
        # both ends; statistics on image bytes would only bloat the footer.
        compression = {name: "zstd" for name in self.schema.names}
        compression[image_field] = "none"
        self._writer = pq.ParquetWriter(
            fileobj,
            self.schema,
            compression=compression,
            write_statistics=["__key__", "cls", "split", "width", "height"],
            use_dictionary=["split"],
        )
        self._rows: list[Sample] = []
        self.count = 0

    def write(self, sample: Sample) -> None:
        check_key(sample["__key__"])
        self._rows.append(sample)
        self.count += 1
        if len(self._rows) >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        metas = [json.loads(row["json"]) for row in self._rows]
        columns = {
            "__key__": [row["__key__"] for row in self._rows],
            self.image_field: [row[self.image_field] for row in self._rows],
            "cls": [int(row["cls"]) for row in self._rows],
            "json": [row["json"].decode("utf-8") for row in self._rows],
        }
        for name in METADATA_COLUMNS:
            columns[name] = [meta.get(name) for meta in metas]
        self._writer.write_table(pa.table(columns, schema=self.schema))
        self._rows = []

    def close(self) -> None:
        self._flush()
        self._writer.close()


def iter_parquet_samples(
    source: BinaryIO | str,
    url: str,
    start: int = 0,
    stop: int | None = None,
    *,
    fields: frozenset[str] = ALLOWED_FIELDS,
) -> Iterator[Sample]:
    """Yield rows `[start, stop)` as the same dicts the tar reader yields.

    Reads one row group at a time and skips row groups outside the range
    without reading them, so a loader can split one shard between workers.
    Like the tar reader, yields only `fields`: a `json` column left out is never read.
    """
    parquet = pq.ParquetFile(source)
    image_field = next((n for n in parquet.schema_arrow.names if n in IMAGE_FIELDS), None)
    if image_field is None:
        raise ValueError(f"{url} has no image column (one of {IMAGE_FIELDS})")
    with_json = "json" in fields
    columns = ["__key__", image_field, "cls", *(["json"] if with_json else [])]
    stop = parquet.metadata.num_rows if stop is None else stop
    first_row = 0
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        lo, hi = max(start, first_row), min(stop, first_row + rows)
        first_row += rows
        if lo >= hi:
            if first_row >= stop:
                return
            continue
        table = parquet.read_row_group(group, columns=columns)
        table = table.slice(lo - (first_row - rows), hi - lo)
        keys = table.column("__key__").to_pylist()
        images = table.column(image_field).to_pylist()
        labels = table.column("cls").to_pylist()
        metas = table.column("json").to_pylist() if with_json else [None] * len(keys)
        for key, image, label, meta in zip(keys, images, labels, metas, strict=True):
            sample = {
                "__key__": key,
                "__url__": url,
                image_field: image,
                "cls": str(label).encode("ascii"),
            }
            if with_json:
                sample["json"] = meta.encode("utf-8")
            yield sample


def parquet_row_groups(source: BinaryIO | str) -> list[int]:
    """Row counts of each row group; lets a loader split a shard by row group."""
    meta = pq.ParquetFile(source).metadata
    return [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]


def count_parquet_samples(source: BinaryIO | str, url: str, limits=None) -> int:
    """Rows in a Parquet shard, from its footer."""
    return pq.ParquetFile(source).metadata.num_rows
