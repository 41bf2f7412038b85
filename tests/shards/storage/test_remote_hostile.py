"""Hostile servers against remote reads: objects that change while read, spans that drip.

A ranged fetch (`shards.storage.ranged.fetch_into`) reads one object over many
requests; whatever the server does between them, the file it writes is one version
of the object, whole, or the fetch fails with one error naming the URL. Against the
real localhost HTTP server (`tests.httpserver`) and the moto S3 server.
"""

from __future__ import annotations

import os
import time

import pytest

from shards.storage import RetryPolicy, ShardReadError, open_stream, ranged
from shards.storage.http import HttpRangeFile
from shards.storage.ranged import fetch_into
from tests.httpserver import LocalHTTPServer

SPAN = 4096
SIZE = 10 * SPAN + 123  # eleven spans
FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=5.0, deadline=20.0)


def version(tag: int, size: int = SIZE) -> bytes:
    """A body whose every byte says which version it is: a splice shows as two tags."""
    return bytes([tag]) * size


@pytest.fixture
def small_spans(monkeypatch):
    monkeypatch.setattr(ranged, "MIN_SPAN", SPAN)
    monkeypatch.setattr(ranged, "MAX_SPAN", SPAN)


def fetch(url: str, out, size: int = SIZE, connections: int = 4, **options) -> bytes:
    """What `fetch_into` wrote (only the bytes it says it wrote)."""
    os.ftruncate(out.fileno(), 0)
    got = fetch_into(url, out.fileno(), options.pop("retry", FAST), size=size,
                     connections=connections, **options)  # fmt: skip
    out.seek(0)
    return out.read()[:got] if got else b""


def assert_one_version(data: bytes, *candidates: bytes) -> None:
    tags = sorted(set(data))
    assert data in candidates, f"{len(data)} bytes holding versions {tags}: a splice"


# Objects that change between spans ------------------------------------------------------
CHANGES = [
    # (id, server options, versions written after the first request)
    ("etag, If-Match honoured", {}, [version(2)]),
    ("etag, If-Match ignored", {"conditions": False}, [version(2)]),
    ("last-modified only, honoured", {"etags": False}, [version(2)]),
    ("last-modified only, ignored", {"etags": False, "conditions": False}, [version(2)]),
    ("shorter new version, ignored", {"conditions": False}, [version(2, SIZE - SPAN)]),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("connections", [1, 4])
@pytest.mark.parametrize(
    ("options", "versions"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES]
)
def test_an_object_changed_after_the_first_span_is_never_spliced(
    tmp_path, small_spans, options, versions, connections
):
    (tmp_path / "obj.bin").write_bytes(version(1))
    server = LocalHTTPServer(tmp_path, **options)
    server.change("/obj.bin", versions, after=1)
    with server as base, open(tmp_path / "out", "w+b") as out:
        data = fetch(f"{base}/obj.bin", out, connections=connections)
    # Restarted once from the new version: all of it, nothing of the first.
    assert_one_version(data, versions[-1])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("options", [{}, {"conditions": False}, {"etags": False}])
def test_an_object_that_keeps_changing_fails_as_one_error_naming_the_url(
    tmp_path, small_spans, options
):
    (tmp_path / "obj.bin").write_bytes(version(1))
    server = LocalHTTPServer(tmp_path, **options)
    server.change("/obj.bin", [version(tag) for tag in range(2, 60)], after=1)
    with server as base, open(tmp_path / "out", "w+b") as out:
        url = base.replace("http://", "http://user:hunter2@") + "/obj.bin?token=sekrit"
        with pytest.raises(ShardReadError) as info:
            fetch(url, out)
    text = str(info.value)
    assert "the object changed while it was read" in text
    assert f"{base.replace('http://', 'http://***@')}/obj.bin?token=REDACTED" in text
    assert "hunter2" not in text and "sekrit" not in text


@pytest.mark.timeout(30)
def test_random_access_reads_one_version_across_its_requests(tmp_path):
    (tmp_path / "obj.bin").write_bytes(version(1))
    server = LocalHTTPServer(tmp_path, conditions=False)
    server.change("/obj.bin", [version(2)], after=1)
    with server as base, HttpRangeFile(f"{base}/obj.bin", FAST) as file:
        assert file.read(100) == version(1, 100)
        file.seek(SIZE - 100)  # a new request: the object changed since the first
        with pytest.raises(ShardReadError, match="the object changed while it was read"):
            file.read(100)


@pytest.mark.timeout(30)
def test_a_stream_resumed_on_a_changed_object_fails_naming_the_url(tmp_path):
    (tmp_path / "obj.bin").write_bytes(version(1))
    server = LocalHTTPServer(tmp_path, conditions=False)
    server.close_after("/obj.bin", 1000)
    server.change("/obj.bin", [version(2)], after=1)
    changed = "the object changed while it was read"
    with (
        server as base,
        open_stream(f"{base}/obj.bin", FAST) as stream,
        pytest.raises(ShardReadError, match=changed) as info,
    ):
        stream.read()
    assert "/obj.bin" in str(info.value)


@pytest.fixture
def moto_object(monkeypatch, tmp_path):
    """`s3://hostile/obj.bin` (version 1) in a moto server, its client and storage options."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.objectstore import MotoS3, isolate_aws_environment

    isolate_aws_environment(monkeypatch, tmp_path)
    with MotoS3() as s3:
        s3.create_bucket("hostile")
        client = s3.client()
        client.put_object(Bucket="hostile", Key="obj.bin", Body=version(1))
        yield "s3://hostile/obj.bin", client, s3.storage_options()


class Overwriter:
    """A fetch's progress callback that overwrites the object after its first span lands."""

    def __init__(self, client, versions: list[bytes]) -> None:
        self.client, self.versions, self.landed = client, list(versions), 0

    def __call__(self, count: int) -> None:
        self.landed += count
        if self.landed >= SPAN and self.versions:
            self.client.put_object(Bucket="hostile", Key="obj.bin", Body=self.versions.pop(0))
            self.landed = 0


@pytest.mark.timeout(60)
def test_an_object_store_object_changed_between_spans_is_never_spliced(
    moto_object, small_spans, tmp_path
):
    url, client, options = moto_object
    with open(tmp_path / "out", "w+b") as out:
        data = fetch(url, out, connections=1, storage_options=options,
                     progress=Overwriter(client, [version(2)]))  # fmt: skip
        assert_one_version(data, version(2))
        keeps_changing = Overwriter(client, [version(tag) for tag in range(3, 60)])
        with pytest.raises(ShardReadError, match="the object changed while it was read"):
            fetch(url, out, connections=1, storage_options=options, progress=keeps_changing)


# One deadline for the whole fetch ---------------------------------------------------------


@pytest.mark.timeout(30)
def test_a_fetch_whose_late_spans_drip_ends_at_its_deadline(tmp_path, small_spans):
    """Each late span takes 2.2 s, under the 2.5 s deadline alone: together they pass it."""
    (tmp_path / "obj.bin").write_bytes(version(1))
    server = LocalHTTPServer(tmp_path)
    server.drip("/obj.bin", interval=2.2 / 16, times=1000, after=1, chunk=SPAN // 16)
    policy = RetryPolicy(attempts=1, timeout=1.0, deadline=2.5)
    with server as base, open(tmp_path / "out", "w+b") as out:
        started = time.monotonic()
        with pytest.raises(ShardReadError) as info:
            fetch(f"{base}/obj.bin", out, retry=policy)
        took = time.monotonic() - started
    assert took < 2.5 + 1.0, f"the fetch ran {took:.1f} s against a 2.5 s deadline"
    assert "/obj.bin" in str(info.value) and "2.5 s" in str(info.value)
