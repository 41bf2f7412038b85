"""Per-sample augmentation on the fast path: timm's policies on the uint8 crop, in workers.

`Augment` (settings, no OpenCV) says what a training crop gets; `build_augmenter` makes
the picklable `Augmenter` a worker runs on each batch's crops in place. The OpenCV side is
imported on first use, so `pipeline.config` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.augment.settings import IMAGENET_MEAN, IMAGENET_STD, Augment

if TYPE_CHECKING:
    from pipeline.augment.augmenter import Augmenter

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "Augment", "Augmenter", "build_augmenter"]


def build_augmenter(
    augment: Augment, image_size: int, crop_resample: str | None = None
) -> Augmenter | None:
    """The `Augmenter` for `augment` on `image_size` crops made with the filter
    `crop_resample` (None: unknown); None when nothing is asked."""
    from pipeline.augment import augmenter

    return augmenter.build_augmenter(augment, image_size, crop_resample)


def __getattr__(name: str) -> Any:
    if name == "Augmenter":
        from pipeline.augment.augmenter import Augmenter

        return Augmenter
    raise AttributeError(f"module 'pipeline.augment' has no attribute {name!r}")
