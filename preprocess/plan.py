"""Turn the sorted input list into shard tasks, deterministically, before any image is read.

Each input gets a key from a hash of its relative path (stable across shard
sizes and seeds), a split (from the manifest, or from the same hash so that the
val set does not move when the seed changes), and a place in a seeded shuffle
of its split. The plan holds paths and labels only, never pixels.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from preprocess.sources import InputError, SourceItem
from shards.sample import check_key


@dataclass(frozen=True)
class PlannedSample:
    """One input, assigned to a shard."""

    key: str
    path: str
    rel: str
    label: int


@dataclass(frozen=True)
class ShardTask:
    """Everything one worker needs to write one shard; small enough to ship to Ray."""

    split: str
    index: int
    samples: tuple[PlannedSample, ...]


@dataclass(frozen=True)
class Plan:
    classes: list[str]
    tasks: list[ShardTask]
    inputs: int
    digest: str  # changes whenever any input path, label, split or order changes
    shard_size: int


def path_digest(rel: str) -> bytes:
    return hashlib.blake2b(rel.encode("utf-8"), digest_size=8, person=b"shardkey").digest()


def sample_key(rel: str) -> str:
    """16 hex characters from the relative path: no dots or slashes, stable across builds."""
    return path_digest(rel).hex()


def hash_split(rel: str, val_fraction: float) -> str:
    """`val` for a stable pseudo-random `val_fraction` of paths, else `train`."""
    unit = (
        int.from_bytes(
            hashlib.blake2b(rel.encode("utf-8"), digest_size=8, person=b"shardspl").digest(), "big"
        )
        / 2**64
    )
    return "val" if unit < val_fraction else "train"


def class_names(items: list[SourceItem]) -> list[str]:
    """Sorted class names; numeric labels sort as numbers so `2` comes before `10`."""
    names = {item.label for item in items}
    if all(name.lstrip("-").isdigit() for name in names):
        return sorted(names, key=int)
    return sorted(names)


def build_plan(items: list[SourceItem], shard_size: int, val_fraction: float, seed: int) -> Plan:
    """Assign every input to exactly one shard of one split.

    Raises:
        InputError: two inputs hash to the same key, a split name is invalid, or a
            path is not valid Unicode.
    """
    classes = class_names(items)
    label_of = {name: index for index, name in enumerate(classes)}
    by_split: dict[str, list[PlannedSample]] = {}
    keys: set[str] = set()
    for item in items:
        try:
            key = sample_key(item.rel)
        except UnicodeEncodeError as error:
            # Listing refuses such names (`bad_name`); a caller's own list may not.
            raise InputError(
                f"input path {ascii(item.rel)} is not valid UTF-8; rename the file and rerun"
            ) from error
        if key in keys:
            raise InputError(f"two inputs share the key {key}; rename {item.rel}")
        keys.add(key)
        split = item.split or hash_split(item.rel, val_fraction)
        try:
            check_key(split)
        except ValueError as error:
            raise InputError(
                f"split name {split!r} of {item.rel} is not usable in file names"
            ) from error
        by_split.setdefault(split, []).append(
            PlannedSample(key, item.path, item.rel, label_of[item.label])
        )
    tasks: list[ShardTask] = []
    digest = hashlib.sha256()
    for split in sorted(by_split):
        samples = sorted(by_split[split], key=_by_key)
        random.Random(f"{seed}:{split}").shuffle(samples)
        for index, start in enumerate(range(0, len(samples), shard_size)):
            chunk = tuple(samples[start : start + shard_size])
            tasks.append(ShardTask(split, index, chunk))
        for sample in samples:
            digest.update(f"{split}\t{sample.rel}\t{sample.label}\n".encode())
    return Plan(classes, tasks, len(items), digest.hexdigest(), shard_size)


def _by_key(sample: PlannedSample) -> str:
    return sample.key
