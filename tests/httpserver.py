"""A localhost HTTP file server with fault injection, for tests of remote shard reading.

    server = LocalHTTPServer(tmp_path)
    server.fail(path="/a.tar", count=2, status=503)
    with server as base_url:
        ...  # GET f"{base_url}/a.tar" gets 503 twice, then the file

It serves files under one directory with `Range`, `ETag` and `Content-Length`
support, binds 127.0.0.1 on an ephemeral port, and records every request.
"""

from __future__ import annotations

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
    `status` with `Location: location`).
    """

    kind: str
    times: int
    status: int = 503
    after_bytes: int | None = None
    reset: bool = False
    location: str = ""


@dataclass(frozen=True)
class Request:
    """What the server saw: path (query stripped), Range header, status sent (0: none)."""

    path: str
    range: str | None
    status: int


class LocalHTTPServer:
    """A threaded HTTP server over `root`; a context manager returning its base URL."""

    def __init__(self, root: str | os.PathLike[str], *, ranges: bool = True) -> None:
        self.root = Path(root).resolve()
        self.ranges = ranges  # False: ignore Range headers, as some servers do
        self.requests: list[Request] = []
        self.bytes_sent: dict[str, int] = {}
        self._faults: dict[str, list[Fault]] = {}
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._serving = ServerThread(_Handler, self, "server")

    # Fault injection -----------------------------------------------------
    def fail(self, path: str, count: int, status: int = 503) -> None:
        """Answer the first `count` requests for `path` with `status`."""
        self._add(path, Fault("status", count, status=status))

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
                if fault.times > 0:
                    fault.times -= 1
                    return fault
        return None

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _count_sent(self, path: str, count: int) -> None:
        with self._lock:
            self.bytes_sent[path] = self.bytes_sent.get(path, 0) + count


class _Handler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        path = unquote(urlsplit(self.path).path)
        fault = self.owner._take_fault(path)
        if fault is not None and fault.kind == "stall" and fault.after_bytes is None:
            self._record(path, 0)  # recorded on arrival: the test may look before release
            self.owner._release.wait(STALL_LIMIT_S)
            self.close_connection = True
            return
        if fault is not None and fault.kind in ("status", "redirect"):
            self._send_empty(path, fault.status, fault.location)
            return
        file_path = (self.owner.root / path.lstrip("/")).resolve()
        if not file_path.is_file() or not file_path.is_relative_to(self.owner.root):
            self._send_empty(path, 404)
            return
        self._send_file(path, file_path, fault)

    def _record(self, path: str, status: int) -> None:
        self.owner._record(Request(path, self.headers.get("Range"), status))

    def _send_empty(self, path: str, status: int, location: str = "") -> None:
        self._record(path, status)
        self.send_response(status)
        if location:
            self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _send_file(self, path: str, file_path: Path, fault: Fault | None) -> None:
        data = file_path.read_bytes()
        stat = file_path.stat()
        start, end, status = 0, len(data), 200
        match = _RANGE.match(self.headers.get("Range") or "")
        if match and self.owner.ranges:
            start = int(match.group(1))
            end = min(len(data), int(match.group(2)) + 1) if match.group(2) else len(data)
            status = 206
        self._record(path, status)
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("ETag", f'"{stat.st_size}-{stat.st_mtime_ns}"')
        self.send_header("Accept-Ranges", "bytes" if self.owner.ranges else "none")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
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
