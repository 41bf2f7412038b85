"""One training sample as it travels between preprocess, shards and pipeline.

A `Sample` is a plain dict, as in webdataset: `__key__` plus one entry per
field, each holding bytes. Tar and Parquet readers both yield exactly this.
"""

from __future__ import annotations

import re

# Field names a shard may carry. Anything else is ignored by our readers, so a
# planted `.pkl` or `.pth` member is never even read, let alone unpickled.
IMAGE_FIELDS = ("jpg", "webp", "png")
ALLOWED_FIELDS = frozenset((*IMAGE_FIELDS, "cls", "json", "txt"))

Sample = dict  # {"__key__": str, "__url__": str, field: bytes, ...}

_KEY_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


class SampleError(Exception):
    """A data error tied to one input or sample: skipped and counted, never fatal alone.

    Attributes:
        reason: a short stable slug (`truncated`, `too_many_pixels`, ...) used as
            the key of skip histograms in manifests and loader stats.
        detail: human-readable explanation.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def check_key(key: str) -> str:
    """Return `key` if it is a valid sample key, else raise ValueError.

    Keys hold no dots or slashes: webdataset splits member names at the first
    dot, and a slash would make a tar member a path.
    """
    if not _KEY_PATTERN.match(key):
        raise ValueError(f"invalid sample key {key!r}: use 1-128 characters of [A-Za-z0-9_-]")
    return key
