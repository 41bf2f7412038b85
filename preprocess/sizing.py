"""Samples per shard from a byte target (`--shard-bytes`), measured before the plan is made.

The plan fixes every shard's inputs before any image is processed: that is what lets the
tasks run independently and a rerun resume shard by shard. An output's size is only known
once it is encoded, so a byte target becomes a sample count: a fixed probe of the inputs
(the ones with the smallest keys, the same on every run) is processed exactly as the build
will process it, and the count is the target divided by the probe's mean size in a tar
shard. Shards then land near the target, give or take how much image sizes vary across
the dataset; the count is recorded in the manifest.
"""

from __future__ import annotations

import re

from preprocess.build import image_field, make_sample
from preprocess.images import ImageConfig
from preprocess.plan import PlannedSample, sample_key
from preprocess.sources import InputError, SourceItem
from shards.formats import TAR
from shards.sample import SampleError

PROBE_SIZE = 64
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """`"512MB"`, `"1GiB"`, `"200000"` -> bytes (decimal KB/MB/GB, binary KiB/MiB/GiB).

    Raises:
        ValueError: not a positive size with a known unit.
    """
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 500MB, 1GiB or 200000")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def shard_size_for_bytes(items: list[SourceItem], target_bytes: int, image: ImageConfig) -> int:
    """Samples per shard that make tar shards of about `target_bytes`.

    Raises:
        InputError: none of the probe's inputs could be processed.
    """
    probe = sorted(items, key=lambda item: sample_key(item.rel))[:PROBE_SIZE]
    field = image_field(image)
    sizes = []
    for item in probe:
        planned = PlannedSample(sample_key(item.rel), item.path, item.rel, 0)
        try:
            sizes.append(
                TAR.sample_bytes(make_sample(planned, item.split or "train", image, field))
            )
        except SampleError:
            continue  # a bad input is the build's to skip and report; the probe just moves on
    if not sizes:
        raise InputError(
            f"--shard-bytes: none of the {len(probe)} inputs sampled to size the shards could "
            "be processed; check the inputs, or give --shard-size instead"
        )
    return max(1, round(target_bytes * len(sizes) / sum(sizes)))
