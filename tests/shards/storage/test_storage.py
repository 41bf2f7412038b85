"""shards.storage: one `is_remote`, the retried listing, and what each transport calls missing."""

from __future__ import annotations

import pytest

from shards.storage import (
    READ_SCHEMES,
    ObjectNotFoundError,
    RetryPolicy,
    ShardReadError,
    is_remote,
    local_path,
    open_stream,
    read_bytes,
    validate_url,
    walk,
)
from shards.storage.retry import call_with_retry
from shards.storage.write import LocalStore, open_output_store
from tests.httpserver import LocalHTTPServer

FAST = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.02, timeout=1.0, deadline=5.0)


@pytest.mark.parametrize(
    ("location", "remote"),
    [
        ("/data/train", False),
        ("relative/dir", False),
        ("file:///data/train", False),
        ("FILE:///data/train", False),  # schemes are case-insensitive (RFC 3986 3.1)
        ("File://localhost/data", False),
        ("./a://b", False),  # `://` inside a path is not a scheme
        ("out:1", False),  # no `//`: a directory a build may write to
        ("s3://bucket/prefix", True),
        ("S3://bucket/prefix", True),
        ("gs://bucket/x", True),
        ("https://host/list.csv", True),
        ("memory://images", True),
    ],
)
def test_is_remote_has_one_answer_for_file_urls_in_any_case(location, remote):
    """Before, shards.io and preprocess.sources disagreed on `FILE://` (local vs remote)."""
    assert is_remote(location) is remote


def test_a_file_url_in_any_case_is_a_local_directory_for_outputs_and_reads(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc")
    upper = "FILE://" + str(tmp_path)
    assert local_path(upper) == str(tmp_path)
    store = open_output_store(upper)
    assert isinstance(store, LocalStore) and store.root == tmp_path.resolve()
    assert read_bytes(f"{upper}/a.bin", 10) == b"abc"
    assert validate_url(f"{upper}/a.bin") == str(tmp_path / "a.bin")


def test_read_bytes_caps_the_read_at_one_byte_past_the_limit(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"x" * 100)
    assert read_bytes(str(tmp_path / "big.bin"), 10) == b"x" * 11


def test_nothing_there_is_object_not_found_on_every_transport(tmp_path):
    """A build counts it `missing`; the loader, like any ShardReadError, as unreadable."""
    with pytest.raises(ObjectNotFoundError, match="FileNotFoundError"):
        open_stream(str(tmp_path / "absent.tar"))
    with LocalHTTPServer(tmp_path) as base, pytest.raises(ObjectNotFoundError, match="HTTP 404"):
        open_stream(f"{base}/absent.tar", FAST)
    fsspec = pytest.importorskip("fsspec")
    fsspec.filesystem("memory").pipe("/storage-test/here.bin", b"x")
    try:
        with pytest.raises(ObjectNotFoundError, match="check the URL"):
            open_stream("memory://storage-test/absent.bin", FAST, schemes=READ_SCHEMES)
        assert read_bytes("memory://storage-test/here.bin", 5, schemes=READ_SCHEMES) == b"x"
    finally:
        fsspec.filesystem("memory").rm("/storage-test", recursive=True)
    assert issubclass(ObjectNotFoundError, ShardReadError)


def test_memory_store_is_for_build_inputs_not_loader_shards():
    with pytest.raises(ValueError, match="scheme not allowed: 'memory'"):
        open_stream("memory://bucket/a.tar")
    with pytest.raises(ValueError, match="scheme not allowed: 'ftp'"):
        open_stream("ftp://host/a.jpg", schemes=READ_SCHEMES)


class Flaky:
    """A call that raises `error` `failures` times, then returns "ok"."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def test_call_with_retry_retries_transient_errors_within_the_budget():
    flaky = Flaky(2, ConnectionResetError("reset"))
    assert call_with_retry(flaky, "s3://b/p", FAST, (OSError,)) == "ok"
    assert flaky.calls == 3
    hopeless = Flaky(10, ConnectionResetError("reset"))
    with pytest.raises(ShardReadError, match=r"s3://b/p \(3 attempt\(s\)\): ConnectionResetError"):
        call_with_retry(hopeless, "s3://b/p", FAST, (OSError,))
    assert hopeless.calls == 3
    missing = Flaky(1, FileNotFoundError("gone"))
    with pytest.raises(FileNotFoundError):
        call_with_retry(missing, "s3://b/p", FAST, (OSError,), permanent=(FileNotFoundError,))
    assert missing.calls == 1
    bug = Flaky(1, TypeError("a bug"))
    with pytest.raises(TypeError):
        call_with_retry(bug, "s3://b/p", FAST, (OSError,))


def test_walk_is_top_down_relative_and_prunable():
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    for path in ("a/1.jpg", "a/b/2.jpg", ".hidden/3.jpg", "top.txt"):
        memory.pipe(f"/walk-test/{path}", b"x")
    try:
        seen = []
        for relative, subdirs, files in walk("memory://walk-test", retry=FAST):
            subdirs[:] = [name for name in subdirs if not name.startswith(".")]
            seen.append((relative, list(subdirs), files))
        assert list(walk("memory://walk-test/absent", retry=FAST)) == [("", [], [])]
    finally:
        memory.rm("/walk-test", recursive=True)
    assert seen == [("", ["a"], ["top.txt"]), ("a", ["b"], ["1.jpg"]), ("a/b", [], ["2.jpg"])]


def test_a_ranged_stream_asks_for_its_span_only_and_resumes_inside_it(tmp_path):
    from shards.storage import RetryingStream

    data = bytes(range(256)) * 64
    (tmp_path / "blob").write_bytes(data)
    server = LocalHTTPServer(tmp_path)
    with server as base:
        server.close_after("/blob", 100, times=1)
        with RetryingStream(f"{base}/blob", FAST, 1000, end=3000) as stream:
            got = b""
            while len(got) < 2000:
                got += stream.read(2000 - len(got))
    assert got == data[1000:3000]
    assert [r.range for r in server.requests] == ["bytes=1000-2999", "bytes=1100-2999"]


@pytest.mark.parametrize("ranges", [True, False])
def test_fetch_into_copies_a_shard_exactly_with_or_without_server_ranges(
    tmp_path, monkeypatch, ranges
):
    from shards.storage import ranged

    monkeypatch.setattr(ranged, "MIN_SPAN", 1000)
    monkeypatch.setattr(ranged, "MAX_SPAN", 1000)
    data = bytes(range(251)) * 40  # 10,040 bytes: eleven spans, the last short
    (tmp_path / "blob").write_bytes(data)
    server = LocalHTTPServer(tmp_path, ranges=ranges)
    with server as base, open(tmp_path / "copy", "w+b") as out:
        got = ranged.fetch_into(f"{base}/blob", out.fileno(), FAST, size=len(data), connections=4)
    assert got == len(data)
    assert (tmp_path / "copy").read_bytes() == data
    assert len(server.requests) == 11


def test_fetch_into_refuses_a_shard_larger_than_the_manifest_says(tmp_path):
    from shards.storage.ranged import fetch_into

    (tmp_path / "blob").write_bytes(b"x" * 5000)
    with (
        LocalHTTPServer(tmp_path) as base,
        open(tmp_path / "copy", "w+b") as out,
        pytest.raises(ShardReadError, match="more than the manifest"),
    ):
        fetch_into(f"{base}/blob", out.fileno(), FAST, size=4000)
