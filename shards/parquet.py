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
others: a plain binary image column, and no `__key__` column.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import BinaryIO
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shards.errors import DEFAULT_LIMITS, MemberCap, ReadLimits, ShardError
from shards.redact import redact_text, redact_url
from shards.sample import (
    ALLOWED_FIELDS,
    IMAGE_FIELDS,
    Sample,
    SampleError,
    check_key,
    oversized_member,
)

_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
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


# Hugging Face `datasets` takes a column as `Image` with no cast only when its Arrow
# type is exactly this struct, nullable (a plain binary column loads as bytes).
IMAGE_STRUCT = pa.struct([pa.field("bytes", pa.binary()), pa.field("path", pa.string())])
# Our own key in each file's metadata; version 2 stores images as `IMAGE_STRUCT`
# (version 1, plain binary, is still read).
METADATA_KEY = b"shardpipe"
HF_METADATA_KEY = b"huggingface"
FORMAT_VERSION = 2
# Columns that hold an integer label: ours, then the one HF datasets writes.
LABEL_COLUMNS = ("cls", "label")
_HF_VALUE_TYPES = {
    pa.string(): "string",
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.float64(): "float64",
}
# The members a shard's samples may carry besides the image, in column order, with the
# column type each is written as (`json` always; the others when the samples have them).
MEMBER_COLUMNS: dict[str, pa.DataType] = {
    "cls": pa.int64(),
    "labels": pa.list_(pa.int64()),
    "json": pa.string(),
    "txt": pa.string(),
    "weight": pa.float64(),
}
DEFAULT_MEMBERS = ("cls", "json")


def shard_schema(image_field: str, members: Sequence[str] = DEFAULT_MEMBERS) -> pa.Schema:
    """The Parquet schema of a shard whose images are stored in `image_field`, no metadata.

    Args:
        members: the sample members besides the image (`MEMBER_COLUMNS`); `json` is
            always written.
    """
    if image_field not in IMAGE_FIELDS:
        raise ValueError(f"image field must be one of {IMAGE_FIELDS}, got {image_field!r}")
    unknown = sorted(set(members) - set(MEMBER_COLUMNS))
    if unknown:
        raise ValueError(f"members {unknown} have no Parquet column; known: {list(MEMBER_COLUMNS)}")
    base = [
        pa.field("__key__", pa.string(), nullable=False),
        # Nullable as HF's features are: a non-nullable field makes HF ignore them.
        pa.field(image_field, IMAGE_STRUCT),
    ]
    for name, kind in MEMBER_COLUMNS.items():
        if name == "json":
            base.append(pa.field("json", kind, nullable=False))
        elif name in members:
            base.append(pa.field(name, kind))
    return pa.schema(base + [pa.field(n, t) for n, t in METADATA_COLUMNS.items()])


def shard_metadata(
    schema: pa.Schema,
    image_field: str,
    class_names: Sequence[str] | None = None,
    description: str | None = None,
    split: str | None = None,
) -> dict[bytes, bytes]:
    """The file metadata of a shard: our `shardpipe` document and HF's `huggingface` one.

    Both are JSON with sorted keys, so equal arguments give equal bytes. Without
    `class_names` the label column is declared a plain int64.
    """
    names = None if class_names is None else [str(name) for name in class_names]
    ours = {
        "format_version": FORMAT_VERSION,
        "key_field": "__key__",
        "image_field": image_field,
        "label_field": "cls" if "cls" in schema.names else None,
        "class_names": names,
        "description": description,
        "split": split,
    }
    features = {}
    for field in schema:
        if field.name == image_field:
            features[field.name] = {"_type": "Image"}
        elif field.name == "cls" and names is not None:
            features[field.name] = {"_type": "ClassLabel", "names": names}
        elif field.name == "labels":
            ids = {"_type": "Value", "dtype": "int64"}
            if names is not None:
                ids = {"_type": "ClassLabel", "names": names}
            features[field.name] = {"_type": "List", "feature": ids}
        else:
            features[field.name] = {"_type": "Value", "dtype": _HF_VALUE_TYPES[field.type]}
    hf = {"info": {"description": description or "", "features": features}}
    return {
        METADATA_KEY: json.dumps(ours, sort_keys=True, ensure_ascii=False).encode("utf-8"),
        HF_METADATA_KEY: json.dumps(hf, sort_keys=True, ensure_ascii=False).encode("utf-8"),
    }


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


# Rows decoded and turned into Python bytes per step. A reader then holds its row
# group's pages (one page per column chunk in our files: pyarrow checks the page size
# only every 1024 rows) plus one such batch, never two more copies of the group.
# 16 MiB takes one of our groups (~15 MiB) in one step: smaller steps cost ~10%.
BATCH_BYTES = 16 * 2**20
# pyarrow opens a file by reading this much of its tail, footer and data alike.
FOOTER_READ_BYTES = 64 * 2**10
# Optional columns read when requested: a shard without them yields samples without them.
TEXT_FIELDS = ("json", "txt")
# Optional typed columns, yielded as the JSON bytes of their tar members (`[0, 3]`, `0.5`):
# `labels` a list of integers, `weight` a number; a JSON string column of either reads too.
JSON_VALUE_FIELDS = ("labels", "weight")
OPTIONAL_FIELDS = TEXT_FIELDS + JSON_VALUE_FIELDS
# pyarrow's words for a file without Parquet's magic or too short to hold a footer.
_NOT_PARQUET_SIGNS = ("magic bytes", "file size is 0", "minimum file footer")
_REBUILD = "rebuild the shard with `preprocess build-shards`"
_HINTS = {
    "not_parquet": f"it is not a Parquet file, or was cut short by a crashed write; {_REBUILD}",
    "bad_footer": f"its footer (the file metadata) is corrupt; {_REBUILD}",
    "bad_data": f"its column data is corrupt; {_REBUILD} and run `preprocess verify`",
}


class _WatchedStream:
    """The caller's stream, keeping the exception its own methods raised, with a read budget.

    pyarrow re-raises a Python file's exception as it was, but reports a corrupt file
    with OSError too; the recorded exception is how a network failure (transient,
    propagated as it is) is told apart from bad bytes (`ShardError`).

    The budget caps the bytes read for the footer or one row group, whatever the
    footer claims: a read past it raises the `ShardError` that `refuse(total)`
    builds, before any memory is spent on it.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.error: Exception | None = None
        self._left = 0
        self._refuse: Callable[[int], ShardError] | None = None
        self._spent = 0
        self._lock = threading.Lock()  # pyarrow may read columns from several threads

    def budget(self, nbytes: int, refuse: Callable[[int], ShardError]) -> None:
        """Allow `nbytes` more bytes of reads; past them, raise `refuse(bytes asked)`."""
        with self._lock:
            self._left, self._refuse, self._spent = nbytes, refuse, 0

    def read(self, size: int = -1) -> bytes:
        with self._lock:
            over = self._refuse is not None and size is not None and size > self._left
            self._left -= max(size or 0, 0)
            self._spent += max(size or 0, 0)
            if over:
                self.error = self._refuse(self._spent)
                raise self.error
        try:
            return self._stream.read(size)
        except Exception as exc:
            self.error = exc
            raise

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return self._stream.seek(offset, whence)
        except Exception as exc:
            self.error = exc
            raise

    def tell(self) -> int:
        try:
            return self._stream.tell()
        except Exception as exc:
            self.error = exc
            raise

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        """The caller opened the stream and closes it."""


@contextmanager
def _arrow_errors(stream: _WatchedStream, url: str, reason: str) -> Iterator[None]:
    """pyarrow's errors on bad bytes as `ShardError(reason)`; the stream's own, unchanged."""
    try:
        yield
    # UnicodeDecodeError: pyarrow decodes column names that are not UTF-8.
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        if stream.error is exc:
            raise
        if stream.error is not None:
            raise stream.error from exc
        if reason == "bad_footer" and any(sign in str(exc) for sign in _NOT_PARQUET_SIGNS):
            reason = "not_parquet"
        detail = f"{type(exc).__name__}: {redact_text(str(exc).strip())}; {_HINTS[reason]}"
        raise ShardError(reason, url, detail) from exc


@contextmanager
def _open_source(source: BinaryIO | str | os.PathLike) -> Iterator[_WatchedStream]:
    if isinstance(source, (str, os.PathLike)):
        # A Python file rather than pyarrow's own, so a disk error stays an OSError
        # of the stream (transient) and is never mistaken for a corrupt shard.
        with open(source, "rb") as file:
            yield _WatchedStream(file)
    else:
        yield _WatchedStream(source)


def _open_parquet(stream: _WatchedStream, url: str, limits: ReadLimits) -> pq.ParquetFile:
    budget = limits.row_group_bytes + FOOTER_READ_BYTES
    stream.budget(budget, partial(_footer_too_large, url, budget))
    with _arrow_errors(stream, url, "bad_footer"):
        # No pre-buffering and no buffered stream: both copy whole column chunks
        # (pages) a second time. Extension types are never materialised.
        return pq.ParquetFile(
            stream, pre_buffer=False, buffer_size=0, arrow_extensions_enabled=False
        )


def _footer_too_large(url: str, budget: int, size: int) -> ShardError:
    return ShardError(
        "bad_footer",
        url,
        f"opening it reads {size} bytes, over the {budget} allowed (ReadLimits.row_group_bytes "
        f"plus pyarrow's first {FOOTER_READ_BYTES}-byte read of the file's tail); {_REBUILD}",
    )


@dataclass(frozen=True)
class ParquetLayout:
    """What a reader takes from a shard whose schema passed `check_schema`.

    Attributes:
        image_field: the image column (one of `IMAGE_FIELDS`).
        columns: the columns to read, also the names they are yielded under;
            `__key__` first when the shard has one.
        image_struct: the image column is HF's `{bytes, path}` struct: only its
            `bytes` leaf is read, never `path`.
        classes: `(label column, class count)` for each label column read whose
            classes the file's metadata names (`metadata_classes`).
    """

    image_field: str
    columns: tuple[str, ...]
    image_struct: bool = False
    classes: tuple[tuple[str, int], ...] = ()

    @property
    def has_key(self) -> bool:
        return self.columns[:1] == ("__key__",)

    @property
    def read_paths(self) -> list[str]:
        """The column paths handed to pyarrow: the struct's `bytes` leaf alone."""
        return [
            f"{name}.bytes" if self.image_struct and name == self.image_field else name
            for name in self.columns
        ]


def check_schema(schema: pa.Schema, url: str, fields: frozenset[str]) -> ParquetLayout:
    """Check a shard's schema against the contract before any row is read.

    The contract: `__key__` a string when present (a shard without one, as HF
    datasets writes, gets keys made from its file name and row index), exactly
    one image column (one of `IMAGE_FIELDS`) holding binary or HF's Image struct
    (a binary `bytes` field; its `path` is never read), the label columns
    (`cls`, HF's `label`) that `fields` asks for integers, at least one of them
    present when any is asked for, `json`/`txt` strings, `labels` a list of
    integers and `weight` a number (either also a JSON string) when present and
    asked for. Columns outside the contract are ignored.

    Raises:
        ShardError: `schema`, naming the missing or mistyped column.
    """
    columns = []
    if schema.get_all_field_indices("__key__"):
        _expect(schema, url, "__key__", "string", (pa.types.is_string, pa.types.is_large_string))
        columns.append("__key__")
    images = [name for name in IMAGE_FIELDS if schema.get_all_field_indices(name)]
    if len(images) != 1:
        found = f"columns {images}" if images else "none"
        raise ShardError(
            "schema",
            url,
            f"needs exactly one image column of {IMAGE_FIELDS}, found {found}; {_REBUILD}",
        )
    image_field = images[0]
    image_struct = _check_image_column(schema, url, image_field)
    if image_field in fields:
        columns.append(image_field)
    labels = _label_columns(schema, url, fields)
    columns += labels
    for name in OPTIONAL_FIELDS:
        if name in fields and schema.get_all_field_indices(name):
            wanted, checks = _OPTIONAL_TYPES.get(name, ("string", _STRING))
            _expect(schema, url, name, wanted, checks)
            columns.append(name)
    named = metadata_classes(schema.metadata)
    classes = tuple((name, named[name]) for name in labels if name in named)
    return ParquetLayout(image_field, tuple(columns), image_struct, classes)


def metadata_classes(metadata: dict[bytes, bytes] | None) -> dict[str, int]:
    """`{label column: class count}` for the label columns whose classes a file names.

    Our `shardpipe` document names them (`class_names`, for its `label_field`), and
    HF datasets' `huggingface` features do for a `ClassLabel` column (`names`). A
    document that is not what those writers write names nothing: the file is read,
    its labels are not range-checked here.
    """
    metadata = metadata or {}
    found: dict[str, int] = {}
    ours = _json_document(metadata.get(METADATA_KEY))
    if isinstance(ours, dict) and ours.get("label_field") in LABEL_COLUMNS:
        names = ours.get("class_names")
        if isinstance(names, list):
            found[ours["label_field"]] = len(names)
    hf = _json_document(metadata.get(HF_METADATA_KEY))
    info = hf.get("info") if isinstance(hf, dict) else None
    features = info.get("features") if isinstance(info, dict) else None
    for name in LABEL_COLUMNS:
        feature = features.get(name) if isinstance(features, dict) else None
        if name in found or not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
            continue
        names, count = feature.get("names"), feature.get("num_classes")
        if isinstance(names, list):
            found[name] = len(names)
        elif type(count) is int and count >= 0:
            found[name] = count
    return found


def _json_document(raw: bytes | None) -> object:
    """A metadata value parsed as JSON; None when absent or not JSON."""
    if raw is None:
        return None
    try:
        return json.loads(raw)
    # ValueError: not UTF-8 or not JSON; RecursionError: nested past the parser's stack.
    except (ValueError, RecursionError):
        return None


def _is_integer_list(kind: pa.DataType) -> bool:
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    return listed and pa.types.is_integer(kind.value_type)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_floating(kind) or pa.types.is_integer(kind)


_STRING = (pa.types.is_string, pa.types.is_large_string)
_OPTIONAL_TYPES = {
    "labels": ("a list of integers (or a JSON string)", (_is_integer_list, *_STRING)),
    "weight": ("a number (or a JSON string)", (_is_number, *_STRING)),
}


_BINARY = (pa.types.is_binary, pa.types.is_large_binary)
_IMAGE_TYPES = "binary or a struct with a binary 'bytes' field (HF's Image)"


def _check_image_column(schema: pa.Schema, url: str, name: str) -> bool:
    """Whether the image column is a struct (checked: its `bytes` is binary); else binary."""
    _expect(schema, url, name, _IMAGE_TYPES, (*_BINARY, pa.types.is_struct))
    kind = schema.field(name).type
    if not pa.types.is_struct(kind):
        return False
    indices = kind.get_all_field_indices("bytes")
    if len(indices) == 1 and any(check(kind.field(indices[0]).type) for check in _BINARY):
        return True
    raise ShardError(
        "schema",
        url,
        f"image column {name!r} is {kind}, not {_IMAGE_TYPES}; write the image bytes into "
        "a 'bytes' field, or rebuild the shard with `preprocess build-shards`",
    )


def _label_columns(schema: pa.Schema, url: str, fields: frozenset[str]) -> list[str]:
    """The label columns to read: those asked for that the shard has, each an integer."""
    asked = [name for name in LABEL_COLUMNS if name in fields]
    present = [name for name in asked if schema.get_all_field_indices(name)]
    if asked and not present:
        wanted = " or ".join(repr(name) for name in asked)
        raise ShardError(
            "schema",
            url,
            f"has no label column {wanted} (the shard contract needs an integer label); "
            f"{_REBUILD}, or leave the label out of the fields read",
        )
    for name in present:
        _expect(schema, url, name, "an integer", (pa.types.is_integer,))
    return present


def _expect(schema: pa.Schema, url: str, name: str, wanted: str, checks: tuple) -> None:
    indices = schema.get_all_field_indices(name)
    if not indices:
        problem = f"has no {name!r} column"
    elif len(indices) > 1:
        problem = f"has {len(indices)} columns named {name!r}"
    elif not any(check(schema.field(indices[0]).type) for check in checks):
        problem = f"column {name!r} is {schema.field(indices[0]).type}, not {wanted}"
    else:
        return
    raise ShardError(
        "schema", url, f"{problem} (the shard contract needs {name!r} {wanted}); {_REBUILD}"
    )


def _row_counts(parquet: pq.ParquetFile, stream: _WatchedStream, url: str) -> list[int]:
    with _arrow_errors(stream, url, "bad_footer"):
        meta = parquet.metadata
        counts = [meta.row_group(group).num_rows for group in range(meta.num_row_groups)]
        total = meta.num_rows
    if any(count < 0 for count in counts) or sum(counts) != total:
        raise ShardError(
            "bad_footer",
            url,
            f"row group counts {counts[:8]}... do not add up to its {total} rows; {_REBUILD}",
        )
    return counts


def _check_row_group(parquet: pq.ParquetFile, group: int, url: str, limits: ReadLimits) -> int:
    """Row group `group`'s uncompressed size from the footer; refused past the cap.

    Column chunk sizes are not read from pyarrow's metadata objects: on a corrupt
    footer (a size-statistics histogram of the wrong length) pyarrow 26 aborts the
    process there. The bytes the columns really take are capped as they are read,
    by the stream's budget, which a lying footer cannot escape.
    """
    meta = parquet.metadata.row_group(group)
    size, rows = meta.total_byte_size, meta.num_rows
    if size < 0:
        raise ShardError("bad_footer", url, f"row group {group} has a negative size; {_REBUILD}")
    if size > limits.row_group_bytes:
        raise _row_group_too_large(url, group, rows, limits, size)
    return size


def _row_group_too_large(
    url: str, group: int, rows: int, limits: ReadLimits, size: int
) -> ShardError:
    suggested = max(1, rows * limits.row_group_bytes // (2 * max(size, 1)))
    return ShardError(
        "row_group_too_large",
        url,
        f"row group {group} takes at least {size} bytes uncompressed ({rows} rows), over the "
        f"cap of {limits.row_group_bytes} (ReadLimits.row_group_bytes): a reader holds a whole "
        f"row group in memory; rebuild with `preprocess build-shards --row-group-size "
        f"{suggested}` (a file another tool wrote: rewrite it with row groups of at most "
        f"{suggested} rows)",
    )


def iter_parquet_samples(
    source: BinaryIO | str | os.PathLike,
    url: str,
    start: int = 0,
    stop: int | None = None,
    *,
    fields: frozenset[str] = ALLOWED_FIELDS,
    limits: ReadLimits = DEFAULT_LIMITS,
    declared: int | None = None,
) -> Iterator[Sample]:
    """Yield rows `[start, stop)` as the same dicts the tar reader yields.

    Follows the reader contract of `shards.formats`. Reads only the columns that
    `fields` asks for (plus `__key__`), one row group at a time and a few MiB of
    rows at a step; row groups outside the range are never read, so a loader can
    split one shard between workers.

    Args:
        source: a seekable binary stream (the caller closes it) or a local path.
        url: the shard's URL, for `__url__` and errors (redacted in both).
        start: first row to yield.
        stop: row to stop before; defaults to `declared`, else the shard's end.
        fields: fields to yield (an image column of `IMAGE_FIELDS`, `cls`/`label`,
            `json`, `txt`, `labels`, `weight`); each is yielded under its column's
            name, `labels` and `weight` as the JSON bytes a tar member holds.
        limits: caps on one cell (`member_bytes`) and one row group (`row_group_bytes`).
        declared: the sample count the manifest promises for this shard.

    Raises:
        ShardError: the shard is not Parquet (`not_parquet`, `bad_footer`,
            `bad_data`), breaks the schema contract (`schema`), has a row group over
            the cap (`row_group_too_large`), repeats a key among the rows read
            (`non_adjacent_key`, as a tar, after the rows before it), ends before
            `stop` (`shard_short`), or holds more rows than `declared` (`shard_long`,
            once the declared ones are out). Exceptions of the stream itself
            (network, disk) propagate as they are.

    A null key, image or label cell (an HF image struct without bytes too), a key
    that is not UTF-8, a label outside the classes the file's metadata names and a
    cell over its column's cap (`limits.cap_for`) make their row a sample with
    `__error__` set to a `SampleError` (`null_cell`, `bad_name`, `bad_label`, the
    cap's reason: `member_too_large`, `bad_text`, ...), without that cell. A shard
    without `__key__` gets `synthetic_key_prefix(url)-{row:09d}` keys.
    """
    _check_window(start, stop, declared)
    with _open_source(source) as stream:
        parquet = _open_parquet(stream, url, limits)
        layout = check_schema(parquet.schema_arrow, url, fields)
        counts = _row_counts(parquet, stream, url)
        rows = sum(counts)
        end = stop if stop is not None else declared if declared is not None else rows
        # The keys of the rows read so far: a repeat is `non_adjacent_key`, as in a tar.
        # Only the window's rows are seen (row groups outside it stay unread, which is
        # what lets a loader split a shard): a whole read, as `preprocess verify` does,
        # sees every repeat.
        seen: set[bytes] | None = set() if layout.has_key else None
        first = 0
        for group, count in enumerate(counts):
            if first >= end:
                break
            lo, hi = max(start, first), min(end, first + count)
            if lo < hi:
                where = _Group(group, lo - first, hi - first, first)
                yield from _iter_group(parquet, stream, where, layout, url, limits, seen)
            first += count
    if rows < end:
        expected = (
            f"its manifest declares {declared}"
            if declared == end
            else f"rows up to {end} were asked for"
        )
        raise ShardError(
            "shard_short",
            url,
            f"the shard holds {rows} rows but {expected}; the shard was "
            "cut or its manifest is wrong: run `preprocess verify` on the dataset",
        )
    if declared is not None and rows > declared and end >= declared:
        raise ShardError(
            "shard_long",
            url,
            f"the shard holds {rows} rows, more than the {declared} its "
            f"manifest declares; the {rows - declared} extra rows were not read: run "
            "`preprocess verify` on the dataset to find which of the two is wrong",
        )


def _check_window(start: int, stop: int | None, declared: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"bad row window [{start}, {stop})")
    if declared is not None and (declared < 0 or (stop is not None and stop > declared)):
        raise ValueError(f"row window [{start}, {stop}) reaches past the declared {declared} rows")


@dataclass(frozen=True)
class _Group:
    """Rows `[lo, hi)` of row group `index`, whose first row is row `first_row` of the file."""

    index: int
    lo: int
    hi: int
    first_row: int


def _iter_group(
    parquet: pq.ParquetFile,
    stream: _WatchedStream,
    group: _Group,
    layout: ParquetLayout,
    url: str,
    limits: ReadLimits,
    seen: set[bytes] | None,
) -> Iterator[Sample]:
    """Rows `[lo, hi)` of a row group, converted a batch at a time.

    `seen` holds the keys of the rows read before; a key met twice stops the shard
    with `non_adjacent_key` after the rows before it, as in a tar.
    """
    size = _check_row_group(parquet, group.index, url, limits)
    count = parquet.metadata.row_group(group.index).num_rows
    batch_rows = max(1, min(count, BATCH_BYTES * count // max(1, size)))
    refuse = partial(_row_group_too_large, url, group.index, count, limits)
    stream.budget(limits.row_group_bytes, refuse)
    batches = parquet.iter_batches(
        batch_size=batch_rows, row_groups=[group.index], columns=layout.read_paths
    )
    safe_url = redact_url(url)
    key_prefix = None if layout.has_key else synthetic_key_prefix(safe_url)
    caps = {name: limits.cap_for(name) for name in layout.columns}
    lo, hi = group.lo, group.hi
    offset = 0  # row, within the group, of the next batch's first row
    while offset < hi:
        with _arrow_errors(stream, url, "bad_data"):
            batch = next(batches, None)
            if batch is None:
                raise pa.ArrowInvalid(
                    f"row group {group.index} ended after {offset} of {count} rows"
                )
            a, b = max(lo - offset, 0), min(hi - offset, batch.num_rows)
            values = _batch_values(batch.slice(a, b - a), layout, caps) if a < b else None
            rows, batch = batch.num_rows, None
        if batch_rows < count:
            # pyarrow's default pool (mimalloc) keeps a freed batch resident for a
            # while and takes fresh pages for the next one; returning them now keeps
            # a big row group's cost at about its own size.
            pa.default_memory_pool().release_unused()
        first_index = group.first_row + offset
        if values is not None:
            repeat = None if seen is None else _first_repeat(seen, values["__key__"])
            where = _Where(first_index + a, safe_url, key_prefix)
            good = b - a if repeat is None else repeat
            yield from islice(_row_samples(values, b - a, where, layout), good)
            if repeat is not None:
                raise _repeated_key(values["__key__"][repeat], first_index + a + repeat, safe_url)
        offset += rows


def _first_repeat(seen: set[bytes], keys: list) -> int | None:
    """Add `keys` to `seen`; the position of the first key already there, else None.

    One set build and one disjointness test a batch (C loops); the Python loop runs
    only for a batch that holds a repeat. Null and oversized cells are not keys.
    """
    present = [key for key in keys if type(key) is bytes]
    fresh = set(present)
    if len(fresh) == len(present) and seen.isdisjoint(fresh):
        seen |= fresh
        return None
    for position, key in enumerate(keys):
        if type(key) is bytes:
            if key in seen:
                return position
            seen.add(key)
    return None


def _repeated_key(raw_key: bytes, index: int, url: str) -> ShardError:
    key = _row_key(raw_key, index, url)[0]
    return ShardError(
        "non_adjacent_key",
        url,
        f"row {index} has the key {key} of an earlier row: a key names one sample; "
        f"run `preprocess verify` on the dataset to list the bad shards, then rebuild them",
        key,
    )


@dataclass(frozen=True)
class _Oversized:
    """A cell over its column's cap (`ReadLimits.cap_for`), left unconverted.

    `size` is its byte count; for a typed list of ids, the least its JSON can take.
    """

    size: int
    cap: MemberCap


@dataclass(frozen=True)
class _BadLabel:
    """A label outside the classes the file's metadata names."""

    value: int
    classes: int


def _batch_values(batch: pa.RecordBatch, layout: ParquetLayout, caps: dict) -> dict:
    values = {}
    classes = dict(layout.classes)
    for name in layout.columns:
        array = batch.column(name)
        if layout.image_struct and name == layout.image_field:
            array = pc.struct_field(array, "bytes")  # null where the struct itself is null
        if name in classes:
            values[name] = _label_values(array, classes[name])
        elif name in JSON_VALUE_FIELDS and not any(check(array.type) for check in _STRING):
            values[name] = _json_cells(array, caps[name])
        else:
            values[name] = _column_values(array, caps[name])
    return values


def _label_values(array: pa.Array, classes: int) -> list:
    """A label column's ints, with `_BadLabel` for those outside `[0, classes)`."""
    cells = array.to_pylist()
    outside = pc.or_(pc.less(array, 0), pc.greater_equal(array, classes))
    if not pc.any(outside).as_py():
        return cells
    return [
        value if value is None or 0 <= value < classes else _BadLabel(value, classes)
        for value in cells
    ]


def _json_cells(array: pa.Array, cap: MemberCap) -> list:
    """A typed `labels` or `weight` column as the JSON bytes its tar members hold.

    A number becomes a float's JSON (`2.0`: what the build writes in both formats),
    a list of ids `[0, 3]`; None for null cells, `_Oversized` past the cap. A list
    whose JSON cannot fit (each id takes at least 3 bytes: a digit and `, `) is never
    turned into Python objects. The values are not judged here: the loader's field
    checks do that (`bad_labels`).
    """
    limit = cap.max_bytes
    if _is_number(array.type):
        cells = []
        for value in array.to_pylist():
            data = None if value is None else json.dumps(float(value)).encode("ascii")
            cells.append(_Oversized(len(data), cap) if data and len(data) > limit else data)
        return cells
    least = pc.multiply(pc.list_value_length(array), 3)
    over = pc.greater(least, limit)
    if pc.any(over).as_py():
        kept = pc.if_else(over, pa.scalar(None, array.type), array).to_pylist()
        sizes = least.to_pylist()
        values = [
            _Oversized(size, cap) if size and size > limit else v
            for size, v in zip(sizes, kept, strict=True)
        ]
    else:
        values = array.to_pylist()
    cells = []
    for value in values:
        if value is None or isinstance(value, _Oversized):
            cells.append(value)
            continue
        data = json.dumps(value).encode("ascii")
        cells.append(_Oversized(len(data), cap) if len(data) > limit else data)
    return cells


def _column_values(array: pa.Array, cap: MemberCap) -> list:
    """Python values of one column: bytes for binary and strings (never decoded here),
    ints for `cls`, None for null cells, `_Oversized` for cells over the cap."""
    if pa.types.is_integer(array.type):
        return array.to_pylist()
    limit = cap.max_bytes
    large = pa.types.is_large_string(array.type) or pa.types.is_large_binary(array.type)
    array = array.cast(pa.large_binary() if large else pa.binary())  # a view, no copy
    lengths = pc.binary_length(array)
    largest = pc.max(lengths).as_py()
    if largest is None or largest <= limit:
        return array.to_pylist()
    over = pc.greater(lengths, limit)
    values = pc.if_else(over, pa.scalar(None, array.type), array).to_pylist()
    return [
        _Oversized(size, cap) if size is not None and size > limit else value
        for size, value in zip(lengths.to_pylist(), values, strict=True)
    ]


def synthetic_key_prefix(url: str) -> str:
    """The start of the keys made for a shard without `__key__`: its stem and directory.

    Keys are `{stem}-{digest}-{row:09d}`, valid for `check_key` (other characters of
    the stem become `_`), where `digest` is 8 hex digits of the sha256 of the file's
    directory (its absolute path, or scheme, host and path of a URL; never its
    credentials or query): the same on every run, and distinct for files of one name
    in two directories, as HF datasets lays out its configs
    (`cfgA/train-00000-of-00001.parquet`, `cfgB/train-00000-of-00001.parquet`).
    """
    if "://" in url:
        parts = urlsplit(url)
        directory, name = parts.path.rsplit("/", 1) if "/" in parts.path else ("", parts.path)
        directory = f"{parts.scheme}://{parts.hostname or ''}{directory}"
    else:
        directory, name = os.path.split(os.path.abspath(url))
    stem = name[: -len(".parquet")] if name.lower().endswith(".parquet") else name
    digest = hashlib.sha256(directory.encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', stem)[:100] or 'row'}-{digest}"


@dataclass(frozen=True)
class _Where:
    """Where a batch's rows are: the first one's row index, the shard, the key prefix."""

    first_index: int
    url: str
    key_prefix: str | None  # None: the shard has a `__key__` column


def _row_samples(values: dict, rows: int, where: _Where, layout: ParquetLayout) -> Iterator[Sample]:
    names = layout.columns
    cells = zip(*(values[name] for name in names), strict=True) if names else [()] * rows
    for offset, row in enumerate(cells):
        index = where.first_index + offset
        key = None if where.key_prefix is None else f"{where.key_prefix}-{index:09d}"
        yield _sample(dict(zip(names, row, strict=True)), index, where.url, key, layout)


def _sample(cells: dict, index: int, url: str, key: str | None, layout: ParquetLayout) -> Sample:
    """One row's sample; `key` is the synthetic key, None when the row has a `__key__` cell."""
    error = None
    if key is None:
        key, error = _row_key(cells.pop("__key__"), index, url)
    sample = {"__key__": key, "__url__": url}
    for name, value in cells.items():
        if isinstance(value, (bytes, int)):
            sample[name] = str(value).encode("ascii") if name in LABEL_COLUMNS else value
        elif value is not None or name not in OPTIONAL_FIELDS:  # a null json is no json
            error = error or _cell_error(name, value, index, url, key, layout)
    if error is not None:
        sample["__error__"] = error
    return sample


def _row_key(raw_key: object, index: int, url: str) -> tuple[str, SampleError | None]:
    """A `__key__` cell as a printable key, and the error that makes its row a skip."""
    if not isinstance(raw_key, bytes):
        return f"<row {index}>", _cell_error("__key__", raw_key, index, url)
    error = None
    try:
        key = raw_key.decode("utf-8")
    except UnicodeDecodeError:
        key = raw_key.decode("utf-8", "backslashreplace")
        error = SampleError("bad_name", f"row {index} of {url}: key {key} is not UTF-8")
    if _CONTROL_CHARS.search(key):  # a newline or escape in a key would forge log lines
        key = key.encode("unicode_escape").decode("ascii")
        error = error or SampleError(
            "bad_name", f"row {index} of {url}: key {key} holds control characters"
        )
    return key, error


def _cell_error(
    name: str,
    value: object,
    index: int,
    url: str,
    key: str | None = None,
    layout: ParquetLayout | None = None,
) -> SampleError:
    where = f"column {name!r} of row {index}" + (f" ({key})" if key else "") + f" in {url}"
    if isinstance(value, _Oversized):
        return oversized_member(value.cap, where, value.size)
    if isinstance(value, _BadLabel):
        return SampleError(
            "bad_label",
            f"{where} is class {value.value}, outside the {value.classes} classes the file's "
            "metadata names",
        )
    if layout is not None and layout.image_struct and name == layout.image_field:
        return SampleError(
            "null_cell",
            f"{where} holds no image bytes (an HF Image may hold only a path, which is never "
            "opened); write the file with the bytes embedded: in HF datasets, "
            "`ds.with_format('arrow').map(datasets.table.embed_table_storage, batched=True)` "
            "before `to_parquet`",
        )
    return SampleError("null_cell", f"{where} is null")


def count_parquet_samples(
    source: BinaryIO | str | os.PathLike, url: str, limits: ReadLimits = DEFAULT_LIMITS
) -> int:
    """Rows in a Parquet shard, from its footer; the same checks as reading it.

    Raises:
        ShardError: as `iter_parquet_samples` does on opening a shard (footer,
            schema, row group sizes); stream exceptions propagate as they are.
    """
    with _open_source(source) as stream:
        parquet = _open_parquet(stream, url, limits)
        schema = parquet.schema_arrow
        # A shard without classes (label-free, multi-label, another writer's) counts too.
        labelled = any(schema.get_all_field_indices(name) for name in LABEL_COLUMNS)
        check_schema(schema, url, ALLOWED_FIELDS - set(() if labelled else LABEL_COLUMNS))
        counts = _row_counts(parquet, stream, url)
        for group in range(len(counts)):
            _check_row_group(parquet, group, url, limits)
        return sum(counts)
