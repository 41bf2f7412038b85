"""A localhost HTTP file server with fault injection, for tests of remote shard reading.

    server = LocalHTTPServer(tmp_path)
    server.fail(path="/a.tar", count=2, status=503)
    with server as base_url:
        ...  # GET f"{base_url}/a.tar" gets 503 twice, then the file

It serves files under one directory with `Range`, `ETag`, `Last-Modified`,
`If-Match`/`If-Unmodified-Since` and `Content-Length` support, binds 127.0.0.1 on
an ephemeral port, and records every request. `change` rewrites a file between
requests, as a store whose object is replaced while it is read.
"""

from __future__ import annotations

import email.utils
import os
import re
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from tests.servers import QuietHandler, ServerThread

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
STALL_LIMIT_S = 30.0  # a stalled handler gives up after this, or when the server stops


@dataclass
class Fault:
    """One injected fault for the first `times` requests of a path.

    kind: "status" (answer `status`), "close" (send `after_bytes` of the body,
    then close; `reset=True` sends a TCP RST), "stall" (send `after_bytes` of the
    body and hang until `release()`, then send the rest; with `after_bytes=None`,
    hang before the headers and close without answering), or "redirect" (answer
    `status` with `Location: location`), "drip" (send the headers, then one
    `chunk` bytes of the body (of the requested range) every `interval` seconds;
    with `headers=True`, drip the status line and a long header too), "endless" (200 with no
    Content-Length, then the file's bytes over and over until the client goes
    away), or "length" (the file's body under `Content-Length: length`, a lie).
    A "status" fault with `retry_after` sends `Retry-After` too. The first `after`
    requests of the path pass untouched before the fault's `times` begin.
    """

    kind: str
    times: int
    status: int = 503
    after_bytes: int | None = None
    reset: bool = False
    location: str = ""
    interval: float = 0.0
    length: int = 0
    retry_after: float | None = None
    headers: bool = False
    after: int = 0
    chunk: int = 1


@dataclass(frozen=True)
class Request:
    """What the server saw: path (query stripped), Range header, status sent (0: none)."""

    path: str
    range: str | None
    status: int


class LocalHTTPServer:
    """A threaded HTTP server over `root`; a context manager returning its base URL."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        ranges: bool = True,
        etags: bool = True,
        conditions: bool = True,
    ) -> None:
        self.root = Path(root).resolve()
        self.ranges = ranges  # False: ignore Range headers, as some servers do
        self.etags = etags  # False: send Last-Modified only
        self.conditions = conditions  # False: ignore If-Match / If-Unmodified-Since
        self._changes: dict[str, list] = {}  # path -> [requests left before, versions]
        self.requests: list[Request] = []
        self.bytes_sent: dict[str, int] = {}
        self._faults: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._serving = ServerThread(_Handler, self, "server")

    # Fault injection -----------------------------------------------------
    def fail(
        self, path: str, count: int, status: int = 503, retry_after: float | None = None
    ) -> None:
        """Answer the first `count` requests for `path` with `status` (and `Retry-After`)."""
        self._add(path, Fault("status", count, status=status, retry_after=retry_after))

    def drip(
        self,
        path: str,
        interval: float,
        times: int = 1,
        headers: bool = False,
        *,
        after: int = 0,
        chunk: int = 1,
    ) -> None:
        """Send the body (and the headers too, if `headers`) `chunk` bytes every `interval` s,
        after `after` untouched requests; a `Range` is honoured (206 of that range).

        No single read stalls; the whole crawls.
        """
        fault = Fault("drip", times, interval=interval, headers=headers, after=after, chunk=chunk)
        self._add(path, fault)

    def change(self, path: str, versions: list[bytes], after: int = 1) -> None:
        """Rewrite the file at `path` with the next of `versions` before each request
        once `after` requests were served: the object changes under its reader (a new
        ETag and Last-Modified each time)."""
        self._changes[path] = [after, list(versions)]

    def endless(self, path: str, times: int = 1) -> None:
        """Answer 200 without Content-Length and repeat the file's bytes forever."""
        self._add(path, Fault("endless", times))

    def lie_length(self, path: str, length: int, times: int = 1) -> None:
        """Send the file under `Content-Length: length`, whatever its real size."""
        self._add(path, Fault("length", times, length=length))

    def close_after(self, path: str, after_bytes: int, times: int = 1, reset: bool = False) -> None:
        """Cut the connection after `after_bytes` of the body, `times` times."""
        self._add(path, Fault("close", times, after_bytes=after_bytes, reset=reset))

    def stall(self, path: str, after_bytes: int | None = None, times: int = 1) -> None:
        """Hang after `after_bytes` of the body (before the headers if None) until released."""
        self._add(path, Fault("stall", times, after_bytes=after_bytes))

    def redirect(self, path: str, location: str, status: int = 302, times: int = 1) -> None:
        """Redirect the first `times` requests for `path` to `location`."""
        self._add(path, Fault("redirect", times, status=status, location=location))

    def release(self) -> None:
        """Let every stalled request go on."""
        self._release.set()

    def count(self, path: str) -> int:
        """Number of requests received for `path`."""
        with self._lock:
            return sum(1 for request in self.requests if request.path == path)

    # Lifecycle -----------------------------------------------------------
    @property
    def url(self) -> str:
        return self._serving.url

    def __enter__(self) -> str:
        self._serving.start()
        return self.url

    def __exit__(self, *exc_info: object) -> None:
        self._release.set()  # stalled handlers finish, so that the server can stop
        self._serving.stop()

    # Used by the handler -------------------------------------------------
    def _add(self, path: str, fault: Fault) -> None:
        with self._lock:
            self._faults.setdefault(path, []).append(fault)

    def _take_fault(self, path: str) -> Fault | None:
        with self._lock:
            for fault in self._faults.get(path, []):
                if fault.after > 0:
                    fault.after -= 1
                    return None
                if fault.times > 0:
                    fault.times -= 1
                    return fault
        return None

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _apply_change(self, path: str) -> None:
        """Write the next version of `path` if its change is due (before serving it)."""
        with self._lock:
            change = self._changes.get(path)
            if change is None:
                return
            if change[0] > 0:
                change[0] -= 1
                return
            if not change[1]:
                return
            data = change[1].pop(0)
            target = self.root / path.lstrip("/")
            previous = target.stat().st_mtime_ns
            target.write_bytes(data)
            # A new Last-Modified (whole seconds) and ETag, however fast the rewrite.
            stamp = max(previous, target.stat().st_mtime_ns) + 2_000_000_000
            os.utime(target, ns=(stamp, stamp))

    def _count_sent(self, path: str, count: int) -> None:
        with self._lock:
            self.bytes_sent[path] = self.bytes_sent.get(path, 0) + count


class _Handler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        path = unquote(urlsplit(self.path).path)
        self.owner._apply_change(path)
        fault = self.owner._take_fault(path)
        if fault is not None and fault.kind == "stall" and fault.after_bytes is None:
            self._record(path, 0)  # recorded on arrival: the test may look before release
            self.owner._release.wait(STALL_LIMIT_S)
            self.close_connection = True
            return
        if fault is not None and fault.kind in ("status", "redirect"):
            self._send_empty(path, fault.status, fault.location, fault.retry_after)
            return
        file_path = (self.owner.root / path.lstrip("/")).resolve()
        if not file_path.is_file() or not file_path.is_relative_to(self.owner.root):
            self._send_empty(path, 404)
            return
        if fault is not None and fault.kind == "drip" and fault.headers:
            self._record(path, 200)
            self.close_connection = True
            padding = b"X-Padding: " + b"a" * 60_000 + b"\r\n"  # under http.client's line cap
            self._drip(path, b"HTTP/1.1 200 OK\r\n" + padding, fault.interval)
            return
        if self._precondition_failed(file_path):
            self._send_empty(path, 412)
            return
        if fault is not None and fault.kind == "drip":
            data = file_path.read_bytes()
            start, end, status = self._span(len(data))
            self._record(path, status)
            self._send_head(file_path, status, start, end, len(data))
            self.close_connection = True
            self._drip(path, data[start:end], fault.interval, fault.chunk)
            return
        if fault is not None and fault.kind in ("endless", "length"):
            self._send_hostile(path, file_path.read_bytes(), fault)
            return
        self._send_file(path, file_path, fault)

    def _validators(self, file_path: Path) -> dict[str, str]:
        stat = file_path.stat()
        found = {"Last-Modified": email.utils.formatdate(stat.st_mtime, usegmt=True)}
        if self.owner.etags:
            found["ETag"] = f'"{stat.st_size}-{stat.st_mtime_ns}"'
        return found

    def _precondition_failed(self, file_path: Path) -> bool:
        if not self.owner.conditions:
            return False
        validators = self._validators(file_path)
        match = self.headers.get("If-Match")
        if match is not None and match.strip() != validators.get("ETag"):
            return True
        since = self.headers.get("If-Unmodified-Since")
        return since is not None and since.strip() != validators["Last-Modified"]

    def _span(self, size: int) -> tuple[int, int, int]:
        """(start, end, status) of the requested range of a `size`-byte body."""
        match = _RANGE.match(self.headers.get("Range") or "")
        if not (match and self.owner.ranges):
            return 0, size, 200
        end = min(size, int(match.group(2)) + 1) if match.group(2) else size
        return int(match.group(1)), end, 206

    def _send_head(self, file_path: Path, status: int, start: int, end: int, size: int) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        for name, value in self._validators(file_path).items():
            self.send_header(name, value)
        self.send_header("Accept-Ranges", "bytes" if self.owner.ranges else "none")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()

    def _record(self, path: str, status: int) -> None:
        self.owner._record(Request(path, self.headers.get("Range"), status))

    def _send_empty(
        self, path: str, status: int, location: str = "", retry_after: float | None = None
    ) -> None:
        self._record(path, status)
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        if retry_after is not None:
            self.send_header("Retry-After", f"{retry_after:g}")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send_file(self, path: str, file_path: Path, fault: Fault | None) -> None:
        data = file_path.read_bytes()
        start, end, status = self._span(len(data))
        self._record(path, status)
        self._send_head(file_path, status, start, end, len(data))
        body = data[start:end]
        if fault is None or fault.kind not in ("close", "stall"):
            self._write(path, body)
            return
        self._write(path, body[: fault.after_bytes])
        if fault.kind == "stall":
            self.owner._release.wait(STALL_LIMIT_S)
            self._write(path, body[fault.after_bytes :])
            return
        if fault.reset:
            # SO_LINGER 0: close() sends RST, so the client sees ECONNRESET.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True

    def _write(self, path: str, body: bytes) -> None:
        # Counted before sending, so a client that holds the bytes sees the count.
        self.owner._count_sent(path, len(body))
        self._send_bytes(body)

    def _send_hostile(self, path: str, data: bytes, fault: Fault) -> None:
        """An endless body or a lying Content-Length; ends when the client leaves."""
        self._record(path, 200)
        self.send_response(200)
        if fault.kind == "length":
            self.send_header("Content-Length", str(fault.length))
        self.end_headers()
        self.close_connection = True
        if fault.kind == "length":
            self._write(path, data)
        else:
            while data and not self.owner._release.is_set():
                if not self._write_or_stop(path, data):
                    return

    def _drip(self, path: str, data: bytes, interval: float, chunk: int = 1) -> None:
        # `_release` is set when the server stops, so no handler outlives it.
        for position in range(0, len(data), chunk):
            if self.owner._release.wait(interval):
                return
            if not self._write_or_stop(path, data[position : position + chunk]):
                return

    def _write_or_stop(self, path: str, chunk: bytes) -> bool:
        """Write `chunk`; False once the client has gone away."""
        self.owner._count_sent(path, len(chunk))
        try:
            self.wfile.write(chunk)
            self.wfile.flush()
        except OSError:
            return False
        return True
