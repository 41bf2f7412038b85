"""`ReadOptions`: how shard bytes are read (retries, caps, checksums, read-ahead, cache).

A settings group of `LoaderOptions` that checks itself where it is made; its flags are
the `reading` group of `train --help`. No torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from shards.errors import ReadLimits
from shards.flags import (
    check_at_least,
    check_bytes,
    check_flag,
    check_int_at_least,
    option,
    refuse,
)
from shards.storage import RetryPolicy
from shards.storage.ranged import DEFAULT_CONNECTIONS, DEFAULT_PREFETCH_BYTES
from shards.units import ByteSize


@dataclass(frozen=True)
class ReadOptions:
    """How shard bytes are read.

    Attributes:
        retry: retries, stall limit and per-shard deadline of every request.
        storage_options: fsspec options for object stores (e.g. endpoint_url); never
            shown in a repr, since credentials go here.
        limits: caps on one shard read (member and cell bytes, members, bytes, Parquet
            row-group size); the manifest's byte count caps each shard too.
        checksums: hash every shard against the manifest's sha256 before reading it;
            a mismatch makes it a bad shard (counted, never half-read). Costs one extra
            read of local shards or a spool to a temporary file for remote ones.
        timeout: seconds to wait for one batch from a worker before raising (a stuck,
            not dead, worker; dead ones raise at once). 0 waits forever. Default: the
            retry policy's per-shard deadline plus two stall limits, so a shard that
            stalls ends as a counted bad shard naming its URL before this watchdog
            (which cannot name one) fires.

        The two byte sizes take an int or a text (`"512MiB"`, `"200GB"`: powers of 1024
        with an `i`, else of 1000; `shards.units`).

        prefetch_bytes: bytes of remote shards fetched ahead per worker (in flight and
            fetched, not yet read), into the cache or a temporary file, never memory;
            the next shard is always fetched, even one larger. 0: stream each remote
            shard as it is read, one connection, no read-ahead.
        fetch_connections: parallel ranged requests per shard fetched, so a store that
            caps one connection's bandwidth does not cap the worker's.
        cache_dir: a node-local directory where fetched shards are kept (checked against
            the manifest's sha256, else its size) for later epochs and for every
            worker and rank on the node. None: no cache.
        cache_limit: bytes the cache may hold; least-recently-used shards not in use and
            not of this job are evicted to stay under it (a dataset larger than the
            limit keeps what fitted first and streams the rest). None: no limit but the
            disk (a full disk turns the cache off with one warning).
        count_remote_shards: count remote tar shards without a manifest by reading each
            once (exact epochs need counts; resampled sampling needs none).
    """

    retry: RetryPolicy = option(
        default_factory=RetryPolicy, text="retries and deadlines of reads", cli=False
    )
    # repr=False: credentials put here must not leak wherever a config is logged.
    storage_options: dict | None = field(
        default=None, repr=False, metadata={"help": "fsspec options", "cli": False}
    )
    limits: ReadLimits = option(
        default_factory=ReadLimits, text="caps on one shard read", cli=False
    )
    checksums: bool = option(
        False,
        "hash every shard against the manifest's sha256 before reading it",
        "reading",
        flag="verify_checksums",
    )
    timeout: float | None = option(
        None,
        "seconds to wait for one batch from a loader worker (0: forever); default: the "
        "per-shard read deadline plus two stall limits",
        "reading",
        flag="batch_timeout",
    )
    prefetch_bytes: ByteSize = option(
        DEFAULT_PREFETCH_BYTES,
        "bytes of remote shards fetched ahead per worker (e.g. 512MiB); 0: stream without "
        "read-ahead",
        "reading",
    )
    fetch_connections: int = option(
        DEFAULT_CONNECTIONS, "parallel ranged requests per remote shard fetched", "reading"
    )
    cache_dir: str | None = option(
        None,
        "node-local directory that keeps fetched remote shards for later epochs; default: no cache",
        "reading",
    )
    cache_limit: ByteSize | None = option(
        None,
        "bytes the shard cache may hold (e.g. 200GB or 200GiB); default: no limit but the disk",
        "reading",
    )
    allow_missing_shards: bool = option(
        False,
        "read the shards that exist when some named ones do not (a half-synced brace "
        "range); default: refuse, naming how many are missing",
        "reading",
    )
    count_remote_shards: bool = option(
        False,
        "count remote tar shards without a manifest by reading each once (exact epochs "
        "need counts); default: refuse, saying how else",
        "reading",
    )

    @property
    def wants_digests(self) -> bool:
        """Whether the shards' sha256 should be read: checked reads or the cache's check."""
        return self.checksums or self.cache_dir is not None

    def __post_init__(self) -> None:
        if not isinstance(self.retry, RetryPolicy):
            raise refuse(self, "retry", f" must be a RetryPolicy, got {self.retry!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise refuse(self, "storage_options", " must be a dict of fsspec options or None")
        if not isinstance(self.limits, ReadLimits):
            raise refuse(self, "limits", f" must be a ReadLimits, got {self.limits!r}")
        check_flag(self, "checksums")
        if self.timeout is not None:
            check_at_least(self, "timeout", 0)
        check_bytes(self, "prefetch_bytes")
        check_int_at_least(self, "fetch_connections", 1)
        if isinstance(self.cache_dir, os.PathLike):
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        if self.cache_dir is not None and not (isinstance(self.cache_dir, str) and self.cache_dir):
            raise refuse(self, "cache_dir", f" must be a directory or None, got {self.cache_dir!r}")
        check_bytes(self, "cache_limit", 1, optional=True)
        check_flag(self, "allow_missing_shards")
        check_flag(self, "count_remote_shards")
