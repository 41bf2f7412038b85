"""Loader fixtures: the session's shards, and helpers to read keys through the loader."""

from __future__ import annotations

import itertools
import shutil

import pytest

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
    options = dict(
        source=str(shard_dir),
        split="train",
        batch_size=8,
        image_size=32,
        num_workers=0,
        seed=11,
        shuffle_buffer=64,
        shuffle_initial=16,
        with_keys=True,
    )
    options.update(overrides)
    if "crop" in overrides:  # a Crop group carries its own image_size
        del options["image_size"]
    if "batch" in overrides:  # a Batching group carries its own size
        del options["batch_size"]
    return build_loader(LoaderConfig(**options))


def epoch_keys(loader, limit=None):
    """Keys per batch for one pass (optionally stopping after `limit` batches)."""
    return [list(keys) for _, _, keys in itertools.islice(loader, limit)]
