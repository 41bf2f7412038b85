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
    """An object store through fsspec, with the client's own retries off and its socket
    waits set from the `RetryPolicy` (`tune`, by each store's class below)."""

    request_per_read = True

    def __init__(self, *schemes: str, shards: bool = True) -> None:
        self.schemes, self.shards = schemes, shards

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
        """A store is read as it is now: a listing cached before `index` wrote a manifest
        would hide it from the next look in the same process. Each store's own class
        adds its client's socket waits and retries."""
        tuned = dict(options)
        tuned.setdefault("use_listings_cache", False)
        return tuned


class S3Transport(FsspecTransport):
    """S3 and compatible stores through s3fs and botocore."""

    package = "s3fs"

    def tune(self, options: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
        """One socket wait is at most the stall limit, and never longer than the deadline;
        s3fs nests two retry loops (5 x 5 tries on a stall) and botocore adds its own:
        one try each, ours is the budget."""
        tuned = super().tune(options, retry)
        config = dict(tuned.get("config_kwargs") or {})
        config.setdefault("connect_timeout", min(retry.timeout, retry.deadline))
        config.setdefault("read_timeout", min(retry.timeout, retry.deadline))
        config.setdefault("retries", {"total_max_attempts": 1})
        tuned["config_kwargs"] = config
        return tuned


class GcsTransport(FsspecTransport):
    """Google Cloud Storage through gcsfs."""

    package = "gcsfs"

    def tune(self, options: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
        tuned = super().tune(options, retry)
        tuned.setdefault("requests_timeout", min(retry.timeout, retry.deadline))
        return tuned


class AzureTransport(FsspecTransport):
    """Azure Blob and Data Lake through adlfs; URLs name `container@account`."""

    package = "adlfs"
    credentials = "account"

    def tune(self, options: Mapping[str, Any], retry: RetryPolicy) -> dict[str, Any]:
        tuned = super().tune(options, retry)
        tuned.setdefault("connection_timeout", min(retry.timeout, retry.deadline))
        tuned.setdefault("read_timeout", min(retry.timeout, retry.deadline))
        return tuned


class MemoryTransport(FsspecTransport):
    """fsspec's in-process store (tests): no bucket, one per process."""

    package = "fsspec"
    authority = ""


register(LocalTransport())
register(HttpTransport())
register(S3Transport("s3"))
register(GcsTransport("gs"))
# A build's inputs only: gcsfs's other name, Azure, fsspec's in-process store (tests).
register(GcsTransport("gcs", shards=False))
register(AzureTransport("az", "abfs", shards=False))
register(MemoryTransport("memory", shards=False))
