"""`Augmenter`: the steps an `Augment` asks for, run in a worker on each uint8 training crop.

Order, as timm's train transform: policy (`auto_augment`) -> colour jitter -> greyscale
-> Gaussian blur -> the user's ops -> random erasing. Picklable (frozen dataclasses of
module-level classes), so it reaches spawned workers; every draw comes from the
sample's `rng`, so a sample gets the same augmentation on any worker, rank or resume.

The policy's ops are drawn before any pixel work (`Augmenter.draw`, in timm's order of
draws), so the loader can hand the leading geometric ops to the fast crop, which
folds them into its own resize (`Augmenter.leading_affine`, `pipeline.fast_transforms`).
The rest run once the batch is cropped, op by op across its images
(`Augmenter.run_batch`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from pipeline.augment.color import ColorJitter, RandomGaussianBlur, RandomGrayscale
from pipeline.augment.erasing import RandomErasing
from pipeline.augment.errors import OpFailed
from pipeline.augment.grammar import parse_policy
from pipeline.augment.levels import AffineOp, AffineRun, DrawnOp, Hparams
from pipeline.augment.policies import build_policy
from pipeline.augment.settings import Augment
from shards.image.policy import load_fast_backends


@dataclass(frozen=True)
class Augmenter:
    """Runs the policy, then `steps` in order, on one crop in place: `augmenter(pixels, rng)`.

    Attributes:
        policy: the `auto_augment` policy (`draw(rng)` -> its drawn ops), or None.
        steps: what follows it, each `step(pixels, rng)` drawing as it goes.
    """

    policy: object | None
    steps: tuple[Callable[[np.ndarray, random.Random], None], ...]

    def draw(self, rng: random.Random) -> tuple[DrawnOp, ...]:
        """The policy's ops for one image, every draw made, in order."""
        return () if self.policy is None else self.policy.draw(rng)

    @staticmethod
    def leading_affine(
        drawn: tuple[DrawnOp, ...],
    ) -> tuple[AffineRun | None, tuple[DrawnOp, ...]]:
        """The drawn ops' leading geometric ones (a crop may fold them), and the rest;
        None when the first op is not geometric."""
        count = 0
        while count < len(drawn) and isinstance(drawn[count], AffineOp):
            count += 1
        return (AffineRun(drawn[:count]) if count else None), drawn[count:]

    def __call__(
        self, pixels: np.ndarray, rng: random.Random, drawn: tuple[DrawnOp, ...] | None = None
    ) -> None:
        """Augment `pixels` (HxWx3 uint8, may be a view into a batch slot) in place.

        Args:
            drawn: the policy's ops from `draw(rng)` (less any the crop has applied);
                None: drawn here.
        """
        # OpenCV writes only into contiguous arrays: a copy for any other, put back after
        work = pixels if pixels.flags.c_contiguous else np.ascontiguousarray(pixels)
        try:
            self.run_batch([(work, rng, self.draw(rng) if drawn is None else drawn)])
        except OpFailed as failed:  # one image: the op's own error, as it raised it
            raise failed.__cause__ from None
        if work is not pixels:
            pixels[...] = work

    def run_batch(
        self, images: list[tuple[np.ndarray, random.Random, tuple[DrawnOp, ...]]]
    ) -> None:
        """Augment each (pixels, rng, drawn) of a batch in place, op by op across images.

        Every image gets its ops in its own order and its steps drawing from its own
        `rng`, so its pixels are those of augmenting it alone; but the k-th ops of all
        images run together, grouped by op, then each step over all images. Why: in a
        loader worker an op called between two JPEG decodes finds its code, tables and
        buffers evicted and ran ~1.4x its time in a loop; grouped, the DeiT recipe's ops
        cost ~20 us an image less (docs/BENCHMARKS.md, "Training recipes"). One op runs
        at a time, so the temporaries are still one image's.

        Args:
            images: C-contiguous HxWx3 uint8 arrays (OpenCV writes only into those), each
                with the rng its policy drew from and the ops it drew.

        Raises:
            OpFailed: an op or step raised (ours never do on a valid image; a user op
                may): which one, on which image (its index in `images`).
        """
        load_fast_backends()  # OpenCV on one thread in this process
        depth = max((len(drawn) for _, _, drawn in images), default=0)
        for place in range(depth):
            kth = [
                (drawn[place], pixels, index)
                for index, (pixels, _, drawn) in enumerate(images)
                if len(drawn) > place
            ]
            kth.sort(key=_op_group)  # stable: images in batch order within a group
            for op, pixels, index in kth:
                try:
                    op(pixels)
                except Exception as error:
                    raise OpFailed(op, index) from error
        for step in self.steps:
            for index, (pixels, rng, _) in enumerate(images):
                try:
                    step(pixels, rng)
                except Exception as error:
                    raise OpFailed(step, index) from error


def _op_group(item: tuple[DrawnOp, np.ndarray, int]) -> int:
    """The same number for the drawn ops that run the same code (an op's function, or
    a geometric op's kind), so `run_batch` runs them one after another."""
    op = item[0]
    return id(getattr(op, "function", None) or getattr(op, "kind", None) or type(op))


def policy_hparams(augment: Augment, image_size: int, crop_resample: str | None) -> Hparams:
    """timm's hparams for `image_size`: translate 45% of the side, fill the mean colour,
    the geometric filter the crop's (`Augment.policy_resample`)."""
    return Hparams(
        translate_const=int(image_size * 0.45),
        fill=tuple(min(255, round(255 * v)) for v in augment.mean),
        resample=augment.policy_resample(crop_resample),
    )


def build_augmenter(
    augment: Augment, image_size: int, crop_resample: str | None = None
) -> Augmenter | None:
    """The `Augmenter` for `augment` on `image_size` crops made with the filter
    `crop_resample` (None: unknown); None when nothing is asked."""
    if not augment.enabled:
        return None
    policy, steps = None, []
    if augment.auto_augment is not None:
        spec = parse_policy(augment.auto_augment)
        policy = build_policy(spec, policy_hparams(augment, image_size, crop_resample))
    if augment.color_jitter is not None and any(augment.jitter_strengths):
        steps.append(ColorJitter.from_strengths(augment.jitter_strengths))
    if augment.grayscale:
        steps.append(RandomGrayscale(augment.grayscale))
    if augment.gaussian_blur:
        steps.append(RandomGaussianBlur(augment.gaussian_blur))
    steps.extend(augment.ops)
    if augment.re_prob:
        steps.append(
            RandomErasing(
                augment.re_prob,
                augment.re_area,
                augment.re_ratio,
                augment.re_mode,
                augment.re_count,
                augment.mean,
                augment.std,
            )
        )
    return Augmenter(policy, tuple(steps))
