"""Open one validated shard URL as a streaming binary file: local, http(s) or fsspec.

Sits between `pipeline.urls` (which validated the URL) and the tar/Parquet
readers. No process is ever spawned and no environment variable is read into a
URL. http(s) and object-store reads resume mid-stream after a dropped connection
(a `Range` request, or reopening at the position), within a stall limit per socket
wait and an overall deadline per stream (`RetryPolicy`); they never return bytes
past the manifest's size. Every failure ends in a `ShardReadError` naming the
redacted URL.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import math
import os
import random
import re
import ssl
import stat
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO
from urllib.parse import unquote, urljoin, urlsplit

from pipeline.urls import FSSPEC_SCHEMES, HTTP_SCHEMES, url_scheme, validate_url
from shards.redact import redact_text, redact_url

LOCAL_BUFFER_SIZE = 1 << 20
HTTP_BUFFER_SIZE = 1 << 20
MAX_REDIRECTS = 5
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# Network failures worth another try: resets, refusals, timeouts, DNS hiccups, bad or
# cut responses. ShardReadError (an OSError too) and certificate errors are re-raised
# before these are caught; anything else (TypeError, ...) is a bug and propagates.
TRANSIENT_ERRORS = (OSError, http.client.HTTPException)
FSSPEC_PACKAGES = {"s3": "s3fs", "gs": "gcsfs"}
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
# storage_options whose values are credentials: scrubbed from every message.
SECRET_OPTION = re.compile(r"key|secret|token|password|credential|session", re.IGNORECASE)

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with jittered exponential backoff, a stall limit and a deadline.

    Attributes:
        attempts: tries per request, and consecutive failed tries allowed mid-stream
            without progress; at least 1.
        base_delay: seconds before the first retry; doubled for each further one.
        max_delay: cap on one delay, including a server's `Retry-After`.
        timeout: the stall limit: seconds one connect or one socket read may wait
            for a byte. It bounds a server that goes silent, not one that drips.
        max_resumes: reconnections allowed over one stream's life, so that a link
            dropping every few bytes ends in an error instead of crawling forever.
        deadline: seconds one shard stream may spend waiting on its server or
            store, from open to its last byte: connects, reads, retries, backoff
            and resumes all count; time the caller spends between reads (decoding,
            a full shuffle buffer, a slow training step) does not, so a slow
            consumer never fails a healthy shard. Each socket read waits at most
            `min(timeout, time left)`, so a server dripping one byte a second ends
            here too. The default, 30 minutes, reads a 10 GB shard at 10 MB/s
            (1000 s) with room for retries; a slow link to large shards needs more.
            `math.inf` turns it off.
    """

    attempts: int = 5
    base_delay: float = 0.5
    max_delay: float = 8.0
    timeout: float = 60.0
    max_resumes: int = 32
    deadline: float = 30 * 60.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.max_resumes < 0:
            raise ValueError(f"attempts must be >= 1 and max_resumes >= 0: {self}")
        if not (self.base_delay >= 0 and self.max_delay >= 0):  # `not >=` also refuses NaN
            raise ValueError(f"delays must be >= 0: {self}")
        if not (0 < self.timeout < math.inf):
            raise ValueError(f"timeout (the stall limit) must be a positive number: {self}")
        if not self.deadline > 0:
            raise ValueError(f"deadline must be > 0 seconds (math.inf for none): {self}")

    def delay(self, failure: int, url: str, retry_after: float = 0.0) -> float:
        """Seconds to wait after the `failure`-th consecutive failure (1-based).

        The jitter (50-100% of the backoff) is seeded by the URL and the failure
        number: reproducible, yet workers reading different shards spread out.
        """
        backoff = min(self.max_delay, self.base_delay * 2 ** (failure - 1))
        jitter = random.Random(zlib.crc32(f"{url}#{failure}".encode())).uniform(0.5, 1.0)
        return min(self.max_delay, max(backoff * jitter, retry_after))


DEFAULT_RETRY = RetryPolicy()  # frozen, so one shared default is safe


class ShardReadError(OSError):
    """A shard could not be opened or read to the end.

    Attributes:
        url: the shard URL, redacted (no credentials or signatures).
        reason: what went wrong last.
        attempts: how many tries were made.
    """

    def __init__(self, url: str, reason: str, attempts: int = 1) -> None:
        self.url = redact_url(url)
        self.reason = reason
        self.attempts = attempts
        super().__init__(f"cannot read shard {self.url} ({attempts} attempt(s)): {reason}")

    def __reduce__(self) -> tuple[type, tuple[str, str, int]]:
        # Keeps the attributes when the error crosses a process boundary.
        return (type(self), (self.url, self.reason, self.attempts))


class StreamClock:
    """The time one shard stream has spent waiting on its server, against `retry.deadline`.

    Only time inside `running()` counts: the reader's own connects, reads and
    backoff sleeps, never the caller's work between reads. Re-entrant, so a
    seekable reader and the streams it opens share one clock and count once.
    """

    def __init__(self, retry: RetryPolicy) -> None:
        self.retry = retry
        self._spent = 0.0
        self._since = 0.0
        self._depth = 0

    @contextlib.contextmanager
    def running(self) -> Any:
        if self._depth == 0:
            self._since = time.monotonic()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._spent += time.monotonic() - self._since

    def spent(self) -> float:
        """Seconds spent waiting so far."""
        return self._spent + (time.monotonic() - self._since if self._depth else 0.0)

    def remaining(self) -> float:
        """Seconds left before the deadline; <= 0 once it passed."""
        return self.retry.deadline - self.spent()

    def socket_timeout(self) -> float:
        """The wait allowed for the next connect or socket read: min(stall limit, time left).

        Raises:
            TimeoutError: the deadline has passed.
        """
        remaining = self.remaining()
        if remaining <= 0:
            raise TimeoutError(f"the {self.retry.deadline:g} s deadline passed")
        return min(self.retry.timeout, remaining)

    def error(self, url: str, position: int, failures: int, last: str = "") -> ShardReadError:
        """The `ShardReadError` for a stream past its deadline at byte `position`."""
        reason = (
            f"deadline of {self.retry.deadline:g} s waiting on the server passed "
            f"after {position} bytes ({failures} failed tries)"
            + (f"; last: {last}" if last else "")
            + "; if the shard is large or the link slow, raise it with"
            " RetryPolicy(deadline=...) (LoaderConfig(retry=...) in the loader)"
        )
        return ShardReadError(url, reason, max(1, failures))


class _TimedSocket:
    """A connected socket whose every send and receive waits at most `clock.socket_timeout()`.

    http.client reads the status line, headers and body through `makefile("rb")`;
    routing each `recv` through the clock bounds a server that drips headers or
    body a byte at a time, which a plain socket timeout (a stall limit) never ends.
    """

    def __init__(self, sock: Any, clock: StreamClock) -> None:
        self._sock, self._clock = sock, clock

    def sendall(self, data: bytes) -> None:
        self._sock.settimeout(self._clock.socket_timeout())
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        # buffering=0: the socket's own SocketIO, counted by the socket so that it
        # stays open after http.client closes the connection object.
        return io.BufferedReader(
            _TimedSocketIO(self._sock, self._sock.makefile(mode, 0), self._clock)
        )

    def close(self) -> None:
        self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _TimedSocketIO(io.RawIOBase):
    def __init__(self, sock: Any, raw: Any, clock: StreamClock) -> None:
        super().__init__()
        self._sock, self._raw, self._clock = sock, raw, clock

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._clock.socket_timeout())
        return self._raw.readinto(buffer)

    def fileno(self) -> int:
        return self._raw.fileno()

    def close(self) -> None:
        self._raw.close()
        super().close()


class _RetryableStatus(Exception):
    """An HTTP status worth retrying (429, 503, ...), raised inside this module only."""

    def __init__(self, status: int, reason: str, retry_after: float) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.retry_after = retry_after


def open_stream(
    url: str,
    retry: RetryPolicy = DEFAULT_RETRY,
    *,
    storage_options: Mapping[str, Any] | None = None,
    random_access: bool = False,
    expected_size: int | None = None,
) -> BinaryIO:
    """Open `url` for streaming reads; the body is never downloaded whole first.

    Args:
        url: a local path, `file://`, `http(s)://`, `s3://` or `gs://` URL. It is
            validated again here, so a `pipe:` URL can never slip through.
        retry: retry, backoff, stall limit and deadline for remote URLs.
        storage_options: keyword arguments for `fsspec.open` on object-store URLs,
            such as `{"endpoint_url": ...}` for an S3-compatible store.
        random_access: return a seekable file for http(s) too (Range requests
            per position), as Parquet readers need; for object stores, pick a
            block cache suited to random rather than sequential reads.
        expected_size: the shard's byte count when the caller knows it (the
            manifest's): the most that is read. A file, server or store reporting
            a larger size (`os.fstat`, `Content-Length`, `Content-Range` total,
            object size) fails at open, since that is not the shard the manifest
            describes; a smaller one is read to its end, where the shard reader
            reports the truncation, so a cut shard costs only its missing rest. A
            body sent without a size ends at `expected_size`, and one that keeps
            going past it fails instead of being read on.

    Returns:
        A readable binary file object; close it when done. Local and object-store
        files can seek; http(s) ones cannot: they are an `io.BufferedReader`
        whose `.raw` is the `RetryingStream`
        (with `retries` and `resumes` counters). Object-store files are an
        `io.BufferedReader` over a `RetryingFsspecFile` (`retries`, `reopens`).
        Read tars from it with `tarfile.open(fileobj=stream, mode="r|")`.
        Remote reads past `retry.deadline` raise `ShardReadError`.

    Raises:
        ValueError: the URL is not allowed, or `expected_size` is negative.
        ShardReadError: the shard could not be opened, after retries where useful,
            or it is larger than `expected_size`. Every message holds the URL
            redacted, never its credentials.
        ImportError: the fsspec backend for the scheme (s3fs, gcsfs) is missing.
    """
    url = validate_url(url)
    if expected_size is not None and not (isinstance(expected_size, int) and expected_size >= 0):
        raise ValueError(f"expected_size must be a byte count >= 0, got {expected_size!r}")
    scheme = url_scheme(url)
    if scheme in HTTP_SCHEMES and random_access:
        raw: io.RawIOBase = HttpRangeFile(url, retry, expected_size=expected_size)
        return io.BufferedReader(raw, HTTP_BUFFER_SIZE)  # type: ignore[return-value]
    if scheme in HTTP_SCHEMES:
        raw = RetryingStream(url, retry, expected_size=expected_size)
        return io.BufferedReader(raw, HTTP_BUFFER_SIZE)  # type: ignore[return-value]
    if scheme in FSSPEC_SCHEMES:
        return _open_fsspec(url, retry, storage_options or {}, random_access, expected_size)
    return _open_local(url, expected_size)


def _open_local(url: str, expected_size: int | None) -> BinaryIO:
    """Open a local shard; only a regular file is one.

    Opened non-blocking first, so a FIFO or device planted under a shard's name is
    refused at once instead of blocking the worker in `open()` forever.
    """
    try:
        fd = os.open(url, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ShardReadError(url, f"{type(exc).__name__}: {exc.strerror or exc}") from exc
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise ShardReadError(url, "not a regular file (a FIFO, device or directory)")
        os.set_blocking(fd, True)
        file = open(fd, "rb", buffering=LOCAL_BUFFER_SIZE, closefd=True)  # noqa: SIM115
    except BaseException:
        os.close(fd)
        raise
    if expected_size is not None and status.st_size > expected_size:
        file.close()
        raise ShardReadError(url, _size_mismatch(status.st_size, expected_size))
    return file


def _size_mismatch(size: int, expected: int) -> str:
    return (
        f"the shard is {size} bytes, more than the manifest's {expected}: "
        "the shard changed or the URL is wrong"
    )


def _open_fsspec(
    url: str,
    retry: RetryPolicy,
    storage_options: Mapping[str, Any],
    random_access: bool,
    expected_size: int | None,
) -> BinaryIO:
    scheme = url_scheme(url)
    try:
        fs = object_store_filesystem(scheme, storage_options, retry)
    except ImportError as exc:
        package = FSSPEC_PACKAGES.get(scheme, "the fsspec backend")
        raise ImportError(
            f"reading {scheme}:// shards needs the {package!r} package: pip install {package}"
        ) from exc
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


_FILESYSTEMS: dict[tuple, Any] = {}
_FILESYSTEMS_LOCK = threading.Lock()


def object_store_filesystem(
    scheme: str, storage_options: Mapping[str, Any], retry: RetryPolicy = DEFAULT_RETRY
) -> Any:
    """An fsspec filesystem whose own retries are off, so `retry` is the only budget.

    s3fs nests two retry loops (5 x 5 tries on a stall) and botocore adds its
    own, which would multiply any budget we set; they are reduced to one try
    each, and botocore's connect and read timeouts come from `retry.timeout`
    (a stall limit, capped at `retry.deadline`), unless
    `storage_options["config_kwargs"]` sets them. One instance per process and
    options: instances hold sockets and an event loop that must not cross a fork
    into DataLoader workers.
    """
    import fsspec  # lazily: only object-store users pay for the import

    options = dict(storage_options)
    if scheme == "s3":
        config = dict(options.get("config_kwargs") or {})
        # One socket wait is at most the stall limit, and never longer than the deadline.
        config.setdefault("connect_timeout", min(retry.timeout, retry.deadline))
        config.setdefault("read_timeout", min(retry.timeout, retry.deadline))
        config.setdefault("retries", {"total_max_attempts": 1})
        options["config_kwargs"] = config
    key = (os.getpid(), scheme, json.dumps(options, sort_keys=True, default=repr))
    with _FILESYSTEMS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = fsspec.filesystem(scheme, skip_instance_cache=True, **options)
            if scheme == "s3":
                fs.retries = 1  # s3fs's public per-instance retry count (class default 5)
            _FILESYSTEMS[key] = fs
    return fs


def secrets_in(options: Any) -> list[str]:
    """Credential values in (nested) storage options, to scrub from messages."""
    found: list[str] = []
    if isinstance(options, Mapping):
        for name, value in options.items():
            if isinstance(value, str) and SECRET_OPTION.search(str(name)) and len(value) >= 4:
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


class _RetryingReader(io.RawIOBase):
    """The read loop, failure budget, deadline and identity check both remote readers share.

    A failed read drops the connection (`_source`), waits out the policy's
    backoff and reconnects at `_pos`, so no byte is skipped or read twice.
    Subclasses connect (`_reopen`), read (`_read_some`) and decide how a failed
    read is reported (`_drop`). Reads never go past `size` (the reported size,
    else `expected_size`), and all waiting counts against `clock`.
    """

    # Errors closing a connection that is already broken: ignored.
    _transient: tuple[type[BaseException], ...] = TRANSIENT_ERRORS

    def __init__(
        self,
        url: str,
        retry: RetryPolicy,
        offset: int = 0,
        *,
        expected_size: int | None = None,
        clock: StreamClock | None = None,
    ) -> None:
        super().__init__()
        self._url, self.url = url, redact_url(url)
        self.retry = retry
        self.clock = clock or StreamClock(retry)
        self.expected_size = expected_size
        self.size: int | None = expected_size
        self._reported: int | None = None  # the size the first connection reported
        self._etag: str | None = None
        self._first = True
        self._source: Any = None  # the open response or file; None between connections
        self._pos = offset
        self._failures = 0  # consecutive, reset by progress
        self.retries = 0

    def readable(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} at byte {self._pos}>"

    def readinto(self, buffer: Any) -> int:
        """Read up to `len(buffer)` bytes of what has arrived; 0 only at the end."""
        if self.closed:
            raise ValueError(f"read from closed stream {self.url}")
        view = memoryview(buffer).cast("B")
        with self.clock.running():
            while True:
                if self.size is not None and self._pos >= self.size:
                    self._check_end()  # before the deadline: every byte is already in
                    return 0
                if self.clock.remaining() <= 0:
                    raise self.clock.error(self._url, self._pos, self._failures)
                if self._source is None:
                    self._reopen()
                want = len(view) if self.size is None else min(len(view), self.size - self._pos)
                data = self._read_some(want)
                if data is None:  # the read failed and `_drop` counted it
                    continue
                if not data and want and self.size is not None:
                    self._drop(ConnectionError(f"body ended at byte {self._pos} of {self.size}"))
                    continue
                view[: len(data)] = data
                self._pos += len(data)
                if data:
                    self._failures = 0
                return len(data)

    def close(self) -> None:
        self._disconnect()
        super().close()

    def _read_some(self, size: int) -> bytes | None:
        """Read up to `size` bytes from `_source`; None once a failure went to `_drop`."""
        raise NotImplementedError

    def _reopen(self) -> None:
        """Connect again at `_pos` after a failed read."""
        raise NotImplementedError

    def _drop(self, exc: BaseException) -> None:
        """Forget a connection whose read failed, then count the failure with `_fail`."""
        raise NotImplementedError

    def _check_end(self) -> None:
        """At `size`: raise if the source has bytes beyond it (it sent more than expected)."""

    def _disconnect(self) -> None:
        source, self._source = self._source, None
        if source is not None:
            with contextlib.suppress(*self._transient):
                source.close()

    def _fail(
        self, exc: BaseException, reason: str, *, retry_after: float = 0.0, give_up: bool = False
    ) -> None:
        """Count a failed try: wait out the backoff, or raise with `reason` past the budget.

        The wait never runs past the deadline: a backoff (or `Retry-After`) longer
        than the time left fails now, since no try could follow it.
        """
        self._failures += 1
        self.retries += 1
        if self.clock.remaining() <= 0:
            raise self.clock.error(self._url, self._pos, self._failures, reason) from exc
        if give_up or self._failures >= self.retry.attempts:
            raise ShardReadError(self._url, reason, self._failures) from exc
        delay = self.retry.delay(self._failures, self._url, retry_after)
        if delay >= self.clock.remaining():
            last = f"{reason}; the next try would wait {delay:g} s"
            raise self.clock.error(self._url, self._pos, self._failures, last) from exc
        time.sleep(delay)

    def _same_object(self, size: int | None, etag: str | None) -> bool:
        """Whether a new connection reads the object the first one did, which fixes it.

        Raises:
            ShardReadError: the first connection reports a size larger than
                `expected_size`.
        """
        if self._first:
            if self.expected_size is not None and size is not None and size > self.expected_size:
                raise ShardReadError(self._url, _size_mismatch(size, self.expected_size))
            self._first = False
            self._reported, self._etag = size, etag
            if size is not None:
                self.size = size
            return True
        return not (
            (self._etag and etag != self._etag)
            or (self._reported is not None and size != self._reported)
        )


class RetryingFsspecFile(_RetryingReader):
    """A seekable object-store file whose reads survive failures by reopening at the position.

    A failed open or read (503, a cut or stalled body) is retried after the
    policy's backoff: the broken file is dropped and reopened at the current
    offset, so no byte is skipped or read twice. If the object's size or ETag
    changed between opens, it stops rather than splice two versions. The
    deadline is checked before every open, read and backoff; one read inside
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
    ) -> None:
        super().__init__(url, retry, expected_size=expected_size)
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
            details = getattr(file, "details", None) or {}
            etag = details.get("ETag") or details.get("etag")
            try:
                same = self._same_object(getattr(file, "size", None), etag)
            except ShardReadError:
                file.close()
                raise
            if not same:
                file.close()
                raise ShardReadError(self._url, "the shard changed in the store while being read")
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
        reason = redact_text(_describe(exc), self._secrets)
        hint = {
            FileNotFoundError: "; check the URL and that the shard was uploaded",
            PermissionError: "; check the credentials (environment, ~/.aws, or storage_options)",
        }.get(type(exc), "")
        where = f" at byte {self._pos}" if self._pos else ""
        return f"{reason}{where}{hint}"

    def _error(self, exc: BaseException) -> ShardReadError:
        return ShardReadError(self._url, self._reason(exc), max(1, self._failures))


class RetryingStream(_RetryingReader):
    """An http(s) body that survives dropped connections by resuming where it stopped.

    After a mid-body failure it re-requests with `Range: bytes=<offset>-`; a
    server that ignores ranges is re-read from the start and the first `offset`
    bytes are skipped. If the `ETag` or size changed between requests, it stops
    with `ShardReadError` rather than splice two versions of a shard. Every
    socket wait is at most `min(retry.timeout, time left to the deadline)`.

    Attributes:
        url: the redacted URL.
        size: the body's size in bytes (sent by the server, else `expected_size`);
            None if neither is known.
        retries: failed tries so far (opening and mid-stream).
        resumes: reconnections after a mid-body failure.
    """

    def __init__(
        self,
        url: str,
        retry: RetryPolicy = DEFAULT_RETRY,
        offset: int = 0,
        *,
        expected_size: int | None = None,
        clock: StreamClock | None = None,
    ) -> None:
        super().__init__(url, retry, offset, expected_size=expected_size, clock=clock)
        self.resumes = 0
        with self.clock.running():
            self._connect()  # open eagerly so that 404 and friends surface at open time

    def _read_some(self, size: int) -> bytes | None:
        try:
            # read1: return what has arrived instead of waiting to fill the buffer.
            return self._source.read1(size)
        except ssl.SSLCertVerificationError:
            raise
        except TRANSIENT_ERRORS as exc:
            self._drop(exc)
            return None

    def _check_end(self) -> None:
        # A server that sent its size cannot overrun it (http.client stops there);
        # one that sent none and goes on past the manifest's size is refused.
        if self._source is None or self._reported is not None:
            return
        try:
            extra = self._source.read1(1)
        except TRANSIENT_ERRORS:
            return  # every expected byte is in; a failure after them loses nothing
        if extra:
            self._disconnect()
            raise ShardReadError(
                self._url,
                f"the server sent more than the manifest's {self.size} bytes and no "
                "Content-Length: the shard changed or the URL is wrong",
            )

    def _reopen(self) -> None:
        self.resumes += 1
        self._connect()

    def _drop(self, exc: BaseException) -> None:
        self._disconnect()
        reason = f"failed at byte {self._pos}: {_describe(exc)} ({self.resumes} resumes)"
        self._fail(exc, reason, give_up=self.resumes >= self.retry.max_resumes)

    def _connect(self) -> None:
        """Request the body from `self._pos`, retrying transient failures."""
        while True:
            if self.clock.remaining() <= 0:
                raise self.clock.error(self._url, self._pos, self._failures)
            try:
                response = _request(self._url, self._pos, self.clock)
                self._source = self._position(response)
                return
            except ShardReadError:
                raise
            except ssl.SSLCertVerificationError as exc:
                raise ShardReadError(self._url, _describe(exc), self._failures + 1) from exc
            except (*TRANSIENT_ERRORS, _RetryableStatus) as exc:
                retry_after = getattr(exc, "retry_after", 0.0)
                self._fail(exc, _describe(exc), retry_after=retry_after)

    def _position(self, response: http.client.HTTPResponse) -> http.client.HTTPResponse:
        """Check that `response` is the same object, and skip to `self._pos`."""
        start, size = _body_span(response)
        try:
            same = self._same_object(size, response.getheader("ETag"))
        except ShardReadError:
            response.close()
            raise
        if not same:
            response.close()
            raise ShardReadError(self._url, "the shard changed on the server while being read")
        if start > self._pos:
            response.close()
            raise ShardReadError(self._url, f"server resumed at byte {start}, not {self._pos}")
        _skip(response, self._pos - start)  # a server without Range support: start == 0
        return response


class HttpRangeFile(io.RawIOBase):
    """A seekable http(s) file read with `Range` requests, for Parquet's random access.

    Parquet readers jump to the footer, then to each row group's column chunks;
    this opens one `RetryingStream` at each new position (so every read keeps
    the retry and resume behaviour) and keeps it while reads stay sequential.
    All of them share one `StreamClock`: the deadline covers the whole file.
    Needs a server that honours ranges, which object stores and CDNs do.
    """

    def __init__(
        self, url: str, retry: RetryPolicy = DEFAULT_RETRY, *, expected_size: int | None = None
    ) -> None:
        super().__init__()
        self._url, self.url, self.retry = url, redact_url(url), retry
        self.clock = StreamClock(retry)
        self.expected_size = expected_size
        self._stream: RetryingStream | None = self._open_at(0)
        self._pos = 0
        self.size = self._stream.size
        if self.size is None:
            self._stream.close()
            raise ShardReadError(url, "the server sends no Content-Length; random access needs it")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url} at byte {self._pos}>"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        target = max(0, base + offset)
        if target != self._pos and self._stream is not None:
            self._stream.close()
            self._stream = None
        self._pos = target
        return target

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self.size:
            return 0
        with self.clock.running():
            if self._stream is None:
                self._stream = self._open_at(self._pos)
            count = self._stream.readinto(buffer)
        self._pos += count
        return count

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        super().close()

    def _open_at(self, offset: int) -> RetryingStream:
        return RetryingStream(
            self._url, self.retry, offset, expected_size=self.expected_size, clock=self.clock
        )


def _request(url: str, offset: int, clock: StreamClock) -> http.client.HTTPResponse:
    """GET `url` from byte `offset`, following up to MAX_REDIRECTS http(s) redirects."""
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        response = _get(current, offset, clock, send_auth=_same_origin(current, url))
        if response.status not in (301, 302, 303, 307, 308):
            _check_status(url, response, offset)
            return response
        location = response.getheader("Location") or ""
        response.close()
        current = _redirect_target(url, current, location)
    raise ShardReadError(url, f"more than {MAX_REDIRECTS} redirects")


def _get(url: str, offset: int, clock: StreamClock, *, send_auth: bool) -> http.client.HTTPResponse:
    parts = urlsplit(url)
    connection_class = (
        http.client.HTTPSConnection
        if parts.scheme.lower() == "https"
        else http.client.HTTPConnection
    )
    # The connect (and TLS handshake) waits at most min(stall, time left); name
    # resolution cannot be bounded without a thread and is left to the resolver.
    connection = connection_class(parts.hostname, parts.port, timeout=clock.socket_timeout())
    # `Connection: close` hands the socket to the response: closing it frees everything.
    headers = {"Connection": "close", "User-Agent": "shardpipe"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    if send_auth and parts.username is not None:
        credentials = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.connect()
        connection.sock = _TimedSocket(connection.sock, clock)
        connection.request("GET", target, headers=headers)
        return connection.getresponse()
    except BaseException:
        connection.close()
        raise


def _check_status(url: str, response: http.client.HTTPResponse, offset: int) -> None:
    status = response.status
    if status == 200 or (status == 206 and offset):
        return
    reason = response.reason
    retry_after = _retry_after(response)
    response.close()
    if status in RETRY_STATUSES:
        raise _RetryableStatus(status, reason, retry_after)
    hint = {
        401: "check the credentials",
        403: "check the credentials or the URL signature's expiry",
        404: "check the URL and that the shard was uploaded",
    }.get(status, "not retried")
    raise ShardReadError(url, f"HTTP {status} {reason}; {hint}")


def _redirect_target(url: str, current: str, location: str) -> str:
    target = urljoin(current, location)
    try:
        validate_url(target, schemes=HTTP_SCHEMES)
    except ValueError as exc:
        raise ShardReadError(url, f"redirect to {redact_url(target)!r} refused: {exc}") from None
    if url_scheme(current) == "https" and url_scheme(target) == "http":
        raise ShardReadError(url, f"redirect from https to plain http {redact_url(target)!r}")
    return target


def _same_origin(first: str, second: str) -> bool:
    # Credentials from the URL go only to the host they were written for.
    a, b = urlsplit(first), urlsplit(second)
    return (a.scheme.lower(), a.hostname, a.port) == (b.scheme.lower(), b.hostname, b.port)


def _body_span(response: http.client.HTTPResponse) -> tuple[int, int | None]:
    """Return (first byte offset, total size or None) of a 200 or 206 response."""
    length = response.getheader("Content-Length")
    if response.status == 200:
        return 0, int(length) if length and length.isdigit() else None
    match = _CONTENT_RANGE.match(response.getheader("Content-Range") or "")
    if not match:
        response.close()
        raise http.client.HTTPException("206 response without a valid Content-Range")
    total = match.group(3)
    return int(match.group(1)), int(total) if total.isdigit() else None


def _skip(response: http.client.HTTPResponse, count: int) -> None:
    while count > 0:
        chunk = response.read(min(count, HTTP_BUFFER_SIZE))
        if not chunk:
            raise http.client.IncompleteRead(b"", count)
        count -= len(chunk)


def _retry_after(response: http.client.HTTPResponse) -> float:
    value = (response.getheader("Retry-After") or "").strip()
    return float(value) if value.isdigit() else 0.0


def _describe(exc: BaseException) -> str:
    # Exception texts here never hold the URL: http.client reports statuses and
    # socket errors only, so the redacted URL in ShardReadError is the only copy.
    text = str(exc)
    if isinstance(exc, _RetryableStatus):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
