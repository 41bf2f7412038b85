"""Remote shards fetched ahead of the reader over parallel ranged requests, within a budget.

Against the real localhost HTTP server, which records every request's Range header
and the bytes it sent per path.
"""

from __future__ import annotations

import io
import re
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pipeline.config import Batching, LoaderConfig, ReadOptions, Resampled, Workers
from pipeline.epoch import Mix, plan_epoch
from pipeline.fetch import ShardFetcher, plan_shards
from pipeline.plan import Partition
from pipeline.sources import ShardSpec
from pipeline.stages import DRAWS_AHEAD, SourceShards
from shards.errors import ShardpipeError
from shards.flags import SettingError
from shards.storage import RetryPolicy, ShardReadError, ranged
from shards.storage.ranged import fetch_into
from tests.conftest import shard_files
from tests.httpserver import LocalHTTPServer
from tests.pipeline.conftest import epoch_keys, loader_for

SPAN = 4096  # small spans, so the test shards (tens of KB) take several requests
BOUNDED = re.compile(r"^bytes=(\d+)-(\d+)$")


@pytest.fixture
def small_spans(monkeypatch):
    monkeypatch.setattr(ranged, "MIN_SPAN", SPAN)
    monkeypatch.setattr(ranged, "MAX_SPAN", SPAN)


@pytest.fixture(scope="module")
def local_epoch(shard_dir) -> Counter:
    loader = loader_for(shard_dir, batch=Batching(size=8, epoch_rule="uneven", drop_last=False))
    return Counter(k for batch in epoch_keys(loader) for k in batch)


def one_epoch(source: str, **overrides) -> tuple[Counter, object]:
    options = dict(batch=Batching(size=8, epoch_rule="uneven", drop_last=False))
    options.update(overrides)
    loader = loader_for(source, **options)
    return Counter(k for batch in epoch_keys(loader) for k in batch), loader


def tar_requests(server: LocalHTTPServer, name: str) -> list:
    return [r for r in server.requests if r.path.endswith("/" + name)]


def spec_for(base: str, shard_dir: Path, path: Path) -> ShardSpec:
    url = f"{base}/{path.relative_to(shard_dir).as_posix()}"
    return ShardSpec(url, "tar", 1, bytes=path.stat().st_size)


def test_remote_shards_arrive_over_parallel_ranges_and_the_epoch_is_exact(
    shard_dir, small_spans, local_epoch
):
    server = LocalHTTPServer(shard_dir)
    with server as base:
        keys, loader = one_epoch(f"{base}/manifest.json", workers=Workers(count=2))
    assert keys == local_epoch
    tars = shard_files(shard_dir, "tar", "train")
    for tar in tars:
        requests = tar_requests(server, tar.name)
        size = tar.stat().st_size
        assert len(requests) == -(-size // SPAN)  # one request per span, none repeated
        spans = sorted(tuple(map(int, BOUNDED.match(r.range).groups())) for r in requests)
        assert spans[0][0] == 0 and spans[-1][1] == size - 1
        assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert server.bytes_sent[requests[0].path] == size  # nothing fetched twice
    fetched = sum(w["fetch"]["bytes_fetched"] for w in loader.stats.workers.values())
    assert fetched == sum(t.stat().st_size for t in tars)


def test_fetch_into_writes_every_byte_at_its_offset_over_several_connections(
    shard_dir, small_spans, tmp_path
):
    tar = shard_files(shard_dir, "tar", "train")[0]
    server = LocalHTTPServer(shard_dir)
    with server as base, open(tmp_path / "copy", "w+b") as out:
        spec = spec_for(base, shard_dir, tar)
        landed = []
        got = fetch_into(
            spec.url,
            out.fileno(),
            RetryPolicy(),
            size=spec.bytes,
            connections=3,
            progress=landed.append,
        )
    assert got == tar.stat().st_size == sum(landed)
    assert (tmp_path / "copy").read_bytes() == tar.read_bytes()


def test_a_server_without_range_support_still_gives_the_exact_epoch(
    shard_dir, small_spans, local_epoch
):
    with LocalHTTPServer(shard_dir, ranges=False) as base:
        keys, _ = one_epoch(f"{base}/manifest.json")
    assert keys == local_epoch


def test_a_cut_range_is_resumed_and_the_epoch_is_exact(shard_dir, small_spans, local_epoch):
    tar = shard_files(shard_dir, "tar", "train")[1]
    server = LocalHTTPServer(shard_dir)
    with server as base:
        server.close_after("/" + tar.relative_to(shard_dir).as_posix(), 1000, times=2)
        keys, _ = one_epoch(
            f"{base}/manifest.json",
            io=ReadOptions(
                retry=RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05, timeout=5)
            ),
        )
    assert keys == local_epoch


def test_a_shard_that_cannot_be_fetched_is_a_counted_bad_shard_naming_its_url(
    shard_copy, small_spans
):
    missing = shard_files(shard_copy, "tar", "train")[2]
    missing.unlink()  # the manifest still lists it: the server answers 404
    with LocalHTTPServer(shard_copy) as base:
        keys, loader = one_epoch(f"{base}/manifest.json", max_skip_fraction=1.0)
    assert keys  # the other shards were read
    assert loader.stats.bad_shards["shard_unreadable"] == 1
    assert any(missing.name in text and "404" in text for text in loader.stats.bad_shard_examples)


def test_the_next_shards_are_fetched_while_one_is_read_within_the_budget(shard_dir):
    tars = shard_files(shard_dir, "tar", "train")[:3]
    budget = tars[0].stat().st_size + tars[1].stat().st_size
    server = LocalHTTPServer(shard_dir)
    with server as base:
        specs = [spec_for(base, shard_dir, tar) for tar in tars]
        fetcher = ShardFetcher(ReadOptions(prefetch_bytes=budget))
        counts = fetcher.schedule(specs)
        wait_for(lambda: all(tar_requests(server, t.name) for t in tars[:2]))
        # Shards 0 and 1 fill the budget: shard 2 waits until shard 0 is taken.
        assert not tar_requests(server, tars[2].name)
        with fetcher.open(specs[0]) as stream:
            assert stream.read() == tars[0].read_bytes()
            wait_for(lambda: tar_requests(server, tars[2].name))  # fetched while 0 is read
        for spec, tar in zip(specs[1:], tars[1:], strict=True):
            with fetcher.open(spec) as stream:
                assert stream.read() == tar.read_bytes()
    assert 0 < counts["ahead_peak"] <= budget
    assert counts["shards_fetched"] == 3 and counts["budget"] == budget
    assert all(len(tar_requests(server, t.name)) == 1 for t in tars)  # each fetched once


def wait_for(condition, limit_s: float = 30.0) -> None:
    """Poll until `condition()` holds (a background fetch); fail past `limit_s`."""
    until = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < until, "the background fetch never happened"
        time.sleep(0.01)


def test_without_prefetch_or_cache_a_remote_shard_streams_over_one_request(shard_dir, local_epoch):
    server = LocalHTTPServer(shard_dir)
    with server as base:
        keys, _ = one_epoch(f"{base}/manifest.json", io=ReadOptions(prefetch_bytes=0))
    assert keys == local_epoch
    for tar in shard_files(shard_dir, "tar", "train"):
        assert [r.range for r in tar_requests(server, tar.name)] == [None]


def test_parquet_shards_are_fetched_and_read_from_local_files(shard_dir, small_spans):
    expected, _ = one_epoch(str(shard_dir), format="parquet")
    with LocalHTTPServer(shard_dir) as base:
        keys, loader = one_epoch(
            f"{base}/manifest.json", format="parquet", workers=Workers(count=2)
        )
    assert keys == expected
    assert sum(w["fetch"]["shards_fetched"] for w in loader.stats.workers.values()) == len(
        shard_files(shard_dir, "parquet", "train")
    )


def test_resampled_mode_fetches_its_next_draws_while_it_reads_one(shard_dir, monkeypatch):
    opened = []
    real_open = ShardFetcher.open

    def counting_open(self, spec):
        opened.append(spec.url)
        return real_open(self, spec)

    monkeypatch.setattr(ShardFetcher, "open", counting_open)
    options = dict(batch=Batching(size=8), sampling=Resampled(epoch_samples=64))
    with LocalHTTPServer(shard_dir) as base:
        remote = loader_for(f"{base}/manifest.json", **options)
        batches = epoch_keys(remote)
    remote_opens = len(opened)
    local = epoch_keys(loader_for(str(shard_dir), **options))
    assert batches == local  # the same draws, whether fetched ahead or not
    assert sum(len(b) for b in batches) == 64
    fetch = remote.stats.workers[0]["fetch"]
    assert fetch["ahead_peak"] > 0  # shards were fetched before the reader opened them
    # Draws stop once those ahead cover the epoch: at most DRAWS_AHEAD fetched unread.
    assert remote_opens <= fetch["shards_fetched"] <= remote_opens + DRAWS_AHEAD


def test_a_failed_fetch_raises_a_shard_read_error_from_open(shard_dir):
    with LocalHTTPServer(shard_dir) as base:
        spec = ShardSpec(f"{base}/tar/no-such-shard.tar", "tar", 1, bytes=100)
        fetcher = ShardFetcher(ReadOptions())
        fetcher.schedule([spec])
        with pytest.raises(ShardReadError, match="404"), fetcher.open(spec):
            pass


def test_cache_and_prefetch_options_are_top_level_keywords_and_checked(tmp_path):
    config = LoaderConfig(source="data", io=ReadOptions(cache_dir=tmp_path, cache_limit="2GiB"))
    assert config.io.cache_dir == str(tmp_path) and config.io.cache_limit == 2 * 2**30
    with pytest.raises(SettingError, match="cache_limit"):
        LoaderConfig(source="data", io=ReadOptions(cache_dir=tmp_path, cache_limit=0))
    with pytest.raises(SettingError, match="fetch_connections"):
        ReadOptions(fetch_connections=0)


# Hostile servers under default prefetch (issue 29) ------------------------------------------


def tar_labels(data: bytes) -> dict[str, bytes]:
    """Each sample key's `.cls` payload in a tar shard's bytes."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {
            m.name.rsplit(".", 1)[0]: data[m.offset_data : m.offset_data + m.size]
            for m in tar.getmembers()
            if m.name.endswith(".cls")
        }


def relabelled(data: bytes) -> bytes:
    """The same tar, every label moved to the next class: same size, other labels."""
    out = bytearray(data)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".cls"):
                label = int(data[member.offset_data : member.offset_data + member.size])
                new = str((label + 1) % 10).encode()
                assert len(new) == member.size
                out[member.offset_data : member.offset_data + member.size] = new
    return bytes(out)


def labels_by_key(loader) -> dict[str, int]:
    return {
        key: int(label)
        for _, labels, keys in loader
        for key, label in zip(keys, labels, strict=True)
    }


@pytest.mark.timeout(60)
def test_a_shard_replaced_between_spans_is_never_spliced_under_default_prefetch(
    shard_copy, small_spans
):
    tar = shard_files(shard_copy, "tar", "train")[1]
    old = tar.read_bytes()
    old_labels, new_labels = tar_labels(old), tar_labels(relabelled(old))
    path = "/" + tar.relative_to(shard_copy).as_posix()
    server = LocalHTTPServer(shard_copy, conditions=False)  # a server ignoring If-Match
    server.change(path, [relabelled(old)], after=1)
    with server as base:
        loader = loader_for(
            f"{base}/manifest.json", batch=Batching(size=8, epoch_rule="uneven", drop_last=False)
        )
        seen = labels_by_key(loader)
    mine = {key: str(label).encode() for key, label in seen.items() if key in old_labels}
    # Started over from the new version: every label delivered is the new one.
    assert mine and mine == {key: new_labels[key] for key in mine}
    assert loader.stats.bad_shards == {}


@pytest.mark.timeout(60)
def test_a_shard_that_keeps_changing_is_a_counted_bad_shard_naming_its_url(shard_copy, small_spans):
    tar = shard_files(shard_copy, "tar", "train")[1]
    old = tar.read_bytes()
    path = "/" + tar.relative_to(shard_copy).as_posix()
    server = LocalHTTPServer(shard_copy)
    server.change(path, [relabelled(old), old] * 20, after=1)
    with server as base:
        loader = loader_for(
            f"{base}/manifest.json",
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            max_skip_fraction=1.0,
        )
        seen = labels_by_key(loader)
    assert not set(seen) & set(tar_labels(old))  # nothing of it delivered
    assert loader.stats.bad_shards["shard_unreadable"] == 1
    (example,) = loader.stats.bad_shard_examples
    assert tar.name in example and "the object changed while it was read" in example


@pytest.mark.timeout(60)
def test_dripping_spans_with_two_workers_end_in_a_named_error_before_the_watchdog(
    shard_copy, small_spans
):
    """Late spans of every shard take 2.3 s each: the 2.5 s deadline covers them all, so each
    shard read fails by its deadline and the workers' skip budgets end the epoch in an error
    naming a shard, before the 4.5 s watchdog (deadline + 2 x 1 s stall limit), which names
    none. With a clock per span no fetch ever failed (each span is under 2.5 s) and the
    watchdog fired first.

    The error is told by its text, not by the clock: the watchdog times one batch's wait, not
    the epoch, and a worker may need two shards (its first, then one read to refill its
    batch, each with its own deadline) to pass its skip budget."""
    server = LocalHTTPServer(shard_copy)
    for tar in shard_files(shard_copy, "tar", "train"):
        path = "/" + tar.relative_to(shard_copy).as_posix()
        server.drip(path, interval=2.3 / 16, times=1000, after=1, chunk=SPAN // 16)
    policy = RetryPolicy(attempts=1, timeout=1.0, deadline=2.5)
    with server as base:
        loader = loader_for(
            f"{base}/manifest.json", workers=Workers(count=2), io=ReadOptions(retry=policy)
        )
        watchdog = loader.batch_timeout()
        started = time.monotonic()
        with pytest.raises(ShardpipeError) as info:
            epoch_keys(loader)
        took = time.monotonic() - started
    text = str(info.value)
    assert watchdog == 2.5 + 2 * 1.0
    assert "DataLoader timed out" not in text
    assert re.search(r"skipped \d+ samples, over its budget .*'shard_unreadable'", text), text
    assert re.search(r"last: shard http://127\.0\.0\.1:\d+/tar/train-\d+\.tar", text), text
    # Bounded by the deadlines, with room for a loaded machine: a fetch without one ran on
    # past a watchdog period per shard.
    assert took < 2 * watchdog, f"{took:.1f} s"


def test_the_fetch_plan_is_a_slots_read_order_and_a_mix_merged_by_progress():
    part = Partition(1, 2, 8, False, "uneven", shuffle_buffer=4, shuffle_initial=2)
    names = [[f"a{i}" for i in range(6)], [f"b{i}" for i in range(3)]]
    counts = (np.array([8, 0, 8, 8, 4, 8]), np.array([6, 6, 6]))
    # One source: its pieces' shards, in the order the slot reads them.
    slot = plan_epoch(counts[0], part, 0, seed=3, epoch=1).worker(1)
    one = SourceShards(Mix.one(counts[0]), (names[0],), (None,))
    read = [names[0][piece.shard] for piece in slot.parts[0].pieces]
    assert plan_shards(slot, one) == read
    # Two sources: each one's shards in its order, merged by how far into its share
    # of the slot each piece starts (how the interleave reaches them).
    mix = Mix(("a", "b"), counts, (36, 18))
    slot = plan_epoch(mix, part, 0, seed=3, epoch=1).worker(0)
    merged = plan_shards(slot, SourceShards(mix, tuple(names), (None, None)))
    for source, part_slot in enumerate(slot.parts):
        own = [names[source][p.shard] for p in part_slot.pieces]
        assert [s for s in merged if s[0] == "ab"[source]] == own
    progress = []
    for source, part_slot in enumerate(slot.parts):
        done = 0
        for piece in part_slot.pieces:
            progress.append((done / part_slot.samples, source, names[source][piece.shard]))
            done += piece.stop - piece.start
    assert merged == [name for *_, name in sorted(progress)]
