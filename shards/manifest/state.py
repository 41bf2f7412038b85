"""The state one manifest read shares across its checks, and how a check fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NoReturn

from shards.manifest.errors import FIX, ManifestError
from shards.manifest.mapped import TableReader
from shards.manifest.names import FORMAT_VERSION, LAYOUT_FLAT, parse_shard_name, shard_name
from shards.manifest.parse import COUNT, key_path, name_problem, show_value, wrong_value

_INT = {int}


@dataclass(frozen=True)
class Selection:
    """What to read of side tables: None reads every split or format."""

    splits: frozenset[str] | None
    formats: tuple[str, ...] | None
    class_counts: bool
    digests: bool = True


class ReadState:
    """What one read of a manifest has learnt so far, shared by the checks of its parts.

    The document (`read.ManifestReader`), its inline shard lists (`inline`), its side
    tables (`side_tables`) and its `fields` entry each check their part against it and
    add to it: the formats, the classes, every file name used.
    """

    def __init__(
        self,
        source: Any,
        read_table: TableReader | None = None,
        selection: Selection | None = None,
    ) -> None:
        self.source = source
        self.read_table = read_table
        self.selection = selection or Selection(None, None, True)
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

    def check_keys(self, obj: dict[str, Any], where: str, allowed: frozenset[str]) -> None:
        for key in obj:
            if key not in allowed:
                known = ", ".join(sorted(allowed))
                self.fail(key_path(where, key), f"is not a manifest field (known: {known})")

    def directory(self, fmt: str) -> str | None:
        """The one directory a shard name of `fmt` may carry: `tar/` (version 3), else None."""
        return f"{fmt}/" if self.version >= 3 else None

    def read_class_counts(self, value: Any, where: str, samples: int) -> list[int]:
        """An empty list, or one non-negative count per class summing to `samples`."""
        where = f"{where}.class_counts"
        if type(value) is not list:
            self.fail(where, wrong_value(value, "a list of per-class counts"))
        if not value:
            return value
        if len(value) != len(self.classes):
            self.fail(where, f"has {len(value)} entries for {len(self.classes)} classes")
        if not set(map(type, value)) <= _INT or min(value) < 0:
            bad = next(i for i, n in enumerate(value) if type(n) is not int or n < 0)
            self.fail(f"{where}[{bad}]", wrong_value(value[bad], COUNT))
        total = sum(value)
        if total != samples:
            self.fail(where, f"sums to {total} but samples is {samples}")
        return value

    def check_derived(self, where: str, split: str, fmt: str, rows: int) -> None:
        """Names made by `shard_name` are plain names when the first and last are."""
        suffix = self.formats[fmt][0]
        for i in sorted({0, rows - 1}) if rows else ():
            name = shard_name(split, i, fmt, self.layout)
            problem = name_problem(name, suffix, self.directory(fmt))
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
                where = f"{key_path('splits', split)}.shards[{index}].files.{fmt}.name"
                self.fail(where, f"{show_value(name)} is used by another shard file")
