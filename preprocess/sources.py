"""List the inputs of a build: an ImageFolder tree or a CSV/JSONL/Parquet manifest.

`stream_sources` yields the `SourceItem`s (path, relative path, class name,
optional split) one at a time, in no particular order, and fills a `Listing`
with an account of every tree entry that is not an input: nothing is kept per
input, so a list of any length streams through in constant memory, and no image
is opened here. Problems that make the input list itself untrustworthy (paths
escaping the root, missing columns, NUL or control characters in a listed path)
are errors before any work starts; duplicates are found by the plan, which sorts
(`preprocess.plan`). Every row of a list is bounded before it is held (`MAX_ROW_CHARS`,
`MAX_LIST_ROW_GROUP_BYTES`; Parquet decodes only the columns the options name), every
value it holds by its cap, and a refusal names the file and the row.

Symlinks are followed, file and directory links alike, as torchvision's
ImageFolder does; a directory link to one of its own ancestors is a loop, left out
and named. With `confine` a directory link resolving outside the root is left out
(`outside_input`); file links are checked when the shard task opens them, which
also catches a link that appears after listing (`preprocess.images.read_source`).

A tree file is an input when its suffix names a format of the decode policy
(`IMAGE_SUFFIXES`: the suffixes Pillow registers for `shards.imagedata.INPUT_FORMATS`,
so listing and decoding agree by construction); every other file is
counted by its suffix in `Listing.left_out_suffixes` (`.txt: 3, .tga: 2`), and
`NOT_DECODED` says why the image types among them are not read. A list file's
rows are inputs whatever their suffix: the content decides (`unidentified`,
`format_not_allowed`).
"""

from __future__ import annotations

import csv
import errno
import io
import json
import os
import posixpath
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit, urlunsplit

from PIL import Image

from shards.errors import DataError
from shards.imagedata import INPUT_FORMATS
from shards.redact import redact_url, url_credentials_problem
from shards.sample import MAX_FIELD_BYTES, Field, SampleError, check_value, decode_text, parse_json
from shards.storage import (
    DEFAULT_RETRY,
    HTTP_SCHEMES,
    OBJECT_STORE_SCHEMES,
    READ_SCHEMES,
    RetryPolicy,
    is_remote,
    local_path,
    open_stream,
    url_scheme,
    walk,
)

# Formats a plugin of the decode policy opens under a name of its own: Pillow's JPEG
# plugin reads a camera's multi-picture JPEG and calls it MPO (the first picture is used).
_OPENED_AS = {"MPO": "JPEG"}


def decoded_suffixes(formats: tuple[str, ...] = INPUT_FORMATS) -> frozenset[str]:
    """The file suffixes of what the decoder opens: every suffix Pillow registers for a
    format in `formats` (or one its plugins open, `_OPENED_AS`).

    Derived, not listed by hand, so the listing and the decoder cannot disagree: a
    suffix Pillow gives to a format outside `formats` (`.dib`, a headerless bitmap) is
    never an input, and a new suffix of an allowed format (`.apng`) is one.
    """
    registered = Image.registered_extensions()  # loads the plugins' names; parses nothing
    return frozenset(
        suffix for suffix, name in registered.items() if _OPENED_AS.get(name, name) in formats
    )


IMAGE_SUFFIXES = decoded_suffixes()
# Image types a tree may hold that are not read, and why: named in the build summary beside
# their counts, so a user knows whether to convert them.
NOT_DECODED = {
    ".tga": "TGA has no magic bytes, so any file could parse as one; convert to PNG",
    ".heic": "HEIF needs a plugin Pillow does not bundle; convert to JPEG",
    ".heif": "HEIF needs a plugin Pillow does not bundle; convert to JPEG",
    ".cur": "a mouse cursor, not a picture",
    ".icns": "a macOS icon bundle; export a PNG",
    ".psd": "a layered Photoshop document; export a PNG or JPEG",
    ".eps": "PostScript needs Ghostscript, a subprocess we never start; convert to PNG",
    ".ps": "PostScript needs Ghostscript, a subprocess we never start; convert to PNG",
    ".pdf": "a document; render its pages to PNG first",
    ".svg": "vector graphics need a renderer; rasterize to PNG first",
    ".jp2": "JPEG 2000 is not on the decoder allowlist; convert to JPEG or PNG",
    ".j2k": "JPEG 2000 is not on the decoder allowlist; convert to JPEG or PNG",
    ".dng": "camera raw needs demosaicing; develop it to JPEG first",
    ".cr2": "camera raw needs demosaicing; develop it to JPEG first",
    ".nef": "camera raw needs demosaicing; develop it to JPEG first",
    ".arw": "camera raw needs demosaicing; develop it to JPEG first",
    ".dib": "a headerless Windows bitmap (DIB) is not on the decoder allowlist; rename a "
    "file that starts with `BM` to .bmp, or convert it to PNG",
    ".pcx": "PCX is not on the decoder allowlist; convert to PNG",
    ".dds": "DDS textures are not on the decoder allowlist; convert to PNG",
    ".qoi": "QOI is not on the decoder allowlist; convert to PNG",
    ".exr": "HDR images have no agreed 8-bit rendering; tone-map to PNG or JPEG",
    ".hdr": "HDR images have no agreed 8-bit rendering; tone-map to PNG or JPEG",
}
for _suffix in (".avif", ".avifs"):
    if _suffix not in IMAGE_SUFFIXES:
        NOT_DECODED[_suffix] = "this Pillow was built without AVIF support; convert to JPEG"
NO_SUFFIX = "(none)"  # the `left_out_suffixes` key of files without a suffix
MANIFEST_SUFFIXES = (".csv", ".jsonl", ".parquet")
# Tree entries that are not inputs and are only counted, not named one by one:
# they are the ordinary furniture of a dataset directory.
COUNTED_ONLY = ("hidden", "other_suffix", "no_class")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class InputError(DataError, ValueError):
    """The input list cannot be trusted; nothing was built."""


@dataclass(frozen=True)
class SourceItem:
    """One input image, before it is read.

    Attributes:
        label: the class name; a sorted list of distinct class names (`--label multi`),
            or None (`--label none`).
        fields: the extra columns' checked values by sample member (`txt`: str,
            `weight`: float, `json`: {column: JSON value}); None without `--fields`.
    """

    path: str  # absolute local path
    rel: str  # path relative to the input root, with `/` separators; the identity of the input
    label: str | list[str] | None  # class name(s)
    split: str | None = None  # from a manifest's split column, else assigned by hash
    where: str | None = None  # the list file and row it came from, for messages
    fields: dict | None = None


# --- extra columns: labels and sample fields from an input list ---------------------------

LABEL_MODES = ("single", "multi", "none")
# Sample members an input-list column may fill (`--fields caption:txt`): the caption, a
# key of the metadata document, a per-sample weight. Multi-label targets come from the
# `label` column (`--label multi`) and go to `labels`; all are in `shards.sample`'s allowlist.
FIELD_MEMBERS = ("txt", "json", "weight")
# Keys the build writes into each sample's metadata document itself; a `json` column
# may not take one of them.
META_KEYS = frozenset(
    ("source", "split", "label", "labels", "width", "height")
    + ("orig_width", "orig_height", "orig_format", "orig_mode")
)
_COLUMN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_LIST_COLUMNS = frozenset(("path", "label", "split"))
# The loader's own checks of each member (`shards.sample.field_value`), applied per row.
_WEIGHT = Field("weight", "weight")
_NO_VALUE = {"txt": "no_text", "json": "no_json", "weight": "no_weight"}
_FIX_ROW = "fix or remove the row and rerun (the row is skipped until then)"
# Multi-label targets are multi-hot: a batch of 256 at 65,536 classes is 64 MiB of float32,
# and every class costs a count per split and shard. ImageNet-21k has 21,841 classes,
# OpenImages' image-level labels ~20k. A row may name this many labels (OpenImages' most
# labelled images have a few hundred); a row naming more is a counted skip (`bad_labels`),
# and a list naming more classes than this is refused (`preprocess.plan.Spill.add`).
MAX_LABELS_PER_ROW = 1024
MAX_MULTI_LABEL_CLASSES = 65_536


@dataclass(frozen=True)
class FieldColumn:
    """One `--fields` entry: input-list column `column` becomes sample member `member`."""

    column: str
    member: str


@dataclass(frozen=True)
class InputColumns:
    """What an input list's columns hold beyond `path` and `split`.

    Attributes:
        label: `single` (a class name in `label`, the default), `multi` (a list of
            class names in `label`) or `none` (no classes: `label` is not read).
        fields: the extra columns and the sample members they fill.
    """

    label: str = "single"
    fields: tuple[FieldColumn, ...] = ()

    @classmethod
    def parse(cls, label: str, specs: tuple[str, ...]) -> InputColumns:
        """From `--label` and `--fields COLUMN:MEMBER,...`.

        Raises:
            ValueError: an unknown label mode, a malformed entry, a member that is not
                one of `FIELD_MEMBERS`, a column used twice, or a member other than
                `json` filled twice; the message says what to write instead.
        """
        if label not in LABEL_MODES:
            raise ValueError(f"--label must be one of {', '.join(LABEL_MODES)}, got {label!r}")
        fields = tuple(_field_column(spec) for spec in specs)
        columns = [f.column for f in fields]
        if len(set(columns)) != len(columns):
            raise ValueError(f"--fields names a column twice: {','.join(specs)}")
        for member in ("txt", "weight"):
            if sum(f.member == member for f in fields) > 1:
                raise ValueError(
                    f"--fields fills `{member}` from two columns; a sample holds one {member}: "
                    "send the other column to `json`"
                )
        return cls(label, fields)

    @property
    def plain(self) -> bool:
        """Single-label with no extra columns: what every build did before these options."""
        return self.label == "single" and not self.fields

    @property
    def required(self) -> tuple[str, ...]:
        """The columns an input list must have."""
        label = ("label",) if self.label != "none" else ()
        return ("path", *label, *(f.column for f in self.fields))

    def members(self, image_field: str) -> dict[str, str]:
        """`{sample member: shards.sample field kind}` of every sample the build writes."""
        members = {image_field: "image", "json": "json"}
        if self.label == "single":
            members["cls"] = "label"
        elif self.label == "multi":
            members["labels"] = "multi_label"
        for spec in self.fields:
            members[spec.member] = {"txt": "text", "json": "json", "weight": "weight"}[spec.member]
        return dict(sorted(members.items()))

    def row_values(
        self, where: str, row: dict, from_text: bool
    ) -> tuple[list[str] | None, dict | None]:
        """A row's multi-label names (None unless `--label multi`) and its fields.

        Args:
            from_text: the row is a CSV line: its cells are text, an empty cell is no
                value, and `json`/`weight` cells hold JSON text (`["a", "b"]`, `0.5`).

        Raises:
            SampleError: a value the loader would refuse (`bad_text`, `bad_json`,
                `bad_weight`, `bad_labels`) or none at all (`no_text`, ...): the row is
                a counted skip.
        """
        labels = _label_names(where, row.get("label"), from_text) if self.label == "multi" else None
        if not self.fields:
            return labels, None
        values: dict = {}
        for spec in self.fields:
            value = row.get(spec.column)
            at = f"{where} column {spec.column!r}"
            if value is None or (from_text and value == ""):
                raise SampleError(_NO_VALUE[spec.member], f"{at} is empty")
            if spec.member == "txt":
                values["txt"] = decode_text(value, at)
                continue
            if spec.member == "weight":
                values["weight"] = _weight_value(value, at, from_text)
            else:
                parsed = parse_json(value if from_text else _json_text(value, at), at)
                values.setdefault("json", {})[spec.column] = parsed
        if "json" in values and len(_json_text(values["json"], where)) > MAX_FIELD_BYTES // 2:
            raise SampleError(
                "bad_json", f"{where}: the json columns take over {MAX_FIELD_BYTES // 2} bytes"
            )
        return labels, values


def _field_column(spec: str) -> FieldColumn:
    column, sep, member = spec.partition(":")
    column, member = column.strip(), member.strip()
    if not sep or not _COLUMN_NAME.match(column):
        raise ValueError(
            f"--fields entry {spec!r}: write COLUMN:MEMBER, e.g. caption:txt,tags:json,w:weight "
            "(a column name is letters, digits and _, at most 64)"
        )
    if member not in FIELD_MEMBERS:
        raise ValueError(
            f"--fields entry {spec!r}: member {member!r} is not one of {', '.join(FIELD_MEMBERS)} "
            "(multi-label targets come from the `label` column with --label multi)"
        )
    if column in _LIST_COLUMNS:
        raise ValueError(f"--fields entry {spec!r}: `{column}` is a column the build reads itself")
    if member == "json" and column in META_KEYS:
        raise ValueError(
            f"--fields entry {spec!r}: the metadata document already holds `{column}` "
            f"(the build writes {', '.join(sorted(META_KEYS))}); rename the column"
        )
    return FieldColumn(column, member)


def _weight_value(value: object, where: str, from_text: bool) -> float:
    """A weight cell checked as the loader checks `.weight`: anything else is `bad_weight`."""
    try:
        parsed = parse_json(value if from_text else _json_text(value, where), where)
    except SampleError as error:  # NaN, infinity, a huge integer, not JSON at all
        raise SampleError("bad_weight", error.detail) from error
    return check_value(_WEIGHT, parsed, where)


def _json_text(value: object, where: str) -> str:
    """A JSONL or Parquet cell as JSON text; a value JSON cannot hold is `bad_json`."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=_RefuseValue(where))
    except ValueError as error:  # NaN or infinity
        raise SampleError("bad_json", f"{where}: {error}") from error


class _RefuseValue:
    """`json.dumps`'s `default`: a cell value JSON has no type for (bytes, a date) is a skip."""

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self, value: object) -> object:
        if isinstance(value, HugeInteger):
            raise SampleError(
                "bad_json", f"{self.where}: {value}, more than a JSON reader converts"
            )
        raise SampleError("bad_json", f"{self.where}: a {type(value).__name__} is not JSON")


def _label_names(where: str, value: object, from_text: bool) -> list[str]:
    """A multi-label cell as sorted distinct class names.

    A CSV cell holds a JSON list (`["cat", "dog"]`) or names separated by `|`
    (`cat|dog`; empty: no labels); a JSONL or Parquet cell a list of names or ids.
    """
    at = f"{where} column 'label'"
    if from_text and isinstance(value, str) and not value.lstrip().startswith("["):
        value = [name.strip() for name in value.split("|")] if value.strip() else []
    elif from_text and isinstance(value, str):
        try:
            value = parse_json(value, at)
        except SampleError as error:
            raise SampleError("bad_labels", error.detail) from error
    if not isinstance(value, list):
        raise SampleError("bad_labels", f"{at} is not a list of class names")
    if len(value) > MAX_LABELS_PER_ROW:
        raise SampleError(
            "bad_labels",
            f"{at} holds {len(value)} labels; --label multi takes at most {MAX_LABELS_PER_ROW} "
            "a row (MAX_LABELS_PER_ROW)",
        )
    names = set()
    for item in value:
        if type(item) not in (str, int):
            raise SampleError("bad_labels", f"{at}: {item!r:.40} is not a class name or id")
        name = str(item)
        if not name or _CONTROL.search(name) or not _is_utf8(name):
            raise SampleError(
                "bad_labels",
                f"{at}: class name {ascii(name):.60} is empty, holds a control character or "
                "is not valid Unicode",
            )
        if len(name) > MAX_NAME_BYTES // 4 and len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise SampleError(
                "bad_labels", f"{at}: a class name over the {MAX_NAME_BYTES}-byte limit"
            )
        names.add(name)
    return sorted(names)


@dataclass(frozen=True)
class LeftOut:
    """A tree entry the build does not use, named so that nothing is dropped silently.

    Attributes:
        path: relative to the input root, printable (non-UTF-8 bytes backslash-escaped).
        reason: `bad_name`, `outside_input`, `loop`, `unreadable_dir`, `not_regular`.
        detail: what is wrong and what to do about it.
        is_input: True for a file that would have been an input (it counts as a
            skipped input in the manifest); False for a directory or a non-image.
    """

    path: str
    reason: str
    detail: str
    is_input: bool


@dataclass
class Listing:
    """What listing found: the inputs, and an account of everything else in the tree.

    Attributes:
        items: the inputs, sorted by relative path (`scan_sources`; empty while
            `stream_sources` streams them).
        root: the resolved local root (tree root or list file's directory) that
            `--confine-to-input` confines reads to; None for an object store.
        links_followed: file and directory symlinks listed through.
        left_out: entries named one by one (see `LeftOut`), sorted by path.
        ignored: counts of entries that are only counted (`COUNTED_ONLY` reasons).
        left_out_suffixes: the `other_suffix` files by lower-cased suffix (`.txt`,
            `.tga`; `NO_SUFFIX` for none): what the summary and manifest show.
    """

    items: list[SourceItem]
    root: str | None = None
    links_followed: int = 0
    left_out: list[LeftOut] = field(default_factory=list)
    ignored: Counter = field(default_factory=Counter)
    left_out_suffixes: Counter = field(default_factory=Counter)

    @property
    def refused(self) -> list[LeftOut]:
        """Files that would have been inputs; they count as skipped inputs."""
        return [entry for entry in self.left_out if entry.is_input]

    def left_out_counts(self) -> dict[str, int]:
        """Every tree entry that is not an input, by reason (refused inputs excluded)."""
        counts = Counter(self.ignored)
        counts.update(entry.reason for entry in self.left_out if not entry.is_input)
        return dict(sorted(counts.items()))

    def suffix_counts(self) -> dict[str, int]:
        """`left_out_suffixes`, most frequent first (ties by suffix): `{".txt": 3, ".tga": 2}`."""
        return dict(sorted(self.left_out_suffixes.items(), key=_by_count_then_name))

    def describe_suffixes(self, limit: int = 10) -> str:
        """One line for the summary: `.txt: 3, .tga: 2 (TGA has no magic bytes, ...)`.

        Suffixes in `NOT_DECODED` carry their reason; past `limit` suffixes the rest are
        summed. Empty when nothing was left out for its suffix.
        """
        counts = list(self.suffix_counts().items())
        parts = []
        for suffix, count in counts[:limit]:
            why = NOT_DECODED.get(suffix)
            parts.append(f"{suffix}: {count}" + (f" ({why})" if why else ""))
        if len(counts) > limit:
            rest = sum(count for _, count in counts[limit:])
            parts.append(f"{len(counts) - limit} more suffixes: {rest}")
        return ", ".join(parts)


def _by_count_then_name(item: tuple[str, int]) -> tuple[int, str]:
    return -item[1], item[0]


def file_suffix(name: str) -> str:
    """The lower-cased suffix that decides whether a tree file is an input (`NO_SUFFIX`: none)."""
    return os.path.splitext(name)[1].lower() or NO_SUFFIX


def list_sources(input_path: str) -> list[SourceItem]:
    """The inputs of a build, sorted by relative path (see `scan_sources`)."""
    return scan_sources(input_path).items


def scan_sources(
    input_path: str, confine: bool = False, columns: InputColumns | None = None
) -> Listing:
    """`stream_sources`, with every input held in `items`: for small inputs and tests."""
    listing, items = stream_sources(input_path, confine, columns)
    listing.items = sorted(items, key=_sort_key)
    return listing


def stream_sources(
    input_path: str,
    confine: bool = False,
    columns: InputColumns | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Listing, Iterator[SourceItem]]:
    """The inputs of a build, one at a time, and the account of every other tree entry.

    The `Listing` is complete once the iterator is exhausted (its `root` at once);
    nothing per input is kept.

    Args:
        confine: leave out directory links that resolve outside the root.
        columns: what a list file's columns hold (default: a single `label`); a row
            whose extra values the loader would refuse is left out as a refused input
            (`LeftOut` with the loader's skip reason), never planned.
        storage_options: fsspec options for an input in an object store (`iter_remote`).

    Raises:
        InputError: a malformed manifest or escaping paths (while iterating), no
            inputs at all (at the end), or (at once) `--fields` or `--label multi`
            for an ImageFolder tree, which has no columns.
        FileNotFoundError: the input does not exist (at once).
    """
    columns = columns or InputColumns()
    if is_remote(input_path):
        listing = Listing([])
        _check_tree_columns(input_path, columns, is_list_file_url(input_path))
        items = iter_remote(input_path, listing, columns, storage_options=storage_options)
        return listing, _account(redact_url(input_path), listing, _label_free(items, columns))
    try:
        path = Path(local_path(input_path))  # a `file://` URL is a local input
    except ValueError as error:
        raise InputError(f"input {error}; pass a directory, a list file or a URL") from None
    if not path.exists():
        raise FileNotFoundError(f"input {input_path} does not exist; check --input")
    _check_tree_columns(input_path, columns, not path.is_dir())
    if path.is_dir():
        scan = _TreeScan(os.path.realpath(path), confine)
        listing = Listing(
            [],
            scan.root,
            left_out=scan.left_out,
            ignored=scan.ignored,
            left_out_suffixes=scan.suffixes,
        )
        items = _label_free(scan.iter_tree(), columns)
        return listing, _account(input_path, listing, items, scan)
    if path.suffix.lower() in MANIFEST_SUFFIXES:
        listing = Listing([], str(path.resolve().parent))
        return listing, _account(input_path, listing, iter_manifest(path, listing, columns))
    raise InputError(
        f"input {input_path} is neither a directory nor a manifest "
        f"({', '.join(MANIFEST_SUFFIXES)}); pass an ImageFolder root or a list file"
    )


def _account(
    input_path: str, listing: Listing, items: Iterator[SourceItem], scan: _TreeScan | None = None
) -> Iterator[SourceItem]:
    """Pass `items` through; at the end, complete `listing` and refuse an empty input."""
    count = 0
    for item in items:
        count += 1
        yield item
    if scan is not None:
        listing.links_followed = scan.links
    listing.left_out.sort(key=_left_out_key)
    if not count:
        refused = Counter(entry.reason for entry in listing.refused)
        why = f" ({', '.join(f'{r}: {n}' for r, n in sorted(refused.items()))} refused)"
        raise InputError(
            f"no images found under {input_path}{why if refused else ''}; an "
            "ImageFolder root holds one directory per class with image files in it"
        )


def _check_tree_columns(input_path: str, columns: InputColumns, is_list: bool) -> None:
    if is_list or (columns.label != "multi" and not columns.fields):
        return
    raise InputError(
        f"input {input_path} is an ImageFolder tree, which has no columns: --fields and "
        "--label multi need a CSV, JSONL or Parquet list of path,label,... (see docs/SHARDS.md)"
    )


def _label_free(items: Iterator[SourceItem], columns: InputColumns) -> Iterator[SourceItem]:
    """A tree's inputs without their class under `--label none`."""
    if columns.label != "none":
        yield from items
        return
    for item in items:
        if item.label is not None:  # a list file's rows come without one already
            item = SourceItem(item.path, item.rel, None, item.split, item.where, item.fields)
        yield item


def _sort_key(item: SourceItem) -> str:
    return item.rel


def _left_out_key(entry: LeftOut) -> str:
    return entry.path


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def printable_name(name: str) -> str:
    """`name` with bytes that are not UTF-8 shown as `\\xNN`: safe to print and to store."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _is_utf8(name: str) -> bool:
    # os.fsdecode turns undecodable bytes into lone surrogates, which UTF-8 refuses.
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def is_inside(path: str, root: str) -> bool:
    """Whether the resolved `path` is `root` or below it (both resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def scan_image_folder(root: Path, confine: bool = False) -> Listing:
    """`root/<class>/.../<file>`, listed at once (see `stream_sources`)."""
    return scan_sources(str(root), confine)


_BAD_NAME = "the file name is not UTF-8; rename it (for example with `convmv`) and rerun"
_BAD_NAME_DIR = "the directory name is not UTF-8, so nothing below it was read; rename it and rerun"


def _sorted_entries(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as entries:
        return sorted(entries, key=_entry_name)


def _entry_name(entry: os.DirEntry) -> str:
    return entry.name


def _is_dir(entry: os.DirEntry) -> bool:
    """Follows links; a broken or looping link is not a directory."""
    try:
        return entry.is_dir()
    except OSError:
        return False


class _TreeScan:
    """One walk of an ImageFolder tree: the inputs found and an account of the rest.

    `root/<class>/.../<file>`: the class is the first directory level. Files with
    an image suffix are inputs. Hidden entries, other suffixes and files directly
    under the root are counted; names that are not UTF-8, loops, unreadable
    directories and non-regular files are left out and named. Only the root's
    entries (the classes) are sorted; a directory's entries are read as they come,
    so a flat directory of millions of files streams too.

    Directories are walked with an explicit stack (a hostile tree may be deeper than
    Python's recursion limit). Each pending directory carries the resolved paths of
    its ancestors, which is what loop detection compares a directory link against;
    for a plain directory the resolved path is its parent's plus its name, so only
    links pay for a `realpath`.
    """

    def __init__(self, root: str, confine: bool) -> None:
        self.root = root
        self.confine = confine
        self.left_out: list[LeftOut] = []
        self.ignored: Counter = Counter()
        self.suffixes: Counter = Counter()
        self.links = 0
        self.pending: list[tuple[str, str, str, tuple[str, ...]]] = []

    def leave_out(self, rel: str, reason: str, detail: str, is_input: bool) -> None:
        self.left_out.append(LeftOut(printable_name(rel), reason, detail, is_input))

    def iter_tree(self) -> Iterator[SourceItem]:
        """The inputs of the whole tree, class directory by class directory."""
        try:
            entries = _sorted_entries(self.root)
        except OSError as error:
            raise InputError(
                f"cannot list the input root {self.root}: {error.strerror}; check its permissions"
            ) from error
        for entry in entries:
            if _is_hidden(entry.name):
                self.ignored["hidden"] += 1
            elif not _is_dir(entry):
                self.ignored["no_class"] += 1
            elif not _is_utf8(entry.name):
                self.leave_out(entry.name, "bad_name", _BAD_NAME_DIR, False)
            else:
                yield from self.iter_class(entry, "", (self.root,), label=entry.name)

    def iter_class(
        self, entry: os.DirEntry, rel: str, chain: tuple[str, ...], label: str
    ) -> Iterator[SourceItem]:
        """The inputs below the directory `entry` (a class directory, or one below it)."""
        self._push(entry, rel, chain, label)
        while self.pending:
            path, dir_rel, dir_label, dir_chain = self.pending.pop()
            try:
                entries = os.scandir(path)
            except OSError as error:
                detail = f"cannot list it ({error.strerror}); fix its permissions and rerun"
                self.leave_out(dir_rel, "unreadable_dir", detail, False)
                continue
            with entries:
                for child in entries:
                    item = self._visit(child, dir_rel, dir_label, dir_chain)
                    if item is not None:
                        yield item

    def _push(self, entry: os.DirEntry, parent_rel: str, chain: tuple[str, ...], label: str):
        rel = f"{parent_rel}/{entry.name}" if parent_rel else entry.name
        if not entry.is_symlink():
            real = os.path.join(chain[-1], entry.name)
            if real in chain:  # a bind mount onto an ancestor, or a tree reached via a link
                self.leave_out(rel, "loop", f"{real} is one of its own ancestors", False)
                return
            self.pending.append((entry.path, rel, label, (*chain, real)))
            return
        real = os.path.realpath(entry.path)
        if self.confine and not is_inside(real, self.root):
            detail = f"a directory link to {real}, outside the input root {self.root} (--confine-to-input)"
            self.leave_out(rel, "outside_input", detail, False)
            return
        if any(is_inside(ancestor, real) for ancestor in chain):
            detail = f"a directory link to {real}, which contains it; link a sibling tree instead"
            self.leave_out(rel, "loop", detail, False)
            return
        self.links += 1
        self.pending.append((entry.path, rel, label, (*chain, real)))

    def _visit(
        self, entry: os.DirEntry, rel: str, label: str, chain: tuple[str, ...]
    ) -> SourceItem | None:
        """The input `entry` is, or None (after pushing a directory or accounting for it)."""
        name = entry.name
        if _is_hidden(name):
            self.ignored["hidden"] += 1
            return None
        if _is_dir(entry):
            if not _is_utf8(name):
                self.leave_out(f"{rel}/{name}", "bad_name", _BAD_NAME_DIR, False)
            else:
                self._push(entry, rel, chain, label)
            return None
        suffix = file_suffix(name)
        if suffix not in IMAGE_SUFFIXES:
            self.ignored["other_suffix"] += 1
            self.suffixes[suffix] += 1
            return None
        child_rel = f"{rel}/{name}"
        if not _is_utf8(name):
            self.leave_out(child_rel, "bad_name", _BAD_NAME, True)
            return None
        problem = _not_a_file(entry)
        if problem is not None:
            self.leave_out(child_rel, problem[0], problem[1], False)
            return None
        self.links += entry.is_symlink()
        return SourceItem(entry.path, child_rel, label)


def _not_a_file(entry: os.DirEntry) -> tuple[str, str] | None:
    """Why an image-suffixed entry cannot be an input, or None when it can.

    A broken link stays an input: its target may come back, and the task reports it
    `missing`, which a rerun retries.
    """
    try:
        if entry.is_file():
            return None
        mode = entry.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "loop", "a symlink that resolves to itself; fix or remove the link"
        return "not_regular", f"cannot stat it ({error.strerror})"
    return "not_regular", f"not a regular file (mode {mode:o}); only files are read"


def scan_manifest(manifest: Path) -> Listing:
    """A list file's inputs, listed at once (see `stream_sources`)."""
    return scan_sources(str(manifest))


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
    for where, row in _iter_rows(manifest, required=columns.required):
        raw_path, label = _row_fields(where, row, columns.label)
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
        item = _column_item(listing, columns, where, row, from_text, (full, rel, label))
        if item is not None:
            listing.links_followed += os.path.islink(full)
            yield item


def _column_item(
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


def _row_fields(where: str, row: dict, label_mode: str = "single") -> tuple[str, str | None]:
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
    bad = _CONTROL.search(value)
    if bad is not None:
        raise InputError(
            f"{where}: {name} {_shown(value)} holds the control character {bad.group()!r} "
            "(a NUL byte or another character below 0x20); fix or remove this row "
            "of the list and rerun"
        )
    if not _is_utf8(value):
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


def _iter_rows(
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
MAX_NAME_BYTES = 1024  # a class name (or a split's): 4x NAME_MAX, the longest directory name


class HugeInteger:
    """A JSON integer too long for Python to convert (over `sys.get_int_max_str_digits()`).

    Stands in for the value in a parsed row: a column nobody declared is never read, a
    declared one holding it is refused (`bad_json`, `bad_weight`, `bad_labels`).
    """

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __str__(self) -> str:
        return f"an integer of {self.digits} digits"

    __repr__ = __str__


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
            if len(wanted) < len(required):  # `_iter_rows` names what is missing
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


# Where a remote input may live: an object store (a tree or a list file), or an http(s)
# server (a list file only: a web server cannot be listed). No scheme that can run
# commands or reach arbitrary local paths is accepted.
REMOTE_INPUT_SCHEMES = tuple(sorted(OBJECT_STORE_SCHEMES | HTTP_SCHEMES))


def is_list_file_url(url: str) -> bool:
    """Whether a remote input names a list file (its path, not its query, decides)."""
    return urlsplit(url).path.rstrip("/").lower().endswith(MANIFEST_SUFFIXES)


def iter_remote(
    url: str,
    listing: Listing | None = None,
    columns: InputColumns | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> Iterator[SourceItem]:
    """An ImageFolder tree in an object store, or a list file in one or on an http(s) server.

    Read through `shards.storage`, as shards are: `retry`'s retries and deadline, the
    store's `storage_options`, URLs redacted in every message. Paths in a remote list
    file are relative to it and may not leave its prefix; credentials and endpoints come
    from `storage_options` or the store's standard environment. A tree is walked prefix
    by prefix, hidden prefixes not entered; the files that are not inputs are counted in
    `listing`, as for a local tree.

    Raises:
        InputError: an unsupported scheme, credentials in the URL, or an http(s) tree.
        ShardReadError: the store or server failed past `retry`'s budget.
    """
    listing = listing if listing is not None else Listing([])
    scheme = url_scheme(url)
    if scheme not in REMOTE_INPUT_SCHEMES:
        raise InputError(
            f"input scheme {scheme}:// is not supported; use one of {REMOTE_INPUT_SCHEMES}"
        )
    credentials = url_credentials_problem(url)
    if credentials is not None:
        raise InputError(f"input {credentials}")
    if is_list_file_url(url):
        reader = _RemoteListReader(url, storage_options, retry)
        yield from _iter_remote_list_file(reader, listing, columns or InputColumns())
        return
    if scheme in HTTP_SCHEMES:
        raise InputError(
            f"input {redact_url(url)} is not a list file: a web server cannot be listed; "
            f"pass a list ({', '.join(MANIFEST_SUFFIXES)}) of paths relative to it"
        )
    base = url.rstrip("/")
    for relative, subdirs, files in walk(base, storage_options, retry):
        subdirs[:] = [name for name in subdirs if not _is_hidden(name)]
        for name in files:
            rel = f"{relative}/{name}" if relative else name
            item = _remote_item(f"{base}/{rel}", rel, rel.split("/"), listing)
            if item is not None:
                yield item


def _remote_item(url: str, rel: str, parts: list[str], listing: Listing) -> SourceItem | None:
    """The input a remote tree file is, or None after counting it as the local walk does."""
    if any(_is_hidden(part) for part in parts):
        listing.ignored["hidden"] += 1
    elif len(parts) < 2:
        listing.ignored["no_class"] += 1
    elif file_suffix(parts[-1]) not in IMAGE_SUFFIXES:
        listing.ignored["other_suffix"] += 1
        listing.left_out_suffixes[file_suffix(parts[-1])] += 1
    else:
        return SourceItem(url, rel, parts[0])
    return None


class _RemoteListReader:
    """Opens a remote list file through `shards.storage`: the `opener` `_iter_rows` calls.

    `name` is the URL redacted, for messages; `base` the URL its rows are relative to.
    """

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None, retry: RetryPolicy
    ) -> None:
        self.url, self.storage_options, self.retry = url, storage_options, retry
        self.name = redact_url(url)
        parts = urlsplit(url)
        self.suffix = os.path.splitext(parts.path.rstrip("/"))[1].lower()
        directory = posixpath.dirname(parts.path.rstrip("/"))
        self.base = urlunsplit((parts.scheme, parts.netloc, directory, "", ""))

    def url_of(self, rel: str) -> str:
        """The URL of a row's path: percent-encoded on http(s), where RFC 3986 rules."""
        quoted = quote(rel) if url_scheme(self.url) in HTTP_SCHEMES else rel
        return f"{self.base.rstrip('/')}/{quoted}"

    def __call__(self, name: str, mode: str = "rb") -> BinaryIO:
        return open_stream(
            self.url,
            self.retry,
            storage_options=self.storage_options,
            random_access=self.suffix == ".parquet",
            schemes=READ_SCHEMES,
        )


def _iter_remote_list_file(
    reader: _RemoteListReader, listing: Listing, columns: InputColumns
) -> Iterator[SourceItem]:
    from_text = reader.suffix == ".csv"
    rows = _iter_rows(reader.name, opener=reader, required=columns.required, suffix=reader.suffix)
    for where, row in rows:
        raw, label = _row_fields(where, row, columns.label)
        rel = posixpath.normpath(raw)
        if raw.startswith("/") or "://" in raw or rel == ".." or rel.startswith("../"):
            raise InputError(f"{where}: path {raw!r} must stay inside the list's prefix")
        found = (reader.url_of(rel), rel, label)
        item = _column_item(listing, columns, where, row, from_text, found)
        if item is not None:
            yield item
