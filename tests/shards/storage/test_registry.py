"""The transport registry: a toy store, one class and one `register` line in this file, is
read, listed and written by the storage layer and the loader reads an epoch from it.

Nothing outside this file knows `mem://`: if a scheme table or if-chain came back
anywhere in the storage layer or the loader, this test would fail there.
"""

from __future__ import annotations

import io
from collections import Counter

import pytest

from pipeline.config import Batching, Crop, LoaderConfig, Shuffle, Workers
from pipeline.loader import build_loader
from shards.manifest import read_manifest
from shards.storage import (
    DEFAULT_RETRY,
    READ_SCHEMES,
    SHARD_SCHEMES,
    ObjectNotFoundError,
    ShardReadError,
    Transport,
    open_stream,
    read_bytes,
    register,
    transport_of,
    unregister,
    validate_url,
)
from shards.storage.write import open_output_store


class DictStore(Transport):
    """A toy store: objects in a dict keyed by URL (`mem://bucket/key`)."""

    schemes = ("mem",)

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def open(self, url, retry, *, storage_options, random_access=False, expected_size=None):
        if url not in self.objects:
            raise ObjectNotFoundError(url, "no such object")
        data = self.objects[url]
        if expected_size is not None and len(data) > expected_size:
            raise ShardReadError(url, f"{len(data)} bytes, more than {expected_size}")
        return io.BytesIO(data)

    def walk(self, url, retry, storage_options):
        root = url.rstrip("/") + "/"
        names = [key[len(root) :] for key in self.objects if key.startswith(root)]
        pending = [""]
        while pending:
            relative = pending.pop()
            inside = f"{relative}/" if relative else ""
            below = [name[len(inside) :] for name in names if name.startswith(inside)]
            subdirs = sorted({name.split("/")[0] for name in below if "/" in name})
            yield relative, subdirs, sorted(name for name in below if "/" not in name)
            pending += [f"{inside}{name}" for name in reversed(subdirs)]

    def write_bytes(self, url, data, storage_options):
        self.objects[url] = bytes(data)

    def remove(self, url, storage_options):
        self.objects.pop(url, None)


@pytest.fixture
def store():
    toy = register(DictStore())  # the one registry line
    yield toy
    unregister(toy)


def test_a_registered_store_is_read_listed_and_written_through_the_storage_layer(store):
    assert "mem" in SHARD_SCHEMES and "mem" in READ_SCHEMES
    assert validate_url("mem://bucket/a.tar") == "mem://bucket/a.tar"
    out = open_output_store("mem://bucket/out")
    out.write_bytes_atomic("a/x.bin", b"hello")
    with out.staged("b.bin") as path:
        path.write_bytes(b"staged")
    assert out.list() == ["a/x.bin", "b.bin"]
    assert read_bytes("mem://bucket/out/a/x.bin", 100) == b"hello"
    with open_stream("mem://bucket/out/b.bin") as stream:
        assert stream.read() == b"staged"
    assert out.info("b.bin").size == 6 and out.info("none.bin") is None
    with pytest.raises(ObjectNotFoundError, match="mem://bucket/out/none.bin"):
        open_stream("mem://bucket/out/none.bin", DEFAULT_RETRY)
    out.remove("a/x.bin")
    assert out.list() == ["b.bin"]


def test_credentials_in_a_registered_store_url_are_refused(store):
    with pytest.raises(ValueError, match=r"\*\*\*@bucket"):
        validate_url("mem://key:secret@bucket/a.tar")


def test_a_store_that_is_unregistered_is_refused_again():
    with pytest.raises(ValueError, match="scheme not allowed: 'mem'"):
        validate_url("mem://bucket/a.tar")


def test_the_loader_reads_an_epoch_from_a_registered_store(store, built_shards):
    """A build's output copied into the toy store (through its OutputStore) is read by the
    loader from the store's manifest: every sample once, as from the local copy."""
    local = built_shards.output
    out = open_output_store("mem://data/out")
    for path in sorted(local.rglob("*")):
        if path.is_file():
            out.write_bytes_atomic(path.relative_to(local).as_posix(), path.read_bytes())
    expected = read_manifest(local).splits["train"].samples
    loader = build_loader(
        LoaderConfig(
            source="mem://data/out/manifest.json",
            batch=Batching(size=8, drop_last=False, epoch_rule="uneven"),
            shuffle=Shuffle(buffer=16, initial=4),
            crop=Crop(image_size=32),
            workers=Workers(count=0),
            with_keys=True,
        )
    )
    keys = Counter(key for _, _, batch_keys in loader for key in batch_keys)
    assert len(keys) == expected and set(keys.values()) == {1}


def test_every_object_store_gets_the_stall_limit_and_one_client_try():
    """The tuning only s3 had: each fsspec store's client waits at most the stall limit
    (capped at the deadline) a socket, and options a user gave win."""
    from shards.storage.retry import RetryPolicy

    retry = RetryPolicy(timeout=7.0, deadline=5.0)
    s3 = transport_of("s3").tune({}, retry)["config_kwargs"]
    assert s3["connect_timeout"] == s3["read_timeout"] == 5.0
    assert s3["retries"] == {"total_max_attempts": 1}
    assert transport_of("gs").tune({}, retry)["requests_timeout"] == 5.0
    azure = transport_of("az").tune({}, retry)
    assert azure["connection_timeout"] == azure["read_timeout"] == 5.0
    assert transport_of("gs").tune({"requests_timeout": 99}, retry)["requests_timeout"] == 99
    for scheme in ("s3", "gs", "gcs", "az", "abfs", "memory"):
        assert transport_of(scheme).tune({}, retry)["use_listings_cache"] is False
