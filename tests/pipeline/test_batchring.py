"""Reused batch buffers: slots come back when batches are dropped, never while they are held."""

import gc
import itertools
import pickle

import pytest
import torch

from pipeline.batchring import BatchRing, SlotBatch, materialize
from pipeline.config import Workers
from tests.pipeline.conftest import loader_for


def test_slot_is_freed_only_when_every_view_is_gone():
    ring = BatchRing(workers=1, slots=2, slot_bytes=2 * 4 * 4 * 3)
    slot = ring.acquire(0, (2, 4, 4, 3))
    slot.writable()[:] = 7
    slot.channels_last = True
    images = materialize(slot)
    assert images.shape == (2, 3, 4, 4) and int(images.sum()) == 7 * 96
    assert ring.holds(images) and ring.free_slots() == 1
    view = images[1:]
    del images, slot
    gc.collect()
    assert ring.free_slots() == 1  # the view still reads the slot
    del view
    gc.collect()
    assert ring.free_slots() == 2


def test_full_ring_and_oversized_batches_fall_back_to_allocation():
    ring = BatchRing(workers=2, slots=1, slot_bytes=100)
    held = ring.acquire(0, (1, 10, 10))
    assert held is not None
    assert ring.acquire(0, (1, 10, 10)) is None  # worker 0's only slot is taken
    assert ring.acquire(1, (1, 10, 11)) is None  # larger than a slot
    assert ring.acquire(1, (1, 10, 10)) is not None  # worker 1 has its own


def test_a_batch_dropped_unused_in_the_owner_frees_its_slot():
    ring = BatchRing(workers=1, slots=1, slot_bytes=8)
    slot = ring.acquire(0, (8,))
    assert ring.free_slots() == 0
    del slot  # e.g. a prefetched batch discarded when an iteration is abandoned
    gc.collect()
    assert ring.free_slots() == 1


def test_a_slot_becomes_a_tensor_only_once():
    ring = BatchRing(workers=1, slots=1, slot_bytes=8)
    slot = ring.acquire(0, (8,))
    first = slot.tensor()
    with pytest.raises(RuntimeError, match="once"):
        slot.tensor()
    assert first.shape == (8,)


def test_a_ring_pickled_outside_a_worker_start_is_detached_and_allocates():
    """A Ray actor gets such a copy; workers starting from a forkserver get the pages
    (tests/pipeline/test_worker_start.py)."""
    ring = BatchRing(workers=1, slots=1, slot_bytes=8)
    copy = pickle.loads(pickle.dumps(ring))
    assert not copy.attached and copy.acquire(0, (8,)) is None
    # A SlotBatch crossing processes keeps only what names the slot.
    slot = ring.acquire(0, (8,))
    assert isinstance(pickle.loads(pickle.dumps(slot)), SlotBatch)


def collect(loader, hold):
    """One epoch of (images, keys); with `hold`, every batch tensor is kept alive."""
    kept, out = [], []
    for images, _, keys in loader:
        if hold:
            kept.append(images)
        out.append((images.clone(), list(keys)))
    return out, kept


@pytest.mark.parametrize("workers", [0, 2])
def test_held_batches_are_never_overwritten(shard_dir, workers):
    reference, _ = collect(
        loader_for(shard_dir, workers=Workers(count=workers, reuse_buffers=False)), False
    )
    loader = loader_for(shard_dir, workers=Workers(count=workers, prefetch_factor=2))
    clones, kept = collect(loader, hold=True)
    assert len(kept) > loader.ring.workers * loader.ring.slots  # more batches than slots
    for (ref_images, ref_keys), (images, keys), live in zip(reference, clones, kept, strict=True):
        assert keys == ref_keys
        assert torch.equal(images, ref_images) and torch.equal(live, ref_images)


@pytest.mark.parametrize("workers", [0, 2])
def test_dropped_batches_reuse_the_ring(shard_dir, workers):
    loader = loader_for(shard_dir, workers=Workers(count=workers, prefetch_factor=2))
    reference, _ = collect(
        loader_for(shard_dir, workers=Workers(count=workers, reuse_buffers=False)), False
    )
    addresses, from_ring, count = set(), 0, 0
    for (images, _, _), (ref_images, _) in zip(loader, reference, strict=True):
        count += 1
        from_ring += loader.ring.holds(images)
        addresses.add(images.data_ptr())
        assert torch.equal(images, ref_images)
    assert from_ring == count  # every batch came from a slot...
    assert len(addresses) <= loader.ring.workers * loader.ring.slots  # ...and slots recur
    del images, ref_images
    gc.collect()
    assert loader.ring.free_slots() == loader.ring.workers * loader.ring.slots


def test_an_abandoned_epoch_gives_its_slots_back_to_the_next(shard_dir):
    loader = loader_for(shard_dir, workers=Workers(count=2, prefetch_factor=2))
    taken = list(itertools.islice(loader, 2))  # stop early: workers hold prefetched batches
    del taken
    batches = sum(1 for _ in loader)  # the next iteration drains and frees them
    gc.collect()
    assert batches > 0
    assert loader.ring.free_slots() == loader.ring.workers * loader.ring.slots


def test_workers_that_exit_every_epoch_allocate_instead(shard_dir):
    assert loader_for(shard_dir, workers=Workers(count=2, persistent=False)).ring is None
    assert loader_for(shard_dir, workers=Workers(count=0, persistent=False)).ring is not None


def test_the_pin_thread_copies_a_slot_out_and_frees_it(monkeypatch):
    # Pinning needs CUDA; a copy stands in for it, which is all the slot logic sees.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone())
    ring = BatchRing(workers=1, slots=1, slot_bytes=2 * 2 * 2 * 3)
    slot = ring.acquire(0, (2, 2, 2, 3))
    slot.writable()[:] = 5
    slot.channels_last = True
    pinned = slot.pin_memory()
    del slot
    gc.collect()
    assert ring.free_slots() == 1  # freed as soon as the copy is made
    assert not ring.holds(pinned) and pinned.shape == (2, 3, 2, 2) and int(pinned.sum()) == 120
