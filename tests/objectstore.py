"""A localhost S3-compatible object store (moto) and a fault-injecting proxy in front of it.

    with MotoS3() as s3, FaultProxy(s3.endpoint) as proxy:
        s3.create_bucket("data")
        s3.upload_dir(local_dir, "data", "shards")
        proxy.fail(r"\\.tar$", times=2, status=503)
        options = s3.storage_options(proxy.endpoint)  # read through the proxy

Both bind 127.0.0.1 on an ephemeral port and run in threads of the test process.
"""

from __future__ import annotations

import http.client
import logging
import os
import re
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.servers import QuietHandler, ServerThread

ACCESS_KEY = "testing"
SECRET_KEY = "testing"
STALL_LIMIT_S = 30.0  # a stalled request gives up after this, or when the proxy stops
# Connection-level headers are not forwarded: each hop sets its own.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-connection",
    }
)
ERROR_CODES = {500: "InternalError", 502: "BadGateway", 503: "ServiceUnavailable"}


def isolate_aws_environment(monkeypatch, scratch) -> None:
    """No real AWS profile, credentials or metadata service is consulted, and no client
    keeps a filesystem made for another test's endpoint: call from a fixture."""
    from shards.storage import objectstore

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(scratch / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(scratch / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # Filesystems are kept per process and options; an endpoint from the environment is
    # read only when one is made.
    monkeypatch.setattr(objectstore, "_FILESYSTEMS", {})


class MotoS3:
    """A moto S3 server in a thread on 127.0.0.1; a context manager returning itself."""

    def __init__(self, access_key: str = ACCESS_KEY, secret_key: str = SECRET_KEY) -> None:
        self.access_key = access_key
        self.secret_key = secret_key
        self._server = None

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the moto server is not running; use it in a with-block")
        host, port = self._server.get_host_and_port()
        return f"http://{host}:{port}"

    def __enter__(self) -> MotoS3:
        from moto.server import ThreadedMotoServer

        # werkzeug logs every request to stderr; the tests' own logs stay readable.
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def storage_options(self, endpoint: str | None = None, **extra) -> dict:
        """fsspec/s3fs options for this server, or for a proxy at `endpoint`."""
        options = {
            "endpoint_url": endpoint or self.endpoint,
            "key": self.access_key,
            "secret": self.secret_key,
        }
        options.update(extra)
        return options

    def client(self):
        """A boto3 S3 client talking straight to moto (no proxy)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
        )

    def create_bucket(self, bucket: str) -> None:
        self.client().create_bucket(Bucket=bucket)

    def upload_dir(self, directory: str | os.PathLike, bucket: str, prefix: str) -> list[str]:
        """Upload every file under `directory` to `s3://bucket/prefix/...`; returns the keys."""
        client = self.client()
        root = Path(directory)
        keys = []
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(root).as_posix()}"
            client.upload_file(str(path), bucket, key)
            keys.append(key)
        return keys

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key under `prefix`, sorted."""
        paginator = self.client().get_paginator("list_objects_v2")
        found = []
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            found += [item["Key"] for item in page.get("Contents", [])]
        return sorted(found)

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def delete(self, bucket: str, key: str) -> None:
        self.client().delete_object(Bucket=bucket, Key=key)


@dataclass
class ProxyFault:
    """One fault for requests whose method matches and whose path matches `pattern`.

    The first `after` matching requests pass untouched; the next `times` get the
    fault. kind: "status" (answer `status` with an S3 XML error), "cut" (send the
    headers and `after_bytes` of the body, then close; `reset=True` sends a TCP
    RST), or "stall" (send the headers and `after_bytes` of the body, or nothing
    when `after_bytes` is None, then hang until `release()`).
    """

    kind: str
    pattern: str
    times: int
    method: str = "GET"
    after: int = 0
    status: int = 503
    after_bytes: int | None = 0
    reset: bool = False
    matched: int = 0
    injected: int = 0


@dataclass(frozen=True)
class ProxyRequest:
    """What the proxy saw: method, path (query stripped), Range header, and the fault kind."""

    method: str
    path: str
    range: str | None
    fault: str | None


class FaultProxy:
    """A reverse proxy on 127.0.0.1 that forwards to `upstream` and injects faults."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.requests: list[ProxyRequest] = []
        self.faults: list[ProxyFault] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._serving = ServerThread(_ProxyHandler, self, "proxy")

    # Fault injection -----------------------------------------------------
    def fail(
        self, pattern: str, times: int, status: int = 503, method: str = "GET", after: int = 0
    ) -> ProxyFault:
        """Answer `times` matching requests with `status` (after letting `after` through)."""
        return self._add(ProxyFault("status", pattern, times, method, after, status=status))

    def cut(
        self,
        pattern: str,
        times: int,
        after_bytes: int = 0,
        method: str = "GET",
        after: int = 0,
        reset: bool = False,
    ) -> ProxyFault:
        """Close `times` matching responses after `after_bytes` of their body."""
        fault = ProxyFault("cut", pattern, times, method, after, after_bytes=after_bytes)
        fault.reset = reset
        return self._add(fault)

    def stall(
        self,
        pattern: str,
        times: int,
        after_bytes: int | None = None,
        method: str = "GET",
        after: int = 0,
    ) -> ProxyFault:
        """Hang `times` matching requests (before the headers if `after_bytes` is None)."""
        return self._add(
            ProxyFault("stall", pattern, times, method, after, after_bytes=after_bytes)
        )

    def release(self) -> None:
        """Let every stalled request go on."""
        self._release.set()

    def clear(self) -> None:
        """Remove every fault and forget the recorded requests."""
        with self._lock:
            self.faults.clear()
            self.requests.clear()

    def count(self, pattern: str, method: str = "GET") -> int:
        """Requests seen whose path matches `pattern`."""
        with self._lock:
            return sum(
                1 for r in self.requests if r.method == method and re.search(pattern, r.path)
            )

    # Lifecycle -----------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return self._serving.url

    def __enter__(self) -> FaultProxy:
        self._serving.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._release.set()  # stalled handlers finish, so that the proxy can stop
        self._serving.stop()

    # Used by the handler -------------------------------------------------
    def _add(self, fault: ProxyFault) -> ProxyFault:
        with self._lock:
            self.faults.append(fault)
        return fault

    def _take_fault(self, method: str, path: str, range_header: str | None) -> ProxyFault | None:
        with self._lock:
            chosen = None
            for fault in self.faults:
                if fault.method != method or not re.search(fault.pattern, path):
                    continue
                fault.matched += 1
                if chosen is None and fault.matched > fault.after and fault.injected < fault.times:
                    fault.injected += 1
                    chosen = fault
            kind = chosen.kind if chosen else None
            self.requests.append(ProxyRequest(method, path, range_header, kind))
            return chosen


class _ProxyHandler(QuietHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._proxy()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET  # noqa: N815

    def _proxy(self) -> None:
        path = urlsplit(self.path).path
        fault = self.owner._take_fault(self.command, path, self.headers.get("Range"))
        body = self._read_request_body()
        if fault is not None and fault.kind == "stall" and fault.after_bytes is None:
            self.owner._release.wait(STALL_LIMIT_S)
            self.close_connection = True
            return
        if fault is not None and fault.kind == "status":
            self._send_error(fault.status)
            return
        status, reason, headers, payload = self._forward(body)
        self.send_response(status, reason)
        for name, value in headers:
            if name.lower() not in HOP_HEADERS:
                self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if self.command == "HEAD":
            return
        if fault is None:
            self._send_bytes(payload)
            return
        self._send_bytes(payload[: fault.after_bytes])
        if fault.kind == "stall":
            self.owner._release.wait(STALL_LIMIT_S)
            self._send_bytes(payload[fault.after_bytes :])
        elif fault.reset:
            # SO_LINGER 0: close() sends RST, so the client sees ECONNRESET.
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def _read_request_body(self) -> bytes:
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            chunks = []
            while size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16):
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        host, port = self.owner.upstream
        connection = http.client.HTTPConnection(host, port, timeout=STALL_LIMIT_S)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        if body or self.command in ("PUT", "POST"):
            headers["Content-Length"] = str(len(body))
        try:
            connection.request(self.command, self.path, body=body, headers=headers)
            response = connection.getresponse()
            payload = response.read()
            return response.status, response.reason, response.getheaders(), payload
        finally:
            connection.close()

    def _send_error(self, status: int) -> None:
        code = ERROR_CODES.get(status, str(status))
        payload = (
            '<?xml version="1.0" encoding="UTF-8"?>'
            f"<Error><Code>{code}</Code><Message>injected by the test proxy</Message></Error>"
        ).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if self.command != "HEAD":
            self._send_bytes(payload)
