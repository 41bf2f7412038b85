"""A split's shard list inline in `manifest.json`, checked shard by shard into a `ShardTable`.

The hot path of reading a large manifest: checks come before messages, and field paths
and messages are only made once something is wrong.
"""

from __future__ import annotations

from typing import Any, NoReturn

import numpy as np

from shards.manifest.names import MAX_FILE_BYTES, MAX_NAME_CHARS, shard_name
from shards.manifest.parse import (
    COUNT,
    MISSING,
    SHA256_HEX,
    key_path,
    name_problem,
    show_value,
    wrong_value,
)
from shards.manifest.state import ReadState
from shards.manifest.table import ClassCounts, FileColumns, ShardTable, digests_from_hex, frozen

_SHARD_KEYS = frozenset(("index", "samples", "files", "class_counts"))
_FILE_KEYS = frozenset(("name", "bytes", "sha256"))


def read_inline_shards(state: ReadState, where: str, split: str, raw_shards: Any) -> ShardTable:
    """A split's shards listed in `manifest.json` itself, checked and collected into columns."""
    if type(raw_shards) is not list:
        state.fail(f"{where}.shards", wrong_value(raw_shards, "a list of shards"))
    columns = _InlineColumns(split, list(state.formats), state.layout)
    for i, raw in enumerate(raw_shards):
        _read_shard(state, where, i, raw, columns)
    return columns.table(len(state.classes))


def _read_shard(state: ReadState, where: str, i: int, data: Any, columns: _InlineColumns) -> None:
    """One shard: the hot path of a large manifest, so checks come before messages."""
    if type(data) is not dict:
        state.fail(f"{where}.shards[{i}]", wrong_value(data, "an object"))
    if len(data) != 3 + ("class_counts" in data):
        state.check_keys(data, f"{where}.shards[{i}]", _SHARD_KEYS)
    index = data.get("index", MISSING)
    if type(index) is not int or index != i:
        state.fail(f"{where}.shards[{i}].index", wrong_value(index, f"{i}: shards are in order"))
    samples = data.get("samples", MISSING)
    if type(samples) is not int or samples < 0:
        state.fail(f"{where}.shards[{i}].samples", wrong_value(samples, COUNT))
    raw_files = data.get("files", MISSING)
    if type(raw_files) is not dict or raw_files.keys() != state.formats.keys():
        _fail_files(state, f"{where}.shards[{i}].files", raw_files)
    for fmt, raw in raw_files.items():
        _read_file(state, where, i, fmt, raw, samples, columns.files[fmt])
    counts = data.get("class_counts", [])
    if type(counts) is not list or counts:
        counts = state.read_class_counts(counts, f"{where}.shards[{i}]", samples)
    columns.add(samples, counts, raw_files)


def _fail_files(state: ReadState, where: str, value: Any) -> NoReturn:
    if type(value) is not dict:
        state.fail(where, wrong_value(value, "an object of files, one per format"))
    missing = [fmt for fmt in state.formats if fmt not in value]
    if missing:
        state.fail(where, f"has no file for format {missing[0]!r}, listed in `formats`")
    extra = next(fmt for fmt in value if fmt not in state.formats)
    state.fail(key_path(where, extra), f"is not in `formats` {list(state.formats)}")


def _read_file(
    state: ReadState, split: str, i: int, fmt: str, data: Any, samples: int, column: _InlineFiles
) -> None:
    if type(data) is not dict or len(data) != 3:
        _fail_file_shape(state, f"{split}.shards[{i}].files.{fmt}", data)
    name = data.get("name", MISSING)
    suffix, min_sample_bytes = state.formats[fmt]
    plain = name
    if state.version >= 3 and type(name) is str and name.startswith(fmt):
        plain = name[len(fmt) + 1 :] if name[len(fmt) : len(fmt) + 1] == "/" else name
    if (
        type(name) is not str
        or not name.endswith(suffix)
        or plain.startswith(".")
        or "/" in plain
        or "\\" in plain
        or ":" in name
        or not name.isprintable()
        or len(name) > MAX_NAME_CHARS
        or name in state.names
    ):
        _fail_name(state, f"{split}.shards[{i}].files.{fmt}.name", name, suffix, fmt)
    state.names.add(name)
    size = data.get("bytes", MISSING)
    if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
        expected = f"a byte count up to {MAX_FILE_BYTES}"
        state.fail(f"{split}.shards[{i}].files.{fmt}.bytes", wrong_value(size, expected))
    digest = data.get("sha256", MISSING)
    if type(digest) is not str or not SHA256_HEX(digest):
        expected = "64 lowercase hex digits"
        state.fail(f"{split}.shards[{i}].files.{fmt}.sha256", wrong_value(digest, expected))
    if samples > size // min_sample_bytes:
        state.fail(
            f"{split}.shards[{i}].samples",
            f"is {show_value(samples)}, more than a {size}-byte {fmt} file can hold "
            f"(at least {min_sample_bytes} bytes a sample)",
        )
    column.names.append(name)
    column.sizes.append(size)
    column.digests.append(digest)


def _fail_file_shape(state: ReadState, where: str, data: Any) -> NoReturn:
    if type(data) is not dict:
        state.fail(where, wrong_value(data, "an object"))
    state.check_keys(data, where, _FILE_KEYS)
    missing = next(key for key in ("name", "bytes", "sha256") if key not in data)
    state.fail(f"{where}.{missing}", "is missing")


def _fail_name(state: ReadState, where: str, name: Any, suffix: str, fmt: str) -> NoReturn:
    problem = name_problem(name, suffix, state.directory(fmt))
    if problem is None:  # the name is fine but taken
        problem = f"{show_value(name)} is used by another shard file"
    state.fail(where, problem)


class _InlineFiles:
    """One format's files of an inline shard list, as they are read."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.sizes: list[int] = []
        self.digests: list[str] = []

    def columns(self, split: str, fmt: str, layout: str) -> FileColumns:
        names = self.names
        derived = all(name == shard_name(split, i, fmt, layout) for i, name in enumerate(names))
        return FileColumns(
            frozen(np.array(self.sizes, np.int64)),
            digests_from_hex(self.digests),
            None if derived else tuple(names),
        )


class _InlineColumns:
    """An inline shard list collected into columns as it is validated."""

    def __init__(self, split: str, formats: list[str], layout: str) -> None:
        self.split = split
        self.layout = layout
        self.formats = formats  # file order: the first shard's, else the manifest's
        self.samples: list[int] = []
        self.rows: list[list[int]] = []
        self.files = {fmt: _InlineFiles() for fmt in formats}

    def add(self, samples: int, class_counts: list[int], files: dict[str, Any]) -> None:
        if not self.samples:
            self.formats = list(files)
        self.samples.append(samples)
        self.rows.append(class_counts)

    def table(self, num_classes: int) -> ShardTable:
        files = {fmt: self.files[fmt].columns(self.split, fmt, self.layout) for fmt in self.formats}
        return ShardTable(
            self.split,
            len(self.samples),
            self.formats,
            frozen(np.array(self.samples, np.int64)),
            files,
            ClassCounts.from_rows(self.rows, num_classes),
            num_classes,
            layout=self.layout,
        )
