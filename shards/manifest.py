"""`manifest.json`: the contract between `preprocess build-shards` and the loader.

Written last and atomically, so a dataset without a manifest is incomplete by
definition. It lists, per split and format, every shard with its sample count,
byte size and sha256, plus the class names, the build config and the skip
histogram. The loader uses the counts to give every rank equal batch counts.

Reading one is strict, because a manifest may come from anywhere (a bucket, a web
server, a hand edit): every field is type-checked, every count cross-checked, and
every shard name must be a plain file beside the manifest. Whatever the bytes, the
only error is a `ManifestError` that names the file and the field.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from shards.formats import FORMAT_NAMES, get_format
from shards.io import atomic_write_bytes
from shards.redact import redact_url
from shards.sample import IMAGE_FIELDS

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardpipe-manifest"
FORMAT_VERSION = 1
SHARD_FORMATS = FORMAT_NAMES

# Why these caps: `to_json` writes ~470 bytes per shard in two formats plus ~10 per
# class count, so 256 MiB holds ~500k shards: LAION-5B at 10k samples a shard. Parsing
# that takes seconds and a few GiB; anything larger is not a manifest we wrote.
MAX_MANIFEST_BYTES = 256 * 2**20
# One shard file is one build task's output, read front to back by one worker; ours are
# 0.1-10 GB. 1 TiB is 100x that and keeps the counts derived from it (`bytes //
# min_sample_bytes`) small enough to plan an epoch with.
MAX_FILE_BYTES = 2**40
# `config` is the only free-form part; the build writes it two levels deep. The cap
# keeps `to_json` (which recurses) and every reader of it far from the recursion limit.
MAX_CONFIG_DEPTH = 32
MAX_NAME_CHARS = 255  # NAME_MAX of common file systems

FIX = "rebuild the dataset with `preprocess build-shards`, or fix the file"
_SHA256 = re.compile(r"[0-9a-f]{64}").fullmatch
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]{1,64}").fullmatch
_INT = {int}
_STR = {str}


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
        """From `asdict(info)` as written by our own build markers (not validated)."""
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
        """Absolute URLs (or paths) of a split's shards in one format, in index order.

        The names were checked at load to be plain file names, so every URL lies
        directly under `base`.
        """
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
    def from_json(cls, text: str | bytes, source: str | os.PathLike = "manifest") -> Manifest:
        """Parse and validate a manifest; `source` names it in errors (redacted).

        Raises:
            ManifestError: for any input that is not a valid manifest: bytes that are
                not UTF-8, invalid JSON, NaN, duplicate keys, deep nesting, a field of
                the wrong type, counts that do not add up, or a shard name that is not
                a plain file name beside the manifest.
        """
        with _gc_paused():
            return _ManifestReader(source).read(_parse(text, source))


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write `manifest.json` atomically: the dataset's commit point."""
    path = Path(directory) / MANIFEST_NAME
    atomic_write_bytes(path, manifest.to_json().encode("utf-8"))
    return path


def read_manifest(path: str | Path) -> Manifest:
    """Read and validate a local manifest file or the manifest inside a shard directory.

    Raises:
        FileNotFoundError: there is no manifest (the build did not finish).
        ManifestError: the file is larger than `MAX_MANIFEST_BYTES` or not a valid manifest.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(
            f"no manifest at {path}: the build did not finish; rerun the same "
            "`preprocess build-shards` command to complete it"
        )
    with path.open("rb") as file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    return Manifest.from_json(data, path)


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


def _name_problem(name: Any, suffix: str) -> str | None:
    """Why `name` is not a plain file name with `suffix` beside the manifest, or None."""
    if type(name) is not str:
        return _wrong(name, "a file name")
    if not name:
        return "is empty; it must be a file name"
    if "/" in name or "\\" in name:
        return f"{_show(name)} is a path; it must be a plain file name beside the manifest"
    if name.startswith("."):
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


# --- validation ---------------------------------------------------------------------------

_TOP_KEYS = frozenset(
    ("format", "version", "classes", "image_field", "formats", "inputs", "written")
    + ("skipped", "splits", "config")
)
_SPLIT_KEYS = frozenset(("samples", "class_counts", "patterns", "shards"))
_SHARD_KEYS = frozenset(("index", "samples", "files", "class_counts"))
_FILE_KEYS = frozenset(("name", "bytes", "sha256"))
_MAX_COUNT = 2**63 - 1  # what an int64 holds: counts are planned with numpy
_COUNT = "a non-negative integer"


class _ManifestReader:
    """One validation pass over a parsed manifest, building the dataclasses as it goes.

    The per-shard path is plain `type(x) is ...` checks and comparisons; strings for
    field paths and messages are only made once something is wrong.
    """

    def __init__(self, source: Any) -> None:
        self.source = source
        self.names: set[str] = set()  # every file name so far: each may be used once
        self.classes: list[str] = []
        self.formats: dict[str, tuple[str, int]] = {}  # name -> (suffix, min_sample_bytes)

    def fail(self, where: str, problem: str, action: str = FIX) -> NoReturn:
        raise ManifestError(self.source, where, problem, action)

    def read(self, data: Any) -> Manifest:
        if type(data) is not dict:
            self.fail("(top level)", _wrong(data, "a JSON object"))
        self.check_identity(data)
        self.check_keys(data, "", _TOP_KEYS)
        self.classes = self.read_classes(data.get("classes", _MISSING))
        image_field = data.get("image_field", _MISSING)
        if type(image_field) is not str or image_field not in IMAGE_FIELDS:
            self.fail("image_field", _wrong(image_field, f"one of {list(IMAGE_FIELDS)}"))
        formats = self.read_formats(data.get("formats", _MISSING))
        splits_raw = data.get("splits", _MISSING)
        if type(splits_raw) is not dict:
            self.fail("splits", _wrong(splits_raw, "an object of splits"))
        splits = {name: self.read_split(name, raw) for name, raw in splits_raw.items()}
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
        return Manifest(self.classes, image_field, formats, splits, config, inputs, skipped)

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
        if type(version) is not int or version != FORMAT_VERSION:
            self.fail(
                "version",
                f"manifest version {_show(version) if version is not _MISSING else 'missing'}; "
                f"this code reads version {FORMAT_VERSION}",
                "rebuild the shards with this version's `preprocess build-shards`, or upgrade",
            )

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

    def read_split(self, name: str, data: Any) -> SplitInfo:
        where = _key("splits", name)
        if not name or not name.isprintable():
            self.fail(where, "a split name must be non-empty and printable")
        if type(data) is not dict:
            self.fail(where, _wrong(data, "an object"))
        self.check_keys(data, where, _SPLIT_KEYS)
        samples = data.get("samples", _MISSING)
        if type(samples) is not int or samples < 0:
            self.fail(f"{where}.samples", _wrong(samples, _COUNT))
        patterns = data.get("patterns", {})
        if type(patterns) is not dict or not set(map(type, patterns.values())) <= _STR:
            self.fail(f"{where}.patterns", _wrong(patterns, "an object of brace patterns"))
        raw_shards = data.get("shards", _MISSING)
        if type(raw_shards) is not list:
            self.fail(f"{where}.shards", _wrong(raw_shards, "a list of shards"))
        shards = [self.read_shard(where, i, raw) for i, raw in enumerate(raw_shards)]
        total = sum(s.samples for s in shards)
        if total != samples:
            self.fail(f"{where}.samples", f"is {_show(samples)} but its shards hold {total}")
        counts = self.read_class_counts(data.get("class_counts", _MISSING), where, samples)
        self.check_split_class_counts(where, counts, shards)
        return SplitInfo(name, samples, shards, counts)

    def check_split_class_counts(
        self, where: str, counts: list[int], shards: list[ShardInfo]
    ) -> None:
        """When every shard has class counts, the split's are their sums."""
        if not counts or not shards or not all(s.class_counts for s in shards):
            return
        sums = [sum(column) for column in zip(*(s.class_counts for s in shards), strict=True)]
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

    def read_shard(self, where: str, i: int, data: Any) -> ShardInfo:
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
        files = {}
        for fmt, raw in raw_files.items():
            files[fmt] = self.read_file(where, i, fmt, raw, samples)
        counts = data.get("class_counts", [])
        if type(counts) is not list or counts:
            counts = self.read_class_counts(counts, f"{where}.shards[{i}]", samples)
        return ShardInfo(i, samples, files, counts)

    def fail_files(self, where: str, value: Any) -> NoReturn:
        if type(value) is not dict:
            self.fail(where, _wrong(value, "an object of files, one per format"))
        missing = [fmt for fmt in self.formats if fmt not in value]
        if missing:
            self.fail(where, f"has no file for format {missing[0]!r}, listed in `formats`")
        extra = next(fmt for fmt in value if fmt not in self.formats)
        self.fail(_key(where, extra), f"is not in `formats` {list(self.formats)}")

    def read_file(self, split: str, i: int, fmt: str, data: Any, samples: int) -> FileInfo:
        if type(data) is not dict or len(data) != 3:
            self.fail_file_shape(f"{split}.shards[{i}].files.{fmt}", data)
        name = data.get("name", _MISSING)
        suffix, min_sample_bytes = self.formats[fmt]
        if (
            type(name) is not str
            or not name.endswith(suffix)
            or name.startswith(".")
            or "/" in name
            or "\\" in name
            or ":" in name
            or not name.isprintable()
            or len(name) > MAX_NAME_CHARS
            or name in self.names
        ):
            self.fail_name(f"{split}.shards[{i}].files.{fmt}.name", name, suffix)
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
        return FileInfo(name, size, digest)

    def fail_file_shape(self, where: str, data: Any) -> NoReturn:
        if type(data) is not dict:
            self.fail(where, _wrong(data, "an object"))
        self.check_keys(data, where, _FILE_KEYS)
        missing = next(key for key in ("name", "bytes", "sha256") if key not in data)
        self.fail(f"{where}.{missing}", "is missing")

    def fail_name(self, where: str, name: Any, suffix: str) -> NoReturn:
        problem = _name_problem(name, suffix)
        if problem is None:  # the name is fine but taken
            problem = f"{_show(name)} is used by another shard file"
        self.fail(where, problem)
