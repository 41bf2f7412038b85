"""The loader under bad data, hostile input, remote reads and dying workers."""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from pipeline.config import Batching, Crop, ReadOptions, Workers
from pipeline.loader import LoaderConfig, build_loader
from pipeline.stats import LoaderDataError
from shards.tar import TarShardWriter, iter_tar_samples
from tests.conftest import shard_files, shard_path, shard_url
from tests.httpserver import LocalHTTPServer
from tests.pipeline.conftest import epoch_keys, loader_for


def rewrite_tar(path: Path, change) -> None:
    """Rewrite a tar shard, passing each sample through `change(index, sample)`."""
    with open(path, "rb") as stream:
        samples = list(iter_tar_samples(stream, str(path)))
    buffer = io.BytesIO()
    writer = TarShardWriter(buffer)
    for index, sample in enumerate(samples):
        sample = change(index, {k: v for k, v in sample.items() if k != "__url__"})
        writer.write(sample)
    writer.close()
    path.write_bytes(buffer.getvalue())


def full_epoch(directory, **overrides):
    loader = loader_for(
        directory, batch=Batching(size=8, epoch_rule="uneven", drop_last=False), **overrides
    )
    return loader, epoch_keys(loader)


def test_undecodable_samples_are_skipped_counted_and_refilled(shard_copy):
    reference = full_epoch(shard_copy)[1]

    def garble(index, sample):
        if index in (1, 4):
            sample["jpg"] = b"\xff\xd8\xff\xe0 definitely not a jpeg"
        return sample

    rewrite_tar(shard_path(shard_copy, "train", 0), garble)
    loader, batches = full_epoch(shard_copy, max_skip_fraction=0.5)
    assert [len(b) for b in batches] == [len(b) for b in reference]  # same batch count and sizes
    assert sum(loader.stats.skipped.values()) == 2
    assert loader.stats.refilled == 2


def test_truncated_shard_costs_only_its_unread_rest(shard_copy):
    reference = full_epoch(shard_copy)[1]
    target = shard_path(shard_copy, "train", 1)
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    loader, batches = full_epoch(shard_copy, max_skip_fraction=1.0)
    assert [len(b) for b in batches] == [len(b) for b in reference]
    skipped = loader.stats.skipped
    assert set(skipped) == {"truncated"} and 5 < skipped["truncated"] < 32
    assert loader.stats.bad_shards == {"truncated": 1}


def test_garbage_shard_past_the_budget_stops_with_a_clear_error(shard_copy):
    for tar in shard_files(shard_copy, "tar", "train"):
        tar.write_bytes(b"<html>503 Service Unavailable</html>" * 100)
    with pytest.raises(LoaderDataError, match="preprocess verify"):
        full_epoch(shard_copy)


def test_code_errors_in_a_transform_propagate_not_skipped(shard_dir):
    with pytest.raises(TypeError, match="bug in transform"):
        epoch_keys(loader_for(shard_dir, crop=Crop(image_size=32, transform=BuggyTransform())))


class BuggyTransform:
    def __call__(self, data, rng):
        raise TypeError("bug in transform")


class KillSometimes:
    """Transform that kills its own worker process on about one sample in five."""

    def __call__(self, data, rng):
        import numpy as np

        if rng.random() < 0.2:
            os.kill(os.getpid(), signal.SIGKILL)
        return np.zeros((32, 32, 3), dtype=np.uint8)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_killed_worker_raises_promptly_instead_of_hanging(shard_dir, start):
    """Spawned, as under torch.distributed, the worker is still the loader's child: its
    death arrives by SIGCHLD, even halfway through sending a batch."""
    loader = loader_for(
        shard_dir,
        crop=Crop(image_size=32, transform=KillSometimes()),
        workers=Workers(count=2, persistent=False, start_method=start),
    )
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="(?i)worker.*(killed|exited)"):
        epoch_keys(loader)
    assert time.monotonic() - began < loader.batch_timeout()  # not the whole batch timeout


def test_pipe_and_shell_urls_are_refused_and_no_process_is_spawned(shard_dir, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a process was spawned")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(os, "system", forbidden)
    monkeypatch.setattr(os, "popen", forbidden)
    for source in [
        "pipe:cat train-000000.tar",
        "pipe:curl -s http://x/a.tar",
        "ftp://host/a.tar",
        f"{shard_dir}/train-$(id).tar\n",
    ]:
        with pytest.raises(ValueError):
            build_loader(LoaderConfig(source=source, workers=Workers(count=0)))
    # A real read works with the process APIs forbidden.
    assert epoch_keys(loader_for(shard_dir))


class Planted:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["PLANTED_MARKER"]),))


def test_planted_pickle_members_are_never_unpickled(shard_copy, tmp_path, monkeypatch):
    marker = tmp_path / "PWNED"
    monkeypatch.setenv("PLANTED_MARKER", str(marker))
    payload = pickle.dumps(Planted())
    pickle.loads(payload)  # the payload is live: loading it creates the marker
    assert marker.exists()
    marker.unlink()

    def plant(index, sample):
        sample.update({"pkl": payload, "pyd": payload, "pth": payload})
        return sample

    for tar in shard_files(shard_copy, "tar", "train"):
        rewrite_tar(tar, plant)
    (shard_copy / "manifest.json").unlink()  # counts now come from the shards themselves
    pattern = shard_path(shard_copy, "train", 0).parent / "train-{000000..000005}.tar"
    loader = loader_for(str(pattern), workers=Workers(count=2))
    assert epoch_keys(loader)
    assert not marker.exists()


def test_shards_and_manifest_stream_from_a_local_http_server(shard_dir):
    local = Counter(k for b in full_epoch(shard_dir)[1] for k in b)
    with LocalHTTPServer(shard_dir) as base:
        loader = loader_for(
            f"{base}/manifest.json",
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=2),
        )
        remote = Counter(k for b in epoch_keys(loader) for k in b)
    assert remote == local


def test_flaky_http_server_is_retried_and_the_epoch_completes(shard_dir):
    from shards.storage import RetryPolicy

    local = Counter(k for b in full_epoch(shard_dir)[1] for k in b)
    server = LocalHTTPServer(shard_dir)
    with server as base:
        server.fail(shard_url("", "train", 0), count=2, status=503)
        server.close_after(shard_url("", "train", 1), 3000, times=1)
        loader = loader_for(
            f"{base}/manifest.json",
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            io=ReadOptions(
                retry=RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05, timeout=5)
            ),
        )
        remote = Counter(k for b in epoch_keys(loader) for k in b)
    assert remote == local


def test_manifest_checks_are_json_not_pickle(shard_dir):
    text = (shard_dir / "manifest.json").read_text()
    assert json.loads(text)["format"] == "shardpipe-manifest"


def test_parquet_shards_stream_over_http_with_range_requests(shard_dir):
    local = Counter(k for b in full_epoch(shard_dir, format="parquet")[1] for k in b)
    server = LocalHTTPServer(shard_dir)
    with server as base:
        loader = loader_for(
            f"{base}/manifest.json",
            format="parquet",
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=2),
        )
        remote = Counter(k for b in epoch_keys(loader) for k in b)
        ranged = [r for r in server.requests if r.path.endswith(".parquet") and r.range]
    assert remote == local
    assert ranged  # row groups were fetched by range, not the whole file up front


def test_an_unreadable_shard_counts_against_the_skip_budget(shard_copy):
    target = shard_path(shard_copy, "train", 2)
    target.write_bytes(b"garbage" * 100)
    with pytest.raises(LoaderDataError, match="over its budget"):
        full_epoch(shard_copy, max_skip_fraction=0.01)
    loader, _ = full_epoch(shard_copy, max_skip_fraction=1.0)
    assert set(loader.stats.skipped) == {"not_tar"}


def test_storage_options_never_appear_in_config_reprs():
    config = LoaderConfig(
        source="s3://bucket/manifest.json", io=ReadOptions(storage_options={"secret": "hunter2"})
    )
    assert "hunter2" not in repr(config)


# --- exactly-once eval: a bad shard's samples are skipped, never replaced by repeats -------


def strip_labels(directory: Path, fmt: str, index: int = 0) -> set[str]:
    """Take the class out of one train shard (its `cls` members or column); its keys."""
    import pyarrow.parquet as pq

    path = shard_path(directory, "train", index, fmt)
    if fmt == "tar":
        keys = set()

        def drop_cls(_, sample):
            keys.add(sample["__key__"])
            return {k: v for k, v in sample.items() if k != "cls"}

        rewrite_tar(path, drop_cls)
        return keys
    table = pq.read_table(path)
    pq.write_table(table.drop_columns(["cls"]), path, row_group_size=16)
    return set(table.column("__key__").to_pylist())


def eval_epoch(directory, world: int, workers: int, **overrides) -> tuple[Counter, list, dict]:
    """Every rank's eval epoch: keys delivered, batch sizes, and the summed counts."""
    seen, sizes = Counter(), []
    counts = {"skipped": Counter(), "refilled": 0, "unfilled": 0}
    for rank in range(world):
        loader = loader_for(
            directory,
            rank=rank,
            world_size=world,
            workers=Workers(count=workers, persistent=False),
            max_skip_fraction=1.0,
            **overrides,
        )
        for keys in epoch_keys(loader):
            seen.update(keys)
            sizes.append(len(keys))
        counts["skipped"].update(loader.stats.skipped)
        counts["refilled"] += loader.stats.refilled
        counts["unfilled"] += loader.stats.unfilled
    return seen, sizes, counts


@pytest.mark.parametrize("fmt", ["tar", "parquet"])
@pytest.mark.parametrize("world, workers", [(1, 0), (2, 2)])
def test_exactly_once_eval_never_delivers_a_sample_twice(shard_copy, fmt, world, workers):
    """The issue's case: a shard without its `cls` gave its count of doubled samples in eval.

    Now every good sample comes exactly once, the bad ones are counted skips, and the
    batches they would have filled come short (`unfilled`); nothing is refilled.
    """
    from tests.pipeline.test_loader import split_keys

    everything = split_keys(shard_copy, "train")
    bad = strip_labels(shard_copy, fmt)
    seen, sizes, counts = eval_epoch(shard_copy, world, workers, format=fmt, train=False)
    assert max(seen.values()) == 1  # no sample twice
    assert set(seen) == set(everything) - bad  # every good one
    assert sum(counts["skipped"].values()) == len(bad) == counts["unfilled"]
    assert counts["refilled"] == 0
    assert sum(sizes) == len(everything) - len(bad) and 0 not in sizes  # short, never empty


def test_training_keeps_its_equal_batches_by_refilling(shard_copy):
    """Training (the `pad` rule) still fills every batch, so DDP ranks stay in step."""
    from tests.pipeline.test_loader import split_keys

    bad = strip_labels(shard_copy, "tar")
    whole = eval_epoch(shard_copy, 2, 0, train=True, batch=Batching(size=8, drop_last=True))
    damaged_loader = loader_for(
        shard_copy, rank=0, world_size=2, batch=Batching(size=8, drop_last=True)
    )
    seen, sizes, counts = eval_epoch(
        shard_copy, 2, 0, train=True, batch=Batching(size=8, drop_last=True)
    )
    assert set(sizes) == {8} and len(sizes) == len(whole[1]) == 2 * len(damaged_loader)
    assert counts["refilled"] == sum(counts["skipped"].values()) > 0 and counts["unfilled"] == 0
    assert not set(seen) & bad and len(split_keys(shard_copy, "train")) > len(bad)


def test_an_eval_worker_whose_last_batches_are_all_bad_reports_its_counts(shard_copy):
    """A worker that ends before its planned batches still hands over its final skips."""
    from tests.pipeline.test_loader import split_keys

    everything = split_keys(shard_copy, "train")
    bad = set()
    for index in range(len(shard_files(shard_copy, "tar", "train"))):
        if index % 2:
            bad |= strip_labels(shard_copy, "tar", index)
    seen, sizes, counts = eval_epoch(shard_copy, 1, 2, train=False)
    assert Counter(seen) == Counter(set(everything) - bad)
    assert counts["skipped"] == {"no_label": len(bad)} and counts["unfilled"] == len(bad)
