"""Tests for shards.storage's readers against a real localhost HTTP server (C6, D1, D4)."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import traceback

import pytest

from shards.storage import RetryingStream, RetryPolicy, ShardReadError, open_stream, validate_url
from shards.storage.patterns import expand_urls
from tests.httpserver import LocalHTTPServer
from tests.shards.storage.test_urls import HOSTILE_URLS

FAST = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01, timeout=2.0)
SIZE = 300_000  # several socket buffers, so cuts land mid-body


@pytest.fixture
def data():
    return random.Random(1234).randbytes(SIZE)


@pytest.fixture
def server(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    (tmp_path / "b.tar").write_bytes(data[::-1])
    return LocalHTTPServer(tmp_path)


def read_all(url: str, retry: RetryPolicy = FAST) -> bytes:
    with open_stream(url, retry) as stream:
        return stream.read()


def test_local_path_and_file_url(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    assert read_all(str(tmp_path / "a.tar")) == data
    assert read_all(f"file://{tmp_path}/a.tar") == data


def test_env_var_in_name_is_literal(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "${HOME}").mkdir()
    (tmp_path / "${HOME}" / "$USER.tar").write_bytes(b"literal")
    [url] = expand_urls("${HOME}/$USER.tar")
    assert read_all(url) == b"literal"


def test_missing_local_file(tmp_path):
    with pytest.raises(ShardReadError, match="FileNotFoundError") as info:
        open_stream(str(tmp_path / "missing.tar"))
    assert info.value.url == str(tmp_path / "missing.tar")


def test_http_read_equals_file(server, data):
    with server as base:
        assert read_all(f"{base}/a.tar") == data
        assert read_all(f"{base}/b.tar") == data[::-1]
    assert server.count("/a.tar") == 1


def test_http_streams_without_downloading_first(server, data):
    # The server sends 64 KB then waits: open_stream must hand out bytes already.
    server.stall("/a.tar", after_bytes=65_536)
    with server as base, open_stream(f"{base}/a.tar", FAST) as stream:
        assert stream.read(1000) == data[:1000]
        assert server.bytes_sent["/a.tar"] == 65_536
        server.release()
        assert stream.read() == data[1000:]


def test_503_then_success_is_retried(server, data):
    server.fail("/a.tar", count=2, status=503)
    with server as base, open_stream(f"{base}/a.tar", FAST) as stream:
        assert stream.read() == data
        assert stream.raw.retries == 2
    assert server.count("/a.tar") == 3


@pytest.mark.parametrize("status", [429, 500, 502, 504])
def test_other_transient_statuses_are_retried(server, data, status):
    server.fail("/a.tar", count=1, status=status)
    with server as base:
        assert read_all(f"{base}/a.tar") == data
    assert server.count("/a.tar") == 2


def test_permanent_503_gives_up_after_attempts(server):
    server.fail("/a.tar", count=100, status=503)
    with server as base, pytest.raises(ShardReadError) as info:
        open_stream(f"{base}/a.tar", FAST)
    assert server.count("/a.tar") == FAST.attempts
    assert info.value.attempts == FAST.attempts
    assert info.value.url == f"{base}/a.tar"
    assert "503" in str(info.value) and f"{base}/a.tar" in str(info.value)
    assert info.value.__cause__ is not None


@pytest.mark.parametrize(("status", "hint"), [(404, "check the URL"), (403, "credentials")])
def test_client_errors_are_not_retried(server, status, hint):
    server.fail("/a.tar", count=100, status=status)
    with server as base, pytest.raises(ShardReadError, match=hint) as info:
        open_stream(f"{base}/a.tar", FAST)
    assert server.count("/a.tar") == 1
    assert str(status) in str(info.value)


def test_missing_file_is_404(server):
    with server as base, pytest.raises(ShardReadError, match="HTTP 404"):
        open_stream(f"{base}/nope.tar", FAST)
    assert server.count("/nope.tar") == 1


def test_connection_refused_is_retried_then_fails(server):
    with server as base:
        pass  # the port is now closed
    with pytest.raises(ShardReadError, match="ConnectionRefusedError") as info:
        open_stream(f"{base}/a.tar", FAST)
    assert info.value.attempts == FAST.attempts


@pytest.mark.parametrize("reset", [False, True])
def test_cut_connection_resumes_with_range(server, data, reset):
    server.close_after("/a.tar", after_bytes=100_000, times=2, reset=reset)
    with server as base, open_stream(f"{base}/a.tar", FAST) as stream:
        assert stream.read() == data
        assert stream.raw.resumes == 2
    ranges = [request.range for request in server.requests]
    assert ranges[0] is None
    assert all(r is not None and r.startswith("bytes=") for r in ranges[1:])
    assert [request.status for request in server.requests] == [200, 206, 206]
    if not reset:  # an orderly close delivers every byte sent, so the offsets are exact
        assert ranges == [None, "bytes=100000-", "bytes=200000-"]


def test_resume_without_range_support_skips_ahead(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    server = LocalHTTPServer(tmp_path, ranges=False)
    server.close_after("/a.tar", after_bytes=120_000, times=1)
    with server as base, open_stream(f"{base}/a.tar", FAST) as stream:
        assert stream.read() == data
    assert [request.status for request in server.requests] == [200, 200]
    assert server.requests[1].range == "bytes=120000-"


def test_cut_connection_beyond_budget_fails(server):
    server.close_after("/a.tar", after_bytes=0, times=100)
    with (
        server as base,
        open_stream(f"{base}/a.tar", FAST) as stream,
        pytest.raises(ShardReadError, match="failed at byte 0"),
    ):
        stream.read()
    assert server.count("/a.tar") == FAST.attempts


def test_resume_count_is_bounded(server):
    # Each cut makes progress, so only max_resumes stops an endless crawl.
    server.close_after("/a.tar", after_bytes=1000, times=100)
    policy = RetryPolicy(attempts=3, base_delay=0.0, timeout=2.0, max_resumes=4)
    with (
        server as base,
        open_stream(f"{base}/a.tar", policy) as stream,
        pytest.raises(ShardReadError, match="4 resumes"),
    ):
        stream.read()
    assert server.count("/a.tar") == 5


def test_shard_changed_between_requests_is_an_error(server, tmp_path, data):
    server.close_after("/a.tar", after_bytes=100_000, times=1)
    with server as base, open_stream(f"{base}/a.tar", FAST) as stream:
        assert stream.read(10) == data[:10]
        (tmp_path / "a.tar").write_bytes(data[::-1])
        os.utime(tmp_path / "a.tar", ns=(1, 1))  # a new ETag, whatever the clock
        with pytest.raises(ShardReadError, match="changed"):
            stream.read()


def test_stall_before_headers_times_out(server):
    server.stall("/a.tar", times=100)
    policy = RetryPolicy(attempts=2, base_delay=0.0, timeout=0.5)
    with server as base, pytest.raises(ShardReadError, match="TimeoutError") as info:
        open_stream(f"{base}/a.tar", policy)
    assert isinstance(info.value.__cause__, TimeoutError)
    assert server.count("/a.tar") == 2


def test_stall_mid_body_times_out_then_resumes(server, data):
    server.stall("/a.tar", after_bytes=50_000, times=1)
    policy = RetryPolicy(attempts=2, base_delay=0.0, timeout=0.5)
    with server as base, open_stream(f"{base}/a.tar", policy) as stream:
        assert stream.read() == data
        assert stream.raw.resumes == 1
    assert server.requests[1].range == "bytes=50000-"


def test_redirect_to_http_is_followed(server, data):
    with server as base:
        server.redirect("/old.tar", f"{base}/a.tar", status=301)
        server.redirect("/rel.tar", "/b.tar", status=307)
        assert read_all(f"{base}/old.tar") == data
        assert read_all(f"{base}/rel.tar") == data[::-1]


@pytest.mark.parametrize(
    "location", ["file:///etc/passwd", "pipe:cat /etc/passwd", "ftp://127.0.0.1/a.tar"]
)
def test_redirect_to_other_schemes_is_refused(server, location):
    server.redirect("/a.tar", location, times=100)
    with server as base, pytest.raises(ShardReadError, match="redirect") as info:
        open_stream(f"{base}/a.tar", FAST)
    assert "scheme not allowed" in str(info.value)
    assert server.count("/a.tar") == 1


def test_redirect_loop_is_bounded(server):
    server.redirect("/loop.tar", "/loop.tar", times=100)
    with server as base, pytest.raises(ShardReadError, match="redirects"):
        open_stream(f"{base}/loop.tar", FAST)
    assert server.count("/loop.tar") == 6


def test_errors_never_show_credentials(server):
    server.fail("/a.tar", count=100, status=503)
    secrets = ["s3cr3tpw", "deadbeefsig", "AKIAEXAMPLE"]
    with server as base:
        host = base.removeprefix("http://")
        url = (
            f"http://alice:s3cr3tpw@{host}/a.tar"
            "?X-Amz-Signature=deadbeefsig&X-Amz-Credential=AKIAEXAMPLE"
        )
        with pytest.raises(ShardReadError) as info:
            open_stream(url, FAST)
        with pytest.raises(ShardReadError) as missing:
            open_stream(url.replace("/a.tar", "/nope.tar"), FAST)
    for error in (info.value, missing.value, pickle.loads(pickle.dumps(info.value))):
        text = "".join(traceback.format_exception(error)) + repr(error) + error.url
        assert "alice" not in text
        assert not any(secret in text for secret in secrets)
        assert "X-Amz-Signature=REDACTED" in text


def test_open_stream_validates_again(tmp_path):
    for url in ["pipe:cat /etc/passwd", "ftp://h/a.tar", "a.tar::b.tar"]:
        with pytest.raises(ValueError):
            open_stream(url)


def test_missing_fsspec_backend_names_the_package():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed")
    with pytest.raises(ImportError, match="pip install gcsfs"):
        open_stream("gs://bucket/a.tar")


def test_retry_policy_validation_and_delays():
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(timeout=0)
    policy = RetryPolicy(base_delay=0.5, max_delay=8.0)
    delays = [policy.delay(n, "https://h/a.tar") for n in range(1, 8)]
    assert delays == [policy.delay(n, "https://h/a.tar") for n in range(1, 8)]
    for n, delay in enumerate(delays, start=1):
        backoff = min(8.0, 0.5 * 2 ** (n - 1))
        assert backoff / 2 <= delay <= backoff
    assert policy.delay(1, "https://h/a.tar", retry_after=100.0) == 8.0


class SpawnCalled(AssertionError):
    pass


def test_no_process_is_ever_spawned(server, tmp_path, data, monkeypatch):
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise SpawnCalled(f"process spawn attempted: {args!r}")

    for module, name in [
        (subprocess, "Popen"),
        (os, "system"),
        (os, "popen"),
        (os, "posix_spawn"),
        (os, "posix_spawnp"),
        (os, "execv"),
        (os, "execvp"),
    ]:
        monkeypatch.setattr(module, name, refuse)
    hostile = [url for url in HOSTILE_URLS if url] + ["pipe:{a,b}", "pipe:$(touch /tmp/x)"]
    for url in hostile:
        for check in (validate_url, open_stream):
            with pytest.raises(ValueError):
                check(url)
        with pytest.raises(ValueError):
            expand_urls([url])
    (tmp_path / "a.tar").write_bytes(data)
    server.redirect("/r.tar", "pipe:touch /tmp/x", times=10)
    with server as base:
        assert read_all(f"{base}/a.tar") == data
        with pytest.raises(ShardReadError):
            open_stream(f"{base}/r.tar", FAST)
    assert read_all(str(tmp_path / "a.tar")) == data
    assert calls == []


def test_retrying_stream_is_a_raw_stream(server, data):
    with server as base:
        stream = RetryingStream(f"{base}/a.tar", FAST)
        buffer = bytearray(10)
        assert stream.readinto(buffer) == 10
        assert bytes(buffer) == data[:10]
        assert stream.readable() and not stream.seekable()
        stream.close()
        with pytest.raises(ValueError):
            stream.readinto(buffer)


def test_object_store_credentials_never_reach_the_store_client(monkeypatch, caplog):
    """Refused before any fsspec filesystem is made, and no log line holds the secret."""
    import logging

    import shards.storage.objectstore as opener

    def no_client(*args, **kwargs):
        raise AssertionError("an fsspec filesystem was made for a URL holding credentials")

    monkeypatch.setattr(opener, "object_store_filesystem", no_client)
    caplog.set_level(logging.DEBUG)
    url = "s3://AKIAEXAMPLE:s3cr3tKEY@bucket/train-000000.tar"
    for random_access in (False, True):
        with pytest.raises(ValueError, match=r"s3://\*\*\*@bucket.*storage_options") as info:
            open_stream(url, FAST, random_access=random_access)
        assert "s3cr3tKEY" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)
    assert "s3cr3tKEY" not in caplog.text


def test_loader_sources_with_object_store_credentials_are_refused(tmp_path):
    from pipeline.config import Workers
    from pipeline.loader import LoaderConfig, build_loader

    for source in ("s3://K3Y:s3cr3tKEY@bucket/train-{000..003}.tar", "gs://K3Y:s3cr3tKEY@b/m.json"):
        with pytest.raises(ValueError, match="holds credentials") as info:
            build_loader(LoaderConfig(source=source, workers=Workers(count=0)))
        assert "s3cr3tKEY" not in str(info.value)
