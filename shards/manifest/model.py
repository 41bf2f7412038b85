"""`Manifest`: the dataset a loader reads and the record of its build, to and from its files."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from shards.manifest.errors import FormatNotBuiltError, SplitNotFoundError
from shards.manifest.mapped import TableReader
from shards.manifest.names import (
    FLAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    INLINE_MAX_SHARDS,
    LAYOUT_FLAT,
    LAYOUTS,
    MANIFEST_NAME,
    parse_shard_name,
    table_name,
)
from shards.manifest.parse import gc_paused, parse_json
from shards.manifest.read import ManifestReader
from shards.manifest.side_tables import encode_table
from shards.manifest.state import Selection
from shards.manifest.table import ShardTable, SplitInfo


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
    # Where it was read from (`from_json`'s `source`), for errors; redacted when shown.
    source: str = field(default="manifest", compare=False, repr=False)

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
            SplitNotFoundError: no such split (a `KeyError` too), naming the ones it has.
            FormatNotBuiltError: the format was not built (a `KeyError` too).
            ValueError: the manifest was read without that split or format.
        """
        if split not in self.splits:
            raise SplitNotFoundError(
                self.source,
                "splits",
                f"split {split!r} not in manifest; it has {sorted(self.splits)}",
                "name one of those splits",
            )
        if fmt is not None and fmt not in self.formats:
            raise FormatNotBuiltError(
                self.source,
                "formats",
                f"format {fmt!r} not built; the manifest has {self.formats}",
                "name one of those formats, or rebuild with `--formats` including it",
            )
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
        selection = Selection(
            None if splits is None else frozenset(splits),
            None if formats is None else tuple(formats),
            shard_class_counts,
            shard_digests,
        )
        with gc_paused():
            fields = ManifestReader(source, read_table, selection).read(parse_json(text, source))
            return cls(**fields, source=os.fspath(source))
