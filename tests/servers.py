"""The lifecycle the tests' localhost HTTP servers share: a thread, an ephemeral port, shutdown.

Used by `tests.httpserver.LocalHTTPServer` and `tests.objectstore.FaultProxy`.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class ServerThread:
    """A `ThreadingHTTPServer` on 127.0.0.1 and an ephemeral port, serving in a daemon thread.

    Its handlers reach `owner` as `self.server.owner`. `start()` and `stop()` go
    in the owner's `__enter__` and `__exit__`.
    """

    def __init__(self, handler: type[BaseHTTPRequestHandler], owner: object, name: str) -> None:
        self._handler, self._owner, self._name = handler, owner, name
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """`http://127.0.0.1:<port>` while running."""
        if self._server is None:
            raise RuntimeError(f"the {self._name} is not running; use it in a with-block")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler)
        self._server.daemon_threads = True
        self._server.owner = self._owner  # type: ignore[attr-defined]
        # A short poll interval: shutdown() waits up to one interval.
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop serving, close the socket and wait for the thread."""
        assert self._server is not None and self._thread is not None, "stop() before start()"
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._server = self._thread = None


class QuietHandler(BaseHTTPRequestHandler):
    """A keep-alive capable handler that logs nothing and reaches its `ServerThread`'s owner."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - base signature
        pass  # keep test output clean

    @property
    def owner(self) -> Any:
        return self.server.owner  # type: ignore[attr-defined]

    def _send_bytes(self, payload: bytes) -> None:
        try:
            self.wfile.write(payload)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up, as clients under test do
