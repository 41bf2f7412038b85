"""http(s) reads: a streaming body that resumes after a dropped connection, or a seekable file.

`http.client` only, one connection per request (`Connection: close`); no process is
spawned and no proxy or environment variable is consulted. A cut body resumes with a
`Range` request (or is re-read and skipped ahead on a server without ranges), every
socket wait is bounded by the `RetryPolicy`'s stall limit and the stream's deadline,
redirects stay on http(s) and never downgrade from https, and URL credentials
(Basic auth) go to their own origin only.
"""

from __future__ import annotations

import base64
import http.client
import io
import re
import ssl
from typing import Any, BinaryIO
from urllib.parse import unquote, urljoin, urlsplit

from shards.redact import redact_url
from shards.storage.retry import (
    DEFAULT_RETRY,
    RETRY_STATUSES,
    TRANSIENT_ERRORS,
    ObjectChangedError,
    ObjectIdentity,
    ObjectNotFoundError,
    RetryableStatus,
    RetryingReader,
    RetryPolicy,
    ShardReadError,
    StreamClock,
    describe,
)
from shards.storage.urls import url_scheme, validate_url

SCHEMES = ("http", "https")  # what this transport serves, and where a redirect may lead

HTTP_BUFFER_SIZE = 1 << 20
MAX_REDIRECTS = 5
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")


def open_http(
    url: str,
    retry: RetryPolicy = DEFAULT_RETRY,
    *,
    random_access: bool = False,
    expected_size: int | None = None,
) -> BinaryIO:
    """A buffered http(s) body: a `RetryingStream`, or an `HttpRangeFile` for `random_access`."""
    if random_access:
        raw: io.RawIOBase = HttpRangeFile(url, retry, expected_size=expected_size)
    else:
        raw = RetryingStream(url, retry, expected_size=expected_size)
    return io.BufferedReader(raw, HTTP_BUFFER_SIZE)  # type: ignore[return-value]


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


class RetryingStream(RetryingReader):
    """An http(s) body that survives dropped connections by resuming where it stopped.

    After a mid-body failure it re-requests with `Range: bytes=<offset>-`; a
    server that ignores ranges is re-read from the start and the first `offset`
    bytes are skipped. Every response must show the version `identity` pinned
    (size, and ETag, else Last-Modified; shared with the other requests of a
    ranged fetch or a random-access file), and every request after the first
    sends it as `If-Match` (a strong ETag) or `If-Unmodified-Since`: a changed
    object stops it with `ObjectChangedError` rather than splice two versions of
    a shard. Every socket wait is at most `min(retry.timeout, time left to the
    deadline)`.

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
        end: int | None = None,
        identity: ObjectIdentity | None = None,
    ) -> None:
        self._end = end  # a ranged fetch's stop: requests ask for no byte at or past it
        super().__init__(
            url, retry, offset, expected_size=expected_size, clock=clock, identity=identity
        )
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
        reason = f"failed at byte {self._pos}: {describe(exc)} ({self.resumes} resumes)"
        self._fail(exc, reason, give_up=self.resumes >= self.retry.max_resumes)

    def _connect(self) -> None:
        """Request the body from `self._pos`, retrying transient failures."""
        while True:
            if self.clock.remaining() <= 0:
                raise self.clock.error(self._url, self._pos, self._failures)
            try:
                conditions = self.identity.conditions()
                response = _request(self._url, self._pos, self.clock, self._end, conditions)
                self._source = self._position(response)
                return
            except ShardReadError:
                raise
            except ssl.SSLCertVerificationError as exc:
                raise ShardReadError(self._url, describe(exc), self._failures + 1) from exc
            except (*TRANSIENT_ERRORS, RetryableStatus) as exc:
                retry_after = getattr(exc, "retry_after", 0.0)
                self._fail(exc, describe(exc), retry_after=retry_after)

    def _position(self, response: http.client.HTTPResponse) -> http.client.HTTPResponse:
        """Check that `response` is the same object, and skip to `self._pos`."""
        start, size = _body_span(response)
        try:
            self._check_object(
                size, response.getheader("ETag"), response.getheader("Last-Modified")
            )
        except ShardReadError:
            response.close()
            raise
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
    All of them share one `StreamClock` (the deadline covers the whole file) and
    one `ObjectIdentity` (every byte comes from the version the first request saw).
    Needs a server that honours ranges, which object stores and CDNs do.
    """

    def __init__(
        self, url: str, retry: RetryPolicy = DEFAULT_RETRY, *, expected_size: int | None = None
    ) -> None:
        super().__init__()
        self._url, self.url, self.retry = url, redact_url(url), retry
        self.clock = StreamClock(retry)
        self.identity = ObjectIdentity()
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
            self._url,
            self.retry,
            offset,
            expected_size=self.expected_size,
            clock=self.clock,
            identity=self.identity,
        )


def _request(
    url: str,
    offset: int,
    clock: StreamClock,
    end: int | None = None,
    conditions: dict[str, str] | None = None,
) -> http.client.HTTPResponse:
    """GET `url` from byte `offset` (up to `end` when given) under the `conditions`
    headers, following up to MAX_REDIRECTS http(s) redirects."""
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        response = _get(
            current,
            offset,
            clock,
            send_auth=_same_origin(current, url),
            end=end,
            conditions=conditions,
        )
        if response.status not in (301, 302, 303, 307, 308):
            _check_status(url, response, bool(offset) or end is not None, bool(conditions))
            return response
        location = response.getheader("Location") or ""
        response.close()
        current = _redirect_target(url, current, location)
    raise ShardReadError(url, f"more than {MAX_REDIRECTS} redirects")


def _get(
    url: str,
    offset: int,
    clock: StreamClock,
    *,
    send_auth: bool,
    end: int | None = None,
    conditions: dict[str, str] | None = None,
) -> http.client.HTTPResponse:
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
    headers = {"Connection": "close", "User-Agent": "shardpipe", **(conditions or {})}
    if offset or end is not None:
        headers["Range"] = f"bytes={offset}-" + ("" if end is None else str(end - 1))
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


def _check_status(
    url: str, response: http.client.HTTPResponse, ranged: bool, conditional: bool = False
) -> None:
    status = response.status
    if status == 200 or (status == 206 and ranged):
        return
    reason = response.reason
    retry_after = _retry_after(response)
    response.close()
    if status == 412 and conditional:
        raise ObjectChangedError(url, f"HTTP 412 {reason} to the first response's validators")
    if status in RETRY_STATUSES:
        raise RetryableStatus(status, reason, retry_after)
    hint = {
        401: "check the credentials",
        403: "check the credentials or the URL signature's expiry",
        404: "check the URL and that the shard was uploaded",
    }.get(status, "not retried")
    error = ObjectNotFoundError if status in (404, 410) else ShardReadError
    raise error(url, f"HTTP {status} {reason}; {hint}")


def _redirect_target(url: str, current: str, location: str) -> str:
    target = urljoin(current, location)
    try:
        validate_url(target, schemes=SCHEMES)
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
