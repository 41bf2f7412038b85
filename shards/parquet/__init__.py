"""Parquet shards holding the same samples, keys and bytes as the tar shards.

Columns: `__key__`, the image (column named by its field, e.g. `jpg`, stored as
Hugging Face's `Image` struct `{bytes, path}` with `path` always null), `cls`
(int64; absent in multi-label and label-free shards), `labels` (multi-label:
list<int64> class ids), `json` (the exact metadata document of the tar member),
`txt` (string) and `weight` (float64) when the samples carry them, and flattened
metadata columns for querying with pyarrow, duckdb or polars. Each column holds
its tar member's value: the reader gives `labels` and `weight` back as the same
JSON bytes the tar holds. The file metadata holds our own `shardpipe` document
and HF's `huggingface` features, so HF datasets reads `Image`, `ClassLabel` and
`List(ClassLabel)` columns with no cast. Row groups are small so a
reader streams one group at a time. The reader also takes Parquet written by
others: a plain binary image column, no `__key__` column, and any other column a
`shards.sample.Field` names (img2dataset's `caption`, say).

The package, bottom up: `schema` (columns and file metadata), `write`
(`ParquetShardWriter`), `stream` (budgeted reads, pyarrow's errors as `ShardError`),
`layout` (the schema contract a reader checks) and `read` (`iter_parquet_samples`,
`count_parquet_samples`).
"""

from shards.parquet.layout import ParquetLayout, check_schema, metadata_classes
from shards.parquet.read import (
    column_names,
    count_parquet_samples,
    iter_parquet_samples,
    synthetic_key_prefix,
)
from shards.parquet.schema import (
    FORMAT_VERSION,
    HF_METADATA_KEY,
    IMAGE_STRUCT,
    LABEL_COLUMNS,
    MEMBER_COLUMNS,
    METADATA_COLUMNS,
    METADATA_KEY,
    ROW_GROUP_SIZE,
    shard_metadata,
    shard_schema,
)
from shards.parquet.write import ParquetShardWriter

__all__ = [
    "FORMAT_VERSION",
    "HF_METADATA_KEY",
    "IMAGE_STRUCT",
    "LABEL_COLUMNS",
    "MEMBER_COLUMNS",
    "METADATA_COLUMNS",
    "METADATA_KEY",
    "ROW_GROUP_SIZE",
    "ParquetLayout",
    "ParquetShardWriter",
    "check_schema",
    "column_names",
    "count_parquet_samples",
    "iter_parquet_samples",
    "metadata_classes",
    "shard_metadata",
    "shard_schema",
    "synthetic_key_prefix",
]
