"""A slow store: a TCP proxy that adds a delay to the first byte of every HTTP request's
answer and caps each connection's bandwidth (the remote-read benchmark's store; tested in
tests/test_slowproxy.py, run alone by benchmarks/slowproxy.py).

    with SlowProxy("http://127.0.0.1:8000", delay_s=0.05, bytes_per_s=20e6) as url:
        ...  # talk to `url` as to the server, slowed

Object stores answer their first byte tens of milliseconds after a request and cap what one
connection carries; a localhost server does neither, so a loader that only works well on
localhost would look fine. The delay is per request, not per connection: the proxy reads
HTTP/1.1 request boundaries (headers, then a `Content-Length` or chunked body) from each
client connection and holds each request `delay_s` from its arrival before passing it on, so
a keep-alive connection pays the delay on every request, as it does against a real store.
Each direction of each connection goes through its own token bucket of `bytes_per_s`.
Clients that pipeline requests get each delayed from its own arrival.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from urllib.parse import urlsplit

CHUNK_BYTES = 64 * 1024
BURST_BYTES = 64 * 1024  # a bucket's depth: what may go out at once before the rate applies
MAX_HEADER_BYTES = 64 * 1024


class TokenBucket:
    """Paces one stream at `rate` bytes/s, allowing `burst` bytes ahead of the rate."""

    def __init__(self, rate: float, burst: int = BURST_BYTES) -> None:
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self, count: int) -> None:
        """Wait until `count` bytes may be sent (the debt of a large chunk is slept off)."""
        if self.rate <= 0:
            return
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= count
        if self.tokens < 0:
            time.sleep(-self.tokens / self.rate)


class RequestFramer:
    """Splits a client's byte stream into HTTP/1.1 requests.

    `feed(data)` returns pieces `(bytes, starts_request)`: the bytes to forward, and
    whether they begin a new request (whose delay is due before they go). A request ends
    after its headers plus a `Content-Length` body or a chunked body with its trailers.
    """

    def __init__(self) -> None:
        self.buffer = b""
        self.state = "head"  # head | body | chunk-size | chunk-data | trailer
        self.remaining = 0

    def feed(self, data: bytes) -> list[tuple[bytes, bool]]:
        self.buffer += data
        pieces: list[tuple[bytes, bool]] = []
        while self.buffer:
            piece = self._next_piece()
            if piece is None:
                break
            pieces.append(piece)
        return pieces

    def _next_piece(self) -> tuple[bytes, bool] | None:
        if self.state == "head":
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(self.buffer) > MAX_HEADER_BYTES:
                    raise ValueError("request headers over 64 KiB: not HTTP/1.1")
                return None
            head = self._take(end + 4)
            self._start_body(head)
            return head, True
        if self.state in ("body", "chunk-data"):
            data = self._take(min(self.remaining, len(self.buffer)))
            self.remaining -= len(data)
            if self.remaining == 0:
                self.state = "head" if self.state == "body" else "chunk-size"
            return data, False
        end = self.buffer.find(b"\r\n")
        if end < 0:
            return None
        line = self._take(end + 2)
        if self.state == "trailer":
            if line == b"\r\n":
                self.state = "head"
            return line, False
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            self.state = "trailer"
        else:
            self.state, self.remaining = "chunk-data", size + 2  # the data and its CRLF
        return line, False

    def _start_body(self, head: bytes) -> None:
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            self.state = "chunk-size"
            return
        self.remaining = int(headers.get(b"content-length", b"0") or b"0")
        self.state = "body" if self.remaining else "head"

    def _take(self, count: int) -> bytes:
        data, self.buffer = self.buffer[:count], self.buffer[count:]
        return data


class SlowProxy:
    """A TCP proxy on 127.0.0.1 in front of `upstream` (http://host:port), in threads.

    A context manager returning its base URL. `requests` and `bytes_to_client` count what
    passed, for checks that the slowing happened.
    """

    def __init__(
        self,
        upstream: str,
        *,
        delay_s: float = 0.05,
        bytes_per_s: float = 20e6,
        port: int = 0,
    ) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self.delay_s, self.bytes_per_s, self.port = delay_s, bytes_per_s, port
        self.requests = 0
        self.bytes_to_client = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        if self._listener is None:
            raise RuntimeError("the proxy is not running; use it in a with-block")
        host, port = self._listener.getsockname()[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> str:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        self._spawn(self._accept_loop, "slowproxy-accept")
        return self.url

    def __exit__(self, *exc_info: object) -> None:
        self._stopping.set()
        for thread in list(self._threads):
            thread.join(timeout=2)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _spawn(self, target, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for sock in (client, upstream):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(0.2)  # so that pumps notice the proxy stopping
            self._spawn(self._pump_requests, "slowproxy-up", client, upstream)
            self._spawn(self._pump_answers, "slowproxy-down", upstream, client)

    def _pump_requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """Client to server: each request held `delay_s` from its arrival, then paced."""
        framer, bucket = RequestFramer(), TokenBucket(self.bytes_per_s)
        try:
            while (data := self._recv(client)) is not None:
                arrived = time.monotonic()
                for piece, starts_request in framer.feed(data):
                    if starts_request:
                        with self._lock:
                            self.requests += 1
                        time.sleep(max(0.0, arrived + self.delay_s - time.monotonic()))
                    bucket.take(len(piece))
                    upstream.sendall(piece)
        except (OSError, ValueError):
            pass
        finally:
            _close_both(client, upstream)

    def _pump_answers(self, upstream: socket.socket, client: socket.socket) -> None:
        """Server to client, paced by the connection's bucket."""
        bucket = TokenBucket(self.bytes_per_s)
        try:
            while (data := self._recv(upstream)) is not None:
                bucket.take(len(data))
                client.sendall(data)
                with self._lock:
                    self.bytes_to_client += len(data)
        except OSError:
            pass
        finally:
            _close_both(client, upstream)

    def _recv(self, sock: socket.socket) -> bytes | None:
        """The next bytes from `sock`; None once it closed or the proxy stops."""
        while not self._stopping.is_set():
            try:
                data = sock.recv(CHUNK_BYTES)
            except TimeoutError:
                continue
            return data or None
        return None


def _close_both(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):  # the other pump may have closed it
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
