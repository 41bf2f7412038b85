"""The benchmarks' slow store (tests/slowproxy.py) keeps its contract: every request on
a keep-alive connection waits its delay before the first byte, each connection is paced at
its rate, and request boundaries are read right (Content-Length and chunked bodies)."""

from __future__ import annotations

import http.client
import os
import time
from urllib.parse import urlsplit

from tests.httpserver import LocalHTTPServer
from tests.slowproxy import BURST_BYTES, RequestFramer, SlowProxy

DELAY_S = 0.05


def connect(url: str) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)


def test_every_request_on_one_connection_waits_its_delay(tmp_path):
    (tmp_path / "a.bin").write_bytes(os.urandom(1000))
    server = LocalHTTPServer(tmp_path)
    with server as base, SlowProxy(base, delay_s=DELAY_S, bytes_per_s=0) as url:
        connection = connect(url)
        waits, bodies = [], []
        for request in range(3):
            headers = {"Range": "bytes=100-199"} if request == 1 else {}
            sent = time.monotonic()
            connection.request("GET", "/a.bin", headers=headers)
            response = connection.getresponse()  # returns once the status line is in
            waits.append(time.monotonic() - sent)
            bodies.append(response.read())
        connection.close()
    assert server.count("/a.bin") == 3
    assert [len(body) for body in bodies] == [1000, 100, 1000]
    assert min(waits) >= DELAY_S  # each request, not only the connection's first


def test_each_connection_is_paced_at_its_rate(tmp_path):
    size, rate = 1_000_000, 2_000_000  # half a second at the capped rate
    payload = os.urandom(size)
    (tmp_path / "big.bin").write_bytes(payload)
    with LocalHTTPServer(tmp_path) as base, SlowProxy(base, delay_s=0, bytes_per_s=rate) as url:
        proxy_started = time.monotonic()
        connection = connect(url)
        connection.request("GET", "/big.bin")
        body = connection.getresponse().read()
        elapsed = time.monotonic() - proxy_started
        connection.close()
    assert body == payload
    # A bucket lets its depth through at once, then the rate: a lower bound only.
    assert elapsed >= (size - BURST_BYTES) / rate


def test_framer_finds_each_request_in_a_stream():
    stream = (
        b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
        b"PUT /b HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello"
        b"POST /c HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n"
        b"HEAD /d HTTP/1.1\r\n\r\n"
    )
    framer = RequestFramer()
    pieces = []
    for position in range(0, len(stream), 7):  # in awkward slices, as TCP may deliver them
        pieces += framer.feed(stream[position : position + 7])
    starts = [piece.split(b" ")[0] for piece, starts_request in pieces if starts_request]
    assert starts == [b"GET", b"PUT", b"POST", b"HEAD"]
    assert b"".join(piece for piece, _ in pieces) == stream
    assert framer.state == "head" and framer.buffer == b""
