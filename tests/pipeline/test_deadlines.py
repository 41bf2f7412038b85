"""Remote shard reads end in bounded time and never read past the manifest's size.

Real localhost servers drip, stream forever, lie about their length or ask for
a 30 s `Retry-After`; every case must end in a `ShardReadError` that names the
shard (redacted) and says how to go on, within the policy's deadline.
"""

from __future__ import annotations

import math
import os
import pickle
import random
import re
import time
import traceback

import pytest

from shards.storage import RetryingFsspecFile, RetryPolicy, ShardReadError, open_stream
from tests.httpserver import LocalHTTPServer

SIZE = 300_000
# A stall limit far above the drip interval: no single read ever stalls.
DRIP = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05, timeout=2.0, deadline=1.0)
FAST = RetryPolicy(attempts=3, base_delay=0.001, max_delay=0.01, timeout=2.0)


@pytest.fixture
def data():
    return random.Random(99).randbytes(SIZE)


@pytest.fixture
def server(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    return LocalHTTPServer(tmp_path)


def read_until_error(stream, chunk: int = 65_536) -> tuple[bytes, ShardReadError]:
    """Everything `stream` hands out before it raises, and the error.

    `read1`, since `read(n)` drops what it gathered when a later raw read raises.
    """
    got = bytearray()
    with pytest.raises(ShardReadError) as info:
        while True:
            piece = stream.read1(chunk)
            if not piece:
                raise AssertionError(f"the stream ended after {len(got)} bytes without an error")
            got += piece
    return bytes(got), info.value


# Deadline --------------------------------------------------------------------------


@pytest.mark.timeout(10)
@pytest.mark.parametrize("random_access", [False, True])
def test_a_drip_fails_at_the_deadline(server, random_access):
    server.drip("/a.tar", interval=0.05)  # 300 kB at 20 B/s: 4 hours without a deadline
    with server as base, open_stream(f"{base}/a.tar", DRIP, random_access=random_access) as stream:
        got, error = read_until_error(stream)
    assert "deadline of 1 s" in error.reason
    assert "RetryPolicy(deadline=...)" in error.reason
    assert 0 < len(got) < 100
    assert f"after {len(got)} bytes" in error.reason
    assert server.count("/a.tar") == 1  # past the deadline nothing is retried


@pytest.mark.timeout(10)
def test_a_drip_in_the_headers_fails_at_the_deadline(server):
    server.drip("/a.tar", interval=0.05, headers=True)
    with server as base, pytest.raises(ShardReadError, match="deadline of 1 s") as info:
        open_stream(f"{base}/a.tar", DRIP)
    assert "after 0 bytes" in info.value.reason
    assert server.count("/a.tar") == 1


@pytest.mark.timeout(10)
def test_the_deadline_spans_resumes_and_backoff(server):
    # Every cut makes progress, so only the deadline ends this crawl.
    server.close_after("/a.tar", after_bytes=1000, times=10_000)
    policy = RetryPolicy(attempts=3, base_delay=0.2, max_delay=0.2, max_resumes=10_000, deadline=1)
    with server as base, open_stream(f"{base}/a.tar", policy) as stream:
        got, error = read_until_error(stream)
    assert "deadline of 1 s" in error.reason
    requests = server.count("/a.tar")
    assert 2 <= requests <= 10
    assert len(got) in (1000 * (requests - 1), 1000 * requests)  # every byte sent, once


@pytest.mark.timeout(10)
def test_backoff_never_sleeps_past_the_deadline(server):
    server.fail("/a.tar", count=100, status=503, retry_after=30)
    policy = RetryPolicy(attempts=10, base_delay=0.0, max_delay=60, timeout=1.0, deadline=0.5)
    with server as base, pytest.raises(ShardReadError) as info:
        open_stream(f"{base}/a.tar", policy)
    assert "deadline of 0.5 s" in info.value.reason
    assert "HTTP 503" in info.value.reason and "would wait 30 s" in info.value.reason
    assert server.count("/a.tar") == 1  # a 30 s wait cannot fit in 0.5 s: no sleep at all


@pytest.mark.timeout(10)
def test_short_retry_after_is_waited_until_the_deadline(server):
    # Retry-After is whole seconds: wait 1 s once, then 1 s more would pass 1.5 s.
    server.fail("/a.tar", count=100, status=503, retry_after=1)
    policy = RetryPolicy(attempts=100, base_delay=0.0, max_delay=60, timeout=1.0, deadline=1.5)
    with server as base, pytest.raises(ShardReadError, match="deadline of 1.5 s"):
        open_stream(f"{base}/a.tar", policy)
    assert server.count("/a.tar") == 2


def test_time_between_reads_does_not_count(server, data):
    # A slow consumer (decoding, a full shuffle buffer) must not fail a healthy shard.
    policy = RetryPolicy(attempts=1, timeout=2.0, deadline=0.3)
    with server as base, open_stream(f"{base}/a.tar", policy) as stream:
        head = stream.read(10)
        time.sleep(0.4)
        assert head + stream.read() == data
        assert stream.raw.clock.spent() < 0.3


@pytest.mark.timeout(10)
def test_an_endless_body_without_a_size_ends_at_the_deadline(server):
    server.endless("/a.tar")
    policy = RetryPolicy(attempts=1, timeout=1.0, deadline=0.3)
    with (
        server as base,
        open_stream(f"{base}/a.tar", policy) as stream,
        pytest.raises(ShardReadError, match="deadline of 0.3 s") as info,
    ):
        while stream.read(1 << 20):
            pass
    assert int(re.search(r"after (\d+) bytes", info.value.reason).group(1)) > SIZE


# Declared size ---------------------------------------------------------------------


@pytest.mark.timeout(10)
def test_an_endless_body_stops_at_the_expected_size(server, data):
    server.endless("/a.tar")
    expected = 2 * SIZE + 12_345  # past one copy of the file: the server repeats it
    with server as base, open_stream(f"{base}/a.tar", FAST, expected_size=expected) as stream:
        got, error = read_until_error(stream)
    assert got == (data * 3)[:expected]
    assert f"more than the manifest's {expected} bytes" in error.reason


@pytest.mark.parametrize("random_access", [False, True])
def test_a_matching_expected_size_reads_normally(server, data, random_access):
    server.close_after("/a.tar", after_bytes=100_000)  # a resume checks the size again
    with server as base:
        url = f"{base}/a.tar"
        with open_stream(url, FAST, random_access=random_access, expected_size=SIZE) as stream:
            assert stream.read() == data


@pytest.mark.parametrize("random_access", [False, True])
@pytest.mark.parametrize(
    ("lie", "expected", "size"),
    [(None, SIZE - 1, SIZE), (SIZE + 1000, SIZE, SIZE + 1000)],
    ids=["manifest-smaller", "length-too-big"],
)
def test_a_size_above_the_manifests_fails_at_open(server, lie, expected, size, random_access):
    if lie is not None:
        server.lie_length("/a.tar", lie)
    with server as base, pytest.raises(ShardReadError) as info:
        open_stream(f"{base}/a.tar", FAST, random_access=random_access, expected_size=expected)
    assert info.value.reason == (
        f"the shard is {size} bytes, more than the manifest's {expected}: "
        "the shard changed or the URL is wrong"
    )
    assert server.count("/a.tar") == 1  # not retried: the answer would not change


@pytest.mark.parametrize("random_access", [False, True])
def test_a_shard_smaller_than_the_manifest_says_is_read_to_its_end(server, data, random_access):
    """A cut shard costs only its missing rest: the reader reports where it ends."""
    with server as base:
        url = f"{base}/a.tar"
        with open_stream(url, FAST, random_access=random_access, expected_size=SIZE + 5) as stream:
            assert stream.read() == data


def test_a_local_file_of_another_size_fails_at_open(tmp_path, data):
    (tmp_path / "a.tar").write_bytes(data)
    with open_stream(str(tmp_path / "a.tar"), expected_size=SIZE) as stream:
        assert stream.read() == data
    with pytest.raises(ShardReadError, match=f"is {SIZE} bytes, more than the manifest's 7:"):
        open_stream(str(tmp_path / "a.tar"), expected_size=7)
    with pytest.raises(ValueError, match="expected_size"):
        open_stream(str(tmp_path / "a.tar"), expected_size=-1)


def test_an_object_store_file_of_another_size_fails_at_open(data):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory", skip_instance_cache=True)
    fs.pipe_file("/bucket/a.tar", data)
    with RetryingFsspecFile("memory://bucket/a.tar", fs, FAST, expected_size=SIZE) as file:
        assert file.read() == data
    with pytest.raises(
        ShardReadError, match=f"is {SIZE} bytes, more than the manifest's {SIZE - 1}"
    ):
        RetryingFsspecFile("memory://bucket/a.tar", fs, FAST, expected_size=SIZE - 1)


@pytest.fixture
def moto_shard(monkeypatch, tmp_path, data):
    """`s3://deadline/a.tar` (the test data) in a moto server, behind a fault proxy."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.objectstore import FaultProxy, MotoS3

    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)  # no real AWS profile or metadata service is consulted
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with MotoS3() as s3, FaultProxy(s3.endpoint) as proxy:
        s3.create_bucket("deadline")
        s3.client().put_object(Bucket="deadline", Key="a.tar", Body=data)
        yield "s3://deadline/a.tar", s3.storage_options(proxy.endpoint), proxy


@pytest.mark.timeout(30)
def test_object_store_reads_stop_at_the_deadline_and_check_the_size(moto_shard, data):
    url, options, proxy = moto_shard
    with open_stream(url, FAST, storage_options=options, expected_size=SIZE) as stream:
        assert stream.read() == data
    with pytest.raises(
        ShardReadError, match=f"is {SIZE} bytes, more than the manifest's {SIZE - 1}:"
    ):
        open_stream(url, FAST, storage_options=options, expected_size=SIZE - 1)
    proxy.fail(r"/a\.tar$", times=10_000, status=503)  # every ranged GET, not the HEAD
    policy = RetryPolicy(
        attempts=1000, base_delay=0.05, max_delay=0.1, timeout=1.0, max_resumes=1000, deadline=3
    )
    with (
        pytest.raises(ShardReadError, match="deadline of 3 s") as info,
        open_stream(url, policy, storage_options=options) as stream,
    ):
        stream.read()
    assert "after 0 bytes" in info.value.reason and "; last: " in info.value.reason
    assert 2 <= proxy.count(r"/a\.tar$") < 100  # retried until the deadline, then no more


# Redaction -------------------------------------------------------------------------


@pytest.mark.timeout(15)
def test_failures_never_show_the_password(server, tmp_path, data):
    (tmp_path / "x.tar").write_bytes(data)
    server.drip("/x.tar", interval=0.05)
    errors = []
    with server as base:
        url = base.replace("http://", "http://user:secret@") + "/x.tar"
        with pytest.raises(ShardReadError) as missing:
            open_stream(url.replace("/x.tar", "/absent.tar"), FAST)
        errors.append(missing.value)
        policy = RetryPolicy(attempts=2, timeout=1.0, deadline=0.3)
        with open_stream(url, policy) as stream:
            assert "secret" not in repr(stream) + repr(stream.raw)
            errors.append(read_until_error(stream)[1])
        with pytest.raises(ShardReadError) as mismatch:
            open_stream(url, FAST, expected_size=SIZE - 1)
        errors.append(mismatch.value)
    assert ["HTTP 404" in errors[0].reason, "deadline" in errors[1].reason] == [True, True]
    assert "more than the manifest's" in errors[2].reason
    for error in errors + [pickle.loads(pickle.dumps(e)) for e in errors]:
        text = str(error) + repr(error) + "".join(traceback.format_exception(error))
        assert "secret" not in text
        assert "http://***@127.0.0.1" in str(error)


# Policy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"deadline": 0},
        {"deadline": -1},
        {"deadline": math.nan},
        {"timeout": math.nan},
        {"timeout": math.inf},
        {"base_delay": math.nan},
    ],
)
def test_retry_policy_refuses_bad_deadlines_and_stalls(bad):
    with pytest.raises(ValueError):
        RetryPolicy(**bad)


def test_retry_policy_defaults_keep_timeout_as_the_stall_limit():
    policy = RetryPolicy()
    assert (policy.timeout, policy.deadline) == (60.0, 1800.0)
    assert RetryPolicy(deadline=math.inf).deadline == math.inf
