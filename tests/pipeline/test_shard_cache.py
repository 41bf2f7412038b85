"""The node-local shard cache: later epochs from disk, LRU under a limit, shared safely.

Against the real localhost HTTP server (its per-path byte counts are what the
server sent) and the moto S3 server behind a counting proxy.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest

from pipeline.config import Batching, ReadOptions, Workers
from pipeline.fetch import ShardFetcher
from pipeline.sources import ShardSpec
from shards.storage import cache as cache_module
from shards.storage.cache import (
    MAGIC,
    PART_SUFFIX,
    SHARD_SUFFIX,
    TRAILER_BYTES,
    ShardCache,
    cache_key,
)
from shards.storage.retry import RetryPolicy
from tests.conftest import shard_files
from tests.httpserver import LocalHTTPServer
from tests.pipeline.conftest import epoch_keys, loader_for

ROOT = Path(__file__).resolve().parents[2]


def remote_loader(base: str, cache_dir, **overrides):
    options = dict(
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
        io=ReadOptions(cache_dir=str(cache_dir)),
    )
    options.update(overrides)
    return loader_for(f"{base}/manifest.json", **options)


def epoch_counts(loader, epoch: int) -> Counter:
    loader.set_epoch(epoch)
    return Counter(k for batch in epoch_keys(loader) for k in batch)


def shard_bytes_sent(server: LocalHTTPServer) -> int:
    return sum(n for path, n in server.bytes_sent.items() if path.endswith(".tar"))


def train_tars(shard_dir) -> list[Path]:
    return shard_files(shard_dir, "tar", "train")


def cached_entries(cache_dir) -> list[Path]:
    return sorted(Path(cache_dir).glob("*" + SHARD_SUFFIX))


def key_of(name: str) -> str:
    """A real cache key (the cache evicts and cleans up only names it makes)."""
    return cache_key(f"http://host/{name}", None, None)


def put(cache: ShardCache, key: str, size: int = 100, keep=frozenset()) -> None:
    """Write an entry of `size` bytes as the fetcher does: reserve, fill, copy, commit."""
    part = cache.reserve(key, size, keep)
    part.file.write(b"x" * size)
    part.file.flush()
    copy, digest = cache.copy_part(part, size)
    copy.close()
    assert cache.commit(part, size, digest, keep)


@pytest.fixture(scope="module")
def local_epoch(shard_dir) -> Counter:
    loader = loader_for(shard_dir, batch=Batching(size=8, epoch_rule="uneven", drop_last=False))
    return Counter(k for batch in epoch_keys(loader) for k in batch)


def test_epoch_two_reads_nothing_from_the_server_when_the_cache_holds_the_dataset(
    shard_dir, tmp_path, local_epoch
):
    cache_dir = tmp_path / "cache"
    server = LocalHTTPServer(shard_dir)
    with server as base:
        loader = remote_loader(base, cache_dir, workers=Workers(count=2))
        assert epoch_counts(loader, 0) == local_epoch
        first = shard_bytes_sent(server)
        assert first == sum(p.stat().st_size for p in train_tars(shard_dir))
        assert len(cached_entries(cache_dir)) == len(train_tars(shard_dir))
        assert epoch_counts(loader, 1) == local_epoch
        fetch = [w["fetch"] for w in loader.stats.workers.values()]
        # A new loader (a restarted job) finds the cache too.
        again = remote_loader(base, cache_dir)
        assert epoch_counts(again, 2) == local_epoch
        assert shard_bytes_sent(server) == first
    assert sum(f["bytes_fetched"] for f in fetch) == 0
    assert sum(f["cache_hits"] for f in fetch) == len(train_tars(shard_dir))


def test_cache_entries_hold_exactly_the_shards_bytes_and_their_sha256(shard_dir, tmp_path):
    cache_dir = tmp_path / "cache"
    with LocalHTTPServer(shard_dir) as base:
        epoch_counts(remote_loader(base, cache_dir, workers=Workers(count=2)), 0)
    digests = set()
    for entry in cached_entries(cache_dir):
        data = entry.read_bytes()
        shard, trailer = data[:-TRAILER_BYTES], data[-TRAILER_BYTES:]
        assert trailer == MAGIC + hashlib.sha256(shard).digest()
        digests.add(hashlib.sha256(shard).hexdigest())
    expected = {hashlib.sha256(p.read_bytes()).hexdigest() for p in train_tars(shard_dir)}
    assert digests == expected
    assert (cache_dir.stat().st_mode & 0o777) == 0o700
    assert ((cache_dir / "claims").stat().st_mode & 0o777) == 0o700


def test_a_shard_changed_on_the_server_is_a_counted_bad_shard_and_never_cached(
    shard_copy, tmp_path
):
    tar = train_tars(shard_copy)[0]
    data = bytearray(tar.read_bytes())
    data[600] ^= 0xFF  # same size, different bytes: only the sha256 tells
    tar.write_bytes(bytes(data))
    cache_dir = tmp_path / "cache"
    with LocalHTTPServer(shard_copy) as base:
        loader = remote_loader(base, cache_dir, max_skip_fraction=1.0)
        epoch_counts(loader, 0)
    assert loader.stats.bad_shards["checksum"] == 1
    assert any(tar.name in text for text in loader.stats.bad_shard_examples)
    assert len(cached_entries(cache_dir)) == len(train_tars(shard_copy)) - 1
    assert not list(Path(cache_dir).glob("*" + PART_SUFFIX))


def test_eviction_keeps_the_cache_under_half_the_dataset_and_epochs_exact(
    shard_dir, tmp_path, local_epoch
):
    sizes = [p.stat().st_size for p in train_tars(shard_dir)]
    limit = sum(sizes) // 2
    cache_dir = tmp_path / "cache"
    seen = []
    real_reserve = ShardCache.reserve

    def watched_reserve(self, key, size, keep=frozenset()):
        part = real_reserve(self, key, size, keep)
        with self._locked():  # the prefetch threads reserve and publish under it too
            seen.append(self.usage())  # with the new part counted
        return part

    server = LocalHTTPServer(shard_dir)
    held, sent = [], []
    with server as base:
        loader = remote_loader(
            base, cache_dir, io=ReadOptions(cache_dir=str(cache_dir), cache_limit=limit)
        )
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ShardCache, "reserve", watched_reserve)
            for epoch in range(3):
                assert epoch_counts(loader, epoch) == local_epoch
                entries = cached_entries(cache_dir)
                used = sum(p.stat().st_size for p in entries)
                assert 0 < used <= limit
                held.append({p.name for p in entries})
                sent.append(shard_bytes_sent(server) - sum(sent))
    assert seen and max(seen) <= limit
    # Scan-resistant: the job's own shards never evict each other, so what the first
    # epoch cached stays, and every later epoch fetches exactly the rest (plain LRU
    # would fetch the whole dataset again each epoch).
    assert sent[0] == sum(sizes)
    assert held[0] == held[1] == held[2]
    assert sent[1] == sent[2] == sum(sizes) - (used - len(held[0]) * TRAILER_BYTES)


def test_eviction_spares_the_jobs_own_shards_and_evicts_others(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), limit=3 * (100 + TRAILER_BYTES))
    cache.prepare()
    other, mine = key_of("other-job"), [key_of(f"mine-{i}") for i in range(1, 5)]
    for key in (other, mine[0], mine[1]):
        put(cache, key)
    os.utime(cache.path(mine[0]), (1, 1))  # the least recently used, but the job's own
    keep = frozenset(mine)
    put(cache, mine[2], keep=keep)
    assert not os.path.exists(cache.path(other))
    assert cache.reserve(mine[3], 100, keep) is None  # streamed past the cache
    assert {p.name for p in cached_entries(cache.root)} == {k + SHARD_SUFFIX for k in mine[:3]}
    assert cache.reserve(key_of("another-job"), 100) is not None  # plain LRU
    assert not os.path.exists(cache.path(mine[0]))


def test_eviction_never_removes_a_shard_in_use(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), limit=2 * (100 + TRAILER_BYTES))
    cache.prepare()
    old, new = key_of("old"), key_of("new")
    for key in (old, new):
        put(cache, key)
    os.utime(cache.path(new), (1, 1))  # "new" is now the least recently used ...
    with open(cache.path(new), "rb") as in_use:  # ... but share-locked by a reader copying it
        fcntl.flock(in_use, fcntl.LOCK_SH)
        part = cache.reserve(key_of("third"), 100)
        assert part is not None
        assert os.path.exists(cache.path(new)) and not os.path.exists(cache.path(old))
        cache.discard(part)
        assert cache.reserve(key_of("too-big"), 200) is None  # only one in use left
    assert cache.reserve(key_of("too-big"), 200) is not None


def test_a_hit_is_a_private_copy_checked_against_the_digest_recorded_at_fetch(tmp_path):
    """What the reader gets is checked as it is copied: later changes to the entry never
    reach it, and a changed entry is rejected (removed) at the next lookup."""
    cache = ShardCache(str(tmp_path / "c"), None)
    cache.prepare()
    key = key_of("shard")
    put(cache, key, 1000)
    copy = cache.lookup(key, 1000, None)
    with open(cache.path(key), "r+b") as entry:
        entry.write(b"y")  # in place, after the check
    assert copy.read() == b"x" * 1000
    with pytest.raises(cache_module.CacheBypass, match="recorded when it was fetched") as caught:
        cache.lookup(key, 1000, None)
    assert caught.value.removed and not os.path.exists(cache.path(key))


def test_two_readers_sharing_a_cache_download_each_shard_once(shard_dir, tmp_path, local_epoch):
    """Two loaders (as two ranks on a node) read the same shards at once through one cache."""
    cache_dir = tmp_path / "cache"
    server = LocalHTTPServer(shard_dir)
    results: list[Counter] = []
    with server as base:

        def run() -> None:
            results.append(epoch_counts(remote_loader(base, cache_dir), 0))

        threads = [threading.Thread(target=run) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert results == [local_epoch, local_epoch]
    for tar in train_tars(shard_dir):
        sent = [n for path, n in server.bytes_sent.items() if path.endswith("/" + tar.name)]
        assert sent == [tar.stat().st_size]


FETCH_ALL = """
import hashlib, json, sys
from pipeline.config import ReadOptions
from pipeline.fetch import ShardFetcher
from pipeline.sources import ShardSpec
specs = [ShardSpec(url, "tar", 1, sha256=sha, bytes=size) for url, sha, size in json.loads(sys.argv[2])]
fetcher = ShardFetcher(ReadOptions(cache_dir=sys.argv[1]))
counts = fetcher.schedule(specs)
for spec in specs:
    with fetcher.open(spec) as stream:
        assert hashlib.sha256(stream.read()).hexdigest() == spec.sha256
print(json.dumps(counts))
"""


def test_three_processes_sharing_a_cache_fetch_each_shard_once(shard_dir, tmp_path):
    """Three processes (flock between processes, not threads) fetch every shard at once."""
    cache_dir = tmp_path / "cache"
    server = LocalHTTPServer(shard_dir)
    with server as base:
        specs = [
            (f"{base}/{tar.relative_to(shard_dir).as_posix()}", sha, tar.stat().st_size)
            for tar in train_tars(shard_dir)
            for sha in [hashlib.sha256(tar.read_bytes()).hexdigest()]
        ]
        argv = [sys.executable, "-c", FETCH_ALL, str(cache_dir), json.dumps(specs)]
        runs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in "abc"]
        counts = [json.loads(run.communicate(timeout=120)[0]) for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert sum(c["shards_fetched"] for c in counts) == len(specs)
    assert sum(c["cache_hits"] for c in counts) == 2 * len(specs)
    for tar in train_tars(shard_dir):
        sent = [n for path, n in server.bytes_sent.items() if path.endswith("/" + tar.name)]
        assert sent == [tar.stat().st_size]


HOLD_CLAIM = """
import sys, time
from shards.storage.cache import ShardCache, cache_key
cache = ShardCache(sys.argv[1], None, wait_s=5)
cache.prepare()
part = cache.reserve(cache_key("unrelated", None, None), 10)  # never finished
with cache.claim(sys.argv[2]) as claimed:
    assert claimed
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_holder_killed_mid_download_neither_hangs_others_nor_leaves_partials(
    shard_dir, tmp_path, local_epoch
):
    cache_dir = tmp_path / "cache"
    with LocalHTTPServer(shard_dir) as base:
        loader = remote_loader(base, cache_dir)
        spec = loader.dataset.sources.shards[0][0]
        key = cache_key(spec.url, spec.sha256, spec.bytes)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_CLAIM, str(cache_dir), key],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout.readline().strip() == "holding"
            assert list(cache_dir.glob("*" + PART_SUFFIX))
            done: list[Counter] = []
            reader = threading.Thread(target=lambda: done.append(epoch_counts(loader, 0)))
            reader.start()  # waits on the claim of shard 0 (the deadline is 30 minutes)
            holder.kill()  # SIGKILL: no cleanup runs; the kernel drops its locks
            holder.wait()
            reader.join(120)
        finally:
            holder.kill()
    assert done == [local_epoch]
    assert len(cached_entries(cache_dir)) == len(train_tars(shard_dir))
    # The killed job's partial file goes at the next start, without a manual clean.
    ShardCache(str(cache_dir), None).prepare()
    assert not list(cache_dir.glob("*" + PART_SUFFIX))


def test_a_full_disk_turns_the_cache_off_with_one_warning(
    shard_dir, tmp_path, local_epoch, monkeypatch, caplog
):
    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_module, "allocate", full)
    cache_dir = tmp_path / "cache"
    server = LocalHTTPServer(shard_dir)
    with server as base, caplog.at_level(logging.WARNING, logger="pipeline"):
        loader = remote_loader(base, cache_dir)
        assert epoch_counts(loader, 0) == local_epoch
        assert epoch_counts(loader, 1) == local_epoch
    warnings = [r for r in caplog.records if "shard cache" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert loader.stats.workers[0]["fetch"]["cache_off"] == 1
    assert not cached_entries(cache_dir) and not list(cache_dir.glob("*" + PART_SUFFIX))
    assert shard_bytes_sent(server) == 2 * sum(p.stat().st_size for p in train_tars(shard_dir))


def test_an_unwritable_cache_directory_turns_the_cache_off_with_one_warning(
    shard_dir, tmp_path, local_epoch, caplog
):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with LocalHTTPServer(shard_dir) as base, caplog.at_level(logging.WARNING, logger="pipeline"):
        loader = remote_loader(base, blocker / "cache")  # a directory under a file: ENOTDIR
        assert epoch_counts(loader, 0) == local_epoch
    warnings = [r for r in caplog.records if "shard cache" in r.getMessage()]
    assert len(warnings) == 1


def test_local_shards_are_read_in_place_never_copied(shard_dir, tmp_path, local_epoch):
    cache_dir = tmp_path / "cache"
    loader = loader_for(
        shard_dir,
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
        io=ReadOptions(cache_dir=str(cache_dir)),
    )
    assert epoch_counts(loader, 0) == local_epoch
    assert not cached_entries(cache_dir)
    assert loader.stats.workers[0]["fetch"]["bytes_fetched"] == 0


def test_cache_entry_names_cannot_escape_the_directory(tmp_path):
    cache = ShardCache(str(tmp_path / "c"), None)
    for url in ("http://h/../../etc/passwd", "s3://b/" + "../" * 20 + "x", "http://h/a%2f..%2fb"):
        key = cache_key(url, None, None)
        assert Path(cache.path(key)).parent == tmp_path / "c"
        assert key.isalnum()


def test_an_epoch_over_a_planted_cache_is_exact_and_never_hangs(shard_dir, tmp_path, local_epoch):
    """Two workers read through a cache where one entry is a FIFO, one right-size
    garbage, one a symlink to an outside file and one held by a stopped job: every
    sample once, no bad shard, each planted entry fetched again or read past the cache
    (before: the FIFO and the held entry hung until the DataLoader watchdog, and the
    garbage was a bad shard)."""
    cache_dir = tmp_path / "cache"
    outside = tmp_path / "outside.tar"
    with LocalHTTPServer(shard_dir) as base:
        epoch_counts(remote_loader(base, cache_dir), 0)  # a first job fills the cache
        loader = remote_loader(
            base,
            cache_dir,
            workers=Workers(count=2),
            io=ReadOptions(cache_dir=str(cache_dir), retry=RetryPolicy(deadline=1), timeout=60),
        )
        fifo, garbage, link, held = (
            cache_dir / (cache_key(s.url, s.sha256, s.bytes) + SHARD_SUFFIX)
            for s in list(loader.dataset.sources.shards[0])[:4]
        )
        fifo.unlink()
        os.mkfifo(fifo)
        garbage.write_bytes(os.urandom(garbage.stat().st_size))
        outside.write_bytes(link.read_bytes())
        link.unlink()
        link.symlink_to(outside)
        mtime = outside.stat().st_mtime_ns
        with open(held, "rb") as holder:
            fcntl.flock(holder, fcntl.LOCK_EX)
            assert epoch_counts(loader, 0) == local_epoch
    assert not loader.stats.bad_shards
    fetch = loader.stats.fetch
    assert fetch["cache_rejected"] == 3 and fetch["cache_timeouts"] == 1
    assert fetch["shards_fetched"] == 4
    assert outside.stat().st_mtime_ns == mtime and fifo.is_file() and not link.is_symlink()


def test_the_fetcher_reads_a_cached_shard_after_its_cache_entry_was_damaged(shard_dir, tmp_path):
    """An entry of the wrong size (not written by the cache) is dropped and fetched again."""
    cache_dir = tmp_path / "cache"
    tar = train_tars(shard_dir)[0]
    with LocalHTTPServer(shard_dir) as base:
        url = f"{base}/{tar.relative_to(shard_dir).as_posix()}"
        spec = ShardSpec(url, "tar", 1, bytes=tar.stat().st_size)
        cache = ShardCache(str(cache_dir), None)
        cache.prepare()
        Path(cache.path(cache_key(spec.url, None, spec.bytes))).write_bytes(b"short")
        fetcher = ShardFetcher(ReadOptions(cache_dir=str(cache_dir)))
        fetcher.schedule([spec])
        with fetcher.open(spec) as stream:
            assert stream.read() == tar.read_bytes()


@pytest.mark.slow
@pytest.mark.distributed
def test_an_s3_dataset_is_read_from_the_cache_in_epoch_two(
    shard_dir, tmp_path, local_epoch, monkeypatch
):
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from tests.objectstore import FaultProxy, MotoS3, isolate_aws_environment

    isolate_aws_environment(monkeypatch, tmp_path)
    cache_dir = tmp_path / "cache"
    with MotoS3() as s3, FaultProxy(s3.endpoint) as proxy:
        s3.create_bucket("cached")
        s3.upload_dir(shard_dir, "cached", "shards")
        loader = loader_for(
            "s3://cached/shards/manifest.json",
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            io=ReadOptions(
                cache_dir=str(cache_dir), storage_options=s3.storage_options(proxy.endpoint)
            ),
        )
        assert epoch_counts(loader, 0) == local_epoch
        first = proxy.count(r"\.tar$")
        assert first >= len(train_tars(shard_dir))
        assert epoch_counts(loader, 1) == local_epoch
        assert proxy.count(r"\.tar$") == first
