"""What listing a build's inputs finds: `SourceItem`s, and a `Listing` of everything else.

The model that the tree walk (`preprocess.tree`), the list-file reader
(`preprocess.list_file`) and remote inputs (`preprocess.remote`) fill and
`preprocess.sources` hands to the plan, with the rule that decides which files are inputs.

A tree file is an input when its suffix names a format of the decode policy
(`IMAGE_SUFFIXES`: the suffixes Pillow registers for `shards.image.policy.INPUT_FORMATS`,
so listing and decoding agree by construction); every other file is
counted by its suffix in `Listing.left_out_suffixes` (`.txt: 3, .tga: 2`), and
`NOT_DECODED` says why the image types among them are not read. A list file's
rows are inputs whatever their suffix: the content decides (`unidentified`,
`format_not_allowed`).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

from PIL import Image

from shards.errors import DataError
from shards.image.policy import INPUT_FORMATS
from shards.redact import redact_text

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
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


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

    path: str  # absolute local path, or a URL (`shards.storage` reads it)
    rel: str  # path relative to the input root, with `/` separators; the identity of the input
    label: str | list[str] | None  # class name(s)
    split: str | None = None  # from a manifest's split column, else assigned by hash
    where: str | None = None  # the list file and row it came from, for messages
    fields: dict | None = None


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

    def __post_init__(self) -> None:
        # Written to errors.jsonl: a URL the reason quotes is recorded redacted.
        object.__setattr__(self, "detail", redact_text(self.detail))


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


def is_hidden(name: str) -> bool:
    return name.startswith(".")


def is_utf8(name: str) -> bool:
    # os.fsdecode turns undecodable bytes into lone surrogates, which UTF-8 refuses.
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
