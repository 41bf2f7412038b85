"""The loader's per-batch main-process work: small tensors cross from workers by value."""

import pickle

import numpy as np
import pytest
import torch

from pipeline.batchring import INLINE_BYTES, InlineTensor, materialize
from pipeline.config import Shuffle, Workers
from pipeline.loader import inline_small_tensors
from tests.pipeline.conftest import loader_for


def test_small_tensors_travel_as_bytes_and_come_back_equal():
    labels = torch.arange(256, dtype=torch.int64)
    big = torch.zeros(INLINE_BYTES + 1, dtype=torch.uint8)
    brain = torch.ones(4, dtype=torch.bfloat16)  # no numpy twin: stays a tensor
    sparse = torch.eye(3).to_sparse()
    values, size, keys, stats = inline_small_tensors(
        ((labels, big, brain, sparse, ["a", "b"]), 2, None, {"worker": 0})
    )
    assert isinstance(values[0], InlineTensor)
    assert values[1] is big and values[2] is brain and values[3] is sparse
    assert values[4] == ["a", "b"]
    assert (size, keys, stats) == (2, None, {"worker": 0})
    sent = pickle.loads(pickle.dumps(values[0]))
    back = materialize(sent)
    assert isinstance(back, torch.Tensor) and back.dtype == torch.int64
    assert torch.equal(back, labels)
    back[0] = 7  # writable, owned by the consumer
    assert materialize(big) is big


def test_numpy_arrays_still_become_tensors_as_the_dataloader_made_them():
    # What the DataLoader's default_convert did without a collate_fn is kept.
    values, *_ = inline_small_tensors(((np.arange(3), [np.ones(2)]), 3, None, {}))
    assert torch.equal(materialize(values[0]), torch.arange(3))
    assert isinstance(values[1][0], torch.Tensor)


def test_the_pin_thread_pins_an_inline_tensor(monkeypatch):
    # Pinning needs CUDA; a copy stands in for it, which is all the wrapper sees.
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, device=None: self.clone() + 1)
    pinned = InlineTensor(np.arange(4)).pin_memory()
    assert torch.equal(pinned, torch.arange(4) + 1)


@pytest.mark.timeout(120)
def test_worker_batches_carry_the_same_labels_without_shared_memory(shard_dir):
    options = dict(fields=("image", "label"), shuffle=Shuffle(buffer=1, initial=1))
    inline = [
        (labels, keys)
        for _, labels, keys in loader_for(shard_dir, workers=Workers(count=1), **options)
    ]
    local = [
        (labels, keys)
        for _, labels, keys in loader_for(shard_dir, workers=Workers(count=0), **options)
    ]
    assert [keys for _, keys in inline] == [keys for _, keys in local]
    for (sent, _), (made, _) in zip(inline, local, strict=True):
        assert sent.dtype == torch.int64 and torch.equal(sent, made)
        assert not sent.is_shared()  # it came as bytes, not as a shared-memory file
