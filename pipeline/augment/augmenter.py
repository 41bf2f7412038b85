"""`Augmenter`: the steps an `Augment` asks for, run in a worker on each uint8 training crop.

Order, as timm's train transform: policy (`auto_augment`) -> colour jitter -> greyscale
-> Gaussian blur -> the user's ops -> random erasing. Picklable (frozen dataclasses of
module-level classes), so it reaches spawned workers; every draw comes from the
sample's `rng`, so a sample gets the same augmentation on any worker, rank or resume.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import cv2
import numpy as np

from pipeline.augment.color import ColorJitter, RandomGaussianBlur, RandomGrayscale
from pipeline.augment.erasing import RandomErasing
from pipeline.augment.grammar import parse_policy
from pipeline.augment.levels import Hparams
from pipeline.augment.policies import build_policy
from pipeline.augment.settings import Augment


class _OneThread:
    """OpenCV set to one thread, once per process (as `shards.image.policy.fast_modules`).

    The loader runs a worker per CPU, each on one image at a time, so OpenCV's own pool
    would oversubscribe the CPUs, and a pool inherited through fork is not safe to use.
    """

    pid: int | None = None

    @classmethod
    def ensure(cls) -> None:
        if cls.pid != os.getpid():
            cv2.setNumThreads(1)
            cls.pid = os.getpid()


@dataclass(frozen=True)
class Augmenter:
    """Runs `steps` in order on one crop, in place: `augmenter(pixels, rng)`."""

    steps: tuple[Callable[[np.ndarray, random.Random], None], ...]

    def __call__(self, pixels: np.ndarray, rng: random.Random) -> None:
        """Augment `pixels` (HxWx3 uint8, may be a view into a batch slot) in place."""
        _OneThread.ensure()
        if pixels.flags.c_contiguous:
            for step in self.steps:
                step(pixels, rng)
            return
        work = np.ascontiguousarray(pixels)  # OpenCV writes only into contiguous arrays
        for step in self.steps:
            step(work, rng)
        pixels[...] = work


def policy_hparams(augment: Augment, image_size: int) -> Hparams:
    """timm's hparams for `image_size`: translate 45% of the side, fill the mean colour."""
    return Hparams(
        translate_const=int(image_size * 0.45),
        fill=tuple(min(255, round(255 * v)) for v in augment.mean),
    )


def build_augmenter(augment: Augment, image_size: int) -> Augmenter | None:
    """The `Augmenter` for `augment` on `image_size` crops; None when nothing is asked."""
    if not augment.enabled:
        return None
    steps: list[Callable] = []
    if augment.auto_augment is not None:
        spec = parse_policy(augment.auto_augment)
        steps.append(build_policy(spec, policy_hparams(augment, image_size)))
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
    return Augmenter(tuple(steps))
