"""Loader workers fork where that is safe, else are spawned, and read alike either way.

Forking a process that runs torch.distributed, Ray or CUDA can hang the child for good
(python/cpython#112275; `shards.processes`); `Workers(start_method="auto")` then spawns
the workers, and the ring slots and the epoch state still reach them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipeline.batchring import BatchRing
from pipeline.config import Crop, ReadOptions, Workers
from pipeline.sharedbytes import SharedBytes
from pipeline.transforms import CenterCrop
from pipeline.worker_start import worker_context
from shards.errors import UsageError
from shards.processes import fork_hazard
from tests.pipeline.conftest import loader_for

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_auto_forks_beside_python_threads_and_spawns_under_torch_distributed(tmp_path):
    printed = run_python(
        f"""
        import threading
        import torch.distributed as dist
        from pipeline.worker_start import worker_context
        from shards.processes import fork_hazard, start_method
        print(worker_context("auto", None).get_start_method(), start_method(), fork_hazard())
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait, name="pinner")
        thread.start()
        print(worker_context("auto", None).get_start_method(), start_method(), "|", fork_hazard())
        stop.set(); thread.join()
        dist.init_process_group(
            "gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1
        )
        print(worker_context("auto", None).get_start_method(), start_method(), "|", fork_hazard())
        """
    ).splitlines()
    # The build's pool counts Python threads too; the loader only the native ones.
    assert printed[0] == "fork fork None"
    assert printed[1] == "fork forkserver | 1 other Python thread run (pinner)"
    expected = "spawn forkserver | torch.distributed is initialized (its communication threads)"
    assert printed[2] == expected


def test_an_asked_start_method_is_taken_as_asked(shard_dir):
    dataset = loader_for(shard_dir).dataset
    assert worker_context("spawn", dataset).get_start_method() == "spawn"
    assert worker_context("fork", dataset).get_start_method() == "fork"
    with pytest.raises(UsageError, match="start_method"):
        Workers(start_method="forkserver")


def test_a_spawned_process_writes_pages_the_parent_reads():
    shared = SharedBytes(64)
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=fill_with_sevens, args=(shared,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert bytes(shared.mapping[:64]) == b"\x07" * 64


def fill_with_sevens(shared: SharedBytes) -> None:
    shared.mapping[:] = b"\x07" * shared.size


def test_spawned_workers_deliver_the_forked_batches_in_ring_slots(shard_dir):
    def epochs(method: str):
        loader = loader_for(shard_dir, workers=Workers(count=2, start_method=method))
        batches = []
        for _ in range(2):
            for images, labels, keys in loader:
                batches.append((images.clone(), labels.clone(), keys, loader.ring.holds(images)))
        return batches

    forked, served = epochs("fork"), epochs("spawn")
    assert len(served) == len(forked) > 4
    for (images, labels, keys, _), (images2, labels2, keys2, in_ring) in zip(
        forked, served, strict=True
    ):
        assert keys2 == keys and torch.equal(labels2, labels) and torch.equal(images2, images)
        assert in_ring  # the ring's pages reached the workers, not a detached copy


def test_a_spawning_loader_resumes_mid_epoch_where_a_forking_one_would(shard_dir):
    def resumed(method: str):
        workers = Workers(count=2, start_method=method)
        first = loader_for(shard_dir, workers=workers)
        iterator = iter(first)
        for _ in range(3):
            next(iterator)
        state = first.state_dict()
        del iterator
        second = loader_for(shard_dir, workers=workers)
        second.load_state_dict(state)  # the epoch state reaches the workers via shared memory
        return [keys for _, _, keys in second]

    assert resumed("spawn") == resumed("fork")


def test_a_dataset_that_does_not_pickle_is_an_error_for_spawn_and_a_warning_for_auto(
    shard_dir, caplog, tmp_path
):
    crop = CenterCrop(size=32)
    transform = lambda data, rng, out=None: crop(data, rng, out)  # noqa: E731
    asked = loader_for(shard_dir, workers=Workers(count=1, start_method="spawn"))
    asked.dataset.transform = transform
    with pytest.raises(UsageError, match=r"start_method='spawn'.*module level"):
        worker_context("spawn", asked.dataset)

    with torch_distributed_alone(tmp_path), caplog.at_level(logging.WARNING, logger="pipeline"):
        assert fork_hazard(count_threads=False) is not None
        context = worker_context("auto", asked.dataset)
        worker_context("auto", asked.dataset)
        picklable = worker_context("auto", loader_for(shard_dir).dataset)
    assert context.get_start_method() == "fork"
    warnings = [r.getMessage() for r in caplog.records if "does not pickle" in r.getMessage()]
    assert len(warnings) == 1  # once per problem, not per loader
    assert "torch.distributed is initialized" in warnings[0] and "lambda" in warnings[0]
    assert picklable.get_start_method() == "spawn"


@contextlib.contextmanager
def torch_distributed_alone(tmp_path):
    """torch.distributed initialized in this process, a world of one."""
    store = f"file://{tmp_path}/store"
    torch.distributed.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_a_ring_reaches_a_spawned_process_attached():
    ring = BatchRing(workers=1, slots=2, slot_bytes=12)
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=take_a_slot, args=(ring,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert ring.free_slots() == 1  # the child's acquire is seen here
    assert bytes(ring.array(0, (12,))) == b"\x05" * 12


def take_a_slot(ring: BatchRing) -> None:
    slot = ring.acquire(0, (12,))
    assert slot is not None
    slot.writable()[:] = 5


class StallForever:
    """A transform whose worker lives on without ever finishing a batch."""

    def __call__(self, data, rng, out=None):
        time.sleep(3600)


def test_a_stalled_spawned_worker_ends_at_the_batch_timeout(shard_dir):
    loader = loader_for(
        shard_dir,
        crop=Crop(image_size=32, transform=StallForever()),
        workers=Workers(count=1, persistent=False, start_method="spawn"),
        io=ReadOptions(timeout=3),
    )
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 3 seconds"):
        next(iter(loader))
    assert time.monotonic() - began >= 3


SCRIPT = """
import sys
import torch.distributed as dist
from pipeline import Batching, Crop, LoaderConfig, Workers, build_loader


def first_batch(shards, store, method):
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    config = LoaderConfig(source=shards, split="train", batch=Batching(size=8),
                          crop=Crop(image_size=32), workers=Workers(count=1, start_method=method))
    loader = build_loader(config)
    images, labels = next(iter(loader))
    print(loader.dataloader().multiprocessing_context.get_start_method(), len(labels))
"""


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "top-level"])
def test_a_script_that_starts_workers_from_its_top_level_is_not_spawned(
    shard_dir, tmp_path, guarded
):
    """A spawned worker imports the main script again: unguarded, it would run the script's
    top level (here: join the process group, start a loader) once more in every worker."""
    call = "first_batch(sys.argv[1], sys.argv[2], sys.argv[3])"
    body = f'if __name__ == "__main__":\n    {call}\n' if guarded else f"{call}\n"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + body)

    def run(method: str) -> subprocess.CompletedProcess:
        store = f"file://{tmp_path}/store-{method}"
        command = [sys.executable, "train.py", str(shard_dir), store, method]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        return subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )

    auto = run("auto")
    assert auto.returncode == 0, auto.stderr
    if guarded:
        assert auto.stdout.split() == ["spawn", "8"]
        assert "cannot be spawned" not in auto.stderr
    else:
        assert auto.stdout.split() == ["fork", "8"]  # forked, and said why, once
        assert auto.stderr.count("cannot be spawned clean") == 1
        assert "train.py, line" in auto.stderr and 'if __name__ == "__main__":' in auto.stderr
        asked = run("spawn")
        assert asked.returncode != 0 and asked.stdout == ""
        assert "start_method='spawn' cannot start the workers" in asked.stderr
