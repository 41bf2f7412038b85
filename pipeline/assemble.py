"""The loader's last stages, from encoded samples to batches: decode + augment each sample
(`BatchAssembler.decode`), then assemble batches of the role's planned sizes, bad samples
counted and skipped, refilled from recent good ones (or, exactly once, left short).

Runs wherever a role runs (a DataLoader worker, the main process, a Ray actor); where the
image batches are written is the caller's choice (`BatchMemory`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.augment import build_augmenter
from pipeline.augment.errors import OpFailed
from pipeline.batchring import BatchRing, SlotBatch
from pipeline.fast_transforms import pillow_fallbacks
from pipeline.stages import StreamSettings
from pipeline.stats import LoaderDataError, WorkerStats, count_skips
from pipeline.transforms import SampleRandom
from shards.errors import UsageError
from shards.sample import (
    Field,
    Sample,
    SampleError,
    check_class_range,
    class_ranged_fields,
    collate_values,
    field_value,
)

if TYPE_CHECKING:
    from pipeline.augment.augmenter import Augmenter

log = logging.getLogger("pipeline")

LOG_EVERY = 100
RESERVE_SIZE = 32


@dataclass(frozen=True)
class BatchMemory:
    """Where a role writes its image batches: a slot of `ring` (DataLoader workers forked
    with one), fresh shared memory (`shared`: a DataLoader worker, so the batch is sent
    without another copy), or plain memory (the main process, a Ray actor)."""

    ring: BatchRing | None = None
    worker: int = 0  # the ring's slots of this DataLoader worker
    shared: bool = False


@dataclass(frozen=True)
class EpochImages:
    """How one epoch's images are made: the crop at the epoch's side, then the augmenter."""

    transform: Callable
    augmenter: Augmenter | None
    size: int

    @property
    def folds(self) -> bool:
        """Whether the crop takes a geometric op to fold into its resize (the fast crops)."""
        return getattr(self.transform, "folds_affine", False)


class BatchAssembler:
    """Decodes a role's shuffled samples into batches of its planned sizes.

    Yields ready batches `(values, size, keys, stats)`; an exactly-once epoch that ends
    short ends with `((), 0, None, stats)`, its final counts (`ShardLoader` yields no batch
    for it). `values` holds one collated entry per field of `settings.fields`, in that
    order: images uint8 `[B, 3, H, W]` (or a ring `SlotBatch`), labels int64 `[B]`, text
    and JSON as lists, multi-label targets float32 `[B, C]`, weights float32 `[B]`.

    Args:
        skip_hint: what to do when the skip budget is spent (`ShardReader.skip_hint`).
    """

    def __init__(
        self,
        settings: StreamSettings,
        transform: Callable,
        skip_hint: Callable[[Mapping[str, int]], str],
        memory: BatchMemory,
    ) -> None:
        self.settings = settings
        self.transform = transform
        self.skip_hint = skip_hint
        self.memory = memory
        self.ranged = class_ranged_fields(settings.fields, settings.num_classes)
        self.direct = direct_image_field(settings, transform)

    def iter_batches(
        self, shuffled, sizes: Iterable[int], epoch: int, stats: WorkerStats
    ) -> Iterator[tuple]:
        reserve: deque = deque(maxlen=RESERVE_SIZE)
        fallbacks = pillow_fallbacks()  # this process's count before this epoch's decodes
        sizes = iter(sizes)  # what an exactly-once epoch leaves unfilled is summed from it
        images = self.epoch_images(epoch)
        for size in sizes:
            target = self.image_target(size, images)
            try:
                rows, keys = self.fill_batch(shuffled, size, epoch, stats, reserve, target, images)
            except BaseException:
                if target is not None:
                    target.abandon()  # a worker's slot is free again, not leaked
                raise
            if len(rows) < size:  # exactly once: the stream ran dry, its bad samples skipped
                stats.unfilled += size - len(rows)
                if not rows:  # no empty batch: the worker's final counts, and the end
                    if target is not None:
                        target.abandon()
                    stats.unfilled += sum(sizes)  # the planned batches left, unfilled too
                    yield (), 0, None, stats.snapshot()
                    return
                if target is not None:
                    target.shorten(len(rows))
            stats.samples += len(rows)
            stats.pillow_fallbacks = pillow_fallbacks() - fallbacks
            yield self.collate(rows, keys, stats, target)

    def fill_batch(
        self,
        shuffled,
        size: int,
        epoch: int,
        stats: WorkerStats,
        reserve: deque,
        target,
        images: EpochImages,
    ) -> tuple[list[tuple], list[str]]:
        """Decode `size` good samples, skipping bad ones; when the stream ends, refill from
        recent good samples, or (`exactly_once`) return the batch short."""
        rows: list[tuple] = []
        keys: list[str] = []
        augments: list = []  # each accepted image's (pixels, rng, drawn ops) to augment
        augmented: list = []  # and its sample
        while len(rows) < size:
            sample = next(shuffled, None)
            if sample is None:
                if self.settings.exactly_once:
                    break
                sample, repeat = self.refill(reserve, stats)
            else:
                repeat = sample.get("__repeat__", 0)  # a mix's pass over its source
            out = None if target is None else target.arrays[len(rows)]
            sample_augments: list = []  # kept only if the whole sample decodes
            try:
                row = self.decode(sample, epoch, stats, sample_augments, repeat, out, images)
            except SampleError as error:
                self.log_skip(sample, error, stats)
                if "__source__" in sample:
                    stats.source_skipped[sample["__source__"]] += 1
                where = f"{sample.get('__url__')} key {sample.get('__key__')}"
                count_skips(stats, error.reason, 1, where, self.skip_hint)
                continue
            reserve.append(sample)
            rows.append(row)
            augments.extend(sample_augments)
            augmented.extend([sample] * len(sample_augments))
            keys.append(sample["__key__"])
            if "__source__" in sample:
                stats.sources[sample["__source__"]] += 1
        if augments:
            self.augment(augments, augmented, images, stats)
        return rows, keys

    def augment(self, augments: list, samples: list, images: EpochImages, stats) -> None:
        """Run the batch's augmentation (`Augmenter.run_batch`), timed.

        Raises:
            UsageError: an op raised (a user op: ours never do on a valid image), naming
                it and the sample. It runs after the batch is cropped, so it cannot
                skip the sample; a sample to leave out is the crop's to refuse.
        """
        started = time.perf_counter()
        try:
            images.augmenter.run_batch(augments)
        except OpFailed as failed:
            sample, error = samples[failed.index], failed.__cause__
            op = getattr(failed.op, "__qualname__", None) or repr(failed.op)
            raise UsageError(
                f"Augment op {op} raised {type(error).__name__}: {error} on sample "
                f"{sample.get('__key__')} of {sample.get('__url__')}; an op must work on any "
                "uint8 HxWx3 crop, and cannot skip a sample: raise SampleError in "
                "Crop.transform for that"
            ) from error
        spent = time.perf_counter() - started
        stats.augment_s += spent
        stats.decode_s += spent

    def epoch_images(self, epoch: int) -> EpochImages:
        """The crop of `epoch` (at its progressive side) and the augmenter for that side.

        Made where a worker starts an epoch (`set_epoch` reaches persistent workers there),
        so a new side needs no new worker: its batches take the first bytes of slots sized
        for the largest side (`ShardLoader.make_ring`).
        """
        s = self.settings
        transform, size = self.transform, s.image_size
        if s.progressive is not None:
            size = s.progressive.size_at(epoch)
            transform = dataclasses.replace(transform, size=size)
        augmenter = None
        if s.augment is not None:  # the policy's geometric filter follows the crop's
            augmenter = build_augmenter(s.augment, size, getattr(transform, "resample", None))
        return EpochImages(transform, augmenter, size)

    def image_target(self, size: int, images: EpochImages) -> ImageTarget | None:
        """The batch buffer the transform writes into, when it can (see `direct_image_field`)."""
        if self.direct is None:
            return None
        side = images.transform.size
        return ImageTarget.allocate((size, side, side, 3), True, self.memory)

    def decode(
        self,
        sample: Sample,
        epoch: int,
        stats: WorkerStats,
        augments: list,
        repeat: int = 0,
        out: np.ndarray | None = None,
        images: EpochImages | None = None,
    ) -> tuple:
        """One value per field: the transformed image, the label, text, ...

        Args:
            augments: where each image's augmentation is left, to run with the batch's
                (`Augmenter.run_batch`) once every field of the sample decoded.
            out: where the image transform writes its pixels (a slot of the batch), when
                the stream writes images in place (`direct_image_field`).
            images: the epoch's crop and augmenter (default: `epoch_images(epoch)`).
        """
        if "__error__" in sample:
            raise sample["__error__"]
        images = self.epoch_images(epoch) if images is None else images
        started = time.perf_counter()
        key, seed = sample["__key__"], self.settings.seed
        parsed: dict = {}  # JSON members parsed once for all fields reading them
        row = []
        for index, spec in enumerate(self.settings.fields):
            value = field_value(sample, spec, parsed)
            # Augmentation randomness comes from the sample key and epoch, so it does
            # not depend on which worker or rank happens to decode the sample.
            if spec.kind == "image":
                slot = out if index == self.direct else None
                value = self.decode_image(
                    value, f"{seed}:{epoch}:{key}:{repeat}", images, slot, augments
                )
            else:
                if index in self.ranged:
                    check_class_range(spec, value, self.settings.num_classes, key)
                if spec.transform is not None:
                    rng = SampleRandom(f"{spec.name}:{seed}:{epoch}:{key}:{repeat}")
                    value = spec.transform(value, rng)
            row.append(value)
        stats.decode_s += time.perf_counter() - started
        return tuple(row)

    def decode_image(
        self,
        data: object,
        draw_key: str,
        images: EpochImages,
        out: np.ndarray | None,
        augments: list,
    ) -> np.ndarray:
        """One image field: the crop, then the augmentation, each drawing from its own
        `SampleRandom` of `draw_key` (seed:epoch:key:repeat), so the crop's draws stay
        those of a loader without augmentation. The policy's draws come first: its leading
        geometric ops go into the crop where it folds them (`pipeline.fast_transforms`);
        the rest run on the crop with the batch's (`augments`).

        Args:
            out: the batch slot the crop writes into, when the stream writes in place.
            augments: where (pixels, rng, ops) is left for `Augmenter.run_batch`.
        """
        rng = SampleRandom(f"aug:{draw_key}")
        augment_rng, drawn, fold = None, None, {}
        if images.augmenter is not None:
            augment_rng = SampleRandom(f"augment:{draw_key}")
            drawn = images.augmenter.draw(augment_rng)
            if images.folds:
                then, drawn = images.augmenter.leading_affine(drawn)
                fold = {} if then is None else {"then": then}
        if out is not None:
            value = images.transform(data, rng, out=out, **fold)
            if value is not out:  # a transform that could not use the slot
                out[...] = value
                value = out
        else:
            value = images.transform(data, rng, **fold)
        if images.augmenter is not None:
            value = augmentable(value)
            augments.append((value, augment_rng, drawn))
        return value

    def refill(self, reserve: deque, stats: WorkerStats) -> tuple[Sample, int]:
        """A recent good sample and its repeat number (for a new augmentation)."""
        if not reserve:
            raise LoaderDataError(
                f"worker {stats.worker}: no readable samples to fill its batches "
                f"(skipped: {dict(stats.skipped)}). {self.skip_hint(stats.skipped)}"
            )
        stats.refilled += 1
        return reserve[stats.refilled % len(reserve)], stats.refilled

    def log_skip(self, sample: Sample, error: SampleError, stats: WorkerStats) -> None:
        skipped = sum(stats.skipped.values()) + 1
        if skipped == 1 or skipped % LOG_EVERY == 0:
            log.warning(
                "skipped sample %s of %s: %s (%d skipped so far)",
                sample.get("__key__"),
                sample.get("__url__"),
                error,
                skipped,
            )

    def collate(
        self,
        rows: list[tuple],
        keys: list[str],
        stats: WorkerStats,
        target: ImageTarget | None = None,
    ) -> tuple:
        values = []
        columns = zip(*rows, strict=True)
        for index, (spec, column) in enumerate(zip(self.settings.fields, columns, strict=True)):
            if target is not None and index == self.direct:
                values.append(target.finish())  # the images were written in place
            elif spec.kind == "image":
                values.append(
                    stack_images(list(column), self.settings.batch.channels_last, self.memory)
                )
            elif spec.transform is not None:
                values.append(stack_outputs(spec, list(column), keys))
            else:
                collated = collate_values(spec, list(column))
                is_array = isinstance(collated, np.ndarray)
                values.append(torch.from_numpy(collated) if is_array else collated)
        keys = keys if self.settings.with_keys else None
        return tuple(values), len(rows), keys, stats.snapshot()


def stack_outputs(spec: Field, outputs: list, keys: list[str]) -> torch.Tensor | list:
    """A field transform's outputs as one batch: tensors and arrays stacked, others a list.

    Raises:
        ValueError: the outputs are tensors of different shapes (a bug of the
            transform, e.g. a tokenizer that does not pad to a fixed length).
    """
    first = outputs[0]
    if not isinstance(first, (torch.Tensor, np.ndarray)):
        return outputs
    tensors = [torch.as_tensor(output) for output in outputs]
    shapes = {tuple(tensor.shape) for tensor in tensors}
    if len(shapes) > 1:
        raise ValueError(
            f"the transform of field {spec.name!r} returned tensors of shapes "
            f"{sorted(shapes)[:4]} in one batch (keys {keys[0]}...); return one fixed shape "
            "(pad or truncate, e.g. to a fixed token count) so the batch can be stacked"
        )
    return torch.stack(tensors)


def direct_image_field(settings: StreamSettings, transform: Callable) -> int | None:
    """Index of the image field whose transform writes straight into the batch, or None.

    The loader's crops (`writes_into`, a fixed `size`) resize into their slot of a
    channels-last batch: no per-sample output array (fresh pages for each 150 KB image)
    and no copy into the batch. Other transforms, NCHW batches and samples with several
    image fields are stacked as before.
    """
    images = [i for i, spec in enumerate(settings.fields) if spec.kind == "image"]
    direct = getattr(transform, "writes_into", False) and isinstance(
        getattr(transform, "size", None), int
    )
    return images[0] if direct and settings.batch.channels_last and len(images) == 1 else None


class ImageTarget:
    """A channels-last uint8 batch being filled in place: a ring slot or fresh shared memory."""

    def __init__(
        self, batch: torch.Tensor | SlotBatch, arrays: np.ndarray, channels_last: bool, ring
    ) -> None:
        self.batch, self.arrays, self.ring = batch, arrays, ring
        self.channels_last = channels_last

    @classmethod
    def allocate(
        cls, nhwc: tuple[int, int, int, int], channels_last: bool, memory: BatchMemory
    ) -> ImageTarget:
        """A batch of `nhwc` images (`[B, 3, H, W]`-shaped, NHWC strides when `channels_last`)."""
        count, height, width, channels = nhwc
        shape = nhwc if channels_last else (count, channels, height, width)
        ring = memory.ring
        slot = ring.acquire(memory.worker, shape) if ring is not None else None
        if slot is not None:
            return cls(slot, slot.writable(), channels_last, ring)
        batch = torch.empty(shape, dtype=torch.uint8)
        if memory.shared:
            batch.share_memory_()  # the DataLoader then sends it without copying it again
        return cls(batch, batch.numpy(), channels_last, None)

    def finish(self) -> torch.Tensor | SlotBatch:
        """What the batch carries: the slot (the consumer makes it a tensor) or the tensor."""
        if isinstance(self.batch, SlotBatch):
            self.batch.channels_last = self.channels_last
            return self.batch
        return self.batch.permute(0, 3, 1, 2) if self.channels_last else self.batch

    def abandon(self) -> None:
        """Give an unfinished batch's slot back (an error stopped the batch)."""
        if isinstance(self.batch, SlotBatch) and self.ring is not None:
            self.ring.release(self.batch.slot)

    def shorten(self, count: int) -> None:
        """Keep the first `count` images: a short batch of an exactly-once epoch.

        The batch dimension is the outermost of either layout, so the first `count`
        images are the slot's (or tensor's) first bytes: nothing moves.
        """
        self.arrays = self.arrays[:count]
        if isinstance(self.batch, SlotBatch):
            self.batch.shape = (count, *self.batch.shape[1:])
        else:
            self.batch = self.batch[:count]


def augmentable(pixels: np.ndarray) -> np.ndarray:
    """`pixels` to augment in place (a batch slot), or a writable, C-contiguous copy of a
    crop that is neither (what `Augmenter.run_batch` writes into).

    Raises:
        UsageError: a `Crop.transform` returned something other than uint8 HxWx3.
    """
    image = isinstance(pixels, np.ndarray) and pixels.dtype == np.uint8 and pixels.ndim == 3
    if not image or pixels.shape[2] != 3:
        raise UsageError(
            f"Crop.transform returned {type(pixels).__name__} "
            f"{getattr(pixels, 'dtype', '')} {tuple(getattr(pixels, 'shape', ()))}; "
            "LoaderConfig.augment needs uint8 HxWx3 pixels: return those, or leave augment out"
        )
    if not (pixels.flags.writeable and pixels.flags.c_contiguous):
        # a transform's read-only output (Pillow's bytes) or a view: one copy, the row's
        pixels = np.array(pixels)
    return pixels


def stack_images(
    images: list[np.ndarray], channels_last: bool, memory: BatchMemory
) -> torch.Tensor | SlotBatch:
    """Write HWC images straight into one batch buffer: a reused ring slot when one is free.

    np.stack, then a permuting copy, then the DataLoader's own copy into shared
    memory made three fresh batch-sized buffers (and their page faults) per
    batch. This makes at most one, and none when the ring has a free slot (see
    `pipeline.batchring`). Without a slot, the buffer is made in shared memory
    inside a worker, so the DataLoader sends it without copying it again.

    Returns:
        A uint8 `[B, 3, H, W]` tensor (NHWC strides when `channels_last`), or a
        `SlotBatch` that the consumer turns into that tensor.
    """
    height, width, channels = images[0].shape
    target = ImageTarget.allocate((len(images), height, width, channels), channels_last, memory)
    slots = target.arrays
    # numpy assignment: a plain memcpy (or one transposing loop) per image, no
    # per-call dispatch or thread-pool overhead as with torch's copy_.
    for index, image in enumerate(images):
        slots[index] = image if channels_last else image.transpose(2, 0, 1)
    return target.finish()


def batch_sizes(samples: int, batches: int, batch_size: int) -> list[int]:
    """Sizes of a worker's batches: full ones, the last one partial if samples run short."""
    return list(iter_batch_sizes(samples, batches, batch_size))


def iter_batch_sizes(samples: int, batches: int, batch_size: int, start: int = 0) -> Iterator[int]:
    """`batch_sizes` from batch `start` on, one at a time: a worker of a 10^9-sample epoch
    has ~2 million batches, a 16 MB list it would hold all epoch."""
    yield from itertools.repeat(batch_size, max(0, batches - 1 - start))
    if start < batches:
        yield min(batch_size, samples - (batches - 1) * batch_size)
