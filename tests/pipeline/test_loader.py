"""The streaming loader on real shards: exact epochs, order, resume, formats, shapes."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pipeline.config import Batching, Workers
from shards.manifest import read_manifest
from tests.conftest import shard_files
from tests.pipeline.conftest import epoch_keys, loader_for


def split_keys(shard_dir, split):
    from shards.tar import iter_tar_samples

    manifest = read_manifest(shard_dir)
    keys = []
    for url in manifest.shard_urls(split, "tar", str(shard_dir)):
        with open(url, "rb") as stream:
            keys += [s["__key__"] for s in iter_tar_samples(stream, url)]
    return keys


def test_batches_are_uint8_images_and_int64_labels(shard_dir):
    loader = loader_for(shard_dir, with_keys=False, batch=Batching(size=8, drop_last=True))
    batches = list(loader)
    assert len(batches) == len(loader) > 0
    images, labels = batches[0]
    assert images.dtype == torch.uint8 and images.shape == (8, 3, 32, 32)
    assert images.is_contiguous(memory_format=torch.channels_last)  # the default layout
    assert labels.dtype == torch.int64 and labels.shape == (8,)
    assert int(labels.min()) >= 0 and int(labels.max()) < 4
    assert images.float().std() > 5  # real pixels, not a constant fill


def test_both_layouts_hold_the_same_pixels(shard_dir):
    nhwc, _, nhwc_keys = next(
        iter(loader_for(shard_dir, batch=Batching(size=8, channels_last=True)))
    )
    nchw, _, nchw_keys = next(
        iter(loader_for(shard_dir, batch=Batching(size=8, channels_last=False)))
    )
    assert nhwc.shape == nchw.shape == (8, 3, 32, 32)
    assert nhwc.is_contiguous(memory_format=torch.channels_last) and not nhwc.is_contiguous()
    assert nchw.is_contiguous()
    assert nhwc_keys == nchw_keys and torch.equal(nhwc, nchw)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_exactly_once_across_ranks_and_workers(shard_dir, world, workers):
    expected = split_keys(shard_dir, "train")
    seen = Counter()
    for rank in range(world):
        loader = loader_for(
            shard_dir,
            rank=rank,
            world_size=world,
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=workers, persistent=False),
        )
        for keys in epoch_keys(loader):
            seen.update(keys)
    assert seen == Counter(expected)


@pytest.mark.parametrize("workers", [0, 2])
def test_pad_rule_gives_every_rank_the_same_batch_count(shard_dir, workers):
    counts = []
    seen = set()
    for rank in range(3):
        loader = loader_for(
            shard_dir,
            rank=rank,
            world_size=3,
            batch=Batching(size=8, drop_last=True),
            workers=Workers(count=workers, persistent=False),
        )
        batches = epoch_keys(loader)
        assert all(len(b) == 8 for b in batches)
        counts.append(len(batches))
        assert len(batches) == len(loader)
        seen.update(k for b in batches for k in b)
    assert len(set(counts)) == 1


def test_order_is_deterministic_and_changes_every_epoch(shard_dir):
    first = epoch_keys(loader_for(shard_dir))
    assert first == epoch_keys(loader_for(shard_dir))
    other_seed = epoch_keys(loader_for(shard_dir, seed=12))
    assert first != other_seed
    loader = loader_for(shard_dir)
    loader.set_epoch(1)
    assert first != epoch_keys(loader)
    # Without drop_last every epoch is a permutation of the same samples.
    whole = [
        loader_for(shard_dir, batch=Batching(size=8, drop_last=False, epoch_rule="uneven"))
        for _ in range(2)
    ]
    whole[1].set_epoch(1)
    epochs = [sorted(k for b in epoch_keys(w) for k in b) for w in whole]
    assert epochs[0] == epochs[1] == sorted(split_keys(shard_dir, "train"))


def test_persistent_workers_see_each_new_epoch(shard_dir):
    loader = loader_for(shard_dir, workers=Workers(count=2, persistent=True))
    epoch0 = epoch_keys(loader)
    epoch1 = epoch_keys(loader)  # advances by itself after a complete pass
    fresh = loader_for(shard_dir, workers=Workers(count=2, persistent=False))
    fresh.set_epoch(1)
    assert epoch1 == epoch_keys(fresh) and epoch1 != epoch0


def test_train_order_mixes_classes_within_batches(shard_dir):
    loader = loader_for(shard_dir, with_keys=False, batch=Batching(size=16))
    labels = torch.cat([labels for _, labels in loader]).tolist()
    changes = sum(a != b for a, b in zip(labels, labels[1:], strict=False))
    assert changes > len(labels) / 2


@pytest.mark.parametrize("workers,stop_after", [(0, 5), (2, 5), (2, 6), (3, 4)])
def test_mid_epoch_resume_continues_the_identical_sequence(shard_dir, workers, stop_after):
    full = epoch_keys(loader_for(shard_dir, workers=Workers(count=workers, persistent=False)))
    interrupted = loader_for(shard_dir, workers=Workers(count=workers, persistent=False))
    head = epoch_keys(interrupted, limit=stop_after)
    state = interrupted.state_dict()
    resumed = loader_for(shard_dir, workers=Workers(count=workers, persistent=False))
    resumed.load_state_dict(state)
    assert resumed.batches_remaining() == len(full) - stop_after
    assert head + epoch_keys(resumed) == full


def test_resume_on_another_world_size_loses_and_doubles_nothing(shard_dir):
    expected = Counter(split_keys(shard_dir, "train"))
    consumed = Counter()
    states = []
    for rank in range(2):
        loader = loader_for(
            shard_dir,
            rank=rank,
            world_size=2,
            batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
            workers=Workers(count=2, persistent=False),
        )
        for keys in epoch_keys(loader, limit=3):
            consumed.update(keys)
        states.append(loader.state_dict())
    assert states[0]["segments"] == states[1]["segments"]
    single = loader_for(
        shard_dir,
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
        workers=Workers(count=1),
    )
    single.load_state_dict(states[0])
    rest = Counter(k for keys in epoch_keys(single) for k in keys)
    assert consumed + rest == expected
    assert max((consumed + rest).values()) == 1


def test_state_after_a_complete_epoch_resumes_at_the_next_epoch(shard_dir):
    loader = loader_for(shard_dir)
    epoch_keys(loader)
    state = loader.state_dict()
    assert state["epoch"] == 1
    resumed = loader_for(shard_dir)
    resumed.load_state_dict(state)
    reference = loader_for(shard_dir)
    reference.set_epoch(1)
    assert epoch_keys(resumed) == epoch_keys(reference)


def test_resume_refuses_a_state_from_another_dataset_or_seed(shard_dir):
    state = loader_for(shard_dir).state_dict()
    with pytest.raises(ValueError, match="another dataset or seed"):
        loader_for(shard_dir, seed=99).load_state_dict(state)


def test_tar_and_parquet_give_the_same_samples_and_pixels(shard_dir):
    tar = list(
        loader_for(shard_dir, split="val", format="tar", train=False, batch=Batching(size=5))
    )
    parquet = list(
        loader_for(shard_dir, split="val", format="parquet", train=False, batch=Batching(size=5))
    )
    assert [b[2] for b in tar] == [b[2] for b in parquet]
    for (a, la, _), (b, lb, _) in zip(tar, parquet, strict=True):
        assert torch.equal(a, b) and torch.equal(la, lb)


def test_eval_reads_every_sample_once_in_order_with_a_partial_last_batch(shard_dir):
    expected = split_keys(shard_dir, "val")
    batches = epoch_keys(loader_for(shard_dir, split="val", train=False, batch=Batching(size=7)))
    assert sum(batches, []) == expected
    assert len(batches[-1]) == len(expected) % 7 or len(batches[-1]) == 7


def test_shard_urls_without_manifest_are_counted_from_the_shards(shard_dir, tmp_path):
    import shutil

    for tar in shard_files(shard_dir, "tar", "train"):
        shutil.copy(tar, tmp_path / tar.name)
    count = len(list(tmp_path.glob("*.tar")))
    pattern = str(tmp_path / f"train-{{000000..{count - 1:06d}}}.tar")
    loader = loader_for(pattern, batch=Batching(size=8, epoch_rule="uneven", drop_last=False))
    keys = sorted(k for b in epoch_keys(loader) for k in b)
    assert keys == sorted(split_keys(shard_dir, "train"))


def test_stats_report_first_batch_throughput_and_waits(shard_dir):
    loader = loader_for(shard_dir, workers=Workers(count=2))
    epoch_keys(loader)
    stats = loader.stats.summary()
    assert stats["first_batch_s"] > 0 and stats["images_per_s"] > 0
    assert stats["batches"] == len(loader) and stats["skipped"] == {}


def test_fields_choose_what_batches_carry_and_in_which_order(shard_dir):
    default = next(iter(loader_for(shard_dir)))
    labels, images, keys = next(iter(loader_for(shard_dir, fields=("label", "image"))))
    assert torch.equal(images, default[0]) and torch.equal(labels, default[1])
    assert keys == default[2]
    metas, only_keys = next(iter(loader_for(shard_dir, fields=("json",))))
    assert only_keys == keys and all(min(m["width"], m["height"]) == 64 for m in metas)
