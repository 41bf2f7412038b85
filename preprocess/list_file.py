"""Read a CSV, JSONL or Parquet input list (`path,label[,split]`) row by row, bounded.

Every row of a list is bounded before it is held (`MAX_ROW_CHARS`,
`MAX_LIST_ROW_GROUP_BYTES`; Parquet decodes only the columns the options name), every
value it holds by its cap, and a refusal names the file and the row. A row's path may
be relative to the list's folder, absolute, or a URL; its key is relative to the list's
root (`ListRoot`: `--input-root`, else the list's folder, else the deepest common
folder). Problems that make the list itself untrustworthy (a path outside
`--input-root`, or under `--confine-to-input` outside the list's folder or a URL;
missing columns; NUL or control characters in a listed path) are `InputError`s before
any work starts.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from preprocess.columns import MAX_NAME_BYTES, HugeInteger, InputColumns
from preprocess.listing import CONTROL_CHARACTER, InputError, LeftOut, Listing, SourceItem, is_utf8
from shards.redact import redact_url
from shards.sample import MAX_FIELD_BYTES, SampleError
from shards.storage import READ_SCHEMES, is_remote, local_path, validate_url

_FIX_ROW = "fix or remove the row and rerun (the row is skipped until then)"


def iter_manifest(
    manifest: Path,
    listing: Listing,
    columns: InputColumns | None = None,
    *,
    input_root: str | None = None,
    confine: bool = False,
) -> Iterator[SourceItem]:
    """Rows `path,label[,split]` (and `columns`) of a local list file.

    A path may be relative to the list's folder, absolute, a `file://` URL or a remote
    URL (`s3://`, `gs://`, `http(s)://`, read through `shards.storage`); its key is
    relative to the list's root (`ListRoot`). Symlinks among the listed paths are
    counted in `listing.links_followed`; rows whose extra values are refused are left
    out in `listing.left_out`; `listing.root` becomes the resolved local root.

    Raises:
        InputError: a path outside `input_root` (or, with `confine`, outside the list's
            folder, or a URL), a malformed URL, or a malformed row.
    """
    columns = columns or InputColumns()
    list_dir = str(manifest.resolve().parent)
    root = list_root(manifest, list_dir, input_root, confine)
    listing.root = os.path.realpath(root.local) if root.local is not None else None
    from_text = manifest.suffix.lower() == ".csv"
    for where, row in iter_rows(manifest, required=columns.required):
        raw_path, label = row_fields(where, row, columns.label)
        full, rel = root.key(where, raw_path, list_location(list_dir, where, raw_path))
        item = column_item(listing, columns, where, row, from_text, (full, rel, label))
        if item is not None:
            if not is_remote(full):
                listing.links_followed += os.path.islink(full)
            yield item


def list_location(list_dir: str, where: str, raw_path: str) -> str:
    """Where a row's path points: a URL checked as every read checks it, or a normal
    absolute local path (a relative one is relative to the list's folder)."""
    try:
        if is_remote(raw_path):
            return validate_url(raw_path, schemes=READ_SCHEMES)
        path = local_path(raw_path)  # a `file://` URL is a local path
    except ValueError as error:
        raise InputError(
            f"{where}: path {_shown(raw_path)}: {error}; fix the row and rerun"
        ) from None
    return os.path.normpath(os.path.join(list_dir, path))


def _relative_to(path: str, folder: str) -> str | None:
    """`path` relative to `folder` with `/` separators, or None when it is not under it.

    What os.path.relpath gives for a path inside the folder, at a fifth of its cost.
    """
    inside = os.path.join(folder, "")  # the folder with one trailing separator
    if path.startswith(inside):
        return path[len(inside) :].replace(os.sep, "/")
    return "." if path == folder else None


def _split_url(url: str) -> tuple[str, str, str]:
    """(`scheme://host`, path, `?query` or ``) of a URL; the path is `/` at least."""
    parts = urlsplit(url)
    query = f"?{parts.query}" if parts.query else ""
    return f"{parts.scheme.lower()}://{parts.netloc}", parts.path or "/", query


def _common_folder(folder: str | None, path: str, module=os.path) -> str:
    """The deepest folder holding both `folder` (None: none yet) and the file `path`."""
    parent = module.dirname(path)
    return parent if folder is None else module.commonpath([folder, parent])


@dataclass(frozen=True)
class ListRoot:
    """What a list file's keys are relative to: stable, path-derived, never colliding.

    Attributes:
        local: the folder local paths are keyed relative to (absolute, not resolved);
            None when the root is a URL prefix.
        prefixes: `scheme://host` -> the URL path folder that host's URLs are keyed
            relative to.
        tag_hosts: the list names more than one place (local files, several hosts):
            a URL's key starts with its host, so two places never share a key.
        strict: every local path must lie under `local` and no URL is accepted
            (`--confine-to-input`); `named`: the `--input-root` as given, whose
            prefix every path must lie under.
    """

    local: str | None
    prefixes: dict[str, str]
    tag_hosts: bool = False
    strict: bool = False
    named: str | None = None

    def key(self, where: str, raw_path: str, location: str) -> tuple[str, str]:
        """(location, key path) of a row, refused naming the row when it has no key."""
        if not is_remote(location):
            rel = None if self.local is None else _relative_to(location, self.local)
            if rel is None:
                raise InputError(f"{where}: path {_shown(raw_path)} lies outside {self._root()}")
            return location, rel
        if self.strict:
            raise InputError(
                f"{where}: path {_shown(raw_path)} is a URL, and --confine-to-input reads "
                f"nothing outside the input root {self.local}; build without "
                "--confine-to-input to read it"
            )
        origin, path, _ = _split_url(location)
        prefix = self.prefixes.get(origin)
        rel = None if prefix is None else _relative_to_url_folder(path, prefix)
        if rel is None:
            raise InputError(f"{where}: path {_shown(raw_path)} lies outside {self._root()}")
        # The key path is what the output records (a sample's `source`, errors.jsonl):
        # the host without `user:password@` and the query redacted, never a credential.
        host = urlsplit(location).netloc.rpartition("@")[2]
        query = _split_url(redact_url(location))[2]
        return location, f"{host}/{rel}{query}" if self.tag_hosts else f"{rel}{query}"

    def _root(self) -> str:
        if self.named is not None:
            return (
                f"--input-root {self.named}; pass an --input-root that holds every listed "
                "path, or leave it out"
            )
        return (
            f"the list's folder {self.local} (--confine-to-input); move the file under it, "
            "or build without --confine-to-input"
        )


def _relative_to_url_folder(path: str, folder: str) -> str | None:
    folder = folder.rstrip("/")
    if path.startswith(f"{folder}/") and len(path) > len(folder) + 1:
        return path[len(folder) + 1 :]
    return None


def list_root(manifest: Path, list_dir: str, input_root: str | None, confine: bool) -> ListRoot:
    """The `ListRoot` of a list: `input_root` when named; with `confine`, the list's folder;
    else the list's folder when every path lies in it, or the deepest common folder of
    the local paths and, per `scheme://host`, of the URLs (found by one pass over the
    list's path column first)."""
    if input_root is not None:
        return _named_root(input_root, confine)
    if confine:
        return ListRoot(list_dir, {}, strict=True)
    local, outside, prefixes = None, False, {}
    for where, row in iter_rows(manifest, required=("path",)):
        raw_path = row.get("path")
        if not isinstance(raw_path, str) or not raw_path:
            continue  # refused naming its row by the pass that reads it
        location = list_location(list_dir, where, raw_path)
        if is_remote(location):
            origin, path, _ = _split_url(location)
            prefixes[origin] = _common_folder(prefixes.get(origin), path, posixpath)
        else:
            local = _common_folder(local, location)
            outside = outside or _relative_to(location, list_dir) is None
    places = len(prefixes) + (local is not None)
    return ListRoot(local if outside else list_dir, prefixes, tag_hosts=places > 1)


def _named_root(input_root: str, confine: bool) -> ListRoot:
    """The `ListRoot` of `--input-root`: a local folder or a URL prefix."""
    if not is_remote(input_root):
        folder = os.path.abspath(local_path(input_root))
        return ListRoot(folder, {}, strict=confine, named=input_root)
    if confine:
        raise InputError(
            f"--input-root {input_root} is a URL, and --confine-to-input reads nothing "
            "outside a local root; leave one of them out"
        )
    origin, path, query = _split_url(input_root)
    if query:
        raise InputError(f"--input-root {input_root} has a query; pass the folder URL only")
    return ListRoot(None, {origin: path}, named=input_root)


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
    """A row's value for a message: redacted, escaped, and at most about 80 characters."""
    text = repr(redact_url(value))
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
    if "path" in required and "path" not in first[1] and URL_COLUMN in first[1]:
        rows = _url_as_path(manifest, opener, required, suffix, first, rows)
        first = next(rows)
    missing = [name for name in required if name not in first[1]]
    if missing:
        declared = " (--fields and --label name the columns beyond `path`)"
        raise InputError(
            f"{manifest} needs columns {', '.join(f'`{n}`' for n in required)}; it has no "
            f"{', '.join(f'`{n}`' for n in missing)} (has {sorted(map(str, first[1]))[:20]})"
            + (declared if len(required) > 2 or "label" not in required else "")
            + _label_free_hint(missing, first[1])
            + "; fix the list or the options and rerun"
        )
    yield first
    yield from rows


# img2dataset's input lists name the image's location `url` (its `--url_col` default) and
# its text `caption` (`--caption_col`): a list without `path` reads `url` as the path.
URL_COLUMN = "url"
CAPTION_COLUMN = "caption"


def _url_as_path(
    manifest: Path | str, opener, required: tuple[str, ...], suffix: str, first, rows
) -> Iterator[tuple[str, dict]]:
    """The rows of a list with `url` and no `path` column, `url` read as `path`."""
    if suffix == ".parquet":  # its reader decodes only the columns asked for: ask again
        asked = tuple(URL_COLUMN if name == "path" else name for name in required)
        rows = _iter_parquet_rows(manifest, opener, asked)
    else:
        rows = itertools.chain([first], rows)
    for where, row in rows:
        row["path"] = row.pop(URL_COLUMN)
        yield where, row


def _label_free_hint(missing: list[str], columns) -> str:
    """For a list without `label`: the flags that build it without classes (and with its
    captions, when it has img2dataset's `caption` column)."""
    if "label" not in missing:
        return ""
    captions = f" --fields {CAPTION_COLUMN}:txt" if CAPTION_COLUMN in columns else ""
    return f"; a list without classes builds with --label none{captions}"


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
