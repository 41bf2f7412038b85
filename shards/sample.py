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
_MAX_LABEL_DIGITS = 18  # fits int64; anything longer is garbage, not a class index


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


def image_field_of(sample: Sample) -> str:
    """Return the name of the image field a sample holds: `jpg`, `webp` or `png`.

    Fields are tried in that order, so a sample holding several uses the first.

    Raises:
        SampleError: `no_image` when the sample holds none of them.
    """
    for field in IMAGE_FIELDS:
        if field in sample:
            return field
    fields = sorted(name for name in sample if not name.startswith("__"))
    raise SampleError(
        "no_image",
        f"sample {sample.get('__key__')!r} has no {'/'.join(IMAGE_FIELDS)} field "
        f"(fields: {', '.join(fields) or 'none'})",
    )


def decode_label(sample: Sample) -> int:
    """Return the class index stored in the sample's `cls` field (ASCII digits, e.g. `b"3"`).

    Raises:
        SampleError: `no_label` when `cls` is missing, `bad_label` when it is not a
            non-negative integer of at most 18 digits.
    """
    key = sample.get("__key__")
    if "cls" not in sample:
        raise SampleError("no_label", f"sample {key!r} has no cls field")
    value = sample["cls"]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value  # already decoded by a user's own reader stage
    text = value.encode("ascii", "replace") if isinstance(value, str) else value
    if isinstance(text, (bytes, bytearray)):
        text = text.strip()
        # bytes.isdigit() is ASCII-only, so no sign, no underscores, no Unicode digits.
        if 0 < len(text) <= _MAX_LABEL_DIGITS and text.isdigit():
            return int(text)
    raise SampleError(
        "bad_label", f"sample {key!r}: cls {value!r:.40} is not a non-negative integer"
    )
