"""`MixupCutmix`: mixup and cutmix of a training batch with label smoothing, on any device.

The batch stage after normalisation: `CudaPrefetcher(..., mix=MixupCutmix(...))` runs it on
the device, or any loop calls `images, targets = mix(images, labels)`. What it does is what
timm's `Mixup` (timm/data/mixup.py) does; its draws come from (seed, rank, epoch, step), so
a resumed run mixes each batch as the uninterrupted run did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shards.errors import UsageError
from shards.flags import check_choice, check_fraction, check_int_at_least, refuse

MODES = ("batch", "pair", "elem")


@dataclass(frozen=True)
class MixDraw:
    """What one batch gets: per element, its lambda (the share of itself it keeps), whether
    it is cut-mixed, and the box (rows `yl:yh`, columns `xl:xh`) pasted from its partner.

    `lam` is already corrected to the box's clipped area. An element with `lam == 1` is left
    as it is. Element `i`'s partner is `B - 1 - i` (the batch flipped), as in timm.
    """

    lam: np.ndarray  # float64 [B]
    cutmix: np.ndarray  # bool [B]
    boxes: np.ndarray  # int64 [B, 4]: yl, yh, xl, xh (an empty box where not cut-mixed)

    @property
    def untouched(self) -> bool:
        return bool((self.lam == 1.0).all())


class MixupCutmix:
    """Mix each training batch with its reverse: mixup (a blend) or cutmix (a pasted box).

    `images, targets = mix(images, labels)`: `images` float `[B, C, H, W]` (normalised, any
    device, any memory layout) are mixed in place and returned; `targets` are float32
    `[B, num_classes]` soft targets: label-smoothed one-hot rows mixed with the partner's
    in proportion to the pixels each contributed, so each row sums to one. Multi-hot
    targets (float `[B, num_classes]`, multi-label) are smoothed the same way per class
    and mixed alike (their rows sum to the mixed label counts, not to one).

    Each call draws from a generator seeded with (seed, rank, epoch, step) and then
    advances `step`: call `set_epoch(epoch)` before each epoch, and after a resume
    `set_position(epoch, batches already trained this epoch)`. `CudaPrefetcher(mix=...)`
    does both itself, from its loader's position.

    Args:
        mixup_alpha: Beta(alpha, alpha) of the mixup lambda; 0 turns mixup off.
        cutmix_alpha: Beta(alpha, alpha) of the cutmix lambda; 0 turns cutmix off.
        cutmix_minmax: `(min, max)` shares of the image side: the box's height and width
            are drawn uniformly in them instead of from the lambda (then cutmix is on,
            with alpha 1, as in timm).
        prob: probability that a batch (mode `batch`) or an element is mixed at all.
        switch_prob: with both on, probability of cutmix instead of mixup.
        mode: one draw for the whole `batch`, one per `pair` (elements `i` and `B-1-i`
            swap the same box or blend), or one per `elem`ent; `pair` and `elem` need
            an even batch, as in timm.
        label_smoothing: the one-hot becomes `1 - s + s/C` on the class and `s/C` off it.
        num_classes: width of the targets.
        seed, rank: with epoch and step, what each batch's draws come from; give each
            rank its own `rank` so ranks do not all draw the same lambda.
    """

    def __init__(
        self,
        *,
        mixup_alpha: float = 1.0,
        cutmix_alpha: float = 0.0,
        cutmix_minmax: Sequence[float] | None = None,
        prob: float = 1.0,
        switch_prob: float = 0.5,
        mode: str = "batch",
        label_smoothing: float = 0.1,
        num_classes: int,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        self.mixup_alpha = mixup_alpha
        self.cutmix_alpha = cutmix_alpha
        self.cutmix_minmax = (
            tuple(cutmix_minmax) if isinstance(cutmix_minmax, Sequence) else cutmix_minmax
        )
        self.prob = prob
        self.switch_prob = switch_prob
        self.mode = mode
        self.label_smoothing = label_smoothing
        self.num_classes = num_classes
        self.seed = seed
        self.rank = rank
        self.check()
        if self.cutmix_minmax is not None:
            self.cutmix_alpha = 1.0  # timm: the box comes from minmax, the lambda only says "mix"
        self.epoch = 0
        self.step = 0

    def check(self) -> None:
        """Refuse a setting outside what it allows, naming it (one line)."""
        for name in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value < 0:
                raise refuse(self, name, f" must be a number of at least 0, got {value!r}")
        minmax = self.cutmix_minmax
        pair = isinstance(minmax, tuple) and len(minmax) == 2
        if minmax is not None and not (pair and all(isinstance(v, (int, float)) for v in minmax)):
            raise refuse(self, "cutmix_minmax", f" must be (min, max) or None, got {minmax!r}")
        if minmax is not None and not 0 < minmax[0] < minmax[1] <= 1:
            raise refuse(
                self, "cutmix_minmax", f" must be (min, max), 0 < min < max <= 1, got {minmax!r}"
            )
        if self.mixup_alpha == 0 and self.cutmix_alpha == 0 and minmax is None:
            raise refuse(
                self,
                "mixup_alpha",
                ": nothing to mix; give mixup_alpha > 0, cutmix_alpha > 0 or cutmix_minmax",
            )
        check_fraction(self, "prob")
        check_fraction(self, "switch_prob")
        check_choice(self, "mode", MODES)
        smoothing = self.label_smoothing
        if (
            not isinstance(smoothing, (int, float))
            or isinstance(smoothing, bool)
            or not 0 <= smoothing < 1
        ):
            raise refuse(self, "label_smoothing", f" must be a number in [0, 1), got {smoothing!r}")
        check_int_at_least(self, "num_classes", 1)
        check_int_at_least(self, "seed", 0)
        check_int_at_least(self, "rank", 0)

    def __repr__(self) -> str:
        return (
            f"MixupCutmix(mixup_alpha={self.mixup_alpha}, cutmix_alpha={self.cutmix_alpha}, "
            f"cutmix_minmax={self.cutmix_minmax}, prob={self.prob}, switch_prob={self.switch_prob}, "
            f"mode={self.mode!r}, label_smoothing={self.label_smoothing}, "
            f"num_classes={self.num_classes}, seed={self.seed}, rank={self.rank})"
        )

    def set_epoch(self, epoch: int) -> None:
        """The next call mixes the first batch of `epoch`."""
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, step: int) -> None:
        """The next call mixes batch `step` (counted from 0) of `epoch`."""
        if epoch < 0 or step < 0:
            raise UsageError(
                f"MixupCutmix.set_position needs epoch and step >= 0, got {epoch}, {step}"
            )
        self.epoch, self.step = epoch, step

    def __call__(
        self, images: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix `images` in place; return them and the soft targets. Advances `step`."""
        self.check_batch(images, labels)
        draw = self.draw(len(images), images.shape[-2], images.shape[-1])
        self.step += 1
        if not draw.untouched:
            if self.mode == "batch":
                mix_whole_batch(images, float(draw.lam[0]), bool(draw.cutmix[0]), draw.boxes[0])
            else:
                mix_each(images, draw)
        return images, self.targets(labels, draw.lam)

    def check_batch(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        if (
            not isinstance(images, torch.Tensor)
            or images.dim() != 4
            or not images.is_floating_point()
        ):
            got = (
                f"{images.dtype} {tuple(images.shape)}"
                if isinstance(images, torch.Tensor)
                else type(images).__name__
            )
            raise UsageError(
                f"MixupCutmix: images must be a float [B, C, H, W] tensor, got {got}; "
                "mix after normalisation (CudaPrefetcher(..., mix=...) does)"
            )
        size = len(images)
        if not isinstance(labels, torch.Tensor) or len(labels) != size:
            raise UsageError(f"MixupCutmix: labels must be a tensor of {size} rows, one per image")
        if self.mode != "batch" and size % 2:
            raise UsageError(
                f"MixupCutmix(mode={self.mode!r}) needs an even batch, got {size}; "
                "use an even batch size or mode='batch'"
            )

    def generator(self) -> np.random.Generator:
        """This batch's own generator: the same (seed, rank, epoch, step) draws the same."""
        return np.random.default_rng([self.seed, self.rank, self.epoch, self.step])

    def draw(self, size: int, height: int, width: int) -> MixDraw:
        """Lambdas, cutmix choices and boxes of a batch of `size` images `height x width`."""
        rng = self.generator()
        count = {"batch": 1, "pair": size // 2, "elem": size}[self.mode]
        lam, cutmix = self.draw_lambdas(rng, count)
        boxes = np.zeros((count, 4), dtype=np.int64)
        if cutmix.any():
            boxes[cutmix], lam[cutmix] = cutmix_boxes(
                rng, lam[cutmix], height, width, self.cutmix_minmax
            )
        if self.mode == "pair":  # element B-1-i shares pair i's draw
            lam, cutmix, boxes = (np.concatenate([a, a[::-1]]) for a in (lam, cutmix, boxes))
        elif self.mode == "batch":
            lam, cutmix, boxes = (np.repeat(a, size, axis=0) for a in (lam, cutmix, boxes))
        return MixDraw(lam, cutmix, boxes)

    def draw_lambdas(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        """timm's `_params_per_elem`: which of `count` draws mix, by cutmix or mixup, and how much."""
        both = self.mixup_alpha > 0 and self.cutmix_alpha > 0
        if both:
            cutmix = rng.random(count) < self.switch_prob
        else:
            cutmix = np.full(count, self.cutmix_alpha > 0)
        lam = np.where(
            cutmix,
            rng.beta(self.cutmix_alpha, self.cutmix_alpha, count) if self.cutmix_alpha > 0 else 1.0,
            rng.beta(self.mixup_alpha, self.mixup_alpha, count) if self.mixup_alpha > 0 else 1.0,
        )
        mixed = rng.random(count) < self.prob
        return np.where(mixed, lam, 1.0), cutmix & mixed

    def targets(self, labels: torch.Tensor, lam: np.ndarray) -> torch.Tensor:
        """Smoothed one-hot (or multi-hot) rows, each mixed with its partner's by `lam`."""
        classes, smoothing = self.num_classes, self.label_smoothing
        if labels.dim() == 1 and not labels.is_floating_point():
            hot = F.one_hot(labels.long(), classes).float()
        elif labels.dim() == 2 and labels.shape[1] == classes:
            hot = labels.float()
        else:
            raise UsageError(
                f"MixupCutmix: labels must be class ids [B] or multi-hot [B, {classes}], "
                f"got {labels.dtype} {tuple(labels.shape)}"
            )
        if smoothing:
            hot = hot * (1.0 - smoothing) + smoothing / classes
        weight = torch.as_tensor(lam, dtype=torch.float32).to(hot.device).unsqueeze(1)
        return hot * weight + hot.flip(0) * (1.0 - weight)


def cutmix_boxes(
    rng: np.random.Generator,
    lam: np.ndarray,
    height: int,
    width: int,
    minmax: tuple[float, float] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Boxes `[n, 4]` (yl, yh, xl, xh) for `n` lambdas, and the lambdas corrected to them.

    timm's `rand_bbox`: a box of `sqrt(1 - lam)` of each side centred on a uniform pixel,
    clipped to the image; or `rand_bbox_minmax`: sides drawn in `minmax` shares of the
    image, placed inside it. Either way the lambda becomes `1 - box area / image area`,
    the share of its own pixels an image keeps.
    """
    count = len(lam)
    if minmax is None:
        ratio = np.sqrt(1.0 - lam)
        cut_h, cut_w = (height * ratio).astype(np.int64), (width * ratio).astype(np.int64)
        cy, cx = rng.integers(0, height, count), rng.integers(0, width, count)
        yl, yh = np.clip(cy - cut_h // 2, 0, height), np.clip(cy + cut_h // 2, 0, height)
        xl, xh = np.clip(cx - cut_w // 2, 0, width), np.clip(cx + cut_w // 2, 0, width)
    else:
        cut_h = side_lengths(rng, height, minmax, count)
        cut_w = side_lengths(rng, width, minmax, count)
        yl = rng.integers(0, height - cut_h + 1)
        xl = rng.integers(0, width - cut_w + 1)
        yh, xh = yl + cut_h, xl + cut_w
    corrected = 1.0 - (yh - yl) * (xh - xl) / float(height * width)
    return np.stack([yl, yh, xl, xh], axis=1), corrected


def side_lengths(
    rng: np.random.Generator, side: int, minmax: tuple[float, float], count: int
) -> np.ndarray:
    """Box sides uniform in `[min, max)` shares of `side` pixels (at least one value wide)."""
    low = int(side * minmax[0])
    high = max(int(side * minmax[1]), low + 1)
    return rng.integers(low, high, count)


def mix_whole_batch(images: torch.Tensor, lam: float, cutmix: bool, box: np.ndarray) -> None:
    """Mode `batch`: one blend or one box for every image, in place (timm's `_mix_batch`)."""
    if cutmix:
        yl, yh, xl, xh = (int(v) for v in box)
        # Flipping only the box region copies the box, not the batch.
        images[:, :, yl:yh, xl:xh] = images[:, :, yl:yh, xl:xh].flip(0)
    else:
        images.lerp_(images.flip(0), 1.0 - lam)  # lam x own + (1 - lam) x partner


def mix_each(images: torch.Tensor, draw: MixDraw) -> None:
    """Modes `pair` and `elem`: every image its own blend or box, in place, without a loop
    over the batch: a blend weight per image, then a box mask per image."""
    size, _, height, width = images.shape
    device = images.device
    partner = images.flip(0)
    blend = np.where(draw.cutmix, 1.0, draw.lam)
    if (blend != 1.0).any():
        weight = torch.as_tensor(1.0 - blend, dtype=images.dtype).to(device)
        images.lerp_(partner, weight.view(size, 1, 1, 1))  # one pass, no temporary
    if draw.cutmix.any():
        boxes = torch.as_tensor(draw.boxes).to(device)
        rows = torch.arange(height, device=device)
        cols = torch.arange(width, device=device)
        in_rows = (rows >= boxes[:, 0:1]) & (rows < boxes[:, 1:2])  # [B, H]
        in_cols = (cols >= boxes[:, 2:3]) & (cols < boxes[:, 3:4])  # [B, W]
        inside = in_rows[:, None, :, None] & in_cols[:, None, None, :]  # [B, 1, H, W]
        torch.where(inside, partner, images, out=images)
