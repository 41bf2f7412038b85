"""The stores this project ships, as registry entries: local files, http(s), fsspec stores.

Each is one `Transport` (`shards.storage.registry`) and one `register` line below; a
new store is added the same way (docs/LOADER.md "Adding a store").
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from shards.storage.http import SCHEMES, RetryingStream, open_http
from shards.storage.local import open_local
from shards.storage.objectstore import (
    RetryingFsspecFile,
    object_store_filesystem,
    open_object,
    secrets_in,
    walk,
)
from shards.storage.registry import Transport, register
from shards.storage.retry import RetryPolicy
from shards.storage.urls import url_scheme
from shards.storage.write import FsspecStore, LocalStore


class LocalTransport(Transport):
    """Plain paths and `file://` URLs: regular files only, never a FIFO waited on."""

    schemes = ("", "file")
    authority = ""

    def open(self, url, retry, *, storage_options, random_access=False, expected_size=None):
        return open_local(url, expected_size)

    def walk(self, url: str, retry: RetryPolicy, storage_options: Mapping[str, Any]):
        root = os.path.abspath(url)
        for directory, subdirs, files in os.walk(root):
            subdirs.sort()
            relative = os.path.relpath(directory, root)
            yield ("" if relative == "." else relative.replace(os.sep, "/")), subdirs, sorted(files)

    def output_store(self, url: str, storage_options: Mapping[str, Any] | None = None):
        return LocalStore(url)


class HttpTransport(Transport):
    """http(s) servers: streamed or ranged GETs with resume; Basic auth in the URL."""

    schemes = SCHEMES
    authority = "host"
    rfc3986 = True
    credentials = "basic"

    def open(self, url, retry, *, storage_options, random_access=False, expected_size=None):
        return open_http(url, retry, random_access=random_access, expected_size=expected_size)

    def open_span(self, url, retry, *, storage_options, size, start, stop, clock, identity):
        return RetryingStream(
            url, retry, start, expected_size=size, end=stop, clock=clock, identity=identity
        )


class FsspecTransport(Transport):
    """An object store through fsspec (s3fs, gcsfs, adlfs, fsspec's `memory://`), with
    the client's own retries off and its socket waits set from the `RetryPolicy`."""

    request_per_read = True

    def __init__(
        self, *schemes: str, package: str, credentials: str = "none", shards: bool = True
    ) -> None:
        self.schemes, self.package = schemes, package
        self.credentials, self.shards = credentials, shards
        self.authority = "" if package == "fsspec" else "bucket"  # memory:// has no bucket

    def open(self, url, retry, *, storage_options, random_access=False, expected_size=None):
        return open_object(url, retry, storage_options, random_access, expected_size)

    def open_span(self, url, retry, *, storage_options, size, start, stop, clock, identity):
        fs = object_store_filesystem(url_scheme(url), storage_options, retry)
        # cache_type "none": each read is one ranged GET of what it asks for.
        reader = RetryingFsspecFile(
            url,
            fs,
            retry,
            {"cache_type": "none"},
            secrets_in(storage_options),
            expected_size=size,
            clock=clock,
            identity=identity,
        )
        reader.seek(start)
        return reader

    def walk(
        self, url: str, retry: RetryPolicy, storage_options: Mapping[str, Any]
    ) -> Iterator[tuple[str, list[str], list[str]]]:
        return walk(url, storage_options, retry)

    def output_store(self, url: str, storage_options: Mapping[str, Any] | None = None):
        return FsspecStore(url, storage_options)

    def write_bytes(self, url: str, data: bytes, storage_options: Mapping[str, Any]) -> None:
        store = FsspecStore(url.rsplit("/", 1)[0], storage_options)
        store.write_bytes_atomic(url.rsplit("/", 1)[1], data)

    def tune(self, options: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
        """One socket wait is at most the stall limit, and never longer than the deadline;
        the client's own retry loops are reduced to one try (ours is the budget)."""
        tuned = dict(options)
        # A store is read as it is now: a listing cached before `index` wrote a manifest
        # would hide it from the next look in the same process.
        tuned.setdefault("use_listings_cache", False)
        wait = min(retry.timeout, retry.deadline)
        if self.package == "s3fs":
            # s3fs nests two retry loops (5 x 5 tries on a stall) and botocore adds its own.
            config = dict(tuned.get("config_kwargs") or {})
            config.setdefault("connect_timeout", wait)
            config.setdefault("read_timeout", wait)
            config.setdefault("retries", {"total_max_attempts": 1})
            tuned["config_kwargs"] = config
        elif self.package == "gcsfs":
            tuned.setdefault("requests_timeout", wait)  # gcsfs's per-request timeout
        elif self.package == "adlfs":
            tuned.setdefault("connection_timeout", wait)  # the Azure SDK's socket waits
            tuned.setdefault("read_timeout", wait)
        return tuned


register(LocalTransport())
register(HttpTransport())
register(FsspecTransport("s3", package="s3fs"))
register(FsspecTransport("gs", package="gcsfs"))
# A build's inputs only: gcsfs's other name, Azure, fsspec's in-process store (tests).
register(FsspecTransport("gcs", package="gcsfs", shards=False))
register(FsspecTransport("az", "abfs", package="adlfs", credentials="account", shards=False))
register(FsspecTransport("memory", package="fsspec", shards=False))
