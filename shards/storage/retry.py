"""The retry policy every remote read obeys, its deadline clock, and the retrying read loop.

`shards.storage.http` and `shards.storage.objectstore` read through `RetryingReader`:
bounded retries with jittered backoff, a stall limit per socket wait, an overall
deadline per stream (`RetryPolicy`), and an identity check (`ObjectIdentity`: size and
ETag, else Last-Modified) on every response, shared by all the requests of one read, so
no byte is skipped, read twice or taken from another version.
Every failure ends in a `ShardReadError` naming the redacted URL.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import math
import random
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from shards.errors import DataError, ShardpipeError
from shards.redact import redact_url

T = TypeVar("T")

# Network failures worth another try: resets, refusals, timeouts, DNS hiccups, bad or
# cut responses. ShardReadError (an OSError too) and certificate errors are re-raised
# before these are caught; anything else (TypeError, ...) is a bug and propagates.
TRANSIENT_ERRORS = (OSError, http.client.HTTPException)
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class RetryableStatus(ShardpipeError):
    """An HTTP status worth retrying (429, 503, ...); raised and caught inside `shards.storage`."""

    def __init__(self, status: int, reason: str, retry_after: float) -> None:
        super().__init__(f"HTTP {status} {reason}")
        self.retry_after = retry_after


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


class ShardReadError(DataError, OSError):
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


class ObjectNotFoundError(ShardReadError):
    """The location holds nothing: no such file, HTTP 404 or 410, no such object.

    Never retried. A build counts it as its input's `missing` skip; the loader, like
    any `ShardReadError`, as an unreadable shard.
    """


class ObjectChangedError(ShardReadError):
    """The object at the URL was replaced while it was read (another ETag, Last-Modified
    or size than its first response): no byte of the new version is taken."""

    def __init__(self, url: str, reason: str, attempts: int = 1) -> None:
        prefix = "the object changed while it was read: "
        if not reason.startswith(prefix):
            reason = (
                f"{prefix}{reason}; it was rewritten on the server meanwhile: read it again "
                "once it stays put (rebuild the manifest if the shard was replaced on purpose)"
            )
        super().__init__(url, reason, attempts)


class ObjectIdentity:
    """The version of an object one read is pinned to, shared by all its requests.

    The first response pins it: the size, and the ETag, else the Last-Modified date.
    Every later response (a resume, another span of a ranged fetch, a seek of a
    random-access file) must show the same, or the read fails with
    `ObjectChangedError`; http(s) requests also send it as a precondition
    (`conditions`). Thread-safe: the spans of one fetch run in parallel.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.pinned = False
        self.size: int | None = None
        self.etag: str | None = None
        self.modified: str | None = None

    def check(self, url: str, size: int | None, etag: str | None, modified: str | None) -> None:
        """Pin the first response's validators; raise if a later one differs.

        Raises:
            ObjectChangedError: the size, the ETag or (without one) Last-Modified differs
                from the first response's; a validator the first had and this lacks counts.
        """
        with self._lock:
            if not self.pinned:
                self.pinned = True
                self.size, self.etag, self.modified = size, etag, modified
                return
            # The ETag, else Last-Modified; a first response with neither pins the size only.
            what, then, now = (
                ("ETag", self.etag, etag)
                if self.etag
                else ("Last-Modified", self.modified, modified)
            )
            if self.size is not None and size != self.size:
                problem = f"{self.size} bytes at first, {size} now"
            elif then is not None and now != then:
                problem = f"{what} {then} at first, {now} now"
            else:
                return
        raise ObjectChangedError(url, problem)

    def conditions(self) -> dict[str, str]:
        """http(s) preconditions for a later request: `If-Match` on a strong ETag, else
        `If-Unmodified-Since` on the Last-Modified date; none before the first response."""
        with self._lock:
            if self.etag and not self.etag.startswith("W/"):
                return {"If-Match": self.etag}
            if self.modified and not self.etag:
                return {"If-Unmodified-Since": self.modified}
            return {}


class StreamClock:
    """The time one shard stream has spent waiting on its server, against `retry.deadline`.

    Only time inside `running()` counts: the reader's own connects, reads and
    backoff sleeps, never the caller's work between reads. Re-entrant, so a
    seekable reader and the streams it opens share one clock and count once.

    With `started` (a `time.monotonic()` instant) it is a wall clock instead: all the
    time since then counts, whatever runs, so the parallel requests of one ranged
    fetch share one deadline from the fetch's start (no caller works between their
    reads). Then it may be shared by threads.
    """

    def __init__(self, retry: RetryPolicy, started: float | None = None) -> None:
        self.retry = retry
        self._started = started
        self._spent = 0.0
        self._since = 0.0
        self._depth = 0

    @contextlib.contextmanager
    def running(self) -> Any:
        if self._started is not None:  # a wall clock runs anyway
            yield
            return
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
        if self._started is not None:
            return time.monotonic() - self._started
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


def call_with_retry(
    call: Callable[[], T],
    url: str,
    retry: RetryPolicy,
    transient: tuple[type[BaseException], ...],
    reason: Callable[[BaseException], str] | None = None,
    *,
    permanent: tuple[type[BaseException], ...] = (),
) -> T:
    """`call()`, tried again after each `transient` failure within `retry`'s budget and deadline.

    For one request that returns whole (a listing, a stat), as `RetryingReader` is for a
    stream. `reason` words a failure for the message (default: `describe`). `permanent`
    errors (a missing object, a refused credential: `OSError`s too) and any other
    exception propagate at once.

    Raises:
        ShardReadError: the last failure, past `retry.attempts` or the deadline.
    """
    clock = StreamClock(retry)
    failures = 0
    with clock.running():
        while True:
            try:
                return call()
            except permanent:
                raise
            except transient as exc:
                failures += 1
                last = (reason or describe)(exc)
                if failures >= retry.attempts:
                    raise ShardReadError(url, last, failures) from exc
                delay = retry.delay(failures, url)
                if delay >= clock.remaining():
                    raise clock.error(url, 0, failures, last) from exc
                time.sleep(delay)


class RetryingReader(io.RawIOBase):
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
        identity: ObjectIdentity | None = None,
    ) -> None:
        super().__init__()
        self._url, self.url = url, redact_url(url)
        self.retry = retry
        self.clock = clock or StreamClock(retry)
        self.identity = identity or ObjectIdentity()
        self.expected_size = expected_size
        self.size: int | None = expected_size
        self._reported: int | None = None  # the size the first connection reported
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
        view = memoryview(buffer).cast("B")
        data = self.read_chunk(len(view))
        view[: len(data)] = data
        return len(data)

    def read_chunk(self, size: int) -> bytes:
        """Up to `size` bytes of what has arrived, as the transport handed them over (no
        copy into a caller's buffer: a ranged fetch writes them straight to its file);
        b"" only at the end."""
        if self.closed:
            raise ValueError(f"read from closed stream {self.url}")
        with self.clock.running():
            while True:
                if self.size is not None and self._pos >= self.size:
                    self._check_end()  # before the deadline: every byte is already in
                    return b""
                if self.clock.remaining() <= 0:
                    raise self.clock.error(self._url, self._pos, self._failures)
                if self._source is None:
                    self._reopen()
                want = size if self.size is None else min(size, self.size - self._pos)
                data = self._read_some(want)
                if data is None:  # the read failed and `_drop` counted it
                    continue
                if not data and want and self.size is not None:
                    self._drop(ConnectionError(f"body ended at byte {self._pos} of {self.size}"))
                    continue
                self._pos += len(data)
                if data:
                    self._failures = 0
                return data

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

    def _check_object(self, size: int | None, etag: str | None, modified: str | None) -> None:
        """A new connection must read the version `identity` pins (the first response's).

        Raises:
            ShardReadError: this reader's first connection reports a size larger than
                `expected_size`.
            ObjectChangedError: the object is another version than the one pinned.
        """
        if self._first:
            if self.expected_size is not None and size is not None and size > self.expected_size:
                raise ShardReadError(self._url, size_mismatch(size, self.expected_size))
            self._first = False
            self._reported = size
            if size is not None:
                self.size = size
        self.identity.check(self._url, size, etag, modified)


def size_mismatch(size: int, expected: int) -> str:
    """Why a shard larger than the manifest says is refused."""
    return (
        f"the shard is {size} bytes, more than the manifest's {expected}: "
        "the shard changed or the URL is wrong"
    )


def describe(exc: BaseException) -> str:
    """`Type: text` of a failure, for a `ShardReadError`'s reason."""
    # Exception texts here never hold the URL: http.client reports statuses and
    # socket errors only, so the redacted URL in ShardReadError is the only copy.
    text = str(exc)
    if isinstance(exc, RetryableStatus):
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
