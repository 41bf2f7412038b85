"""Shard sources to URLs: bounded brace and glob expansion, then validation.

The loader's first step, and how `preprocess verify`, `info` and `index` read a pattern.

Every shard source passes through `expand_urls` before any reader sees it, so a
hostile URL list fails here, before a byte is read. Each expanded URL is checked by
`shards.storage.validate_url` (schemes, characters, credentials: the rules every
read obeys, listed there); this module adds the pattern rules.

Decisions (reliability.md §10 D1-D4, §11.1):
    * Nothing here or in `shards.storage` ever spawns a process; that, not
      character filtering, is the real guarantee. `pipe:` and every scheme
      outside the allowlist are rejected outright, before expansion.
    * No substitution of any kind: `${VAR}`, `$VAR` and `~` are literal
      characters of a path.
    * A local name starting with `word:` reads as a URL scheme; write `./word:x`.
    * Brace patterns: `{000..127}` numeric ranges (zero padding kept, descending
      allowed) and `{a,b}` lists. Braces without `..` or a comma are literal
      (`${HOME}` stays as written). Nested or unbalanced braces are an error.
      The expansion size is computed before anything is generated.
    * Duplicates after expansion are an error, not silently dropped: a shard
      listed twice would be read twice per epoch.
    * A local path holding `*`, `?` or `[` that names no file as written is a glob
      (`DIR/*.tar`, `DIR/**/*.parquet`), expanded after the braces, sorted; a glob
      matching nothing is an error. Remote URLs are never globbed (no listing calls).
"""

from __future__ import annotations

import glob
import itertools
import os
import re
from collections.abc import Collection, Iterator, Sequence

from shards.errors import UsageError
from shards.redact import redact_url
from shards.storage.urls import (
    SHARD_SCHEMES,
    check_characters,
    check_scheme,
    is_remote,
    url_scheme,
    validate_url,
)

MAX_SHARDS = 1_000_000
GLOB_CHARACTERS = frozenset("*?[")

_RANGE = re.compile(r"^(\d{1,18})\.\.(\d{1,18})$")


def brace_count(pattern: str) -> int:
    """Return how many strings `pattern` expands to, without generating them.

    Raises:
        ValueError: nested or unbalanced braces, or a malformed range.
    """
    count = 1
    for group in _brace_groups(pattern):
        if not isinstance(group, str):
            count *= len(group)
    return count


def expand_braces(pattern: str, *, max_shards: int = MAX_SHARDS) -> list[str]:
    """Expand `{000..127}` ranges and `{a,b}` lists in `pattern`, in order.

    Raises:
        ValueError: the expansion would exceed `max_shards` (checked before any
            string is generated), or the pattern is malformed.
    """
    count = brace_count(pattern)
    if count > max_shards:
        raise UsageError(
            f"brace pattern {redact_url(pattern)!r} expands to {count} URLs, "
            f"more than max_shards={max_shards}; split it or raise max_shards"
        )
    pieces = [(group,) if isinstance(group, str) else group for group in _brace_groups(pattern)]
    return ["".join(combo) for combo in itertools.product(*pieces)]


class _PaddedRange(Sequence):
    """A numeric brace range whose items are zero-padded strings, made on demand.

    Its length is known without generating anything, which is what lets the
    expansion cap be checked before allocation.
    """

    def __init__(self, first: int, last: int, width: int) -> None:
        step = 1 if last >= first else -1
        self.numbers = range(first, last + step, step)
        self.width = width

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, index: int) -> str:  # type: ignore[override]
        return str(self.numbers[index]).zfill(self.width)


_Group = str | list[str] | _PaddedRange


def _brace_groups(pattern: str) -> list[_Group]:
    """Split `pattern` into literal strings, `{a,b}` lists and numeric ranges."""
    groups: list[_Group] = []
    literal: list[str] = []
    pos = 0
    while pos < len(pattern):
        char = pattern[pos]
        if char == "}":
            raise UsageError(f"unbalanced '}}' in {redact_url(pattern)!r}")
        if char != "{":
            literal.append(char)
            pos += 1
            continue
        end = pattern.find("}", pos + 1)
        if end < 0:
            raise UsageError(f"unbalanced '{{' in {redact_url(pattern)!r}")
        body = pattern[pos + 1 : end]
        if "{" in body:
            raise UsageError(
                f"nested braces are not supported in {redact_url(pattern)!r}; "
                "write the alternatives out or pass a list"
            )
        group = _parse_group(body)
        if group is None:  # `{HOME}`: not a pattern, kept as written
            literal.append(pattern[pos : end + 1])
        else:
            groups.extend(["".join(literal), group])
            literal = []
        pos = end + 1
    groups.append("".join(literal))
    return groups


def _parse_group(body: str) -> list[str] | _PaddedRange | None:
    match = _RANGE.match(body)
    if match:
        first, last = match.groups()
        # As in bash: a leading zero on either end pads every item to the wider end.
        padded = (len(first) > 1 and first[0] == "0") or (len(last) > 1 and last[0] == "0")
        width = max(len(first), len(last)) if padded else 0
        return _PaddedRange(int(first), int(last), width)
    if ".." in body:
        raise UsageError(f"malformed range {{{body}}}: use non-negative integers like {{000..127}}")
    if "," in body:
        return body.split(",")
    return None


def is_glob(source: str) -> bool:
    """A local path with `*`, `?` or `[` that names no file as written (`DIR/*.tar`)."""
    return (
        not is_remote(source)
        and "://" not in source  # a `file://` URL names its file exactly
        and any(char in GLOB_CHARACTERS for char in source)
        and not os.path.exists(source)
    )


def expand_glob(pattern: str) -> list[str]:
    """The regular files `pattern` matches (`**` included), sorted, as absolute paths.

    Raises:
        UsageError: nothing matches.
    """
    paths = sorted(
        os.path.abspath(path) for path in glob.glob(pattern, recursive=True) if os.path.isfile(path)
    )
    if not paths:
        raise UsageError(f"no file matches {pattern!r}; check the directory and the pattern")
    return paths


def expand_urls(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    max_shards: int = MAX_SHARDS,
    schemes: Collection[str] = SHARD_SCHEMES,
    data_root: str | os.PathLike[str] | None = None,
) -> list[str]:
    """Expand and validate shard sources into a list of unique, normal-form URLs.

    Args:
        source: one pattern or a list of them; each is a local path, a `file://`,
            `http(s)://`, `s3://` or `gs://` URL, optionally with brace patterns
            such as `train-{000000..000127}.tar`.
        max_shards: cap on the total number of URLs, checked before expanding.
        schemes: the allowed schemes, see `validate_url`.
        data_root: if set, local paths must lie inside it, see `validate_url`.

    Returns:
        The URLs in the order given, local paths absolute.

    Raises:
        ValueError: a disallowed scheme or character, a malformed or too large
            pattern, zero URLs, or the same URL twice (named in the message).
    """
    sources = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    patterns = [os.fspath(item) if isinstance(item, os.PathLike) else item for item in sources]
    for pattern in patterns:
        # Fail on `pipe:{0..999999999}` or a NUL before doing any work on the pattern.
        check_characters(pattern)
        if url_scheme(pattern):  # `{http,https}://...` is checked once expanded
            check_scheme(pattern, schemes)
    total = sum(brace_count(pattern) for pattern in patterns)
    if total > max_shards:
        raise UsageError(
            f"shard sources expand to {total} URLs, more than max_shards={max_shards}; "
            "split the list or raise max_shards"
        )
    if total == 0:
        raise UsageError("no shard URLs given: the source list is empty")
    urls: list[str] = []
    seen: set[str] = set()
    for raw in iter_expanded(patterns, max_shards):
        url = validate_url(raw, schemes=schemes, data_root=data_root)
        if url in seen:
            raise UsageError(f"duplicate shard URL after expansion: {redact_url(url)!r}")
        seen.add(url)
        urls.append(url)
        if len(urls) > max_shards:
            raise UsageError(
                f"shard sources match more than max_shards={max_shards} files; "
                "split the list or raise max_shards"
            )
    return urls


def iter_expanded(patterns: Sequence[str], max_shards: int) -> Iterator[str]:
    """Each pattern's braces expanded, then each local glob among the results."""
    for pattern in patterns:
        for raw in expand_braces(pattern, max_shards=max_shards):
            if is_glob(raw):
                yield from expand_glob(raw)
            else:
                yield raw
