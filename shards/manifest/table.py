"""A split's shards in memory: `ShardTable` (numpy columns), its `ShardInfo` rows, `SplitInfo`.

Read or built once per process and shared read-only by every worker a loader forks;
a `ShardInfo` is made only when one shard is looked at.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from shards.manifest.names import LAYOUT_FLAT, format_dir, shard_name, shard_pattern


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


def frozen(array: np.ndarray) -> np.ndarray:
    """`array`, read-only: tables are shared by every worker a loader forks."""
    array.flags.writeable = False
    return array


def exact_sum(values: np.ndarray) -> int:
    """The sum of non-negative int64 counts of at most 2**40 each, as an exact Python int.

    `np.sum` wraps silently past 2**63; chunks of 2**20 values cannot.
    """
    chunk = 2**20
    return sum(int(values[i : i + chunk].sum()) for i in range(0, len(values), chunk))


DIGEST_BYTES = 32


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
            frozen(counted), frozen(indptr), frozen(classes.astype(np.int32)), frozen(values)
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
    if any(len(text) != 2 * DIGEST_BYTES for text in hexes):
        raise ValueError("every sha256 must be 64 hex digits")
    raw = bytes.fromhex("".join(hexes))
    return frozen(np.frombuffer(raw, np.uint8).reshape(len(hexes), DIGEST_BYTES))


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
                frozen(np.array([entry.bytes for entry in entries], np.int64)),
                digests_from_hex([entry.sha256 for entry in entries]),
                None if derived else names,
            )
        rows = [info.class_counts for info in infos]
        num_classes = next((len(row) for row in rows if row), 0)
        samples = frozen(np.array([info.samples for info in infos], np.int64))
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
        """Brace pattern of the shard files, per format whose names are ours (`shard_name`):
        shards indexed with names of their own (`preprocess index`) have none."""
        if not len(self.shards):
            return {}
        count, layout = len(self.shards), self.shards.layout
        return {
            fmt: shard_pattern(self.name, count, fmt, layout)
            for fmt in self.shards.formats
            if self.shards.files[fmt].names is None
        }

    def to_dict(self) -> dict[str, Any]:
        """The split with its shards inline, as in a version-1 manifest."""
        return {
            "samples": self.samples,
            "class_counts": self.class_counts,
            "patterns": self.patterns(),
            "shards": list(self.shards.iter_dicts()),
        }
