"""Object-store reads (s3, gs, ...) through fsspec, with our retry policy as the only budget.

The client's own retry loops are turned off (`object_store_filesystem`), so a
`RetryPolicy` means the same on a store as on an http(s) server: a failed open or
read is retried after the policy's backoff by reopening at the position, within the
stream's deadline, and an object that changed between opens is refused. Listing a
prefix (`walk`) retries each listing call the same way. Credential values given in
`storage_options` are scrubbed from every message.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, BinaryIO

from shards.redact import is_secret_name, redact_text
from shards.storage.registry import transport_of
from shards.storage.retry import (
    DEFAULT_RETRY,
    ObjectIdentity,
    ObjectNotFoundError,
    RetryingReader,
    RetryPolicy,
    ShardReadError,
    StreamClock,
    call_with_retry,
    describe,
)
from shards.storage.urls import url_scheme

# Object-store reads go through fsspec's block cache. "readahead" fetches what a
# read asks for plus one block in a single ranged GET and keeps it. Tar shards are
# read front to back, so 8 MiB blocks (the usual S3 ranged-GET size) amortise the
# request latency while holding little memory per stream; s3fs's default, 50 MiB,
# would make the first sample wait for 50 MiB. Parquet jumps to the footer, then
# reads the row groups in order, each group's column chunks back to back, so a
# smaller block wastes little on the footer read and on pieces that start or stop
# mid-shard. `default_block_size`/`default_cache_type` in storage_options win.
FSSPEC_SEQUENTIAL_CACHE = ("readahead", 8 * 2**20)
FSSPEC_RANDOM_CACHE = ("readahead", 1 * 2**20)
FSSPEC_BUFFER_SIZE = 64 * 2**10  # the block cache holds the data; this batches small reads


def open_object(
    url: str,
    retry: RetryPolicy,
    storage_options: Mapping[str, Any],
    random_access: bool = False,
    expected_size: int | None = None,
) -> BinaryIO:
    """A buffered object-store file: a `RetryingFsspecFile` with a block cache for the access.

    Raises:
        ImportError: the fsspec backend for the scheme (s3fs, gcsfs, adlfs) is missing.
    """
    fs = _filesystem(url_scheme(url), storage_options, retry)
    cache_type, block_size = FSSPEC_RANDOM_CACHE if random_access else FSSPEC_SEQUENTIAL_CACHE
    open_options = {}
    if "default_cache_type" not in storage_options:
        open_options["cache_type"] = cache_type
    if "default_block_size" not in storage_options:
        open_options["block_size"] = block_size
    raw = RetryingFsspecFile(
        url, fs, retry, open_options, secrets_in(storage_options), expected_size=expected_size
    )
    return io.BufferedReader(raw, FSSPEC_BUFFER_SIZE)  # type: ignore[return-value]


def _filesystem(scheme: str, storage_options: Mapping[str, Any], retry: RetryPolicy) -> Any:
    """`object_store_filesystem`, or an ImportError naming the package to install."""
    try:
        return object_store_filesystem(scheme, storage_options, retry)
    except ImportError as exc:
        transport = transport_of(scheme)
        package = transport.package if transport and transport.package else "the fsspec backend"
        raise ImportError(
            f"reading {scheme}:// URLs needs the {package!r} package: pip install {package}"
        ) from exc


_FILESYSTEMS: dict[tuple, Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def object_store_filesystem(
    scheme: str, storage_options: Mapping[str, Any], retry: RetryPolicy = DEFAULT_RETRY
) -> Any:
    """An fsspec filesystem whose own retries are off, so `retry` is the only budget.

    The scheme's transport tunes the client (`Transport.tune`): its retry loops are
    reduced to one try (s3fs nests two, 5 x 5 tries on a stall, and botocore adds its
    own, which would multiply any budget we set) and its socket waits come from
    `retry.timeout` (a stall limit, capped at `retry.deadline`), unless
    `storage_options` sets them. One instance per process and options: instances hold
    sockets and an event loop that must not cross a fork into DataLoader workers.
    """
    import fsspec  # lazily: only object-store users pay for the import

    transport = transport_of(scheme)
    options = transport.tune(storage_options, retry) if transport else dict(storage_options)
    key = (os.getpid(), scheme, json.dumps(options, sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)
            if hasattr(fs, "retries"):
                fs.retries = 1  # the client's public per-instance retry count (s3fs: 5)
            _FILESYSTEMS[key] = fs
    return fs


def secrets_in(options: Any) -> list[str]:
    """Credential values in (nested) storage options, to scrub from messages."""
    found: list[str] = []
    if isinstance(options, Mapping):
        for name, value in options.items():
            if isinstance(value, str) and is_secret_name(str(name)) and len(value) >= 4:
                found.append(value)
            elif isinstance(value, Mapping):
                found += secrets_in(value)
    return found


def _permanent_fsspec_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [
        FileNotFoundError,
        PermissionError,
        IsADirectoryError,
        NotADirectoryError,
    ]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError

        errors += [NoCredentialsError, PartialCredentialsError]
    return tuple(errors)


def _transient_fsspec_errors() -> tuple[type[BaseException], ...]:
    # What object-store clients raise for a dropped, cut or stalled connection
    # besides OSError: botocore's transport errors and aiohttp's client errors.
    errors: list[type[BaseException]] = [OSError]
    with contextlib.suppress(ImportError):
        from botocore.exceptions import BotoCoreError

        errors.append(BotoCoreError)
    with contextlib.suppress(ImportError):
        from aiohttp import ClientError

        errors.append(ClientError)
    return tuple(errors)


class RetryingFsspecFile(RetryingReader):
    """A seekable object-store file whose reads survive failures by reopening at the position.

    A failed open or read (503, a cut or stalled body) is retried after the
    policy's backoff: the broken file is dropped and reopened at the current
    offset, so no byte is skipped or read twice. Every open must find the
    version `identity` pinned (size, and ETag, else last-modified; shared with the
    other spans of a ranged fetch), or it stops with `ObjectChangedError` rather
    than splice two versions; within one open s3fs sends the ETag as `If-Match`
    on each ranged GET, and a 412 there is a failed read that reopens and finds
    the change. The deadline is checked before every open, read and backoff; one read inside
    fsspec (at most a cache block, 8 MiB) is bounded only by the client's
    socket timeouts (`retry.timeout`), as fsspec offers no per-call deadline.

    Attributes:
        url: the redacted URL.
        size: the object's size in bytes.
        retries: failed tries so far (opening and reading).
        reopens: reopenings after a failed read.
    """

    def __init__(
        self,
        url: str,
        fs: Any,
        retry: RetryPolicy = DEFAULT_RETRY,
        open_options: Mapping[str, Any] | None = None,
        secrets: list[str] | None = None,
        *,
        expected_size: int | None = None,
        clock: StreamClock | None = None,
        identity: ObjectIdentity | None = None,
    ) -> None:
        super().__init__(url, retry, expected_size=expected_size, clock=clock, identity=identity)
        self._fs = fs
        self._open_options = dict(open_options or {})
        self._secrets = list(secrets or [])
        self._permanent = _permanent_fsspec_errors()
        self._transient = _transient_fsspec_errors()
        self.reopens = 0
        with self.clock.running():
            self._connect()  # eagerly, so that a missing object surfaces at open time

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size or 0}[whence]
        self._pos = max(0, base + offset)
        if self._source is not None:
            self._source.seek(self._pos)  # no request: the next read fetches from here
        return self._pos

    def _read_some(self, size: int) -> bytes | None:
        try:
            return self._source.read(size)
        except self._permanent as exc:
            raise self._error(exc) from exc
        except self._transient as exc:
            self._drop(exc)
        except IndexError as exc:
            # s3fs (2026.9) indexes `args[0]` of a read timeout that has no args
            # while translating it; the context is the real, transient failure.
            if not isinstance(exc.__context__, self._transient):
                raise
            self._drop(exc.__context__)
        return None

    def _connect(self) -> None:
        """Open the object at `self._pos`, retrying transient failures."""
        while True:
            if self.clock.remaining() <= 0:
                raise self.clock.error(self._url, self._pos, self._failures)
            try:
                file = self._fs.open(self._url, "rb", **self._open_options)
            except self._permanent as exc:
                raise self._error(exc) from exc
            except self._transient as exc:
                self._fail(exc, self._reason(exc))
                continue
            try:
                self._check_object(getattr(file, "size", None), *_validators(file))
            except ShardReadError:
                file.close()
                raise
            file.seek(self._pos)
            self._source = file
            return

    def _reopen(self) -> None:
        if self.reopens >= self.retry.max_resumes:
            raise ShardReadError(
                self._url, f"gave up at byte {self._pos} after {self.reopens} reopenings"
            )
        self.reopens += 1
        self._connect()

    def _drop(self, exc: BaseException) -> None:
        self._disconnect()
        self._fail(exc, self._reason(exc))

    def _reason(self, exc: BaseException) -> str:
        reason = redact_text(describe(exc), self._secrets)
        hint = {
            FileNotFoundError: "; check the URL and that the shard was uploaded",
            PermissionError: "; check the credentials (environment, ~/.aws, or storage_options)",
        }.get(type(exc), "")
        where = f" at byte {self._pos}" if self._pos else ""
        return f"{reason}{where}{hint}"

    def _error(self, exc: BaseException) -> ShardReadError:
        error = ObjectNotFoundError if isinstance(exc, FileNotFoundError) else ShardReadError
        return error(self._url, self._reason(exc), max(1, self._failures))


def _validators(file: Any) -> tuple[str | None, str | None]:
    """(ETag, last-modified) of an open fsspec file, as its backend names them."""
    details = getattr(file, "details", None) or {}
    etag = details.get("ETag") or details.get("etag")
    stamps = [details.get(name) for name in ("LastModified", "last_modified", "updated", "mtime")]
    modified = next((stamp for stamp in stamps if stamp), None)
    return (str(etag) if etag else None), (str(modified) if modified else None)


def walk(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
) -> Iterator[tuple[str, list[str], list[str]]]:
    """Walk an object-store prefix top-down, as `os.walk` does: `(relative, subdirs, files)`.

    `relative` is the prefix below `url`, `/`-separated (`""` first, for `url` itself);
    prune `subdirs` in place to skip them. Each listing call is retried under `retry`
    (the client's own retries are off); a prefix that vanished meanwhile holds nothing.

    Raises:
        ShardReadError: a listing failed past the retry budget or its deadline, or the
            store refused the credentials.
        ImportError: the fsspec backend for the scheme is missing.
    """
    import fsspec.core

    options = storage_options or {}
    fs = _filesystem(url_scheme(url), options, retry)
    root = fsspec.core.strip_protocol(url).rstrip("/") or "/"
    secrets = secrets_in(options)
    pending = [""]
    while pending:
        relative = pending.pop()
        prefix = f"{root.rstrip('/')}/{relative}" if relative else root
        subdirs, files = _list_prefix(fs, prefix, retry, secrets)
        yield relative, subdirs, files
        pending += [f"{relative}/{name}" if relative else name for name in reversed(subdirs)]


def _list_prefix(
    fs: Any, prefix: str, retry: RetryPolicy, secrets: list[str]
) -> tuple[list[str], list[str]]:
    """The names of the sub-prefixes and of the objects directly under `prefix`."""
    url = fs.unstrip_protocol(prefix)

    def reason(exc: BaseException) -> str:
        return redact_text(describe(exc), secrets)

    try:
        entries = call_with_retry(
            functools.partial(fs.ls, prefix, detail=True),
            url,
            retry,
            _transient_fsspec_errors(),
            reason,
            permanent=_permanent_fsspec_errors(),
        )
    except FileNotFoundError:
        return [], []
    except _permanent_fsspec_errors() as exc:
        hint = "; check the credentials (environment, ~/.aws, or storage_options)"
        raise ShardReadError(url, reason(exc) + hint) from exc
    subdirs, files = [], []
    for entry in entries:
        path = entry["name"].rstrip("/")
        if path == prefix:
            continue
        name = path.rsplit("/", 1)[-1]
        (subdirs if entry["type"] == "directory" else files).append(name)
    return sorted(subdirs), sorted(files)
