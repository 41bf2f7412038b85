"""Resampled mode (fixed epoch length, draws with replacement) and class balancing."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch

from pipeline.config import Batching, Resampled, Workers
from preprocess.job import run_build
from tests.conftest import shard_path, small_build_config
from tests.pipeline.conftest import epoch_keys, loader_for


@pytest.fixture(scope="module")
def skewed_shards(sample_dir, tmp_path_factory):
    """Classes 60 : 6 : 6 — the kind of skew class balancing is for."""
    files = sorted((sample_dir / "class_000").iterdir())
    files += sorted((sample_dir / "class_001").iterdir())[:6]
    files += sorted((sample_dir / "class_002").iterdir())[:6]
    root = tmp_path_factory.mktemp("skew")
    for f in files:
        (root / f.parent.name).mkdir(exist_ok=True)
        shutil.copy(f, root / f.parent.name / f.name)
    listing = root / "list.csv"
    listing.write_text(
        "path,label\n" + "".join(f"{f.parent.name}/{f.name},{f.parent.name}\n" for f in files)
    )
    out = listing.parent / "shards"
    run_build(small_build_config(listing, out, val_fraction=0.0, shard_size=16))
    return out


def labels_of(loader):
    return Counter(torch.cat([labels for _, labels, _ in loader]).tolist())


def test_class_balance_evens_out_a_skewed_dataset(skewed_shards):
    plain = labels_of(
        loader_for(skewed_shards, batch=Batching(size=20), sampling=Resampled(epoch_samples=600))
    )
    balanced = labels_of(
        loader_for(
            skewed_shards,
            batch=Batching(size=20),
            sampling=Resampled(epoch_samples=600, balance=True),
        )
    )
    assert sum(plain.values()) == sum(balanced.values()) == 600
    assert plain[0] > 0.7 * 600  # the skew shows without balancing
    for label in range(3):
        assert 140 < balanced[label] < 260, balanced


def test_resampled_epochs_have_fixed_length_and_equal_batches_per_rank(skewed_shards):
    counts = set()
    for rank in range(3):
        loader = loader_for(
            skewed_shards,
            batch=Batching(size=8),
            sampling=Resampled(epoch_samples=100),
            workers=Workers(count=2, persistent=False),
            rank=rank,
            world_size=3,
        )
        batches = epoch_keys(loader)
        counts.add(len(batches))
        assert len(batches) == len(loader)
    assert len(counts) == 1


def test_resampled_is_deterministic_varies_by_epoch_and_resumes_exactly(skewed_shards):
    options = dict(
        batch=Batching(size=8),
        sampling=Resampled(epoch_samples=96),
        workers=Workers(count=2, persistent=False),
    )
    full = epoch_keys(loader_for(skewed_shards, **options))
    assert full == epoch_keys(loader_for(skewed_shards, **options))
    later = loader_for(skewed_shards, **options)
    later.set_epoch(1)
    assert epoch_keys(later) != full
    head_loader = loader_for(skewed_shards, **options)
    head = epoch_keys(head_loader, limit=5)
    resumed = loader_for(skewed_shards, **options)
    resumed.load_state_dict(head_loader.state_dict())
    assert head + epoch_keys(resumed) == full


def test_balance_without_counts_is_refused(shard_dir):
    # epoch_samples without resampling is the flat spelling's mistake: tests/pipeline/test_config.py
    with pytest.raises(ValueError, match="class counts"):
        loader_for(str(shard_path(shard_dir, "train", 0)), sampling=Resampled(balance=True))
