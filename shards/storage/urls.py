"""Where bytes live: URL schemes, `is_remote`, and the validation every read starts with.

The one place a location is parsed. Shard sources (`shards.storage.patterns`, which
adds brace and glob expansion), the build's inputs and outputs and `shards.storage`'s readers
all ask here whether a location is local and whether its URL is safe to hand to a
client. Nothing here spawns a process or reads an environment variable into a URL.

Decisions (docs/RELIABILITY.md "Remote reads"):
    * `file://` is local, in any case (`FILE://` too: schemes are case-insensitive,
      RFC 3986 §3.1); a `file://` URL becomes its local path before it is opened.
    * A scheme needs two characters or more, so `C:` never reads as one.
    * Control characters and surrounding whitespace are refused in every URL; http(s)
      URLs keep to the RFC 3986 character set; no remote URL may hold `$(` or a
      backtick; `::`-joined URL chains are refused.
    * Credentials in an object-store URL (`s3://KEY:SECRET@bucket/...`) are refused
      (`shards.redact.url_credentials_problem`); http(s) `user:password@` is Basic auth.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection
from urllib.parse import unquote, urlsplit

from shards.errors import UsageError
from shards.redact import redact_url, url_credentials_problem
from shards.storage.registry import READ_SCHEMES, SHARD_SCHEMES, Transport, transport_of

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
# RFC 3986 unreserved + reserved + '%'. Anything else in a remote URL is a typo or an attack.
_REMOTE_URL_CHARS = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*$")
_IPV6_HOST = re.compile(r"\[[0-9A-Fa-f:.]*\]")  # `[::1]` holds '::' legitimately


def url_scheme(url: str) -> str:
    """Return the lower-case scheme of `url`, or `""` for a plain local path."""
    match = _SCHEME.match(url)
    return match.group(1).lower() if match else ""


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for a `scheme://` URL other than `file://` (in any case): bytes a client fetches.

    A plain path is local even when `://` appears inside it (`./a://b`), and so is a
    name like `out:1`, which has no `//`: a build may write to such a directory.
    """
    text = os.fspath(location)
    scheme = url_scheme(text)
    return bool(scheme) and scheme != "file" and text[len(scheme) + 1 :][:2] == "//"


def local_path(location: str | os.PathLike[str]) -> str:
    """The local path a plain path or a `file://` URL names (see `file_url_path`)."""
    text = os.fspath(location)
    return file_url_path(text) if url_scheme(text) == "file" else text


def validate_url(
    url: str,
    *,
    schemes: Collection[str] = SHARD_SCHEMES,
    data_root: str | os.PathLike[str] | None = None,
) -> str:
    """Check one URL (no patterns) and return its normal form.

    Local paths become absolute (`..` collapsed, `~` and `$VAR` kept literally);
    `file://` URLs become local paths. Remote URLs are returned unchanged.

    Args:
        url: a local path or a URL with an allowed scheme.
        schemes: the schemes accepted (`""` means a plain local path): by default
            what the loader reads shards from (`SHARD_SCHEMES`); at most
            `READ_SCHEMES`.
        data_root: if set, local paths must lie inside this directory after
            resolving symlinks.

    Raises:
        ValueError: with the reason and what would be accepted instead.
    """
    check_characters(url)
    scheme = check_scheme(url, schemes)
    if scheme in ("", "file"):
        return _absolute_path(url, data_root)
    _check_remote(url, transport_of(scheme))
    return url


def check_scheme(url: str, schemes: Collection[str]) -> str:
    """The scheme of `url`, refused unless it is in `schemes` (and one we can read)."""
    scheme = url_scheme(url)
    if scheme not in schemes or scheme not in READ_SCHEMES:
        allowed = sorted(s + "://" if s else "local paths" for s in schemes if s in READ_SCHEMES)
        raise UsageError(
            f"scheme not allowed: {scheme!r} in {redact_url(url)!r}; allowed: {', '.join(allowed)}"
            " (a local file whose name starts with 'word:' must be written './word:...')"
        )
    return scheme


def check_characters(url: str) -> None:
    """Refuse a URL (or pattern) with control characters, padding or a `::` chain."""
    if not isinstance(url, str):
        raise TypeError(f"shard URLs must be str, got {type(url).__name__}")
    if not url:
        raise UsageError("empty shard URL")
    if _CONTROL_CHARS.search(url):
        raise UsageError(
            f"control character (NUL, newline, tab, ...) in shard URL {redact_url(url)!r}; "
            "percent-encode it or rename the file"
        )
    if url != url.strip():
        raise UsageError(f"leading or trailing whitespace in shard URL {redact_url(url)!r}")
    if "::" in _IPV6_HOST.sub("", url):
        raise UsageError(
            f"'::'-joined URL chains are not supported: {redact_url(url)!r}; "
            "pass the URLs as a list instead"
        )


def _absolute_path(url: str, data_root: str | os.PathLike[str] | None) -> str:
    path = os.path.abspath(local_path(url))
    if data_root is not None:
        root = os.path.realpath(data_root)
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise UsageError(
                f"shard path {path!r} is outside data root {root!r} (symlinks resolved)"
            )
    return path


def file_url_path(url: str) -> str:
    """The local path of a `file://` URL (RFC 8089: its path is percent-encoded).

    Raises:
        ValueError: a remote host, a relative path, or a query or fragment.
    """
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise UsageError(
            f"file URL {redact_url(url)!r} names a remote host; only local files are allowed"
        )
    if not parts.path.startswith("/"):
        raise UsageError(
            f"file URL {redact_url(url)!r} needs an absolute path, as in file:///data/x.tar"
        )
    if parts.query or parts.fragment:
        raise UsageError(
            f"file URL {redact_url(url)!r} has a query or fragment; percent-encode '?' and '#'"
        )
    return unquote(parts.path)


def credentials_problem(url: str) -> str | None:
    """Why `url` must be refused for the credentials it holds, by its store's credential
    shape (`shards.redact.url_credentials_problem`), or None."""
    transport = transport_of(url_scheme(url))
    return url_credentials_problem(url, transport.credentials if transport else "none")


def _check_remote(url: str, transport: Transport) -> None:
    credentials = credentials_problem(url)  # s3://KEY:SECRET@bucket: never handed on
    if credentials is not None:
        raise UsageError(credentials)
    # http.client needs RFC 3986 anyway; object-store keys may hold spaces and more.
    if transport.rfc3986 and not _REMOTE_URL_CHARS.match(url):
        raise UsageError(
            f"character outside RFC 3986 in {redact_url(url)!r} "
            "(space, backtick, braces, quotes, non-ASCII, ...); percent-encode it"
        )
    if "$(" in url or "`" in url:
        raise UsageError(f"{redact_url(url)!r} contains shell substitution syntax; refused")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError on a malformed port
    except ValueError as exc:
        raise UsageError(f"malformed URL {redact_url(url)!r}: {exc}") from None
    if not parts.hostname and transport.authority:
        raise UsageError(f"URL {redact_url(url)!r} has no {transport.authority}")
    if port == 0:
        raise UsageError(f"URL {redact_url(url)!r} has port 0")
