"""Batch buffers that DataLoader workers reuse instead of allocating fresh shared memory.

Why: a worker that builds every batch in new shared memory pays the kernel for each new
page, ~20 ms for a 256 x 224 x 224 x 3 batch on a 2-core machine: ~80 us an image, about
8% of what decoding and cropping it costs. FFCV and DALI avoid this by reusing buffers
and asking users not to hold batches; this ring reuses them without that rule. A slot is
written again only after every tensor over it has been freed in the consumer (a
`weakref.finalize` on the array torch keeps alive), and a worker that finds none of its
slots free builds the batch in fresh shared memory as before. Holding batches is never
unsafe, only slower.

The ring is one shared mapping (`pipeline.sharedbytes.SharedBytes`) made in the main
process: forked workers inherit it, workers started by a forkserver or spawn map the same
pages from the descriptor that comes with the dataset. Pickled for anything else (a Ray
actor) it arrives detached, and that copy always allocates.

Flow: a worker `acquire`s a slot, fills `SlotBatch.writable()`, and sends the small
`SlotBatch` through the DataLoader's queue. The consumer turns it into a tensor with
`SlotBatch.tensor()`; the DataLoader's pin-memory thread calls `SlotBatch.pin_memory()`,
which copies the slot into pinned memory and frees it at once.
"""

from __future__ import annotations

import math
import os
import uuid
import weakref

import numpy as np
import torch

from pipeline.sharedbytes import SharedBytes

_FREE, _TAKEN = 0, 1
_RINGS: weakref.WeakValueDictionary[str, BatchRing] = weakref.WeakValueDictionary()


class BatchRing:
    """`slots` reusable batch buffers of `slot_bytes` for each of `workers` workers.

    A batch smaller than a slot (a progressive schedule's smaller epochs, an eval loader's
    short last batch) takes the slot's first bytes, so one ring serves every epoch's size.
    Pages are committed on first use only, so an unused ring costs address space, not
    memory; a used one holds `workers * slots * slot_bytes` bytes of shared memory for the
    loader's lifetime (what the in-flight batches would take anyway).
    """

    def __init__(self, workers: int, slots: int, slot_bytes: int) -> None:
        if workers < 1 or slots < 1 or slot_bytes < 1:
            raise ValueError("a batch ring needs at least one worker, slot and byte")
        self.workers, self.slots, self.slot_bytes = workers, slots, slot_bytes
        self.token = uuid.uuid4().hex
        self.owner = os.getpid()
        count = workers * slots
        self._memory = SharedBytes(count + count * slot_bytes)
        self._attach()

    def _attach(self) -> None:
        self._mapping = self._memory.mapping  # a flag byte per slot, then the slots
        self._pixels_at = self.workers * self.slots
        if self._mapping is not None:
            _RINGS[self.token] = self

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_mapping"]  # the mapping comes back from `_memory` (or not: detached)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._attach()

    @property
    def attached(self) -> bool:
        return self._mapping is not None

    def acquire(self, worker: int, shape: tuple[int, ...]) -> SlotBatch | None:
        """A free slot of `worker` for a uint8 batch of `shape`, or None (allocate instead)."""
        nbytes = math.prod(shape)  # np.prod costs ~5 us a call: a ufunc reduce on a new array
        if self._mapping is None or nbytes > self.slot_bytes or not 0 <= worker < self.workers:
            return None
        first = worker * self.slots
        for slot in range(first, first + self.slots):
            if self._mapping[slot] == _FREE:
                self._mapping[slot] = _TAKEN
                return SlotBatch(self.token, slot, tuple(shape), self.owner)
        return None

    def array(self, slot: int, shape: tuple[int, ...]) -> np.ndarray:
        """A writable numpy view of the slot's first bytes, shaped `shape`."""
        if self._mapping is None:
            raise RuntimeError("this batch ring is detached (a copy pickled for another process)")
        count = math.prod(shape)
        offset = self._pixels_at + slot * self.slot_bytes
        array = np.frombuffer(self._mapping, np.uint8, count, offset)
        return array.reshape(shape)

    def release(self, slot: int) -> None:
        if self._mapping is not None:
            self._mapping[slot] = _FREE

    def free_slots(self) -> int:
        """Slots not held by a worker or a consumer right now (for tests and diagnostics)."""
        if self._mapping is None:
            return 0
        return sum(1 for flag in self._mapping[: self._pixels_at] if flag == _FREE)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory lies in this ring."""
        if self._mapping is None:
            return False
        start = np.frombuffer(self._mapping, np.uint8, 1).ctypes.data + self._pixels_at
        return start <= tensor.data_ptr() < start + self.workers * self.slots * self.slot_bytes


class SlotBatch:
    """A uint8 batch stored in a ring slot: what a worker sends instead of a tensor.

    In the process that owns the ring, a `SlotBatch` dropped without being turned into a
    tensor (a discarded prefetch, say) frees its slot; the worker's own copy never does.
    """

    def __init__(self, token: str, slot: int, shape: tuple[int, ...], owner: int) -> None:
        self.token, self.slot, self.shape, self.owner = token, slot, shape, owner
        self.channels_last = False  # storage is NHWC: hand out an NCHW-shaped view
        self._pending = os.getpid() == owner  # the slot is ours to free if never used

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_pending"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._pending = os.getpid() == self.owner

    def __del__(self) -> None:
        if getattr(self, "_pending", False):
            ring = _RINGS.get(self.token)
            if ring is not None:
                ring.release(self.slot)

    def _ring(self) -> BatchRing:
        ring = _RINGS.get(self.token)
        if ring is None or not ring.attached:
            raise RuntimeError(
                "the loader that made this batch is gone; take batches from a live loader"
            )
        return ring

    def writable(self) -> np.ndarray:
        """The slot as a writable array of `shape` (the worker fills it)."""
        return self._ring().array(self.slot, self.shape)

    def tensor(self) -> torch.Tensor:
        """The batch as a tensor over the slot; the slot is freed when the tensor is."""
        if not self._pending:
            raise RuntimeError(
                "a SlotBatch becomes a tensor once, in the process that owns its ring"
            )
        ring = self._ring()
        array = ring.array(self.slot, self.shape)
        # torch keeps `array` alive exactly as long as the storage: once no tensor or view
        # over the slot is left, the array dies and the slot is free for the worker again.
        weakref.finalize(array, ring.release, self.slot)
        self._pending = False
        batch = torch.from_numpy(array)
        return batch.permute(0, 3, 1, 2) if self.channels_last else batch

    def pin_memory(self, device: str | torch.device | None = None) -> torch.Tensor:
        """Called by the DataLoader's pin-memory thread: a pinned copy; the slot is freed now."""
        batch = self.tensor()
        return batch.pin_memory(device) if device is not None else batch.pin_memory()


# Tensors up to this size cross from a worker pickled by value (`InlineTensor`).
INLINE_BYTES = 64 * 1024
# dtypes with a numpy twin (`Tensor.numpy()` refuses bfloat16, complex32, quantized types).
_INLINE_DTYPES = frozenset(
    (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
    )
)


class InlineTensor:
    """A small CPU tensor sent from a worker as its bytes instead of through shared memory.

    Why: torch sends a tensor through the DataLoader's queue as a shared-memory file whose
    descriptor the consumer fetches over a new socket connection to the worker, ~300 us of
    the main process's time per tensor on a 2-core machine, whatever its size: more than
    the rest of a batch's bookkeeping. A batch's labels (2 KiB for 256 samples) cost less
    as 2 KiB in the pickle. The consumer turns it back into a tensor with `tensor()`, or
    the pin-memory thread with `pin_memory()`, so batches look as before.
    """

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    @classmethod
    def wrap(cls, value: object) -> object:
        """`value` as an `InlineTensor` when it is a small plain CPU tensor, else unchanged."""
        if (
            isinstance(value, torch.Tensor)
            and value.dtype in _INLINE_DTYPES
            and value.device.type == "cpu"
            and value.layout == torch.strided  # not sparse
            and not value.is_nested
            and not value.requires_grad
            and value.nbytes <= INLINE_BYTES
        ):
            return cls(value.numpy())
        return value

    def tensor(self) -> torch.Tensor:
        return torch.from_numpy(self.array)

    def pin_memory(self, device: str | torch.device | None = None) -> torch.Tensor:
        """Called by the DataLoader's pin-memory thread: the tensor, pinned."""
        batch = self.tensor()
        return batch.pin_memory(device) if device is not None else batch.pin_memory()


def materialize(value: object) -> object:
    """A batch entry as the consumer sees it: ring slots and inline tensors become tensors."""
    return value.tensor() if isinstance(value, (SlotBatch, InlineTensor)) else value
