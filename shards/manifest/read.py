"""Reading a parsed manifest: the document and its splits checked, the `Manifest`'s fields out."""

from __future__ import annotations

from typing import Any

from shards.formats import FORMATS, get_format, is_format
from shards.manifest.fields import check_fields_entry
from shards.manifest.inline import read_inline_shards
from shards.manifest.names import (
    FORMAT_NAME,
    LAYOUT_FLAT,
    LAYOUTS,
    MAX_CONFIG_DEPTH,
    READ_VERSIONS,
)
from shards.manifest.parse import COUNT, MAX_COUNT, MISSING, key_path, show_value, wrong_value
from shards.manifest.side_tables import read_side_table
from shards.manifest.state import ReadState
from shards.manifest.table import ShardTable, SplitInfo
from shards.sample import IMAGE_FIELDS

_STR = {str}
_TOP_KEYS_V2 = frozenset(
    ("format", "version", "classes", "image_field", "formats", "inputs", "written")
    + ("skipped", "splits", "config", "fields")
)
_TOP_KEYS = _TOP_KEYS_V2 | {"layout"}
_SPLIT_KEYS_V1 = frozenset(("samples", "class_counts", "patterns", "shards"))
_SPLIT_KEYS = _SPLIT_KEYS_V1 | {"table"}


class ManifestReader(ReadState):
    """One validation pass over a parsed manifest: the document and its splits.

    Inline shard lists go to `inline`, side tables to `side_tables`, the `fields` entry
    to `fields`. The per-shard path is plain `type(x) is ...` checks and comparisons;
    strings for field paths and messages are only made once something is wrong.
    """

    def read(self, data: Any) -> dict[str, Any]:
        """The `Manifest`'s keyword arguments, checked: `Manifest.from_json` builds it."""
        if type(data) is not dict:
            self.fail("(top level)", wrong_value(data, "a JSON object"))
        self.check_identity(data)
        self.check_keys(data, "", _TOP_KEYS if self.version >= 3 else _TOP_KEYS_V2)
        self.layout = self.read_layout(data.get("layout", MISSING))
        self.classes = self.read_classes(data.get("classes", MISSING))
        image_field = data.get("image_field", MISSING)
        if type(image_field) is not str or image_field not in IMAGE_FIELDS:
            self.fail("image_field", wrong_value(image_field, f"one of {list(IMAGE_FIELDS)}"))
        formats = self.read_formats(data.get("formats", MISSING))
        splits_raw = data.get("splits", MISSING)
        if type(splits_raw) is not dict:
            self.fail("splits", wrong_value(splits_raw, "an object of splits"))
        splits = {name: self.read_split(name, raw) for name, raw in splits_raw.items()}
        self.check_derived_names()
        written = sum(s.samples for s in splits.values())
        declared = data.get("written", written)
        if type(declared) is not int or declared != written:
            self.fail(
                "written", wrong_value(declared, f"{written}, the sum of the splits' samples")
            )
        skipped = self.read_skipped(data.get("skipped", MISSING))
        inputs = data.get("inputs", MISSING)
        expected = written + sum(skipped.values())
        if type(inputs) is not int or inputs != expected:
            self.fail("inputs", wrong_value(inputs, f"{expected}, the written plus skipped inputs"))
        config = data.get("config", MISSING)
        self.check_config(config)
        return dict(
            classes=self.classes,
            image_field=image_field,
            formats=formats,
            splits=splits,
            config=config,
            inputs=inputs,
            skipped=skipped,
            complete=self.complete,
            layout=self.layout,
            fields=check_fields_entry(self, data.get("fields"), splits),
        )

    def read_layout(self, value: Any) -> str:
        """Version 3 names its layout; earlier versions are flat."""
        if self.version < 3:
            return LAYOUT_FLAT
        if type(value) is not str or value not in LAYOUTS:
            self.fail("layout", wrong_value(value, f"one of {list(LAYOUTS)}"))
        return value

    def check_identity(self, data: dict[str, Any]) -> None:
        """`format` and `version` first, so a newer manifest gets the upgrade advice."""
        fmt = data.get("format", MISSING)
        if fmt != FORMAT_NAME or type(fmt) is not str:
            self.fail(
                "format",
                wrong_value(fmt, repr(FORMAT_NAME)) + ": not a shardpipe manifest",
                "pass the manifest.json that `preprocess build-shards` wrote",
            )
        version = data.get("version", MISSING)
        if type(version) is not int or version not in READ_VERSIONS:
            *most, last = map(str, READ_VERSIONS)
            readable = f"{', '.join(most)} and {last}"
            self.fail(
                "version",
                f"manifest version {show_value(version) if version is not MISSING else 'missing'}; "
                f"this code reads versions {readable}",
                "rebuild the shards with this version's `preprocess build-shards`, or upgrade",
            )
        self.version = version

    def read_classes(self, value: Any) -> list[str]:
        if type(value) is not list:
            self.fail("classes", wrong_value(value, "a list of class names"))
        if not set(map(type, value)) <= _STR:
            bad = next(i for i, name in enumerate(value) if type(name) is not str)
            self.fail(f"classes[{bad}]", wrong_value(value[bad], "a class name (a string)"))
        if len(set(value)) != len(value):
            seen: set[str] = set()
            bad = next(i for i, name in enumerate(value) if name in seen or seen.add(name))
            self.fail(f"classes[{bad}]", f"{show_value(value[bad])} is listed twice")
        return value

    def read_formats(self, value: Any) -> list[str]:
        expected = f"a non-empty list of shard formats (from {list(FORMATS)})"
        if type(value) is not list or not value:
            self.fail("formats", wrong_value(value, expected))
        for i, name in enumerate(value):
            if type(name) is not str or not is_format(name):
                self.fail(f"formats[{i}]", wrong_value(name, f"one of {list(FORMATS)}"))
            if name in self.formats:
                self.fail(f"formats[{i}]", f"{show_value(name)} is listed twice")
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
            self.fail("skipped", wrong_value(value, "an object of skip reasons and counts"))
        for reason, count in value.items():
            if type(count) is not int or not 0 <= count <= MAX_COUNT:
                self.fail(key_path("skipped", reason), wrong_value(count, COUNT))
        return value

    def check_config(self, config: Any) -> None:
        """Plain JSON values, finite numbers, at most `MAX_CONFIG_DEPTH` levels deep."""
        if type(config) is not dict:
            self.fail("config", wrong_value(config, "an object"))
        stack: list[tuple[Any, str, int]] = [(config, "config", 1)]
        while stack:
            value, where, depth = stack.pop()
            children = value.items() if type(value) is dict else enumerate(value)
            for key, child in children:
                kind = type(child)
                if kind is dict or kind is list:
                    path = key_path(where, key) if type(value) is dict else f"{where}[{key}]"
                    if depth >= MAX_CONFIG_DEPTH:
                        self.fail(path, f"nested deeper than {MAX_CONFIG_DEPTH} levels")
                    stack.append((child, path, depth + 1))
                elif kind not in (str, int, float, bool) and child is not None:
                    path = key_path(where, key) if type(value) is dict else f"{where}[{key}]"
                    self.fail(path, wrong_value(child, "a JSON value"))
        self.check_listing(config.get("listing", MISSING))

    def check_listing(self, listing: Any) -> None:
        """`config.listing`: the build's account of tree entries that were not inputs."""
        if listing is MISSING:
            return
        if type(listing) is not dict:
            self.fail("config.listing", wrong_value(listing, "an object"))
        suffixes = listing.get("left_out_suffixes", MISSING)
        if suffixes is MISSING:
            return
        where = "config.listing.left_out_suffixes"
        if type(suffixes) is not dict:
            self.fail(where, wrong_value(suffixes, "an object of file suffixes and counts"))
        for suffix, count in suffixes.items():
            if type(count) is not int or not 0 <= count <= MAX_COUNT:
                self.fail(key_path(where, suffix), wrong_value(count, COUNT))

    def read_split(self, name: str, data: Any) -> SplitInfo:
        where = key_path("splits", name)
        if not name or not name.isprintable():
            self.fail(where, "a split name must be non-empty and printable")
        if type(data) is not dict:
            self.fail(where, wrong_value(data, "an object"))
        self.check_keys(data, where, _SPLIT_KEYS if self.version >= 2 else _SPLIT_KEYS_V1)
        samples = data.get("samples", MISSING)
        if type(samples) is not int or samples < 0:
            self.fail(f"{where}.samples", wrong_value(samples, COUNT))
        patterns = data.get("patterns", {})
        if type(patterns) is not dict or not set(map(type, patterns.values())) <= _STR:
            self.fail(f"{where}.patterns", wrong_value(patterns, "an object of brace patterns"))
        if "table" in data:
            if "shards" in data:
                self.fail(where, "has both `shards` and `table`; a split lists its shards once")
            table = read_side_table(self, where, name, data["table"])
        else:
            table = read_inline_shards(self, where, name, data.get("shards", MISSING))
        if table.loaded and (total := table.total_samples()) != samples:
            self.fail(f"{where}.samples", f"is {show_value(samples)} but its shards hold {total}")
        counts = self.read_class_counts(data.get("class_counts", MISSING), where, samples)
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
