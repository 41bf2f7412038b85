"""The error an augmentation op's failure travels in, apart from OpenCV's modules."""

from __future__ import annotations

from shards.errors import UsageError


class OpFailed(UsageError):
    """An op of `Augmenter.run_batch` raised on image `index`, the op's error its cause:
    the loader names the sample (an op runs after the batch is cropped, so it cannot
    skip one; a user op's bug, hence a usage error). A module of its own, so catching it
    imports no OpenCV."""

    def __init__(self, op: object, index: int) -> None:
        super().__init__(f"augmentation op {op!r} raised on image {index} of the batch")
        self.op, self.index = op, index
