"""Read a CSV, JSONL or Parquet input list (`path,label[,split]`) row by row, bounded.

Every row of a list is bounded before it is held (`MAX_ROW_CHARS`,
`MAX_LIST_ROW_GROUP_BYTES`; Parquet decodes only the columns the options name), every
value it holds by its cap, and a refusal names the file and the row. Problems that make
the list itself untrustworthy (paths escaping its directory, missing columns, NUL or
control characters in a listed path) are `InputError`s before any work starts.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

from preprocess.columns import MAX_NAME_BYTES, HugeInteger, InputColumns
from preprocess.listing import CONTROL_CHARACTER, InputError, LeftOut, Listing, SourceItem, is_utf8
from shards.sample import MAX_FIELD_BYTES, SampleError

_FIX_ROW = "fix or remove the row and rerun (the row is skipped until then)"


def iter_manifest(
    manifest: Path, listing: Listing, columns: InputColumns | None = None
) -> Iterator[SourceItem]:
    """Rows `path,label[,split]` (and `columns`); paths are relative to the manifest's directory.

    Symlinks among the listed paths are counted in `listing.links_followed`; rows
    whose extra values are refused are left out in `listing.left_out`.
    """
    columns = columns or InputColumns()
    root = str(manifest.resolve().parent)
    inside = os.path.join(root, "")  # the root with one trailing separator
    from_text = manifest.suffix.lower() == ".csv"
    for where, row in iter_rows(manifest, required=columns.required):
        raw_path, label = row_fields(where, row, columns.label)
        if os.path.isabs(raw_path) or "://" in raw_path:
            raise InputError(f"{where}: path {raw_path!r} must be relative to the manifest")
        full = os.path.normpath(os.path.join(root, raw_path))
        # What os.path.relpath gives for a path inside the root, at a fifth of its cost.
        if full.startswith(inside):
            rel = full[len(inside) :].replace(os.sep, "/")
        elif full == root:
            rel = "."
        else:
            raise InputError(f"{where}: path {raw_path!r} escapes the manifest's directory")
        item = column_item(listing, columns, where, row, from_text, (full, rel, label))
        if item is not None:
            listing.links_followed += os.path.islink(full)
            yield item


def column_item(
    listing: Listing,
    columns: InputColumns,
    where: str,
    row: dict,
    from_text: bool,
    found: tuple[str, str, str | None],
) -> SourceItem | None:
    """The row's input with its extra values, or None after leaving it out as refused."""
    path, rel, label = found
    try:
        labels, values = columns.row_values(where, row, from_text)
    except SampleError as error:
        listing.left_out.append(LeftOut(rel, error.reason, f"{error.detail}; {_FIX_ROW}", True))
        return None
    split = _split_name(where, row.get("split"))
    label = labels if columns.label == "multi" else label
    return SourceItem(path, rel, label, split, where, values)


def _split_name(where: str, value: object) -> str | None:
    """A row's `split` cell as a name (None: assigned by hash), refused naming the row
    when no split could be called that."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: split is {value!s:.40}, not a name such as `train`")
    split = str(value)
    _check_name(where, "split", split, MAX_NAME_BYTES)
    return split


def row_fields(where: str, row: dict, label_mode: str = "single") -> tuple[str, str | None]:
    """A row's path and label (None unless single-label: `InputColumns.row_values` reads
    the others), refused when unusable as a file name or a class name."""
    raw_path, label = row.get("path"), row.get("label")
    if label_mode != "single":
        label = "-"  # checked (multi) or not read (none) elsewhere
    if not raw_path or label is None or str(label) == "":
        needs = "`path` and `label`" if label_mode == "single" else "`path`"
        raise InputError(f"{where}: every row needs {needs}; fix the row and rerun")
    if not isinstance(raw_path, str):
        raise InputError(
            f"{where}: path must be text, not {type(raw_path).__name__}; write the file's "
            "path relative to the list, as a string"
        )
    if isinstance(label, HugeInteger):
        raise InputError(f"{where}: label is {label}; a class name is text or a small integer")
    label = str(label)
    for name, value, limit in (
        ("path", raw_path, MAX_PATH_BYTES),
        ("label", label, MAX_NAME_BYTES),
    ):
        _check_name(where, name, value, limit)
    return raw_path, (label if label_mode == "single" else None)


def _check_name(where: str, name: str, value: str, limit: int) -> None:
    """Refuse a path or class name that no file system or class list can hold."""
    bad = CONTROL_CHARACTER.search(value)
    if bad is not None:
        raise InputError(
            f"{where}: {name} {_shown(value)} holds the control character {bad.group()!r} "
            "(a NUL byte or another character below 0x20); fix or remove this row "
            "of the list and rerun"
        )
    if not is_utf8(value):
        raise InputError(
            f"{where}: {name} {_shown(_undecoded(value))} is not UTF-8 text (bytes that are "
            "not UTF-8, or a lone surrogate escape); save the list as UTF-8, or fix or remove "
            "this row, and rerun"
        )
    if len(value) > limit // 4 and len(value.encode("utf-8")) > limit:
        raise InputError(
            f"{where}: {name} {_shown(value)} is {len(value.encode('utf-8'))} bytes, over the "
            f"{limit}-byte limit of a {name}; fix or remove this row of the list and rerun"
        )


def _undecoded(value: str) -> str:
    """`value` with the bytes that were not UTF-8 shown as `\\xNN`, as the file holds them."""
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate from a JSON `\\ud800` escape
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _shown(value: str) -> str:
    """A row's value for a message: escaped, and at most about 80 characters of it."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def iter_rows(
    manifest: Path | str,
    opener=open,
    required: tuple[str, ...] = ("path", "label"),
    suffix: str | None = None,
) -> Iterator[tuple[str, dict]]:
    """(where, row) pairs of a CSV, JSONL or Parquet list, read as a stream.

    `where` names the file and row; `opener` is `open` or a remote list's reader, and
    `suffix` the list's format when `manifest` (a name for messages) does not end in it.
    CSV and JSONL rows are named by their line, Parquet rows by their index from 1.
    The first row must have the `required` columns. Every row is bounded before it is
    held (`MAX_ROW_CHARS`, `MAX_LIST_ROW_GROUP_BYTES`): a row past the bound is an
    `InputError` naming the file and row, read no further than the bound.
    """
    suffix = suffix or os.path.splitext(str(manifest))[1].lower()
    if suffix == ".parquet":
        rows = _iter_parquet_rows(manifest, opener, required)
    else:
        rows = _iter_csv_or_jsonl(manifest, opener, suffix)
    first = next(rows, None)
    if first is None:
        return
    missing = [name for name in required if name not in first[1]]
    if missing:
        declared = " (--fields and --label name the columns beyond `path`)"
        raise InputError(
            f"{manifest} needs columns {', '.join(f'`{n}`' for n in required)}; it has no "
            f"{', '.join(f'`{n}`' for n in missing)} (has {sorted(map(str, first[1]))[:20]})"
            + (declared if len(required) > 2 or "label" not in required else "")
            + "; fix the list or the options and rerun"
        )
    yield first
    yield from rows


# Bounds on one row of an input list, so that no row costs more than its share of memory
# whatever the file holds. A CSV or JSONL row may hold this many characters: a caption and
# JSON columns at their caps (`MAX_FIELD_BYTES` each) with room for quoting and escapes; a
# longer line is refused after reading this much of it, never held whole.
MAX_ROW_CHARS = 8 * MAX_FIELD_BYTES
# A CSV cell may be this long: twice the cap of a caption or JSON value, so a cell just
# over the cap is that row's counted skip (`bad_text`), not the whole list's refusal.
# The csv module's own default is 128 KiB; this only ever raises its (global) limit.
MAX_CSV_CELL = 2 * MAX_FIELD_BYTES
MAX_PATH_BYTES = 4096  # PATH_MAX on Linux: no file system opens a longer path


class _BoundedLines:
    """The lines of a text list file, each (and each CSV row) at most `MAX_ROW_CHARS`.

    A line is read with `readline(MAX_ROW_CHARS + 1)`, so a 100 MB line costs the bound,
    not 100 MB, before it is refused naming its file and line. `number` is the line last
    read; `row_chars` counts the characters since `start_row`, for rows of several lines
    (a quoted CSV cell holding newlines).
    """

    def __init__(self, file, name: str) -> None:
        self.file, self.name = file, name
        self.number = 0
        self.row_chars = 0

    def __iter__(self) -> _BoundedLines:
        return self

    def __next__(self) -> str:
        line = self.file.readline(MAX_ROW_CHARS + 1)
        if not line:
            raise StopIteration
        self.number += 1
        self.row_chars += len(line)
        if self.row_chars > MAX_ROW_CHARS:
            raise InputError(
                f"{self.name} line {self.number}: a row of over {MAX_ROW_CHARS} characters "
                "(a missing line break or quote, or a value far over its cap); fix the row "
                "and rerun"
            )
        return line

    def start_row(self) -> None:
        self.row_chars = 0


def _iter_csv_or_jsonl(manifest: Path | str, opener, suffix: str) -> Iterator[tuple[str, dict]]:
    """Rows of a CSV or JSONL list, decoded as UTF-8 (a leading BOM dropped).

    Bytes that are not UTF-8 become lone surrogates (`surrogateescape`) instead of
    refusing the whole file unnamed: a path or class name holding one is refused naming
    its row (`_check_name`), a caption or JSON column is that row's skip, and a column
    nobody declared is never looked at.
    """
    with opener(manifest, "rb") as raw:
        text = io.TextIOWrapper(raw, encoding="utf-8-sig", errors="surrogateescape", newline="")
        lines = _BoundedLines(text, str(manifest))
        if suffix == ".csv":
            yield from _iter_csv(manifest, lines)
            return
        for line in lines:
            lines.start_row()
            if line.strip():
                where = f"{manifest} line {lines.number}"
                yield where, _parse_json_line(where, line)


def _iter_csv(manifest: Path | str, lines: _BoundedLines) -> Iterator[tuple[str, dict]]:
    if csv.field_size_limit() < MAX_CSV_CELL:
        csv.field_size_limit(MAX_CSV_CELL)
    reader = csv.DictReader(lines)
    while True:
        try:
            row = next(reader, None)
        except csv.Error as error:
            raise InputError(
                f"{manifest} line {lines.number}: not readable as CSV ({error}); fix the row "
                "and rerun"
            ) from error
        if row is None:
            return
        lines.start_row()
        yield f"{manifest} line {reader.line_num}", row


# Parquet rows are decoded a batch at a time: a few MB, whatever the list's length.
_PARQUET_BATCH = 8192
# The decoded bytes of the columns read, per row group, that a list may hold (its footer
# says): pyarrow decodes a row group's pages as the batches need them, and this bounds
# what a batch can hold. 1 GiB is ~10^7 rows of path, label and a short caption.
MAX_LIST_ROW_GROUP_BYTES = 2**30


def _iter_parquet_rows(
    manifest: Path | str, opener, required: tuple[str, ...]
) -> Iterator[tuple[str, dict]]:
    """Rows of a Parquet list: only the columns the build reads are decoded.

    A column nobody declared is never read, whatever it holds.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    number = 0
    try:
        with opener(manifest, "rb") as f:
            parquet = pq.ParquetFile(f)
            names = parquet.schema_arrow.names
            wanted = [name for name in (*required, "split") if name in names]
            if len(wanted) < len(required):  # `iter_rows` names what is missing
                yield f"{manifest} row 1", dict.fromkeys(names)
                return
            _check_row_groups(manifest, parquet.metadata, wanted)
            for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH, columns=wanted):
                for row in _batch_rows(manifest, batch, number):
                    number += 1
                    yield f"{manifest} row {number}", row
    except (pa.ArrowException, OSError) as error:
        raise InputError(
            f"{manifest}: not a readable Parquet file (near row {number + 1}: {error}); "
            "rewrite it and rerun"
        ) from error


def _check_row_groups(manifest: Path | str, metadata, wanted: list[str]) -> None:
    """Refuse a row group whose read columns decode to over `MAX_LIST_ROW_GROUP_BYTES`."""
    first = 1
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        size = sum(
            group.column(i).total_uncompressed_size
            for i in range(group.num_columns)
            if group.column(i).path_in_schema.split(".")[0] in wanted
        )
        if size > MAX_LIST_ROW_GROUP_BYTES:
            raise InputError(
                f"{manifest} rows {first}-{first + group.num_rows - 1} (row group {index}): "
                f"columns {wanted} take {size} bytes decoded, over {MAX_LIST_ROW_GROUP_BYTES}; "
                "rewrite the list with smaller row groups (pyarrow: row_group_size=100_000)"
            )
        first += group.num_rows


def _batch_rows(manifest: Path | str, batch, before: int) -> list[dict]:
    """A record batch's rows as dicts; a cell Python cannot hold is refused naming its row."""
    try:
        return batch.to_pylist()
    except (UnicodeDecodeError, RecursionError, ValueError):
        pass
    for index in range(batch.num_rows):  # only on failure: find the row, one at a time
        try:
            batch.slice(index, 1).to_pylist()
        except (UnicodeDecodeError, RecursionError, ValueError) as error:
            raise InputError(
                f"{manifest} row {before + index + 1}: a value Python cannot read "
                f"({type(error).__name__}: {str(error)[:120]}); fix or remove the row and rerun"
            ) from error
    return batch.to_pylist()


def _parse_json_line(where: str, line: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise InputError(f"{where}: not JSON ({error.msg}); fix the line and rerun") from error
    except RecursionError as error:
        raise InputError(
            f"{where}: JSON nested too deeply; each line is one flat object"
        ) from error
    except ValueError:  # an integer past Python's digit limit: parse again, holding it as such
        row = json.loads(line, parse_int=_bounded_int)
    if not isinstance(row, dict):
        raise InputError(f"{where}: each line must be a JSON object")
    return row


def _bounded_int(text: str) -> int | HugeInteger:
    try:
        return int(text)
    except ValueError:
        return HugeInteger(len(text.lstrip("-")))
