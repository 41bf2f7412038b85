"""The Parquet shard reader: rows as the same `Sample` dicts the tar reader yields.

Follows the reader contract of `shards.formats`: one row group at a time, a few
MiB of rows a step, only the columns asked for; problems of one row are counted
skips, problems of the shard a `ShardError`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import BinaryIO
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shards.errors import DEFAULT_LIMITS, MemberCap, ReadLimits, ShardError
from shards.parquet.layout import (
    BYTES_TYPES,
    JSON_VALUE_FIELDS,
    OPTIONAL_FIELDS,
    STRING_TYPES,
    ParquetLayout,
    check_schema,
    is_number,
)
from shards.parquet.schema import LABEL_COLUMNS
from shards.parquet.stream import (
    WatchedStream,
    arrow_errors,
    check_row_group,
    open_parquet,
    open_source,
    pages_too_large,
    row_counts,
    row_group_too_large,
)
from shards.redact import redact_url
from shards.sample import ALLOWED_FIELDS, Sample, SampleError, oversized_member

# Rows decoded and turned into Python bytes per step. A reader then holds its row
# group's pages (one page per column chunk in our files: pyarrow checks the page size
# only every 1024 rows) plus one such batch, never two more copies of the group.
# 16 MiB takes one of our groups (~15 MiB) in one step: smaller steps cost ~10%.
BATCH_BYTES = 16 * 2**20
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


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
            `json`, `txt`, `labels`, `weight`, or any column a `Field` maps, such as
            img2dataset's `caption`); each is yielded under its column's name,
            `labels`, `weight` and mapped numbers as the JSON bytes a tar member holds.
        limits: caps on one cell (`member_bytes`) and one row group (`row_group_bytes`).
        declared: the sample count the manifest promises for this shard.

    Raises:
        ShardError: the shard is not Parquet (`not_parquet`, `bad_footer`,
            `bad_data`), breaks the schema contract (`schema`), has a row group over
            the cap (`row_group_too_large`), ends before `stop` (`shard_short`), or
            holds more rows than `declared` (`shard_long`, once the declared ones are
            out). Exceptions of the stream itself (network, disk) propagate as they are.

    A null key, image or label cell (an HF image struct without bytes too), a key
    that is not UTF-8, a label outside the classes the file's metadata names and a
    cell over its column's cap (`limits.cap_for`) make their row a sample with
    `__error__` set to a `SampleError` (`null_cell`, `bad_name`, `bad_label`, the
    cap's reason: `member_too_large`, `bad_text`, ...), without that cell. A shard
    without `__key__` gets `synthetic_key_prefix(url)-{row:09d}` keys. A row repeating
    the key of a row read before it is its own sample all the same, yielded under
    `{key}-{row:09d}` with `__repeated_key__` set to the key the file gave it.
    """
    _check_window(start, stop, declared)
    with open_source(source) as stream:
        parquet = open_parquet(stream, url, limits)
        layout = check_schema(parquet.schema_arrow, url, fields)
        counts = row_counts(parquet, stream, url)
        rows = sum(counts)
        end = stop if stop is not None else declared if declared is not None else rows
        # The keys of the rows read so far: a row repeating one is still its own sample
        # (a columnar file has no member grouping to break), read under a made key.
        # Only the window's rows are seen (row groups outside it stay unread, which is
        # what lets a loader split a shard): a whole read, as the loader's of a whole
        # shard and `preprocess verify`'s, sees every repeat.
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
    stream: WatchedStream,
    group: _Group,
    layout: ParquetLayout,
    url: str,
    limits: ReadLimits,
    seen: set[bytes] | None,
) -> Iterator[Sample]:
    """Rows `[lo, hi)` of a row group, converted a batch at a time.

    `seen` holds the keys of the rows read before; a row repeating one is read under
    a made key (`_distinct_keys`).
    """
    size = check_row_group(parquet, group.index, url, limits)
    count = parquet.metadata.row_group(group.index).num_rows
    batch_rows = max(1, min(count, BATCH_BYTES * count // max(1, size)))
    refuse = partial(row_group_too_large, url, group.index, count, limits)
    unpacked = partial(pages_too_large, url, group.index, size, limits)
    stream.budget(limits.row_group_bytes, refuse, (limits.row_group_bytes, unpacked))
    batches = parquet.iter_batches(
        batch_size=batch_rows, row_groups=[group.index], columns=layout.read_paths
    )
    safe_url = redact_url(url)
    key_prefix = None if layout.has_key else synthetic_key_prefix(safe_url)
    caps = {name: limits.cap_for(name) for name in layout.columns}
    lo, hi = group.lo, group.hi
    offset = 0  # row, within the group, of the next batch's first row
    while offset < hi:
        with arrow_errors(stream, url, "bad_data"):
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
            where = _Where(first_index + a, safe_url, key_prefix)
            if seen is not None:
                where.repeated.update(_distinct_keys(seen, values["__key__"], where.first_index))
            yield from _row_samples(values, b - a, where, layout)
        offset += rows


def _distinct_keys(seen: set[bytes], keys: list, first_index: int) -> dict[int, bytes]:
    """Make `keys` distinct from each other and from `seen`, in place, and add them to it.

    A key already read becomes `{key}-{row:09d}` (`row` the file's row index; `_` added
    while that too was read): every row of a columnar file is its own sample, so a
    repeat is delivered, under a key that is the same on every whole read. Returns
    `{position: the key the file gave}` of the renamed ones. One set build and one
    disjointness test a batch (C loops); the Python loop runs only for a batch that
    holds a repeat. Null and oversized cells are not keys.
    """
    present = [key for key in keys if type(key) is bytes]
    fresh = set(present)
    if len(fresh) == len(present) and seen.isdisjoint(fresh):
        seen |= fresh
        return {}
    renamed = {}
    for position, key in enumerate(keys):
        if type(key) is not bytes:
            continue
        if key in seen:
            made = b"%s-%09d" % (key, first_index + position)
            while made in seen:
                made += b"_"
            keys[position], renamed[position] = made, key
        seen.add(keys[position])
    return renamed


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
        elif name in JSON_VALUE_FIELDS and not any(check(array.type) for check in STRING_TYPES):
            values[name] = _json_cells(array, caps[name])
        elif name in layout.mapped:
            values[name] = _mapped_cells(array, caps[name])
        else:
            values[name] = _column_values(array, caps[name])
    return values


def _label_values(array: pa.Array, classes: int) -> list:
    """A label column's ints, with `_BadLabel` for those outside `[0, classes)`.

    Compared as float64: arrow has no common type for uint64 and a Python int (it
    casts to int64, which 2^64 - 1 does not fit), and any integer type casts to it;
    rounding past 2^53 cannot bring a value back inside `[0, classes)`.
    """
    cells = array.to_pylist()
    values = array.cast(pa.float64(), safe=False)
    outside = pc.or_(pc.less(values, 0), pc.greater_equal(values, float(classes)))
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
    if is_number(array.type):
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


def _mapped_cells(array: pa.Array, cap: MemberCap) -> list:
    """A column a `Field` maps, as the bytes a tar member of its name would hold.

    Strings and binary as they are (UTF-8 bytes, never decoded here), an integer as its
    digits (`3`: a class id for a label field), a float and a list of ids as their JSON
    (`0.5`, `[0, 3]`); None for null cells, `_Oversized` past the cap. The field's kind
    decodes and judges the bytes, as it would a tar member's.
    """
    if any(check(array.type) for check in BYTES_TYPES):
        return _column_values(array, cap)
    if not pa.types.is_integer(array.type):
        return _json_cells(array, cap)
    cells = []
    for value in array.to_pylist():
        data = None if value is None else str(value).encode("ascii")
        cells.append(_Oversized(len(data), cap) if data and len(data) > cap.max_bytes else data)
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
    """Where a batch's rows are: the first one's row index, the shard, the key prefix,
    and the keys the file gave the rows read under a made key (by position in the batch)."""

    first_index: int
    url: str
    key_prefix: str | None  # None: the shard has a `__key__` column
    repeated: dict[int, bytes] = field(default_factory=dict)


def _row_samples(values: dict, rows: int, where: _Where, layout: ParquetLayout) -> Iterator[Sample]:
    names = layout.columns
    cells = zip(*(values[name] for name in names), strict=True) if names else [()] * rows
    for offset, row in enumerate(cells):
        index = where.first_index + offset
        key = None if where.key_prefix is None else f"{where.key_prefix}-{index:09d}"
        sample = _sample(dict(zip(names, row, strict=True)), index, where.url, key, layout)
        if offset in where.repeated:
            sample["__repeated_key__"] = _row_key(where.repeated[offset], index, where.url)[0]
        yield sample


def _sample(cells: dict, index: int, url: str, key: str | None, layout: ParquetLayout) -> Sample:
    """One row's sample; `key` is the synthetic key, None when the row has a `__key__` cell."""
    error = None
    if key is None:
        key, error = _row_key(cells.pop("__key__"), index, url)
    sample = {"__key__": key, "__url__": url}
    for name, value in cells.items():
        if isinstance(value, (bytes, int)):
            sample[name] = str(value).encode("ascii") if name in LABEL_COLUMNS else value
        # A null json (or mapped cell) is no json: the sample lacks it, as a tar may.
        elif value is not None or (name not in OPTIONAL_FIELDS and name not in layout.mapped):
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
    with open_source(source) as stream:
        parquet = open_parquet(stream, url, limits)
        schema = parquet.schema_arrow
        # A shard without classes (label-free, multi-label, another writer's) counts too.
        labelled = any(schema.get_all_field_indices(name) for name in LABEL_COLUMNS)
        check_schema(schema, url, ALLOWED_FIELDS - set(() if labelled else LABEL_COLUMNS))
        counts = row_counts(parquet, stream, url)
        for group in range(len(counts)):
            check_row_group(parquet, group, url, limits)
        return sum(counts)


def column_names(
    source: BinaryIO | str | os.PathLike, url: str, limits: ReadLimits = DEFAULT_LIMITS
) -> tuple[str, ...]:
    """The columns of a Parquet shard, in file order, from its footer alone.

    Raises:
        ShardError: the footer cannot be read (`not_parquet`, `bad_footer`); stream
            exceptions propagate as they are.
    """
    with open_source(source) as stream:
        parquet = open_parquet(stream, url, limits)
        with arrow_errors(stream, url, "bad_footer"):
            return tuple(parquet.schema_arrow.names)
