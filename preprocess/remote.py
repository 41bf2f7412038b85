"""Build inputs in an object store (a tree or a list file) or on an http(s) server (a list).

Read through `shards.storage`, as shards are: the same retries, deadlines, storage
options and URL redaction.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO
from urllib.parse import quote, urlsplit, urlunsplit

from preprocess.columns import InputColumns
from preprocess.list_file import column_item, iter_rows, row_fields
from preprocess.listing import (
    IMAGE_SUFFIXES,
    MANIFEST_SUFFIXES,
    InputError,
    Listing,
    SourceItem,
    file_suffix,
    is_hidden,
)
from shards.redact import redact_url
from shards.storage import (
    DEFAULT_RETRY,
    READ_SCHEMES,
    RetryPolicy,
    credentials_problem,
    is_remote,
    open_stream,
    transport_of,
    url_scheme,
    validate_url,
)


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
    file are relative to it and may not leave its prefix, or are absolute URLs (of any
    store); credentials and endpoints come from `storage_options` or the store's
    standard environment. A tree is walked prefix by prefix, hidden prefixes not
    entered; the files that are not inputs are counted in `listing`, as for a local tree.

    Raises:
        InputError: an unsupported scheme, credentials in the URL, or an http(s) tree.
        ShardReadError: the store or server failed past `retry`'s budget.
    """
    listing = listing if listing is not None else Listing([])
    # Where a remote input may live: any registered store (a tree where it can be
    # listed, else a list file). No scheme that can run commands is ever registered.
    transport = transport_of(url_scheme(url))
    if transport is None or not is_remote(url):
        remote = sorted(f"{s}://" for s in READ_SCHEMES if is_remote(f"{s}://x"))
        raise InputError(f"input scheme {url_scheme(url)}:// is not supported; use one of {remote}")
    credentials = credentials_problem(url)
    if credentials is not None:
        raise InputError(f"input {credentials}")
    if is_list_file_url(url):
        reader = _RemoteListReader(url, storage_options, retry)
        yield from _iter_remote_list_file(reader, listing, columns or InputColumns())
        return
    if not transport.listable:
        raise InputError(
            f"input {redact_url(url)} is not a list file: a web server cannot be listed; "
            f"pass a list ({', '.join(MANIFEST_SUFFIXES)}) of paths relative to it"
        )
    base = url.rstrip("/")
    for relative, subdirs, files in transport.walk(base, retry, storage_options or {}):
        subdirs[:] = [name for name in subdirs if not is_hidden(name)]
        for name in files:
            rel = f"{relative}/{name}" if relative else name
            item = _remote_item(f"{base}/{rel}", rel, rel.split("/"), listing)
            if item is not None:
                yield item


def _remote_item(url: str, rel: str, parts: list[str], listing: Listing) -> SourceItem | None:
    """The input a remote tree file is, or None after counting it as the local walk does."""
    if any(is_hidden(part) for part in parts):
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
    """Opens a remote list file through `shards.storage`: the `opener` `iter_rows` calls.

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
        quoted = quote(rel) if transport_of(url_scheme(self.url)).rfc3986 else rel
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
    rows = iter_rows(reader.name, opener=reader, required=columns.required, suffix=reader.suffix)
    for where, row in rows:
        raw, label = row_fields(where, row, columns.label)
        if is_remote(raw):
            found = (row_url(where, raw), url_key(raw), label)
        else:
            rel = posixpath.normpath(raw)
            if raw.startswith("/") or "://" in raw or rel == ".." or rel.startswith("../"):
                raise InputError(
                    f"{where}: path {redact_url(raw)!r} must stay inside the list's prefix, "
                    "or be an absolute URL"
                )
            found = (reader.url_of(rel), rel, label)
        item = column_item(listing, columns, where, row, from_text, found)
        if item is not None:
            yield item


def row_url(where: str, raw: str) -> str:
    """A row's absolute URL, checked as every read checks one (scheme, characters,
    credentials), or an `InputError` naming the row."""
    try:
        return validate_url(raw, schemes=READ_SCHEMES)
    except ValueError as error:
        raise InputError(f"{where}: path {redact_url(raw)!r}: {error}; fix the row") from None


def url_key(url: str) -> str:
    """The key path of an absolute URL row: `host/path` and the query redacted (what the
    output records: a sample's `source`, errors.jsonl), never a credential, and never
    equal to a relative row's, which names no host."""
    parts = urlsplit(redact_url(url))
    host = parts.netloc.rpartition("@")[2]
    query = f"?{parts.query}" if parts.query else ""
    return f"{host}{parts.path}{query}"
