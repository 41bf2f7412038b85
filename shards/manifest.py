"""`manifest.json`: the contract between `preprocess build-shards` and the loader.

Written last and atomically, so a dataset without a manifest is incomplete by
definition. It lists, per split and format, every shard with its sample count,
byte size and sha256, plus the class names, the build config and the skip
histogram. The loader uses the counts to give every rank equal batch counts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shards.io import atomic_write_bytes

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardpipe-manifest"
FORMAT_VERSION = 1
SHARD_FORMATS = ("tar", "parquet")


def shard_name(split: str, index: int, fmt: str) -> str:
    """`train-000012.tar`: the one place shard file names are made."""
    return f"{split}-{index:06d}.{fmt}"


def shard_pattern(split: str, count: int, fmt: str) -> str:
    """Brace pattern covering `count` shards, e.g. `train-{000000..000127}.tar`."""
    if count == 1:
        return shard_name(split, 0, fmt)
    return f"{split}-{{{0:06d}..{count - 1:06d}}}.{fmt}"


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
        files = {fmt: FileInfo(**info) for fmt, info in data["files"].items()}
        return cls(data["index"], data["samples"], files, list(data.get("class_counts", [])))


@dataclass(frozen=True)
class SplitInfo:
    """All shards of one split, in index order."""

    name: str
    samples: int
    shards: list[ShardInfo]
    class_counts: list[int]

    def patterns(self) -> dict[str, str]:
        """Brace pattern of the shard files, per format."""
        formats = self.shards[0].files if self.shards else {}
        return {fmt: shard_pattern(self.name, len(self.shards), fmt) for fmt in formats}

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> SplitInfo:
        shards = [ShardInfo.from_dict(s) for s in data["shards"]]
        return cls(name, data["samples"], shards, list(data["class_counts"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "class_counts": self.class_counts,
            "patterns": self.patterns(),
            "shards": [asdict(s) for s in self.shards],
        }


@dataclass(frozen=True)
class Manifest:
    """The dataset description a loader needs, and the record of how it was built."""

    classes: list[str]
    image_field: str
    formats: list[str]
    splits: dict[str, SplitInfo]
    config: dict[str, Any]
    inputs: int
    skipped: dict[str, int]

    @property
    def written(self) -> int:
        return sum(s.samples for s in self.splits.values())

    def shard_urls(self, split: str, fmt: str, base: str) -> list[str]:
        """Absolute URLs (or paths) of a split's shards in one format, in index order."""
        if split not in self.splits:
            raise KeyError(f"split {split!r} not in manifest; it has {sorted(self.splits)}")
        if fmt not in self.formats:
            raise KeyError(f"format {fmt!r} not built; the manifest has {self.formats}")
        base = base.rstrip("/")
        return [f"{base}/{s.files[fmt].name}" for s in self.splits[split].shards]

    def to_json(self) -> str:
        document = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "classes": self.classes,
            "image_field": self.image_field,
            "formats": self.formats,
            "inputs": self.inputs,
            "written": self.written,
            "skipped": dict(sorted(self.skipped.items())),
            "splits": {name: self.splits[name].to_dict() for name in sorted(self.splits)},
            "config": self.config,
        }
        return json.dumps(document, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "manifest") -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT_NAME:
            raise ValueError(f"{source} is not a {FORMAT_NAME} file")
        if data.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"{source} has manifest version {data.get('version')}; this code reads "
                f"version {FORMAT_VERSION}: rebuild the shards or upgrade"
            )
        splits = {name: SplitInfo.from_dict(name, s) for name, s in data["splits"].items()}
        return cls(
            classes=list(data["classes"]),
            image_field=data["image_field"],
            formats=list(data["formats"]),
            splits=splits,
            config=data["config"],
            inputs=data["inputs"],
            skipped=dict(data["skipped"]),
        )


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write `manifest.json` atomically: the dataset's commit point."""
    path = Path(directory) / MANIFEST_NAME
    atomic_write_bytes(path, manifest.to_json().encode("utf-8"))
    return path


def read_manifest(path: str | Path) -> Manifest:
    """Read a local manifest file or the manifest inside a shard directory."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"no manifest at {path}: the build did not finish; rerun the same "
            "`preprocess build-shards` command to complete it"
        )
    return Manifest.from_json(path.read_text("utf-8"), str(path))
