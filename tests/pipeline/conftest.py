"""Loader fixtures: the session's shards, and helpers to read keys through the loader."""

from __future__ import annotations

import itertools
import shutil

import pytest

from pipeline.config import Batching, Crop, Shuffle, Workers
from pipeline.loader import LoaderConfig, build_loader


@pytest.fixture(scope="session")
def shard_dir(built_shards):
    return built_shards.output


@pytest.fixture
def shard_copy(shard_dir, tmp_path):
    """A private copy of the session shards that a test may damage."""
    out = tmp_path / "shards"
    shutil.copytree(shard_dir, out)
    return out


def loader_for(shard_dir, **overrides):
    """A small train loader over `shard_dir`; a group in `overrides` replaces this one's whole
    (`batch=Batching(size=4)` is a batch of 4 with the other `Batching` defaults)."""
    options = dict(
        source=str(shard_dir),
        split="train",
        batch=Batching(size=8),
        crop=Crop(image_size=32),
        workers=Workers(count=0),
        seed=11,
        shuffle=Shuffle(buffer=64, initial=16),
        with_keys=True,
    )
    options.update(overrides)
    return build_loader(LoaderConfig(**options))


def epoch_keys(loader, limit=None):
    """Keys per batch for one pass (optionally stopping after `limit` batches)."""
    return [list(keys) for _, _, keys in itertools.islice(loader, limit)]
