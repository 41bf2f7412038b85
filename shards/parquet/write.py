"""`ParquetShardWriter`: one deterministic Parquet shard, a row group at a time.

Writes the columns and metadata `shards.parquet.schema` defines; equal samples give
equal bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from shards.parquet.schema import (
    DEFAULT_MEMBERS,
    IMAGE_STRUCT,
    MEMBER_COLUMNS,
    METADATA_COLUMNS,
    ROW_GROUP_SIZE,
    shard_metadata,
    shard_schema,
)
from shards.sample import IMAGE_FIELDS, Sample, check_key


class ParquetShardWriter:
    """Buffers up to one row group of samples and writes it; deterministic output.

    Args:
        fileobj: a binary file opened for writing.
        image_field: the image column, same name as the tar member suffix.
        row_group_size: rows per row group; each group is a streaming unit for readers.
        class_names: the dataset's classes (a label indexes them), for the metadata.
        description: the dataset's description, for the metadata.
        split: the split this shard belongs to, for the metadata.
        members: the members every sample carries besides the image (`MEMBER_COLUMNS`
            names). None: those of the first sample written; a shard with no samples
            then gets `cls` and `json` (`json` alone when `class_names` is empty).
    """

    def __init__(
        self,
        fileobj: BinaryIO,
        image_field: str,
        row_group_size: int = ROW_GROUP_SIZE,
        *,
        class_names: Sequence[str] | None = None,
        description: str | None = None,
        split: str | None = None,
        members: Sequence[str] | None = None,
    ):
        if image_field not in IMAGE_FIELDS:
            raise ValueError(f"image field must be one of {IMAGE_FIELDS}, got {image_field!r}")
        self.image_field = image_field
        self.row_group_size = row_group_size
        self._fileobj = fileobj
        self._dataset = (class_names, description, split)
        self._writer: pq.ParquetWriter | None = None
        self.members: tuple[str, ...] | None = None
        self.schema: pa.Schema | None = None
        if members is not None:
            self._open(members)
        self._rows: list[Sample] = []
        self.count = 0

    def _open(self, members: Sequence[str]) -> None:
        schema = shard_schema(self.image_field, members)
        metadata = shard_metadata(schema, self.image_field, *self._dataset)
        self.schema = schema.with_metadata(metadata)
        self.members = tuple(name for name in schema.names if name in MEMBER_COLUMNS)
        image_field = self.image_field
        # Images are already compressed: storing them uncompressed saves CPU on
        # both ends; statistics on image bytes would only bloat the footer.
        # Keys are column paths: the image struct's leaves are `jpg.bytes`, `jpg.path`.
        compression = {name: "zstd" for name in self.schema.names if name != image_field}
        compression[f"{image_field}.bytes"] = "none"
        compression[f"{image_field}.path"] = "zstd"
        if "labels" in self.members:
            del compression["labels"]
            compression["labels.list.element"] = "zstd"
        statistics = ["__key__", "cls", "split", "width", "height"]
        self._writer = pq.ParquetWriter(
            self._fileobj,
            self.schema,
            compression=compression,
            write_statistics=[name for name in statistics if name in self.schema.names],
            use_dictionary=["split"],
            # pyarrow's copy of the Arrow schema (ARROW:schema) would repeat the metadata
            # (every class name) in each footer; our types need no Arrow hints, and
            # readers take the key-value metadata as the schema's.
            store_schema=False,
        )
        self._writer.add_key_value_metadata(metadata)

    def write(self, sample: Sample) -> None:
        check_key(sample["__key__"])
        carried = tuple(name for name in MEMBER_COLUMNS if name in sample)
        if self._writer is None:
            self._open(carried)
        if carried != self.members or self.image_field not in sample:
            raise ValueError(
                f"sample {sample['__key__']} carries {[self.image_field, *carried]}, but this "
                f"shard's columns are {[self.image_field, *(self.members or ())]}: every "
                "sample of a shard carries the same members"
            )
        self._rows.append(sample)
        self.count += 1
        if len(self._rows) >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        metas = [json.loads(row["json"]) for row in self._rows]
        images = pa.array([row[self.image_field] for row in self._rows], pa.binary())
        columns = {
            "__key__": [row["__key__"] for row in self._rows],
            self.image_field: pa.StructArray.from_arrays(
                [images, pa.nulls(len(images), pa.string())], fields=list(IMAGE_STRUCT)
            ),
            "json": [row["json"].decode("utf-8") for row in self._rows],
        }
        if "cls" in self.members:
            columns["cls"] = [int(row["cls"]) for row in self._rows]
        if "labels" in self.members:
            columns["labels"] = [json.loads(row["labels"]) for row in self._rows]
        if "txt" in self.members:
            columns["txt"] = [row["txt"].decode("utf-8") for row in self._rows]
        if "weight" in self.members:
            columns["weight"] = [float(json.loads(row["weight"])) for row in self._rows]
        for name in METADATA_COLUMNS:
            columns[name] = [meta.get(name) for meta in metas]
        self._writer.write_table(pa.table(columns, schema=self.schema))
        self._rows = []

    def close(self) -> None:
        if self._writer is None:
            labelled = self._dataset[0] is None or len(self._dataset[0]) > 0
            self._open(DEFAULT_MEMBERS if labelled else ("json",))
        self._flush()
        self._writer.close()
