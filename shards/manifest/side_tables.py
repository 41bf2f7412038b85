"""A large split's shard table as a Parquet side file: written, referenced, fetched and checked.

The reference in `manifest.json` (name, rows, bytes, sha256) is checked first, including
the row bound (`MIN_TABLE_ROW_BYTES`), then the file against its size and sha256, then its
columns get the inline checks, vectorised.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shards.manifest.errors import FIX, TABLE_FIX, ManifestError
from shards.manifest.mapped import MappedFile
from shards.manifest.names import (
    MAX_FILE_BYTES,
    MAX_TABLE_BYTES,
    MAX_TABLE_ROWS,
    MIN_TABLE_ROW_BYTES,
    TABLE_SUFFIX,
    shard_name,
)
from shards.manifest.parse import COUNT, MISSING, SHA256_HEX, name_problem, show_value, wrong_value
from shards.manifest.state import ReadState
from shards.manifest.table import DIGEST_BYTES, ClassCounts, FileColumns, ShardTable, frozen
from shards.redact import redact_text

_TABLE_KEYS = frozenset(("name", "rows", "bytes", "sha256"))
_CHECK_ROWS = 2**16  # side-table rows whose class counts are checked at a time


def encode_table(table: ShardTable, formats: Sequence[str]) -> bytes:
    """A split's shard table as the Parquet bytes of its side file (deterministic).

    Columns: `samples`, then per format `<fmt>_bytes`, `<fmt>_sha256` (32 raw bytes)
    and `<fmt>_name` only when the names are not `shard_name`'s, then `class_ids`
    and `class_counts` (sparse lists, null for a shard without counts) when any
    shard has counts.
    """
    n = len(table)
    columns: dict[str, pa.Array] = {"samples": pa.array(table.samples, pa.int64())}
    compression = {"samples": "zstd"}
    for fmt in formats:
        files = table.file_columns(fmt)
        digests = pa.py_buffer(np.ascontiguousarray(files.digests).tobytes())
        columns[f"{fmt}_bytes"] = pa.array(files.sizes, pa.int64())
        columns[f"{fmt}_sha256"] = pa.FixedSizeBinaryArray.from_buffers(
            pa.binary(DIGEST_BYTES), n, [None, digests]
        )
        compression.update({f"{fmt}_bytes": "zstd", f"{fmt}_sha256": "none"})  # random bytes
        if files.names is not None:
            columns[f"{fmt}_name"] = pa.array(files.names, pa.string())
            compression[f"{fmt}_name"] = "zstd"
    counts = table.class_counts
    if counts is not None and counts.counted.any():
        offsets = pa.array(counts.indptr, pa.int64())
        mask = pa.array(~counts.counted)
        columns["class_ids"] = pa.LargeListArray.from_arrays(
            offsets, pa.array(counts.classes, pa.int32()), mask=mask
        )
        columns["class_counts"] = pa.LargeListArray.from_arrays(
            offsets, pa.array(counts.counts, pa.int64()), mask=mask
        )
        # Keyed by leaf path: a list column's values are `<name>.list.element`.
        compression.update(
            {f"{name}.list.element": "zstd" for name in ("class_ids", "class_counts")}
        )
    sink = pa.BufferOutputStream()
    pq.write_table(
        pa.table(columns),
        sink,
        compression=compression,
        use_dictionary=False,
        write_statistics=False,
    )
    return sink.getvalue().to_pybytes()


@dataclass(frozen=True)
class _TableRef:
    """A split's side table as `manifest.json` records it."""

    name: str
    rows: int
    bytes: int
    sha256: str


def read_side_table(state: ReadState, where: str, split: str, raw: Any) -> ShardTable:
    """A split whose shards are in a side table: read it if selected, then check it."""
    ref = _read_table_ref(state, f"{where}.table", raw)
    selected = state.selection.splits
    if selected is not None and split not in selected:
        state.complete = False
        return ShardTable(
            split,
            ref.rows,
            list(state.formats),
            num_classes=len(state.classes),
            layout=state.layout,
        )
    table = _TableDecoder(state, where, split, ref).decode()
    # Decoding the Parquet file leaves freed buffers in pyarrow's pool (~35 MiB at
    # 10^6 shards); give them back, or every forked worker inherits them resident.
    pa.default_memory_pool().release_unused()
    return table


def _read_table_ref(state: ReadState, where: str, data: Any) -> _TableRef:
    if type(data) is not dict:
        state.fail(where, wrong_value(data, "an object naming the split's side table"))
    state.check_keys(data, where, _TABLE_KEYS)
    name = data.get("name", MISSING)
    problem = name_problem(name, TABLE_SUFFIX)
    if problem is None and name in state.names:
        problem = f"{show_value(name)} is used by another file"
    if problem is not None:
        state.fail(f"{where}.name", problem)
    state.names.add(name)
    rows = data.get("rows", MISSING)
    if type(rows) is not int or not 0 <= rows <= MAX_TABLE_ROWS:
        state.fail(f"{where}.rows", wrong_value(rows, f"a shard count up to {MAX_TABLE_ROWS}"))
    size = data.get("bytes", MISSING)
    if type(size) is not int or not 0 < size <= MAX_TABLE_BYTES:
        state.fail(f"{where}.bytes", wrong_value(size, f"a byte count up to {MAX_TABLE_BYTES}"))
    digest = data.get("sha256", MISSING)
    if type(digest) is not str or not SHA256_HEX(digest):
        state.fail(f"{where}.sha256", wrong_value(digest, "64 lowercase hex digits"))
    row_bytes = MIN_TABLE_ROW_BYTES * len(state.formats)
    if rows > size // row_bytes:
        state.fail(
            f"{where}.rows",
            f"is {rows}, more shards than a {size}-byte side table can hold (at least "
            f"{row_bytes} bytes a shard: a 32-byte sha256 per format)",
        )
    return _TableRef(name, rows, size, digest)


def _fetch_table(state: ReadState, where: str, ref: _TableRef) -> bytes | MappedFile:
    """The side table's bytes, checked against the size and sha256 the manifest records."""
    if state.read_table is None:
        state.fail(
            where,
            f"lists the split's shards in the side file {show_value(ref.name)}, and no reader "
            "for side files was given",
            "read the manifest with `read_manifest(path)` or "
            "`pipeline.sources.resolve_source`, which read its side files",
        )
    try:
        data = state.read_table(ref.name, ref.bytes)
    except OSError as error:
        problem = f"cannot read the side file {show_value(ref.name)}: {redact_text(str(error))}"
        state.fail(where, problem, TABLE_FIX)
    if len(data) != ref.bytes:
        if isinstance(data, MappedFile):
            data.file.close()  # never hashed: its file is closed here
        size = f"more than {ref.bytes}" if len(data) > ref.bytes else str(len(data))
        problem = f"{show_value(ref.name)} is {size} bytes, the manifest records {ref.bytes}"
        state.fail(where, problem + " (truncated or replaced)", TABLE_FIX)
    found = data.hexdigest() if isinstance(data, MappedFile) else hashlib.sha256(data).hexdigest()
    if found != ref.sha256:
        problem = f"{show_value(ref.name)} does not match the sha256 the manifest records"
        state.fail(where, problem + " (replaced or corrupted)", TABLE_FIX)
    return data


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


class _TableDecoder:
    """Reads one side table and applies the inline checks to its columns, vectorised."""

    def __init__(self, reader: ReadState, where: str, split: str, ref: _TableRef) -> None:
        self.reader = reader
        self.where = where
        self.split = split
        self.ref = ref

    def fail(self, field: str, problem: str) -> NoReturn:
        self.reader.fail(f"{self.where}{field}", f"{problem} (in {self.ref.name})")

    def fail_row(self, row: int, field: str, problem: str) -> NoReturn:
        self.fail(f".shards[{row}]{field}", problem)

    def decode(self) -> ShardTable:
        """Fetch and check the side file, read the selected columns, check them.

        Whatever pyarrow or a decoder raises on the file's bytes (a corrupt footer, a
        column name that is not UTF-8, pages that do not decode) is a `ManifestError`
        naming the file, raised from it; a `MemoryError` stays one.
        """
        data = _fetch_table(self.reader, f"{self.where}.table", self.ref)
        try:
            return self.decode_bytes(data)
        except (ManifestError, MemoryError):
            raise
        except _TABLE_ERRORS as error:
            detail = redact_text(str(error).strip())[:300]
            problem = f"not a readable Parquet table ({type(error).__name__}: {detail})"
            raise ManifestError(
                self.reader.source, f"{self.where}.table", f"{problem} (in {self.ref.name})", FIX
            ) from error

    def decode_bytes(self, data: bytes | MappedFile) -> ShardTable:
        buffer = data.map if isinstance(data, MappedFile) else data
        parquet = pq.ParquetFile(pa.BufferReader(pa.py_buffer(buffer)))
        schema, rows = parquet.schema_arrow, parquet.metadata.num_rows
        if rows != self.ref.rows:
            self.fail(".table", f"holds {rows} shards, the manifest records {self.ref.rows}")
        columns = self.columns_to_read(schema)
        arrow = parquet.read(columns=columns, use_threads=False)
        del parquet, buffer, data  # the file: the columns are read, and checks need memory
        for name in columns:
            if arrow.column(name).null_count and name not in ("class_ids", "class_counts"):
                row = _first(arrow.column(name).is_null().to_numpy(zero_copy_only=False))
                self.fail_row(row, f".{name}", "is null")
        samples = frozen(arrow.column("samples").to_numpy())
        if (samples < 0).any():
            row = _first(samples < 0)
            self.fail_row(row, ".samples", wrong_value(int(samples[row]), COUNT))
        files = {fmt: self.file_columns(arrow, fmt, samples) for fmt in self.reader.wanted}
        num_classes = len(self.reader.classes)
        class_counts = None
        if not self.reader.selection.class_counts and "class_ids" in schema.names:
            self.reader.complete = False
        elif "class_ids" in schema.names:
            class_counts = self.class_counts(arrow, samples, num_classes)
        elif self.reader.selection.class_counts:
            class_counts = ClassCounts.from_rows([[]] * rows, num_classes)
        formats = list(self.reader.formats)
        return ShardTable(
            self.split,
            rows,
            formats,
            samples,
            files,
            class_counts,
            num_classes,
            self.ref.sha256,
            layout=self.reader.layout,
        )

    def columns_to_read(self, schema: pa.Schema) -> list[str]:
        """Check the schema (known columns, their types, nothing missing); the ones to read."""
        expected: dict[str, Callable[[pa.DataType], bool]] = {"samples": _is_int64}
        for fmt in self.reader.formats:
            expected[f"{fmt}_bytes"] = _is_int64
            expected[f"{fmt}_sha256"] = _is_digest
            expected[f"{fmt}_name"] = _is_string
        expected["class_ids"] = _IsListOf(pa.int32())
        expected["class_counts"] = _IsListOf(pa.int64())
        if len(set(schema.names)) != len(schema.names):
            self.fail(".table", "names a column twice")
        for column in schema:
            if column.name not in expected:
                known = ", ".join(expected)
                self.fail(".table", f"has the column {show_value(column.name)}; known: {known}")
            if not expected[column.name](column.type):
                self.fail(".table", f"column {column.name} has the wrong type {column.type}")
        required = ["samples"] + [
            f"{f}_{c}" for f in self.reader.formats for c in ("bytes", "sha256")
        ]
        if ("class_ids" in schema.names) != ("class_counts" in schema.names):
            required += ["class_ids", "class_counts"]
        for name in required:
            if name not in schema.names:
                self.fail(".table", f"has no column {name}")
        wanted = ["samples"]
        for fmt in self.reader.wanted:
            wanted += [f"{fmt}_bytes"]
            wanted += [f"{fmt}_sha256"] if self.reader.selection.digests else []
            wanted += [f"{fmt}_name"] if f"{fmt}_name" in schema.names else []
        if self.reader.selection.class_counts and "class_ids" in schema.names:
            wanted += ["class_ids", "class_counts"]
        return wanted

    def file_columns(self, arrow: pa.Table, fmt: str, samples: np.ndarray) -> FileColumns:
        sizes = frozen(arrow.column(f"{fmt}_bytes").to_numpy())
        bad = (sizes < 0) | (sizes > MAX_FILE_BYTES)
        if bad.any():
            row = _first(bad)
            expected = f"a byte count up to {MAX_FILE_BYTES}"
            self.fail_row(row, f".files.{fmt}.bytes", wrong_value(int(sizes[row]), expected))
        suffix, min_sample_bytes = self.reader.formats[fmt]
        over = samples > sizes // min_sample_bytes
        if over.any():
            row = _first(over)
            self.fail_row(
                row,
                ".samples",
                f"is {samples[row]}, more than a {sizes[row]}-byte {fmt} file can hold "
                f"(at least {min_sample_bytes} bytes a sample)",
            )
        names = None
        if f"{fmt}_name" in arrow.column_names:
            names = self.explicit_names(arrow.column(f"{fmt}_name").to_pylist(), fmt, suffix)
        else:
            self.reader.check_derived(self.where, self.split, fmt, len(samples))
        digests = None
        if f"{fmt}_sha256" in arrow.column_names:
            digests = _digests(arrow.column(f"{fmt}_sha256"))
        else:
            self.reader.complete = False  # a manifest without digests is never written back
        return FileColumns(sizes, digests, names)

    def explicit_names(self, names: list[str], fmt: str, suffix: str) -> tuple[str, ...] | None:
        """Names stored in the table: each checked as an inline name is."""
        taken = self.reader.names
        for row, name in enumerate(names):
            problem = name_problem(name, suffix, self.reader.directory(fmt))
            if problem is None and name in taken:
                problem = f"{show_value(name)} is used by another shard file"
            if problem is not None:
                self.fail_row(row, f".files.{fmt}.name", problem)
            taken.add(name)
        layout = self.reader.layout
        if all(name == shard_name(self.split, i, fmt, layout) for i, name in enumerate(names)):
            return None
        return tuple(names)

    def class_counts(self, arrow: pa.Table, samples: np.ndarray, num_classes: int) -> ClassCounts:
        """The sparse class counts: ascending known classes, positive counts, row sums."""
        ids = _one_chunk(arrow.column("class_ids"))
        counts = _one_chunk(arrow.column("class_counts"))
        counted = ~ids.is_null().to_numpy(zero_copy_only=False)
        offsets = ids.offsets.to_numpy()
        if not np.array_equal(offsets, counts.offsets.to_numpy()) or not np.array_equal(
            counted, ~counts.is_null().to_numpy(zero_copy_only=False)
        ):
            self.fail(".table", "columns class_ids and class_counts do not pair up")
        if ids.values.null_count or counts.values.null_count:
            self.fail(".table", "class_ids or class_counts hold a null entry")
        indptr = offsets - offsets[0] if offsets[0] else offsets
        lengths = np.diff(indptr)
        if (lengths[~counted] != 0).any():
            row = _first(~counted & (lengths != 0))
            self.fail_row(row, ".class_counts", "is null but has entries")
        classes = ids.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        values = counts.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
        entries = _ClassEntries(classes, values, indptr, samples, counted, num_classes)
        for start in range(0, len(samples), _CHECK_ROWS):
            self.check_class_rows(entries, start, min(start + _CHECK_ROWS, len(samples)))
        return ClassCounts(
            frozen(counted),
            frozen(indptr),
            frozen(np.asarray(classes, np.int32)),
            frozen(np.asarray(values, np.int64)),
        )

    def check_class_rows(self, entries: _ClassEntries, start: int, stop: int) -> None:
        """Rows `start..stop` of the class counts: a chunk bounds the temporaries."""
        low, high = entries.indptr[start], entries.indptr[stop]
        classes, values = entries.classes[low:high], entries.values[low:high]
        indptr = entries.indptr[start : stop + 1] - low
        row_of = np.repeat(np.arange(start, stop), np.diff(indptr))
        samples = entries.samples[start:stop]
        bad = (classes < 0) | (classes >= entries.num_classes)
        if bad.any():
            at = _first(bad)
            problem = f"names class {classes[at]}, but there are {entries.num_classes} classes"
            self.fail_row(int(row_of[at]), ".class_counts", problem)
        bad = (values <= 0) | (values > entries.samples[row_of])
        if bad.any():
            at = _first(bad)
            problem = f"holds {values[at]} for class {classes[at]}; entries are 1..samples"
            self.fail_row(int(row_of[at]), ".class_counts", problem)
        rising = np.diff(classes) > 0
        inner = indptr[1:-1]
        rising[inner[(inner > 0) & (inner < len(classes))] - 1] = True  # row boundaries
        if not rising.all():
            at = _first(~rising) + 1
            problem = f"lists class {classes[at]} out of order or twice"
            self.fail_row(int(row_of[at]), ".class_counts", problem)
        padded = np.zeros(len(values) + 1, np.int64)
        np.cumsum(values, out=padded[1:])
        falls = padded[1:] <= padded[:-1]  # every entry is > 0, so a fall is an overflow
        if falls.any():
            self.fail_row(int(row_of[_first(falls)]), ".class_counts", "sums past an int64")
        sums = padded[indptr[1:]] - padded[indptr[:-1]]
        wrong = entries.counted[start:stop] & (sums != samples)
        if wrong.any():
            at = _first(wrong)
            problem = f"sums to {sums[at]} but samples is {samples[at]}"
            self.fail_row(start + at, ".class_counts", problem)


@dataclass(frozen=True)
class _ClassEntries:
    """The class-count columns of a side table, as `check_class_rows` reads them."""

    classes: np.ndarray
    values: np.ndarray
    indptr: np.ndarray
    samples: np.ndarray
    counted: np.ndarray
    num_classes: int


# What reading a side table's bytes may raise: pyarrow's errors (ArrowInvalid, which is
# also a ValueError, ArrowTypeError, ...), OSError for pages that do not decode, and
# UnicodeDecodeError (a ValueError) for a column name that is not UTF-8.
_TABLE_ERRORS = (pa.ArrowException, OSError, ValueError)


def _one_chunk(column: pa.ChunkedArray) -> pa.Array:
    """A column as one array, without a copy when it is one chunk already."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _is_int64(kind: pa.DataType) -> bool:
    return kind == pa.int64()


def _is_digest(kind: pa.DataType) -> bool:
    return kind == pa.binary(DIGEST_BYTES)


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


class _IsListOf:
    def __init__(self, value: pa.DataType) -> None:
        self.value = value

    def __call__(self, kind: pa.DataType) -> bool:
        return pa.types.is_large_list(kind) and kind.value_type == self.value


def _digests(column: pa.ChunkedArray) -> np.ndarray:
    """`uint8 [n, 32]` from a `fixed_size_binary(32)` column, without a per-row copy."""
    array = _one_chunk(column)
    if not len(array):
        return frozen(np.zeros((0, DIGEST_BYTES), np.uint8))
    raw = np.frombuffer(array.buffers()[1], np.uint8)
    start = array.offset * DIGEST_BYTES
    return frozen(raw[start : start + len(array) * DIGEST_BYTES].reshape(-1, DIGEST_BYTES))
