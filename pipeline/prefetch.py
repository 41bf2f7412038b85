"""`CudaPrefetcher`: the last stage of the loader, from pinned uint8 batches to normalized device tensors.

Wraps any iterable of `(images uint8 [B,3,H,W], labels [B][, keys])`, or of any other tuple of
fields the loader delivers; on CUDA it copies the next batch on a side stream while the
current one trains, and normalizes the images on the GPU.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from pipeline.mixup import MixupCutmix

log = logging.getLogger("pipeline")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_NOTHING = object()


class CudaPrefetcher:
    """Iterate `loader`, yielding its batches on `device`, converted to `dtype` and normalized.

        Each image becomes `(x / 255 - mean) / std`, computed as `(x - 255 mean) / (255 std)` with
        the constants made once on the device; the arithmetic runs in float32 and is cast to
        `dtype` last, so bf16/fp16 output is the correctly rounded float32 value. Labels move to
        the device unchanged, and so does every other tensor of the batch (multi-hot targets,
    weights, token ids); entries that are not tensors (keys, captions, JSON) pass through.

        On CUDA, every step of the hand-over is there for a reason (timm #2781/#2784 lists what
        goes wrong without them):

        - The side stream is created once, in `__init__`. The caching allocator pools memory per
          stream; a new stream per epoch strands the old stream's blocks in its pool.
        - Before each copy the side stream waits on the consumer's stream, so the copy is ordered
          after work the consumer already queued (including making `mean`/`std` and anything it
          released) and never overwrites storage that queued kernels still read.
        - The copy is `non_blocking` from pinned memory, so it overlaps the consumer's compute;
          from pageable memory it cannot overlap, which is why an unpinned loader is warned about.
        - The consumer's stream waits on the side stream before the batch is handed over, so its
          kernels never read a half-copied or half-normalized batch.
        - `record_stream(consumer)` on the handed-over tensors: they were allocated on the side
          stream, and without it the allocator could give their memory to the next prefetch as
          soon as Python drops them, while the consumer's kernels still read them.
        - One batch is prefetched ahead: batch k+1 is copied while batch k is used.
        - An empty loader yields nothing (no error, no hang).

        Because the prefetcher is one batch ahead of its consumer on CUDA, `state_dict()` rewinds
        the loader's state by the one batch it holds unseen, and a prefetcher abandoned mid-epoch
        gives that batch back to the loader, so a resumed run neither skips nor repeats a batch.

        On the CPU (a CPU `device`, or CUDA unavailable) the API is the same, with no streams and
        no look-ahead.

        Args:
            loader: yields `(images, labels)` or `(images, labels, keys)`; `images` uint8
                `[B, 3, H, W]` in either memory format.
            device: where batches go, e.g. `"cuda"`, `"cuda:1"` or `"cpu"`.
            dtype: floating dtype of the output images.
            mean: per-channel mean of images scaled to [0, 1].
            std: per-channel standard deviation of images scaled to [0, 1].
            channels_last: output images in `torch.channels_last` memory format; otherwise in
                the contiguous NCHW format, whatever the layout the loader delivers (its default
                channels-last batches are transposed on the device, where it is cheap).
            mix: a `pipeline.MixupCutmix` applied to each batch after normalisation, on the
                device (on the side stream, in float32, before the cast to `dtype`): the
                labels (second entry) become its soft targets. At the start of each
                iteration it is set to the loader's epoch and position (`epoch`,
                `len(loader) - batches_remaining()`) when the loader has them, so a resumed
                or restarted epoch mixes each batch as before. Never give it to an
                evaluation prefetcher.
    """

    def __init__(
        self,
        loader: Iterable,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        mean: Sequence[float] = IMAGENET_MEAN,
        std: Sequence[float] = IMAGENET_STD,
        channels_last: bool = False,
        mix: MixupCutmix | None = None,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        if len(mean) != 3 or len(std) != 3:
            raise ValueError("mean and std need one value per RGB channel")
        if min(std) <= 0:
            raise ValueError(f"std must be positive, got {tuple(std)}")
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            log.warning("CUDA is not available: CudaPrefetcher normalizes on the CPU instead")
            device = torch.device("cpu")
        self.loader = loader
        self.mix = mix
        self.device = device
        self.dtype = dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        # Folding the 1/255 into the constants turns the normalization into one sub and one div.
        scaled_mean = [m * 255 for m in mean]
        scaled_std = [s * 255 for s in std]
        self.mean = torch.tensor(scaled_mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(scaled_std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._ahead = False  # a batch taken from the loader is not yet handed to the consumer
        self._warned_unpinned = False

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[tuple]:
        self.align_mix()
        if self.stream is None:
            for batch in self.loader:
                yield self.convert(batch)
            return
        yield from self.iter_cuda()

    def iter_cuda(self) -> Iterator[tuple]:
        """Copy batch k+1 on the side stream while the consumer works on batch k."""
        batches = iter(self.loader)
        first = next(batches, _NOTHING)
        if first is _NOTHING:
            return
        pending = self.launch(first)
        try:
            for batch in batches:
                ready = self.hand_over(pending)
                self._ahead = True
                pending = self.launch(batch)
                yield ready
            self._ahead = False
            yield self.hand_over(pending)
        finally:
            if self._ahead:
                self.give_back_pending()

    def launch(self, batch: Sequence) -> tuple:
        """Queue the copy and normalization of `batch` on the side stream (host returns at once)."""
        self.check_pinned(batch[0])
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            return self.move(batch, non_blocking=True)

    def hand_over(self, batch: tuple) -> tuple:
        """Make the consumer's stream wait for `batch` and keep its memory until it is used."""
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_stream(self.stream)
        for item in batch:
            if isinstance(item, torch.Tensor):
                item.record_stream(consumer)
        return batch

    def convert(self, batch: Sequence) -> tuple:
        """The synchronous path: move and normalize `batch` on the current stream."""
        return self.move(batch, non_blocking=False)

    def move(self, batch: Sequence, non_blocking: bool) -> tuple:
        """Every tensor of `batch` on the device, the images (a 4-D first entry) normalized.

        Entries that are not tensors (keys, captions, JSON documents) pass through.
        """
        moved = []
        for item in batch:
            if isinstance(item, torch.Tensor):
                item = item.to(self.device, non_blocking=non_blocking)
            moved.append(item)
        if not (moved and isinstance(moved[0], torch.Tensor) and moved[0].dim() == 4):
            return tuple(moved)
        moved[0] = self.normalize(moved[0])
        if self.mix is not None and len(moved) > 1:
            moved[0], moved[1] = self.mix(moved[0], moved[1])
        if self.dtype != torch.float32:
            moved[0] = moved[0].to(self.dtype)
        return tuple(moved)

    def normalize(self, images: torch.Tensor) -> torch.Tensor:
        """`(images / 255 - mean) / std` in float32 (`move` casts to `dtype` after mixing)."""
        # copy=True: a float32 input must not be normalized in place under its owner.
        out = images.to(torch.float32, copy=True, memory_format=self.memory_format)
        return out.sub_(self.mean).div_(self.std)

    def align_mix(self) -> None:
        """Point the mix at the batch the loader yields next: its epoch and index in it."""
        loader = self.loader
        if self.mix is None or not all(hasattr(loader, n) for n in ("epoch", "batches_remaining")):
            return
        self.mix.set_position(loader.epoch, len(loader) - loader.batches_remaining())

    def check_pinned(self, images) -> None:
        if not isinstance(images, torch.Tensor) or images.is_pinned() or self._warned_unpinned:
            return
        self._warned_unpinned = True
        warnings.warn(
            "CudaPrefetcher got batches in pageable memory: host-to-device copies cannot "
            "overlap compute. Build the loader with pin_memory=True.",
            stacklevel=2,
        )

    def give_back_pending(self) -> None:
        """Rewind the loader over the batch that was prefetched but never handed over."""
        if hasattr(self.loader, "load_state_dict") and hasattr(self.loader, "state_dict"):
            self.loader.load_state_dict(self.state_dict())
        self._ahead = False

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)  # type: ignore[attr-defined]
        if self.mix is not None:
            self.mix.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The loader's state as of the batches handed to the consumer."""
        if self._ahead:
            return self.loader.state_dict(in_flight=1)  # type: ignore[attr-defined]
        return self.loader.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)  # type: ignore[attr-defined]
