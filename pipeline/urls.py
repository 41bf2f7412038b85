"""Shard URL validation, bounded brace expansion and redaction: the loader's first step.

Every shard source passes through `expand_urls` before any opener sees it, so a
hostile URL list fails here, before a byte is read.

Decisions (reliability.md §10 D1-D4, §11.1):
    * Nothing here or in `pipeline.opener` ever spawns a process; that, not
      character filtering, is the real guarantee. `pipe:` and every scheme
      outside the allowlist are rejected outright.
    * No substitution of any kind: `${VAR}`, `$VAR` and `~` are literal
      characters of a path. `::`-joined URL chains are rejected; pass a list.
    * Control characters (NUL, newline, tab, ...) and leading or trailing
      whitespace are rejected in every URL. http(s) URLs must also keep to the
      RFC 3986 character set (so spaces, braces and non-ASCII must be
      percent-encoded), and no remote URL may contain `$(` or a backtick.
      `'`, `;` and a lone `$` are legal in real query strings and are accepted.
    * A local name starting with `word:` reads as a URL scheme; write `./word:x`.
    * Brace patterns: `{000..127}` numeric ranges (zero padding kept, descending
      allowed) and `{a,b}` lists. Braces without `..` or a comma are literal
      (`${HOME}` stays as written). Nested or unbalanced braces are an error.
      The expansion size is computed before anything is generated.
    * Duplicates after expansion are an error, not silently dropped: a shard
      listed twice would be read twice per epoch.
    * Credentials in an object-store URL (`s3://KEY:SECRET@bucket/...`) are refused
      (`shards.redact.url_credentials_problem`): s3fs would take them for a bucket
      name and log them. http(s) `user:password@` is Basic auth, sent to that origin
      only and redacted in every message.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Collection, Sequence
from urllib.parse import unquote, urlsplit

from shards.redact import redact_url, url_credentials_problem

MAX_SHARDS = 1_000_000

LOCAL_SCHEMES = frozenset({"", "file"})
HTTP_SCHEMES = frozenset({"http", "https"})
FSSPEC_SCHEMES = frozenset({"s3", "gs"})
ALLOWED_SCHEMES = LOCAL_SCHEMES | HTTP_SCHEMES | FSSPEC_SCHEMES

# A scheme needs at least two characters so that nothing looks like a drive letter.
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# RFC 3986 unreserved + reserved + '%'. Anything else in a remote URL is a typo or an attack.
_REMOTE_URL_CHARS = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*$")
_IPV6_HOST = re.compile(r"\[[0-9A-Fa-f:.]*\]")  # `[::1]` holds '::' legitimately
_RANGE = re.compile(r"^(\d{1,18})\.\.(\d{1,18})$")


def url_scheme(url: str) -> str:
    """Return the lower-case scheme of `url`, or `""` for a plain local path."""
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def validate_url(
    url: str,
    *,
    schemes: Collection[str] = ALLOWED_SCHEMES,
    data_root: str | os.PathLike[str] | None = None,
) -> str:
    """Check one already-expanded shard URL and return its normal form.

    Local paths become absolute (`..` collapsed, `~` and `$VAR` kept literally);
    `file://` URLs become local paths. Remote URLs are returned unchanged.

    Args:
        url: a local path or a URL with an allowed scheme.
        schemes: the schemes accepted (`""` means a plain local path). Defaults to
            local paths, `file`, `http`, `https`, `s3` and `gs`; pass a subset to
            narrow it.
        data_root: if set, local paths must lie inside this directory after
            resolving symlinks.

    Raises:
        ValueError: with the reason and what would be accepted instead.
    """
    _check_characters(url)
    scheme = _check_scheme(url, schemes)
    if scheme in LOCAL_SCHEMES:
        return _local_path(url, data_root)
    _check_remote(url, scheme)
    return url


def _check_scheme(url: str, schemes: Collection[str]) -> str:
    scheme = url_scheme(url)
    if scheme not in schemes or scheme not in ALLOWED_SCHEMES:
        allowed = sorted(s + "://" if s else "local paths" for s in set(schemes) & ALLOWED_SCHEMES)
        raise ValueError(
            f"scheme not allowed: {scheme!r} in {redact_url(url)!r}; allowed: {', '.join(allowed)}"
            " (a local file whose name starts with 'word:' must be written './word:...')"
        )
    return scheme


def _check_characters(url: str) -> None:
    if not isinstance(url, str):
        raise TypeError(f"shard URLs must be str, got {type(url).__name__}")
    if not url:
        raise ValueError("empty shard URL")
    if _CONTROL_CHARS.search(url):
        raise ValueError(
            f"control character (NUL, newline, tab, ...) in shard URL {redact_url(url)!r}; "
            "percent-encode it or rename the file"
        )
    if url != url.strip():
        raise ValueError(f"leading or trailing whitespace in shard URL {redact_url(url)!r}")
    if "::" in _IPV6_HOST.sub("", url):
        raise ValueError(
            f"'::'-joined URL chains are not supported: {redact_url(url)!r}; "
            "pass the URLs as a list instead"
        )


def _local_path(url: str, data_root: str | os.PathLike[str] | None) -> str:
    path = url if not url_scheme(url) else _file_url_path(url)
    path = os.path.abspath(path)
    if data_root is not None:
        root = os.path.realpath(data_root)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise ValueError(
                f"shard path {path!r} is outside data root {root!r} (symlinks resolved)"
            )
    return path


def _file_url_path(url: str) -> str:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"file URL {redact_url(url)!r} names a remote host; only local files are allowed"
        )
    if not parts.path.startswith("/"):
        raise ValueError(
            f"file URL {redact_url(url)!r} needs an absolute path, as in file:///data/x.tar"
        )
    if parts.query or parts.fragment:
        raise ValueError(
            f"file URL {redact_url(url)!r} has a query or fragment; percent-encode '?' and '#'"
        )
    # RFC 8089: the path of a file URL is percent-encoded.
    return unquote(parts.path)


def _check_remote(url: str, scheme: str) -> None:
    credentials = url_credentials_problem(url)  # s3://KEY:SECRET@bucket: never handed on
    if credentials is not None:
        raise ValueError(credentials)
    # http.client needs RFC 3986 anyway; object-store keys may hold spaces and more.
    if scheme in HTTP_SCHEMES and not _REMOTE_URL_CHARS.match(url):
        raise ValueError(
            f"character outside RFC 3986 in {redact_url(url)!r} "
            "(space, backtick, braces, quotes, non-ASCII, ...); percent-encode it"
        )
    if "$(" in url or "`" in url:
        raise ValueError(f"{redact_url(url)!r} contains shell substitution syntax; refused")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a malformed port
    except ValueError as exc:
        raise ValueError(f"malformed URL {redact_url(url)!r}: {exc}") from None
    if not parts.hostname:
        what = "host" if scheme in HTTP_SCHEMES else "bucket"
        raise ValueError(f"URL {redact_url(url)!r} has no {what}")
    if port == 0:
        raise ValueError(f"URL {redact_url(url)!r} has port 0")


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
        raise ValueError(
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
            raise ValueError(f"unbalanced '}}' in {redact_url(pattern)!r}")
        if char != "{":
            literal.append(char)
            pos += 1
            continue
        end = pattern.find("}", pos + 1)
        if end < 0:
            raise ValueError(f"unbalanced '{{' in {redact_url(pattern)!r}")
        body = pattern[pos + 1 : end]
        if "{" in body:
            raise ValueError(
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
        raise ValueError(f"malformed range {{{body}}}: use non-negative integers like {{000..127}}")
    if "," in body:
        return body.split(",")
    return None


def expand_urls(
    source: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    *,
    max_shards: int = MAX_SHARDS,
    schemes: Collection[str] = ALLOWED_SCHEMES,
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
        _check_characters(pattern)
        if url_scheme(pattern):  # `{http,https}://...` is checked once expanded
            _check_scheme(pattern, schemes)
    total = sum(brace_count(pattern) for pattern in patterns)
    if total > max_shards:
        raise ValueError(
            f"shard sources expand to {total} URLs, more than max_shards={max_shards}; "
            "split the list or raise max_shards"
        )
    if total == 0:
        raise ValueError("no shard URLs given: the source list is empty")
    urls: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        for raw in expand_braces(pattern, max_shards=max_shards):
            url = validate_url(raw, schemes=schemes, data_root=data_root)
            if url in seen:
                raise ValueError(f"duplicate shard URL after expansion: {redact_url(url)!r}")
            seen.add(url)
            urls.append(url)
    return urls
