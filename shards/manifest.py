"""`manifest.json`: the contract between `preprocess build-shards` and the loader.

Written last and atomically, so a dataset without a manifest is incomplete by
definition. It lists, per split and format, every shard with its sample count,
byte size and sha256, plus the class names, the build config and the skip
histogram. The loader uses the counts to give every rank equal batch counts.

In memory a split's shards are a `ShardTable`: numpy columns (counts, sizes, raw
sha256 digests, sparse per-shard class counts), with file names derived from
`shard_name` unless the manifest says otherwise, and a `ShardInfo` made only when
one shard is looked at: ~90 bytes a shard in two formats, plus 12 a non-zero class
count, where one `ShardInfo` per shard took ~1.5 KB.

On disk (version 2) a split of at most `INLINE_MAX_SHARDS` shards keeps its shard
list inline in `manifest.json`, exactly as version 1 did; a larger split's list goes
to a Parquet side file `_shards-<split>.parquet` beside it, referenced from the
manifest by name, row count, byte size and sha256, and written before it (the
manifest stays the commit point). Why two layouts rather than one: a small
dataset's manifest stays one self-contained file that can be read, diffed, edited
and copied with a text editor, `curl` or `jq`, and every hostile-input check of
version 1 keeps applying to it unchanged; past a few thousand shards JSON costs
~20 us and ~2.5 KB of transient objects a shard to parse (300k shards: 5.5 s and
800 MiB), where a side table loads 10^6 shards in 0.6 s (the loader's one split and
format in 0.15 s and ~160 MiB). Both layouts end in the same `ShardTable` and the
same checks, so what a reader trusts does not depend on the layout. The leading `_`
keeps `pyarrow.dataset` and polars from taking the side file for a data file.
`write_manifest` (or `Manifest.to_files`) writes this layout; `Manifest.to_json`
gives the whole manifest as one inline document, whatever its size.

Version 3 names its `layout`: `flat` (every shard beside the manifest, as in
versions 1 and 2) or `by_format` (`tar/train-000000.tar`, `parquet/...`: one
directory per format, so each holds one kind of file and pyarrow, polars, duckdb
and HF datasets open it by its path). A shard name may carry at most that one
directory, its own format's name; derived names follow the layout.

Reading one is strict, because a manifest may come from anywhere (a bucket, a web
server, a hand edit): every field is type-checked, every count cross-checked, and
every shard name must be a plain file beside the manifest or in its format's
directory (never `..`, an absolute path or a URL); a side file must match
its recorded size and sha256 before it is parsed, and its columns get the same
checks as inline shards. Whatever the bytes, the only error is a `ManifestError`
that names the file and the field.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import mmap
import operator
import os
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shards.formats import FORMAT_NAMES, get_format
from shards.io import NotRegularFileError, OutputStore, atomic_write_bytes, open_regular_file
from shards.redact import redact_text, redact_url
from shards.sample import ALLOWED_FIELDS, FIELD_KINDS, IMAGE_FIELDS

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardpipe-manifest"
FORMAT_VERSION = 3  # 2: a split's shard list may live in a side table; 3: `layout`
READ_VERSIONS = (1, 2, 3)
# A flat manifest is written as version 2, byte for byte what earlier builds wrote, so
# readers from before version 3 keep reading flat outputs; only `by_format` needs 3.
FLAT_VERSION = 2
SHARD_FORMATS = FORMAT_NAMES
# Where a build puts its shards: `flat` beside the manifest (versions 1 and 2, and
# version 3 when asked), or `by_format`, one directory per format (`tar/`, `parquet/`),
# which pyarrow, polars, duckdb and HF datasets open by its path with no glob.
LAYOUT_FLAT = "flat"
LAYOUT_BY_FORMAT = "by_format"
LAYOUTS = (LAYOUT_FLAT, LAYOUT_BY_FORMAT)

# Why these caps: `to_json` writes ~470 bytes per shard in two formats plus ~10 per
# class count, so 256 MiB holds ~500k shards inline: LAION-5B at 10k samples a shard.
# Parsing that takes seconds and a few GiB; anything larger is not a manifest we wrote.
MAX_MANIFEST_BYTES = 256 * 2**20
# One shard file is one build task's output, read front to back by one worker; ours are
# 0.1-10 GB. 1 TiB is 100x that and keeps the counts derived from it (`bytes //
# min_sample_bytes`) small enough to plan an epoch with.
MAX_FILE_BYTES = 2**40
# `config` is the only free-form part; the build writes it two levels deep. The cap
# keeps `to_json` (which recurses) and every reader of it far from the recursion limit.
MAX_CONFIG_DEPTH = 32
MAX_NAME_CHARS = 255  # NAME_MAX of common file systems
# A split above this many shards gets a side table (see the module docstring): at 2k
# shards the inline list is ~1 MB of JSON and ~50 ms to parse, still pleasant to read.
INLINE_MAX_SHARDS = 2048
# A side table is ~90 bytes a shard in two formats (sha256 does not compress) plus its
# class counts; 4 GiB is 10x a 10M-shard table, 2**26 shards 1,000x LAION-5B's.
MAX_TABLE_BYTES = 4 * 2**30
MAX_TABLE_ROWS = 2**26
# The fewest bytes one shard takes in a side table, per format: its sha256, 32 random
# bytes that `encode_table` stores plainly (no compression, no dictionary) and that no
# codec shrinks. So a table of `rows` shards in F formats is at least `rows * 32 * F`
# bytes, and a table claiming more rows than `bytes // (32 * F)` was not written by us:
# it is refused before it is read, whatever its columns compress to and whether or not
# the digests are read (2**26 zero rows in 1.7 MB would cost ~4 GiB to load).
MIN_TABLE_ROW_BYTES = 32
TABLE_PREFIX = "_shards-"
TABLE_SUFFIX = ".parquet"

FIX = "rebuild the dataset with `preprocess build-shards`, or fix the file"
TABLE_FIX = (
    "copy the manifest's side tables (`_shards-*.parquet`) with it: they are part of the "
    "dataset; or rebuild it with `preprocess build-shards`"
)
_SHA256 = re.compile(r"[0-9a-f]{64}").fullmatch
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}").fullmatch
_INT = {int}
_STR = {str}
_DIGEST_BYTES = 32
_CHECK_ROWS = 2**16  # side-table rows whose class counts are checked at a time

# `(name, recorded byte count) -> the side file's bytes`, at most count + 1 of them.
TableReader = Callable[[str, int], "bytes | MappedFile"]


class ManifestError(ValueError):
    """A manifest that cannot be trusted: malformed, inconsistent, or naming files elsewhere.

    Attributes:
        source: where the manifest came from, redacted: safe to log.
        field: the offending field as a path (`splits.train.shards[3].samples`), or
            `(file)` for the file as a whole.
        problem: what is wrong.
        action: what to do about it.
    """

    def __init__(self, source: Any, field: str, problem: str, action: str = FIX) -> None:
        self.source = redact_url(os.fspath(source) if isinstance(source, os.PathLike) else source)
        self.field = field
        self.problem = problem
        self.action = action
        super().__init__(f"{self.source}: {field}: {problem}; {action}")

    def __reduce__(self) -> tuple[type, tuple]:
        # Keeps the attributes when the error crosses a DataLoader worker's pipe.
        return (type(self), (self.source, self.field, self.problem, self.action))


def format_dir(fmt: str, layout: str = LAYOUT_FLAT) -> str:
    """The directory (with its `/`) that `layout` puts format `fmt`'s shards in: `tar/` or ``."""
    return f"{fmt}/" if layout == LAYOUT_BY_FORMAT else ""


def shard_name(split: str, index: int, fmt: str, layout: str = LAYOUT_FLAT) -> str:
    """`train-000012.tar` (or `tar/train-000012.tar`): the one place shard names are made.

    The name is relative to the manifest's directory.
    """
    return f"{format_dir(fmt, layout)}{split}-{index:06d}.{fmt}"


def shard_pattern(split: str, count: int, fmt: str, layout: str = LAYOUT_FLAT) -> str:
    """Brace pattern covering `count` shards, e.g. `train-{000000..000127}.tar`."""
    if count == 1:
        return shard_name(split, 0, fmt, layout)
    return f"{format_dir(fmt, layout)}{split}-{{{0:06d}..{count - 1:06d}}}.{fmt}"


@dataclass(frozen=True)
class FileInfo:
    """One shard file: name relative to the manifest, size and checksum."""

    name: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class ShardInfo:
    """One shard index of a split, present in one or more formats with the same samples."""

    index: int
    samples: int
    files: dict[str, FileInfo]
    class_counts: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardInfo:
        """From `asdict(info)` as written by our own build markers (not validated)."""
        files = {fmt: FileInfo(**info) for fmt, info in data["files"].items()}
        return cls(data["index"], data["samples"], files, list(data.get("class_counts", [])))


# --- the in-memory shard table ------------------------------------------------------------


def _frozen(array: np.ndarray) -> np.ndarray:
    """`array`, read-only: tables are shared by every worker a loader forks."""
    array.flags.writeable = False
    return array


def exact_sum(values: np.ndarray) -> int:
    """The sum of non-negative int64 counts of at most 2**40 each, as an exact Python int.

    `np.sum` wraps silently past 2**63; chunks of 2**20 values cannot.
    """
    chunk = 2**20
    return sum(int(values[i : i + chunk].sum()) for i in range(0, len(values), chunk))


@dataclass(frozen=True, eq=False)
class ClassCounts:
    """Per-shard class counts of a split, sparse: the non-zero counts only (CSR).

    Shard `i` holds `counts[indptr[i]:indptr[i + 1]]` samples of the classes
    `classes[indptr[i]:indptr[i + 1]]` (ascending); its other classes hold none.
    `counted[i]` is False for a shard that records no class counts at all (its
    `ShardInfo.class_counts` is `[]`). Sparse because a shard of ImageNet-21k holds
    a few hundred of 21,841 classes.
    """

    counted: np.ndarray  # bool [shards]
    indptr: np.ndarray  # int64 [shards + 1]
    classes: np.ndarray  # int32 [entries]
    counts: np.ndarray  # int64 [entries], each > 0

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[int]], num_classes: int) -> ClassCounts:
        """From one dense list per shard, `[]` for a shard without counts.

        Raises:
            ValueError: a non-empty list does not hold `num_classes` counts.
        """
        counted = np.fromiter((len(row) > 0 for row in rows), bool, len(rows))
        dense_rows = [row for row in rows if row]
        if any(len(row) != num_classes for row in dense_rows):
            raise ValueError(f"every shard's class_counts must hold {num_classes} counts or none")
        dense = np.array(dense_rows, dtype=np.int64).reshape(len(dense_rows), num_classes)
        local, classes = np.nonzero(dense)
        per_row = np.bincount(np.flatnonzero(counted)[local], minlength=len(rows))
        indptr = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(per_row, out=indptr[1:])
        values = dense[local, classes]
        return cls(
            _frozen(counted), _frozen(indptr), _frozen(classes.astype(np.int32)), _frozen(values)
        )

    def row(self, index: int, num_classes: int) -> list[int]:
        """Shard `index`'s counts as one dense list, `[]` when it has none."""
        if not self.counted[index]:
            return []
        dense = [0] * num_classes
        start, stop = self.indptr[index], self.indptr[index + 1]
        for cls_id, count in zip(
            self.classes[start:stop].tolist(), self.counts[start:stop].tolist(), strict=True
        ):
            dense[cls_id] = count
        return dense

    def totals(self, num_classes: int) -> np.ndarray:
        """Samples per class over every shard."""
        totals = np.zeros(num_classes, np.int64)
        np.add.at(totals, self.classes, self.counts)
        return totals

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClassCounts):
            return NotImplemented
        return all(
            np.array_equal(a, b)
            for a, b in zip(
                (self.counted, self.indptr, self.classes, self.counts),
                (other.counted, other.indptr, other.classes, other.counts),
                strict=True,
            )
        )

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True, eq=False)
class FileColumns:
    """One format's files of a split: byte sizes, raw sha256 digests and, rarely, names.

    Digests are a `uint8 [shards, 32]` array rather than numpy's `S32`, whose items
    lose their trailing zero bytes. `names` is None when every name is
    `shard_name(split, index, fmt, layout)` of its table's layout, as in every
    build of ours.
    """

    sizes: np.ndarray  # int64 [shards]
    digests: np.ndarray | None  # uint8 [shards, 32]; None when left unread
    names: tuple[str, ...] | None = None

    def sha256(self, index: int) -> str | None:
        """The shard file's sha256 as hex; None when the digests were left unread."""
        return None if self.digests is None else self.digests[index].tobytes().hex()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileColumns):
            return NotImplemented
        return (
            self.names == other.names
            and np.array_equal(self.sizes, other.sizes)
            and (self.digests is None) == (other.digests is None)
            and (self.digests is None or np.array_equal(self.digests, other.digests))
        )

    __hash__ = None  # type: ignore[assignment]


def digests_from_hex(hexes: Sequence[str]) -> np.ndarray:
    """`uint8 [n, 32]` digests from n sha256 hex strings.

    Raises:
        ValueError: one is not 64 hex digits.
    """
    if any(len(text) != 2 * _DIGEST_BYTES for text in hexes):
        raise ValueError("every sha256 must be 64 hex digits")
    raw = bytes.fromhex("".join(hexes))
    return _frozen(np.frombuffer(raw, np.uint8).reshape(len(hexes), _DIGEST_BYTES))


class ShardTable(Sequence[ShardInfo]):
    """A split's shards as columns; `table[i]` (and iteration) makes a `ShardInfo`.

    A table read for a subset of the manifest (see `read_manifest`) may lack some
    formats' columns or the class counts (`class_counts is None`), or hold no
    columns at all (`loaded` is False, only `len()` and `formats` work): asking for
    what was not read raises `ValueError`.

    Attributes:
        split: the split's name, which derived file names start with.
        formats: every format the shards exist in, in file order.
        class_counts: the per-shard class counts, None when not read.
        num_classes: the dataset's class count (the width of a dense count list).
        table_sha256: the sha256 of the side table the columns were read from (it
            covers every shard's recorded digest), None for an inline shard list.
        layout: the manifest's layout (`LAYOUTS`), which derived file names follow.
    """

    def __init__(
        self,
        split: str,
        rows: int,
        formats: Sequence[str],
        samples: np.ndarray | None = None,
        files: dict[str, FileColumns] | None = None,
        class_counts: ClassCounts | None = None,
        num_classes: int = 0,
        table_sha256: str | None = None,
        layout: str = LAYOUT_FLAT,
    ) -> None:
        self.split = split
        self.layout = layout
        self.rows = rows
        self.formats = tuple(formats)
        self._samples = samples
        self.files = files or {}
        self.class_counts = class_counts
        self.num_classes = num_classes
        self.table_sha256 = table_sha256
        self._name_index: dict[str, dict[str, int]] = {}  # built on first `index_of`

    @classmethod
    def from_infos(
        cls, split: str, infos: Sequence[ShardInfo], layout: str = LAYOUT_FLAT
    ) -> ShardTable:
        """From `ShardInfo`s in index order (what a build's shard tasks return).

        Raises:
            ValueError: the indexes are not 0..n-1, the shards disagree on their
                formats or class count width, or a sha256 is not 64 hex digits.
        """
        if any(info.index != i for i, info in enumerate(infos)):
            raise ValueError(f"split {split!r}: shard indexes must be 0..{len(infos) - 1} in order")
        formats = tuple(infos[0].files) if infos else ()
        if any(info.files.keys() != set(formats) for info in infos):
            raise ValueError(f"split {split!r}: every shard must have a file in {list(formats)}")
        files = {}
        for fmt in formats:
            entries = [info.files[fmt] for info in infos]
            names = tuple(entry.name for entry in entries)
            derived = all(name == shard_name(split, i, fmt, layout) for i, name in enumerate(names))
            files[fmt] = FileColumns(
                _frozen(np.array([entry.bytes for entry in entries], np.int64)),
                digests_from_hex([entry.sha256 for entry in entries]),
                None if derived else names,
            )
        rows = [info.class_counts for info in infos]
        num_classes = next((len(row) for row in rows if row), 0)
        samples = _frozen(np.array([info.samples for info in infos], np.int64))
        class_counts = ClassCounts.from_rows(rows, num_classes)
        return cls(
            split, len(infos), formats, samples, files, class_counts, num_classes, layout=layout
        )

    @property
    def loaded(self) -> bool:
        return self._samples is not None

    @property
    def samples(self) -> np.ndarray:
        """Samples per shard, int64."""
        self.require_loaded()
        return self._samples

    def require_loaded(self) -> None:
        if self._samples is None:
            raise ValueError(
                f"the shard table of split {self.split!r} was not read (the manifest was "
                "read for other splits); read it with `read_manifest(path)`"
            )

    def total_samples(self) -> int:
        return exact_sum(self.samples)

    def file_columns(self, fmt: str) -> FileColumns:
        """The columns of format `fmt`.

        Raises:
            KeyError: the shards do not exist in `fmt`.
            ValueError: they do, but this table was read without `fmt`.
        """
        if fmt not in self.formats:
            raise KeyError(f"format {fmt!r} not built; the shards exist in {list(self.formats)}")
        self.require_loaded()
        if fmt not in self.files:
            raise ValueError(
                f"the {fmt} columns of split {self.split!r} were not read; read the manifest "
                f"with formats including {fmt!r}"
            )
        return self.files[fmt]

    def name(self, index: int, fmt: str) -> str:
        names = self.file_columns(fmt).names
        if names is not None:
            return names[index]
        return shard_name(self.split, index, fmt, self.layout)

    def names(self, fmt: str) -> list[str]:
        """Every shard's file name in `fmt`, relative to the manifest, in index order."""
        names = self.file_columns(fmt).names
        if names is not None:
            return list(names)
        return [shard_name(self.split, i, fmt, self.layout) for i in range(self.rows)]

    def derived_prefix(self, fmt: str) -> str | None:
        """`tar/` (or ``) when every `fmt` name is `prefix + shard_name(split, i, fmt)`;
        None when the names are the manifest's own (`file_columns(fmt).names`)."""
        if self.file_columns(fmt).names is not None:
            return None
        return format_dir(fmt, self.layout)

    def index_of(self, name: str, fmt: str) -> int | None:
        """The index of the shard whose `fmt` file has the explicit name `name`, or None."""
        files = self.files.get(fmt)
        if files is None or files.names is None:
            return None
        if fmt not in self._name_index:
            self._name_index[fmt] = {n: i for i, n in enumerate(files.names)}
        return self._name_index[fmt].get(name)

    def total_bytes(self, fmt: str) -> int:
        return exact_sum(self.file_columns(fmt).sizes)

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.rows))]
        index = operator.index(index)
        if index < 0:
            index += self.rows
        if not 0 <= index < self.rows:
            raise IndexError(f"shard {index} of a split with {self.rows}")
        return self.info(index)

    def info(self, index: int) -> ShardInfo:
        """Shard `index` as a `ShardInfo` (with the formats and counts that were read)."""
        files = {
            fmt: FileInfo(self.name(index, fmt), int(columns.sizes[index]), columns.sha256(index))
            for fmt, columns in self.files.items()
        }
        counts = self.class_counts.row(index, self.num_classes) if self.class_counts else []
        return ShardInfo(index, int(self.samples[index]), files, counts)

    def __iter__(self) -> Iterator[ShardInfo]:
        for index in range(self.rows):
            yield self.info(index)

    def iter_dicts(self) -> Iterator[dict[str, Any]]:
        """Each shard as `asdict(ShardInfo)`: its inline form in `manifest.json`."""
        for info in self:
            files = {fmt: asdict(file) for fmt, file in info.files.items()}
            yield {
                "index": info.index,
                "samples": info.samples,
                "files": files,
                "class_counts": info.class_counts,
            }

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ShardTable):
            return NotImplemented
        if (self.split, self.rows, self.formats, self.loaded, self.layout) != (
            other.split,
            other.rows,
            other.formats,
            other.loaded,
            other.layout,
        ):
            return False
        if not self.loaded:
            return True
        counted = self.class_counts is not None and bool(self.class_counts.counted.any())
        return (
            np.array_equal(self.samples, other.samples)
            and self.files == other.files
            and self.class_counts == other.class_counts
            and (not counted or self.num_classes == other.num_classes)
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = "" if self.loaded else ", not read"
        return f"ShardTable({self.split!r}, {self.rows} shards, {list(self.formats)}{state})"


def parse_shard_name(name: str, layout: str = LAYOUT_FLAT) -> tuple[str, int, str] | None:
    """`(split, index, fmt)` when `name` is `shard_name(split, index, fmt, layout)`, else None."""
    stem, dot, fmt = name.rpartition(".")
    stem = stem.removeprefix(format_dir(fmt, layout))
    split, dash, digits = stem.rpartition("-")
    if not (dot and dash and digits.isascii() and digits.isdigit()):
        return None
    index = int(digits)
    return (split, index, fmt) if shard_name(split, index, fmt, layout) == name else None


def table_name(split: str) -> str:
    """`_shards-train.parquet`: the side file of a split's shard table."""
    if _PLAIN_KEY(split):
        return f"{TABLE_PREFIX}{split}{TABLE_SUFFIX}"
    return f"{TABLE_PREFIX}{hashlib.sha256(split.encode('utf-8')).hexdigest()[:16]}{TABLE_SUFFIX}"


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
            pa.binary(_DIGEST_BYTES), n, [None, digests]
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


# --- the manifest -------------------------------------------------------------------------


@dataclass(frozen=True)
class SplitInfo:
    """All shards of one split, in index order.

    `shards` is a `ShardTable`; a list of `ShardInfo` (as a build assembles) is
    turned into one.
    """

    name: str
    samples: int
    shards: ShardTable
    class_counts: list[int]

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardTable):
            object.__setattr__(self, "shards", ShardTable.from_infos(self.name, list(self.shards)))

    def patterns(self) -> dict[str, str]:
        """Brace pattern of the shard files, per format."""
        if not len(self.shards):
            return {}
        count, layout = len(self.shards), self.shards.layout
        return {fmt: shard_pattern(self.name, count, fmt, layout) for fmt in self.shards.formats}

    def to_dict(self) -> dict[str, Any]:
        """The split with its shards inline, as in a version-1 manifest."""
        return {
            "samples": self.samples,
            "class_counts": self.class_counts,
            "patterns": self.patterns(),
            "shards": list(self.shards.iter_dicts()),
        }


@dataclass(frozen=True)
class Manifest:
    """The dataset description a loader needs, and the record of how it was built.

    `complete` is False for a manifest read for a subset (some splits, formats, or
    without per-shard class counts; see `read_manifest`): it cannot be written back.
    `layout` (`LAYOUTS`) says where the shard files are; every split's table has it.
    """

    classes: list[str]
    image_field: str
    formats: list[str]
    splits: dict[str, SplitInfo]
    config: dict[str, Any]
    inputs: int
    skipped: dict[str, int]
    complete: bool = field(default=True, compare=False, repr=False)
    layout: str = LAYOUT_FLAT
    # What the samples carry beyond image + class (`check_fields_entry`); None: a
    # single-label build of image, `cls` and `json`, as every build before it was.
    fields: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        for name, split in self.splits.items():
            if split.shards.layout != self.layout:
                raise ValueError(
                    f"split {name!r}: its shard table has layout {split.shards.layout!r}, "
                    f"the manifest {self.layout!r}; make it with `ShardTable.from_infos"
                    f"(..., layout={self.layout!r})`"
                )

    @property
    def written(self) -> int:
        return sum(s.samples for s in self.splits.values())

    @property
    def left_out_suffixes(self) -> dict[str, int]:
        """Files the build's listing left out for their suffix, by suffix (`{".txt": 3}`)."""
        listing = self.config.get("listing")
        return dict(listing.get("left_out_suffixes", {})) if isinstance(listing, dict) else {}

    def shard_table(self, split: str, fmt: str | None = None) -> ShardTable:
        """The shard table of `split`, checked to hold the columns of `fmt` when given.

        Raises:
            KeyError: no such split, or the format was not built.
            ValueError: the manifest was read without that split or format.
        """
        if split not in self.splits:
            raise KeyError(f"split {split!r} not in manifest; it has {sorted(self.splits)}")
        if fmt is not None and fmt not in self.formats:
            raise KeyError(f"format {fmt!r} not built; the manifest has {self.formats}")
        table = self.splits[split].shards
        if fmt is not None:
            table.file_columns(fmt)
        return table

    def shard_urls(self, split: str, fmt: str, base: str) -> list[str]:
        """Absolute URLs (or paths) of a split's shards in one format, in index order.

        The names were checked at load to be plain file names, or plain names in their
        format's directory (version 3), so every URL lies under `base`.
        """
        table = self.shard_table(split, fmt)
        base = base.rstrip("/")
        return [f"{base}/{name}" for name in table.names(fmt)]

    def locate(self, name: str, fmt: str) -> tuple[str, int] | None:
        """`(split, index)` of the shard whose `fmt` file is called `name`, or None."""
        parsed = parse_shard_name(name, self.layout)
        if parsed is not None and parsed[2] == fmt and parsed[0] in self.splits:
            split, index, _ = parsed
            table = self.splits[split].shards
            if index < len(table) and fmt in table.files and table.files[fmt].names is None:
                return split, index
        for split, info in self.splits.items():
            index = info.shards.index_of(name, fmt)
            if index is not None:
                return split, index
        return None

    def to_json(self) -> str:
        """The whole manifest as one self-contained document, every shard inline.

        What `write_manifest` writes for a dataset without large splits; for one with
        large splits, see `to_files`.
        """
        return self.encode({})

    def to_files(self, inline_max_shards: int = INLINE_MAX_SHARDS) -> list[tuple[str, bytes]]:
        """`(name, bytes)` of every file of the manifest, in commit order.

        A side table for each split of more than `inline_max_shards` shards, then
        `manifest.json`, which records their sizes and sha256. Deterministic: the
        same manifest gives the same bytes.
        """
        files, references = [], {}
        for name in sorted(self.splits):
            table = self.splits[name].shards
            if len(table) > inline_max_shards:
                self.require_complete()
                data = encode_table(table, self.formats)
                references[name] = {
                    "name": table_name(name),
                    "rows": len(table),
                    "bytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),
                }
                files.append((table_name(name), data))
        files.append((MANIFEST_NAME, self.encode(references).encode("utf-8")))
        return files

    def require_complete(self) -> None:
        if not self.complete:
            raise ValueError(
                "this manifest was read for a subset of its splits, formats or class counts "
                "and cannot be written back; read it whole with `read_manifest(path)`"
            )

    def encode(self, references: dict[str, dict[str, Any]]) -> str:
        """`manifest.json`'s text, with the splits in `references` pointing at side tables."""
        self.require_complete()
        splits = {}
        for name in sorted(self.splits):
            split = self.splits[name]
            entry = {
                "samples": split.samples,
                "class_counts": split.class_counts,
                "patterns": split.patterns(),
            }
            if name in references:
                entry["table"] = references[name]
            else:
                entry["shards"] = list(split.shards.iter_dicts())
            splits[name] = entry
        document = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "layout": self.layout,
            "classes": self.classes,
            "image_field": self.image_field,
            "formats": self.formats,
            "inputs": self.inputs,
            "written": self.written,
            "skipped": dict(sorted(self.skipped.items())),
            "splits": splits,
            "config": self.config,
        }
        if self.fields is not None:
            document["fields"] = self.fields
        if self.layout == LAYOUT_FLAT:
            document["version"] = FLAT_VERSION
            del document["layout"]
        return json.dumps(document, indent=1) + "\n"

    @classmethod
    def from_json(
        cls,
        text: str | bytes,
        source: str | os.PathLike = "manifest",
        *,
        read_table: TableReader | None = None,
        splits: Collection[str] | None = None,
        formats: Collection[str] | None = None,
        shard_class_counts: bool = True,
        shard_digests: bool = True,
    ) -> Manifest:
        """Parse and validate a manifest; `source` names it in errors (redacted).

        Args:
            text: the bytes of `manifest.json`.
            source: where it came from, for messages.
            read_table: reads a side table by name (at most its recorded size + 1
                bytes); needed when the manifest has one. Its `OSError`s become
                `ManifestError`s naming the side file.
            splits, formats, shard_class_counts: read only these splits' side tables,
                only these formats' columns (the manifest's first format when none
                of them was built), and skip the per-shard class counts (which the
                loader never needs). The manifest is then not `complete`. Inline
                shard lists are always read whole.
            shard_digests: False leaves the side tables' per-shard sha256 column
                unread (32 bytes a shard: 32 MB at 10^6 shards, in every process
                that loads the table), for a reader that does not hash the shards;
                `FileColumns.digests` is then None and `ShardTable.table_sha256`,
                the side table's own checksum, stands for them. Inline digests are
                always read.

        Raises:
            ManifestError: for any input that is not a valid manifest: bytes that are
                not UTF-8, invalid JSON, NaN, duplicate keys, deep nesting, a field of
                the wrong type, counts that do not add up, a shard name that is not
                a plain file name beside the manifest, or a side table that is missing,
                does not match its recorded size and sha256, or breaks the same rules.
        """
        selection = _Selection(
            None if splits is None else frozenset(splits),
            None if formats is None else tuple(formats),
            shard_class_counts,
            shard_digests,
        )
        with _gc_paused():
            return _ManifestReader(source, read_table, selection).read(_parse(text, source))


class LocalTableReader:
    """Reads side tables from a local directory (a `TableReader`), mapped, not copied."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def __call__(self, name: str, size: int) -> MappedFile:
        return MappedFile(self.directory / name)


class MappedFile:
    """A local side table, memory-mapped: hashed in pieces, then only the columns read.

    A million-shard table is ~76 MB; read into memory whole, it would be the peak of
    every process that loads the manifest. Mapped, hashing reads it through a small
    buffer and Parquet touches only the pages of the columns it decodes.
    """

    CHUNK = 1 << 20

    def __init__(self, path: Path) -> None:
        # Kept open until hashed: the bytes hashed are the ones mapped.
        self.file = open_regular_file(path)
        self.size = os.fstat(self.file.fileno()).st_size
        self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""

    def __len__(self) -> int:
        return self.size

    def hexdigest(self) -> str:
        """The file's sha256, read through a small buffer (mapped pages would stay resident)."""
        digest = hashlib.sha256()
        chunk = bytearray(self.CHUNK)
        with self.file:
            self.file.seek(0)
            while read := self.file.readinto(chunk):
                digest.update(memoryview(chunk)[:read])
        return digest.hexdigest()


def write_manifest(
    target: str | Path | OutputStore,
    manifest: Manifest,
    *,
    inline_max_shards: int = INLINE_MAX_SHARDS,
) -> Path | str:
    """Write the side tables, then `manifest.json` (the dataset's commit point), atomically.

    `target` is a directory or an `OutputStore`; returns where the manifest went.
    """
    files = manifest.to_files(inline_max_shards)
    if isinstance(target, OutputStore):
        for name, data in files:
            target.write_bytes_atomic(name, data)
        return target.location(MANIFEST_NAME)
    directory = Path(target)
    for name, data in files:
        atomic_write_bytes(directory / name, data)
    return directory / MANIFEST_NAME


def read_manifest(
    path: str | Path,
    *,
    splits: Collection[str] | None = None,
    formats: Collection[str] | None = None,
    shard_class_counts: bool = True,
) -> Manifest:
    """Read and validate a local manifest file or the manifest inside a shard directory.

    Side tables are read from the manifest's directory. `splits`, `formats` and
    `shard_class_counts` read a subset, as for `Manifest.from_json`.

    Raises:
        FileNotFoundError: there is no manifest (the build did not finish).
        ManifestError: the file is larger than `MAX_MANIFEST_BYTES`, not a regular
            file (a FIFO: refused, never waited on) or not a valid manifest, or a side
            table it names is missing, not a regular file, or invalid.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"no manifest at {path}: the build did not finish; rerun the same "
            "`preprocess build-shards` command to complete it"
        )
    try:
        file = open_regular_file(path)
    except NotRegularFileError as error:
        problem = f"{error}; a manifest is a file"
        raise ManifestError(path, "(file)", problem) from error
    with file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    return Manifest.from_json(
        data,
        path,
        read_table=LocalTableReader(path.parent),
        splits=splits,
        formats=formats,
        shard_class_counts=shard_class_counts,
    )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a manifest is parsed and checked.

    A 100k-shard manifest is about a million new dicts and lists, none of them garbage
    and none in a cycle, yet their allocation triggers hundreds of collections that
    each walk the growing tree: over half of the load time. Pausing halves it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# --- parsing ------------------------------------------------------------------------------


class _Missing:
    """Stands for an absent key, so that a missing field fails its type check."""


class _Rejected:
    """Stands for a JSON value we refuse (NaN, Infinity, a float overflowing to inf)."""

    def __init__(self, text: str) -> None:
        self.text = text


class _DuplicateKeys(dict):
    """An object that repeated a key: it fails every `type(x) is dict` check."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        seen: set[str] = set()
        self.key = next(k for k, _ in pairs if k in seen or seen.add(k))


_MISSING = _Missing()


def _object_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _DuplicateKeys(pairs)


def _reject_constant(text: str) -> _Rejected:
    return _Rejected(text)


def _parse_float(text: str) -> float | _Rejected:
    value = float(text)
    # 1e999 parses to inf, which `to_json` would write back as the non-JSON `Infinity`.
    return value if value - value == 0.0 else _Rejected(text)


def _parse(text: str | bytes, source: Any) -> Any:
    """JSON to Python, with every problem of the file as a whole as a `ManifestError`."""
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(source, "(file)", f"larger than {MAX_MANIFEST_BYTES} bytes")
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as error:
            raise ManifestError(
                source, "(file)", f"not UTF-8 text (byte {error.start}: {error.reason})"
            ) from error
    try:
        return json.loads(
            text,
            object_pairs_hook=_object_from_pairs,
            parse_constant=_reject_constant,
            parse_float=_parse_float,
        )
    except json.JSONDecodeError as error:
        problem = f"not valid JSON: {error.msg} at line {error.lineno} column {error.colno}"
        raise ManifestError(source, "(file)", problem) from error
    except RecursionError as error:
        problem = "nested too deeply to be a manifest (ours are a few levels deep)"
        raise ManifestError(source, "(file)", problem) from error
    except ValueError as error:  # an integer of more than 4300 digits
        raise ManifestError(source, "(file)", f"not valid JSON: {error}") from error


def _show(value: Any) -> str:
    """A short, escaped rendering of a hostile value for an error message."""
    if isinstance(value, _Rejected):
        return value.text
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str) and len(value) > 80:
        value = value[:80]
    text = json.dumps(value)  # escapes control characters; never raises for JSON values
    return text if len(text) <= 80 else text[:77] + "..."


def _wrong(value: Any, expected: str) -> str:
    """What is wrong with `value`, which should have been `expected`."""
    if value is _MISSING:
        return f"is missing; it must be {expected}"
    if isinstance(value, _DuplicateKeys):
        return f"has the key {_show(value.key)} more than once (duplicate keys are ambiguous)"
    if isinstance(value, _Rejected):
        return f"is {value.text}, which is not a JSON number; it must be {expected}"
    return f"must be {expected}, got {_show(value)}"


def _key(where: str, key: str) -> str:
    """`where.key`, or `where["odd key"]` for keys that are not plain words."""
    if not _PLAIN_KEY(key):
        return f"{where}[{_show(key)}]"
    return f"{where}.{key}" if where else key


def _name_problem(name: Any, suffix: str, directory: str | None = None) -> str | None:
    """Why `name` is not a plain file name with `suffix` beside the manifest, or None.

    With `directory` (`tar/`), a plain name inside that one directory is fine too.
    """
    if type(name) is not str:
        return _wrong(name, "a file name")
    if not name:
        return "is empty; it must be a file name"
    plain = name[len(directory) :] if directory and name.startswith(directory) else name
    if "/" in plain or "\\" in plain:
        where = "beside the manifest" + (f" or in {directory!r}" if directory else "")
        return f"{_show(name)} is a path; it must be a plain file name {where}"
    if not plain:
        return f"{_show(name)} is a directory; it must be a file name"
    if plain.startswith("."):
        return f"{_show(name)} starts with '.'; hidden names and '..' are refused"
    if ":" in name:
        return f"{_show(name)} holds ':'; URL schemes and drive letters are refused"
    if not name.isprintable():
        return f"{_show(name)} holds control or non-printable characters"
    if len(name) > MAX_NAME_CHARS:
        return f"is {len(name)} characters long; the limit is {MAX_NAME_CHARS}"
    if not name.endswith(suffix):
        return f"{_show(name)} does not end with {suffix!r}, the suffix of its format"
    return None


# --- the `fields` entry -------------------------------------------------------------------

LABEL_MODES = ("single", "multi", "none")
_FIELDS_KEYS = frozenset(("label", "members", "columns", "label_counts"))


def fields_entry(
    label: str,
    members: dict[str, str],
    columns: dict[str, str],
    label_counts: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """The manifest's `fields`: what each sample carries and where it came from.

    Args:
        label: `single`, `multi` or `none` (`preprocess build-shards --label`).
        members: `{sample member: shards.sample field kind}` (`{"txt": "text", ...}`).
        columns: `{input-list column: member}` (`--fields`).
        label_counts: multi-label only: per split, the samples holding each class.
    """
    entry: dict[str, Any] = {
        "label": label,
        "members": dict(sorted(members.items())),
        "columns": dict(sorted(columns.items())),
    }
    if label_counts is not None:
        entry["label_counts"] = {split: label_counts[split] for split in sorted(label_counts)}
    return entry


def check_fields_entry(
    reader: _ManifestReader, value: Any, splits: dict[str, SplitInfo]
) -> dict[str, Any] | None:
    """The `fields` entry checked: absent (None), or as `fields_entry` writes it.

    Members must be allowlisted shard fields of known kinds, columns must name one of
    them; `label_counts` are given exactly for multi-label, one count per class per
    split, none above the split's samples; a label-free dataset has no classes.
    """
    if value is None:
        return None
    if type(value) is not dict:
        reader.fail("fields", _wrong(value, "an object"))
    reader.check_keys(value, "fields", _FIELDS_KEYS)
    label = value.get("label", _MISSING)
    if type(label) is not str or label not in LABEL_MODES:
        reader.fail("fields.label", _wrong(label, f"one of {list(LABEL_MODES)}"))
    members = value.get("members", _MISSING)
    if type(members) is not dict or not members:
        reader.fail("fields.members", _wrong(members, "an object of members and kinds"))
    for name, kind in members.items():
        if name not in ALLOWED_FIELDS or type(kind) is not str or kind not in FIELD_KINDS:
            reader.fail(
                _key("fields.members", name),
                f"{_show(name)}: {_show(kind)} is not an allowlisted member "
                f"({', '.join(sorted(ALLOWED_FIELDS))}) of a kind in {list(FIELD_KINDS)}",
            )
    columns = value.get("columns", {})
    if type(columns) is not dict:
        reader.fail("fields.columns", _wrong(columns, "an object of columns and members"))
    for column, member in columns.items():
        if type(member) is not str or member not in members:
            reader.fail(_key("fields.columns", column), _wrong(member, "one of `members`"))
    if label == "none" and reader.classes:
        reader.fail("fields.label", "is `none` but the manifest lists classes")
    counts = value.get("label_counts")
    if (label == "multi") != (counts is not None):
        reader.fail("fields.label_counts", "must be given for multi-label datasets only")
    if counts is not None:
        _check_label_counts(reader, counts, splits)
    return value


def _check_label_counts(reader: _ManifestReader, counts: Any, splits: dict) -> None:
    if type(counts) is not dict:
        reader.fail("fields.label_counts", _wrong(counts, "an object of splits"))
    for split, row in counts.items():
        where = _key("fields.label_counts", split)
        if split not in splits:
            reader.fail(where, f"names no split of the manifest ({', '.join(sorted(splits))})")
        if type(row) is not list or len(row) != len(reader.classes):
            reader.fail(where, _wrong(row, f"a list of {len(reader.classes)} counts"))
        samples = splits[split].samples
        for index, count in enumerate(row):
            if type(count) is not int or not 0 <= count <= samples:
                reader.fail(f"{where}[{index}]", _wrong(count, f"a count of at most {samples}"))


# --- validation ---------------------------------------------------------------------------

_TOP_KEYS_V2 = frozenset(
    ("format", "version", "classes", "image_field", "formats", "inputs", "written")
    + ("skipped", "splits", "config", "fields")
)
_TOP_KEYS = _TOP_KEYS_V2 | {"layout"}
_SPLIT_KEYS_V1 = frozenset(("samples", "class_counts", "patterns", "shards"))
_SPLIT_KEYS = _SPLIT_KEYS_V1 | {"table"}
_TABLE_KEYS = frozenset(("name", "rows", "bytes", "sha256"))
_SHARD_KEYS = frozenset(("index", "samples", "files", "class_counts"))
_FILE_KEYS = frozenset(("name", "bytes", "sha256"))
_MAX_COUNT = 2**63 - 1  # what an int64 holds: counts are planned with numpy
_COUNT = "a non-negative integer"


@dataclass(frozen=True)
class _Selection:
    """What to read of side tables: None reads every split or format."""

    splits: frozenset[str] | None
    formats: tuple[str, ...] | None
    class_counts: bool
    digests: bool = True


@dataclass(frozen=True)
class _TableRef:
    """A split's side table as `manifest.json` records it."""

    name: str
    rows: int
    bytes: int
    sha256: str


class _ManifestReader:
    """One validation pass over a parsed manifest, building the dataclasses as it goes.

    The per-shard path is plain `type(x) is ...` checks and comparisons; strings for
    field paths and messages are only made once something is wrong.
    """

    def __init__(
        self,
        source: Any,
        read_table: TableReader | None = None,
        selection: _Selection | None = None,
    ) -> None:
        self.source = source
        self.read_table = read_table
        self.selection = selection or _Selection(None, None, True)
        self.version = FORMAT_VERSION
        self.layout = LAYOUT_FLAT
        self.names: set[str] = set()  # every explicit file name so far: each may be used once
        self.derived: dict[tuple[str, str], int] = {}  # (split, fmt) -> shards named by rule
        self.classes: list[str] = []
        self.formats: dict[str, tuple[str, int]] = {}  # name -> (suffix, min_sample_bytes)
        self.wanted: tuple[str, ...] = ()  # formats whose side-table columns are read
        self.complete = True

    def fail(self, where: str, problem: str, action: str = FIX) -> NoReturn:
        raise ManifestError(self.source, where, problem, action)

    def read(self, data: Any) -> Manifest:
        if type(data) is not dict:
            self.fail("(top level)", _wrong(data, "a JSON object"))
        self.check_identity(data)
        self.check_keys(data, "", _TOP_KEYS if self.version >= 3 else _TOP_KEYS_V2)
        self.layout = self.read_layout(data.get("layout", _MISSING))
        self.classes = self.read_classes(data.get("classes", _MISSING))
        image_field = data.get("image_field", _MISSING)
        if type(image_field) is not str or image_field not in IMAGE_FIELDS:
            self.fail("image_field", _wrong(image_field, f"one of {list(IMAGE_FIELDS)}"))
        formats = self.read_formats(data.get("formats", _MISSING))
        splits_raw = data.get("splits", _MISSING)
        if type(splits_raw) is not dict:
            self.fail("splits", _wrong(splits_raw, "an object of splits"))
        splits = {name: self.read_split(name, raw) for name, raw in splits_raw.items()}
        self.check_derived_names()
        written = sum(s.samples for s in splits.values())
        declared = data.get("written", written)
        if type(declared) is not int or declared != written:
            self.fail("written", _wrong(declared, f"{written}, the sum of the splits' samples"))
        skipped = self.read_skipped(data.get("skipped", _MISSING))
        inputs = data.get("inputs", _MISSING)
        expected = written + sum(skipped.values())
        if type(inputs) is not int or inputs != expected:
            self.fail("inputs", _wrong(inputs, f"{expected}, the written plus skipped inputs"))
        config = data.get("config", _MISSING)
        self.check_config(config)
        return Manifest(
            self.classes,
            image_field,
            formats,
            splits,
            config,
            inputs,
            skipped,
            self.complete,
            layout=self.layout,
            fields=check_fields_entry(self, data.get("fields"), splits),
        )

    def read_layout(self, value: Any) -> str:
        """Version 3 names its layout; earlier versions are flat."""
        if self.version < 3:
            return LAYOUT_FLAT
        if type(value) is not str or value not in LAYOUTS:
            self.fail("layout", _wrong(value, f"one of {list(LAYOUTS)}"))
        return value

    def directory(self, fmt: str) -> str | None:
        """The one directory a shard name of `fmt` may carry: `tar/` (version 3), else None."""
        return f"{fmt}/" if self.version >= 3 else None

    def check_identity(self, data: dict[str, Any]) -> None:
        """`format` and `version` first, so a newer manifest gets the upgrade advice."""
        fmt = data.get("format", _MISSING)
        if fmt != FORMAT_NAME or type(fmt) is not str:
            self.fail(
                "format",
                _wrong(fmt, repr(FORMAT_NAME)) + ": not a shardpipe manifest",
                "pass the manifest.json that `preprocess build-shards` wrote",
            )
        version = data.get("version", _MISSING)
        if type(version) is not int or version not in READ_VERSIONS:
            *most, last = map(str, READ_VERSIONS)
            readable = f"{', '.join(most)} and {last}"
            self.fail(
                "version",
                f"manifest version {_show(version) if version is not _MISSING else 'missing'}; "
                f"this code reads versions {readable}",
                "rebuild the shards with this version's `preprocess build-shards`, or upgrade",
            )
        self.version = version

    def check_keys(self, obj: dict[str, Any], where: str, allowed: frozenset[str]) -> None:
        for key in obj:
            if key not in allowed:
                known = ", ".join(sorted(allowed))
                self.fail(_key(where, key), f"is not a manifest field (known: {known})")

    def read_classes(self, value: Any) -> list[str]:
        if type(value) is not list:
            self.fail("classes", _wrong(value, "a list of class names"))
        if not set(map(type, value)) <= _STR:
            bad = next(i for i, name in enumerate(value) if type(name) is not str)
            self.fail(f"classes[{bad}]", _wrong(value[bad], "a class name (a string)"))
        if len(set(value)) != len(value):
            seen: set[str] = set()
            bad = next(i for i, name in enumerate(value) if name in seen or seen.add(name))
            self.fail(f"classes[{bad}]", f"{_show(value[bad])} is listed twice")
        return value

    def read_formats(self, value: Any) -> list[str]:
        expected = f"a non-empty list of shard formats (from {list(FORMAT_NAMES)})"
        if type(value) is not list or not value:
            self.fail("formats", _wrong(value, expected))
        for i, name in enumerate(value):
            if type(name) is not str or name not in FORMAT_NAMES:
                self.fail(f"formats[{i}]", _wrong(name, f"one of {list(FORMAT_NAMES)}"))
            if name in self.formats:
                self.fail(f"formats[{i}]", f"{_show(name)} is listed twice")
            shard_format = get_format(name)
            self.formats[name] = (shard_format.suffix, shard_format.min_sample_bytes)
        wanted = self.selection.formats
        self.wanted = tuple(value if wanted is None else [f for f in value if f in wanted])
        if not self.wanted:
            self.wanted = (value[0],)
        if len(self.wanted) < len(value):
            self.complete = False
        return value

    def read_skipped(self, value: Any) -> dict[str, int]:
        if type(value) is not dict:
            self.fail("skipped", _wrong(value, "an object of skip reasons and counts"))
        for reason, count in value.items():
            if type(count) is not int or not 0 <= count <= _MAX_COUNT:
                self.fail(_key("skipped", reason), _wrong(count, _COUNT))
        return value

    def check_config(self, config: Any) -> None:
        """Plain JSON values, finite numbers, at most `MAX_CONFIG_DEPTH` levels deep."""
        if type(config) is not dict:
            self.fail("config", _wrong(config, "an object"))
        stack: list[tuple[Any, str, int]] = [(config, "config", 1)]
        while stack:
            value, where, depth = stack.pop()
            children = value.items() if type(value) is dict else enumerate(value)
            for key, child in children:
                kind = type(child)
                if kind is dict or kind is list:
                    path = _key(where, key) if type(value) is dict else f"{where}[{key}]"
                    if depth >= MAX_CONFIG_DEPTH:
                        self.fail(path, f"nested deeper than {MAX_CONFIG_DEPTH} levels")
                    stack.append((child, path, depth + 1))
                elif kind not in (str, int, float, bool) and child is not None:
                    path = _key(where, key) if type(value) is dict else f"{where}[{key}]"
                    self.fail(path, _wrong(child, "a JSON value"))
        self.check_listing(config.get("listing", _MISSING))

    def check_listing(self, listing: Any) -> None:
        """`config.listing`: the build's account of tree entries that were not inputs."""
        if listing is _MISSING:
            return
        if type(listing) is not dict:
            self.fail("config.listing", _wrong(listing, "an object"))
        suffixes = listing.get("left_out_suffixes", _MISSING)
        if suffixes is _MISSING:
            return
        where = "config.listing.left_out_suffixes"
        if type(suffixes) is not dict:
            self.fail(where, _wrong(suffixes, "an object of file suffixes and counts"))
        for suffix, count in suffixes.items():
            if type(count) is not int or not 0 <= count <= _MAX_COUNT:
                self.fail(_key(where, suffix), _wrong(count, _COUNT))

    def read_split(self, name: str, data: Any) -> SplitInfo:
        where = _key("splits", name)
        if not name or not name.isprintable():
            self.fail(where, "a split name must be non-empty and printable")
        if type(data) is not dict:
            self.fail(where, _wrong(data, "an object"))
        self.check_keys(data, where, _SPLIT_KEYS if self.version >= 2 else _SPLIT_KEYS_V1)
        samples = data.get("samples", _MISSING)
        if type(samples) is not int or samples < 0:
            self.fail(f"{where}.samples", _wrong(samples, _COUNT))
        patterns = data.get("patterns", {})
        if type(patterns) is not dict or not set(map(type, patterns.values())) <= _STR:
            self.fail(f"{where}.patterns", _wrong(patterns, "an object of brace patterns"))
        if "table" in data:
            if "shards" in data:
                self.fail(where, "has both `shards` and `table`; a split lists its shards once")
            table = self.read_side_table(where, name, data["table"])
        else:
            raw_shards = data.get("shards", _MISSING)
            if type(raw_shards) is not list:
                self.fail(f"{where}.shards", _wrong(raw_shards, "a list of shards"))
            columns = _InlineColumns(name, list(self.formats), self.layout)
            for i, raw in enumerate(raw_shards):
                self.read_shard(where, i, raw, columns)
            table = columns.table(len(self.classes))
        if table.loaded and (total := table.total_samples()) != samples:
            self.fail(f"{where}.samples", f"is {_show(samples)} but its shards hold {total}")
        counts = self.read_class_counts(data.get("class_counts", _MISSING), where, samples)
        self.check_split_class_counts(where, counts, table)
        return SplitInfo(name, samples, table, counts)

    def check_split_class_counts(self, where: str, counts: list[int], table: ShardTable) -> None:
        """When every shard has class counts, the split's are their sums."""
        shard_counts = table.class_counts
        if not counts or not len(table) or shard_counts is None:
            return
        if not shard_counts.counted.all():
            return
        sums = shard_counts.totals(len(counts)).tolist()
        if sums != counts:
            bad = next(c for c, (a, b) in enumerate(zip(sums, counts, strict=True)) if a != b)
            problem = f"is {counts[bad]} but the shards' class_counts[{bad}] sum to {sums[bad]}"
            self.fail(f"{where}.class_counts[{bad}]", problem)

    def read_class_counts(self, value: Any, where: str, samples: int) -> list[int]:
        """An empty list, or one non-negative count per class summing to `samples`."""
        where = f"{where}.class_counts"
        if type(value) is not list:
            self.fail(where, _wrong(value, "a list of per-class counts"))
        if not value:
            return value
        if len(value) != len(self.classes):
            self.fail(where, f"has {len(value)} entries for {len(self.classes)} classes")
        if not set(map(type, value)) <= _INT or min(value) < 0:
            bad = next(i for i, n in enumerate(value) if type(n) is not int or n < 0)
            self.fail(f"{where}[{bad}]", _wrong(value[bad], _COUNT))
        total = sum(value)
        if total != samples:
            self.fail(where, f"sums to {total} but samples is {samples}")
        return value

    def read_shard(self, where: str, i: int, data: Any, columns: _InlineColumns) -> None:
        """One shard: the hot path of a large manifest, so checks come before messages."""
        if type(data) is not dict:
            self.fail(f"{where}.shards[{i}]", _wrong(data, "an object"))
        if len(data) != 3 + ("class_counts" in data):
            self.check_keys(data, f"{where}.shards[{i}]", _SHARD_KEYS)
        index = data.get("index", _MISSING)
        if type(index) is not int or index != i:
            self.fail(f"{where}.shards[{i}].index", _wrong(index, f"{i}: shards are in order"))
        samples = data.get("samples", _MISSING)
        if type(samples) is not int or samples < 0:
            self.fail(f"{where}.shards[{i}].samples", _wrong(samples, _COUNT))
        raw_files = data.get("files", _MISSING)
        if type(raw_files) is not dict or raw_files.keys() != self.formats.keys():
            self.fail_files(f"{where}.shards[{i}].files", raw_files)
        for fmt, raw in raw_files.items():
            self.read_file(where, i, fmt, raw, samples, columns.files[fmt])
        counts = data.get("class_counts", [])
        if type(counts) is not list or counts:
            counts = self.read_class_counts(counts, f"{where}.shards[{i}]", samples)
        columns.add(samples, counts, raw_files)

    def fail_files(self, where: str, value: Any) -> NoReturn:
        if type(value) is not dict:
            self.fail(where, _wrong(value, "an object of files, one per format"))
        missing = [fmt for fmt in self.formats if fmt not in value]
        if missing:
            self.fail(where, f"has no file for format {missing[0]!r}, listed in `formats`")
        extra = next(fmt for fmt in value if fmt not in self.formats)
        self.fail(_key(where, extra), f"is not in `formats` {list(self.formats)}")

    def read_file(
        self, split: str, i: int, fmt: str, data: Any, samples: int, column: _InlineFiles
    ) -> None:
        if type(data) is not dict or len(data) != 3:
            self.fail_file_shape(f"{split}.shards[{i}].files.{fmt}", data)
        name = data.get("name", _MISSING)
        suffix, min_sample_bytes = self.formats[fmt]
        plain = name
        if self.version >= 3 and type(name) is str and name.startswith(fmt):
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
            or name in self.names
        ):
            self.fail_name(f"{split}.shards[{i}].files.{fmt}.name", name, suffix, fmt)
        self.names.add(name)
        size = data.get("bytes", _MISSING)
        if type(size) is not int or not 0 <= size <= MAX_FILE_BYTES:
            expected = f"a byte count up to {MAX_FILE_BYTES}"
            self.fail(f"{split}.shards[{i}].files.{fmt}.bytes", _wrong(size, expected))
        digest = data.get("sha256", _MISSING)
        if type(digest) is not str or not _SHA256(digest):
            expected = "64 lowercase hex digits"
            self.fail(f"{split}.shards[{i}].files.{fmt}.sha256", _wrong(digest, expected))
        if samples > size // min_sample_bytes:
            self.fail(
                f"{split}.shards[{i}].samples",
                f"is {_show(samples)}, more than a {size}-byte {fmt} file can hold "
                f"(at least {min_sample_bytes} bytes a sample)",
            )
        column.names.append(name)
        column.sizes.append(size)
        column.digests.append(digest)

    def fail_file_shape(self, where: str, data: Any) -> NoReturn:
        if type(data) is not dict:
            self.fail(where, _wrong(data, "an object"))
        self.check_keys(data, where, _FILE_KEYS)
        missing = next(key for key in ("name", "bytes", "sha256") if key not in data)
        self.fail(f"{where}.{missing}", "is missing")

    def fail_name(self, where: str, name: Any, suffix: str, fmt: str) -> NoReturn:
        problem = _name_problem(name, suffix, self.directory(fmt))
        if problem is None:  # the name is fine but taken
            problem = f"{_show(name)} is used by another shard file"
        self.fail(where, problem)

    # --- side tables ----------------------------------------------------------------------

    def read_side_table(self, where: str, split: str, raw: Any) -> ShardTable:
        """A split whose shards are in a side table: read it if selected, then check it."""
        ref = self.read_table_ref(f"{where}.table", raw)
        selected = self.selection.splits
        if selected is not None and split not in selected:
            self.complete = False
            return ShardTable(
                split,
                ref.rows,
                list(self.formats),
                num_classes=len(self.classes),
                layout=self.layout,
            )
        table = _TableDecoder(self, where, split, ref).decode()
        # Decoding the Parquet file leaves freed buffers in pyarrow's pool (~35 MiB at
        # 10^6 shards); give them back, or every forked worker inherits them resident.
        pa.default_memory_pool().release_unused()
        return table

    def read_table_ref(self, where: str, data: Any) -> _TableRef:
        if type(data) is not dict:
            self.fail(where, _wrong(data, "an object naming the split's side table"))
        self.check_keys(data, where, _TABLE_KEYS)
        name = data.get("name", _MISSING)
        problem = _name_problem(name, TABLE_SUFFIX)
        if problem is None and name in self.names:
            problem = f"{_show(name)} is used by another file"
        if problem is not None:
            self.fail(f"{where}.name", problem)
        self.names.add(name)
        rows = data.get("rows", _MISSING)
        if type(rows) is not int or not 0 <= rows <= MAX_TABLE_ROWS:
            self.fail(f"{where}.rows", _wrong(rows, f"a shard count up to {MAX_TABLE_ROWS}"))
        size = data.get("bytes", _MISSING)
        if type(size) is not int or not 0 < size <= MAX_TABLE_BYTES:
            self.fail(f"{where}.bytes", _wrong(size, f"a byte count up to {MAX_TABLE_BYTES}"))
        digest = data.get("sha256", _MISSING)
        if type(digest) is not str or not _SHA256(digest):
            self.fail(f"{where}.sha256", _wrong(digest, "64 lowercase hex digits"))
        row_bytes = MIN_TABLE_ROW_BYTES * len(self.formats)
        if rows > size // row_bytes:
            self.fail(
                f"{where}.rows",
                f"is {rows}, more shards than a {size}-byte side table can hold (at least "
                f"{row_bytes} bytes a shard: a 32-byte sha256 per format)",
            )
        return _TableRef(name, rows, size, digest)

    def fetch_table(self, where: str, ref: _TableRef) -> bytes | MappedFile:
        """The side table's bytes, checked against the size and sha256 the manifest records."""
        if self.read_table is None:
            self.fail(
                where,
                f"lists the split's shards in the side file {_show(ref.name)}, and no reader "
                "for side files was given",
                "read the manifest with `read_manifest(path)` or "
                "`pipeline.sources.resolve_source`, which read its side files",
            )
        try:
            data = self.read_table(ref.name, ref.bytes)
        except OSError as error:
            problem = f"cannot read the side file {_show(ref.name)}: {redact_text(str(error))}"
            self.fail(where, problem, TABLE_FIX)
        if len(data) != ref.bytes:
            if isinstance(data, MappedFile):
                data.file.close()  # never hashed: its file is closed here
            size = f"more than {ref.bytes}" if len(data) > ref.bytes else str(len(data))
            problem = f"{_show(ref.name)} is {size} bytes, the manifest records {ref.bytes}"
            self.fail(where, problem + " (truncated or replaced)", TABLE_FIX)
        found = (
            data.hexdigest() if isinstance(data, MappedFile) else hashlib.sha256(data).hexdigest()
        )
        if found != ref.sha256:
            problem = f"{_show(ref.name)} does not match the sha256 the manifest records"
            self.fail(where, problem + " (replaced or corrupted)", TABLE_FIX)
        return data

    def check_derived(self, where: str, split: str, fmt: str, rows: int) -> None:
        """Names made by `shard_name` are plain names when the first and last are."""
        suffix = self.formats[fmt][0]
        for i in sorted({0, rows - 1}) if rows else ():
            name = shard_name(split, i, fmt, self.layout)
            problem = _name_problem(name, suffix, self.directory(fmt))
            if problem is not None:
                self.fail(f"{where}.shards[{i}].files.{fmt}.name", problem)
        self.derived[(split, fmt)] = rows

    def check_derived_names(self) -> None:
        """No explicit name is also the derived name of a shard of a side table."""
        if not self.derived:
            return
        for name in self.names:
            parsed = parse_shard_name(name, self.layout)
            if parsed is None:
                continue
            split, index, fmt = parsed
            if index < self.derived.get((split, fmt), 0):
                where = f"{_key('splits', split)}.shards[{index}].files.{fmt}.name"
                self.fail(where, f"{_show(name)} is used by another shard file")


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
            _frozen(np.array(self.sizes, np.int64)),
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
            _frozen(np.array(self.samples, np.int64)),
            files,
            ClassCounts.from_rows(self.rows, num_classes),
            num_classes,
            layout=self.layout,
        )


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


class _TableDecoder:
    """Reads one side table and applies the inline checks to its columns, vectorised."""

    def __init__(self, reader: _ManifestReader, where: str, split: str, ref: _TableRef) -> None:
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
        data = self.reader.fetch_table(f"{self.where}.table", self.ref)
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
        samples = _frozen(arrow.column("samples").to_numpy())
        if (samples < 0).any():
            row = _first(samples < 0)
            self.fail_row(row, ".samples", _wrong(int(samples[row]), _COUNT))
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
                self.fail(".table", f"has the column {_show(column.name)}; known: {known}")
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
        sizes = _frozen(arrow.column(f"{fmt}_bytes").to_numpy())
        bad = (sizes < 0) | (sizes > MAX_FILE_BYTES)
        if bad.any():
            row = _first(bad)
            expected = f"a byte count up to {MAX_FILE_BYTES}"
            self.fail_row(row, f".files.{fmt}.bytes", _wrong(int(sizes[row]), expected))
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
            problem = _name_problem(name, suffix, self.reader.directory(fmt))
            if problem is None and name in taken:
                problem = f"{_show(name)} is used by another shard file"
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
            _frozen(counted),
            _frozen(indptr),
            _frozen(np.asarray(classes, np.int32)),
            _frozen(np.asarray(values, np.int64)),
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
    return kind == pa.binary(_DIGEST_BYTES)


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
        return _frozen(np.zeros((0, _DIGEST_BYTES), np.uint8))
    raw = np.frombuffer(array.buffers()[1], np.uint8)
    start = array.offset * _DIGEST_BYTES
    return _frozen(raw[start : start + len(array) * _DIGEST_BYTES].reshape(-1, _DIGEST_BYTES))
