"""Samples per shard from a byte target (`--shard-bytes`), and the byte estimate of `--dry-run`.

The plan fixes every shard's inputs before any image is processed: that is what lets the
tasks run independently and a rerun resume shard by shard. An output's size is only known
once it is encoded, so a byte target becomes a sample count: a fixed probe of the inputs
(the ones with the smallest keys, the same on every run) is processed exactly as the build
will process it, and the count is the target divided by the probe's mean size in a tar
shard. Shards then land near the target, give or take how much image sizes vary across
the dataset; the count is recorded in the manifest. The probe is picked from a stream of
inputs with a bounded heap, so the listing never has to be held.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from preprocess.build import build_shard_sample, image_field
from preprocess.images import ImageConfig
from preprocess.listing import InputError, SourceItem
from preprocess.plan import PROBE_SIZE, PlannedSample, sample_key
from shards.formats import DEFAULT_FORMAT, get_format
from shards.sample import SampleError


@dataclass(frozen=True)
class Probe:
    """Sizes of the probe's inputs, processed exactly as the build processes them.

    Attributes:
        tried: inputs of the probe.
        sizes: per format, the bytes each readable input adds to a shard file.
        failed: the reasons of the inputs that could not be processed.
    """

    tried: int
    sizes: dict[str, list[int]] = field(default_factory=dict)
    failed: Counter = field(default_factory=Counter)

    def mean_bytes(self, fmt: str) -> float | None:
        sizes = self.sizes.get(fmt)
        return sum(sizes) / len(sizes) if sizes else None


def probe_inputs(
    items: Iterable[SourceItem],
    image: ImageConfig,
    formats: Iterable[str] = (DEFAULT_FORMAT,),
    storage_options: Mapping[str, Any] | None = None,
) -> Probe:
    """Process the `PROBE_SIZE` inputs of `items` with the smallest keys (the same on every
    run, wherever they are in the listing) and measure them in each of `formats`; remote
    inputs are read with the build's `storage_options`."""
    probe = heapq.nsmallest(PROBE_SIZE, items, key=_key_of)
    field_name = image_field(image)
    sizes: dict[str, list[int]] = {fmt: [] for fmt in formats}
    failed: Counter = Counter()
    for item in probe:
        planned = PlannedSample(sample_key(item.rel), item.path, item.rel, 0)
        try:
            sample = build_shard_sample(
                planned,
                item.split or "train",
                image,
                field_name,
                storage_options=storage_options,
            )
        except SampleError as error:
            failed[error.reason] += 1  # the build's to skip and report; the probe moves on
            continue
        for fmt in sizes:
            sizes[fmt].append(get_format(fmt).sample_bytes(sample))
    return Probe(len(probe), sizes, failed)


def _key_of(item: SourceItem) -> str:
    return sample_key(item.rel)


def shard_size_for_bytes(
    items: Iterable[SourceItem],
    target_bytes: int,
    image: ImageConfig,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Samples per shard that make tar shards of about `target_bytes`.

    `items` may be the whole listing or just the plan's probe (`Plan.probe`): both
    give the same inputs, hence the same count.

    Raises:
        InputError: none of the probe's inputs could be processed.
    """
    probe = probe_inputs(items, image, storage_options=storage_options)
    sizes = probe.sizes[DEFAULT_FORMAT]
    if not sizes:
        raise InputError(
            f"--shard-bytes: none of the {probe.tried} inputs sampled to size the shards could "
            "be processed; check the inputs, or give --shard-size instead"
        )
    return max(1, round(target_bytes * len(sizes) / sum(sizes)))
