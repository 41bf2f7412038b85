"""Progressive resizing: train images sized by epoch (FFCV's rule), through workers,
ring slots and resume; eval keeps `Crop.image_size`."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipeline import Augment, Crop, ProgressiveResize, Workers
from shards.flags import SettingError
from tests.pipeline.conftest import loader_for

# 16 px at epoch 0, 24 at epoch 1, 32 from epoch 2 on.
SCHEDULE = ProgressiveResize(start=16, end=32, first_epoch=0, last_epoch=2, step=8)
DEIT = Augment(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)


def loader(shard_dir, crop: Crop, **overrides):
    return loader_for(shard_dir, crop=crop, **overrides)


def pixels_by_key(batches) -> dict[str, torch.Tensor]:
    return {
        key: image for images, _, keys in batches for key, image in zip(keys, images, strict=True)
    }


def test_size_at_ramps_linearly_to_the_nearest_step_as_ffcv():
    ffcv = ProgressiveResize(start=160, end=192, first_epoch=0, last_epoch=10, step=32)
    # 160 + 32 * e / 10 rounds to 160 up to epoch 4 (172.8) and to 192 from epoch 5 (176.0,
    # a half: to the even multiple, 6 x 32).
    assert [ffcv.size_at(e) for e in range(12)] == [160] * 5 + [192] * 7
    fine = ProgressiveResize(start=160, end=224, first_epoch=2, last_epoch=6, step=16)
    assert [fine.size_at(e) for e in range(8)] == [160, 160, 160, 176, 192, 208, 224, 224]
    down = ProgressiveResize(start=224, end=128, last_epoch=3, step=32)
    assert [down.size_at(e) for e in range(5)] == [224, 192, 160, 128, 128]
    assert down.largest == 224
    # A multiple of `step` outside start..end is never used: the side stays within them.
    odd = ProgressiveResize(start=100, end=110, last_epoch=2, step=32)
    assert odd.size_at(1) == 100
    assert Crop(image_size=48, progressive=ffcv).train_size(7) == 192
    assert Crop(image_size=48).train_size(7) == 48


@pytest.mark.parametrize(
    "options,message",
    [
        (
            dict(start=160, end=192, last_epoch=10, step=0),
            "ProgressiveResize.step must be at least 1",
        ),
        (dict(start=16, end=192, last_epoch=10), "ProgressiveResize.start must be at least 32"),
        (dict(start=160, end=192, first_epoch=5, last_epoch=4), "last_epoch must be at least 5"),
        (dict(start=160, end=192, last_epoch=True), "last_epoch must be an integer"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(options, message):
    with pytest.raises(SettingError, match=message):
        ProgressiveResize(**options)


def test_crop_refuses_a_schedule_with_a_custom_transform():
    with pytest.raises(SettingError, match="Crop.progressive resizes the built-in crops"):
        Crop(progressive=SCHEDULE, transform=lambda data, rng: data)
    with pytest.raises(SettingError, match="Crop.progressive must be a ProgressiveResize"):
        Crop(progressive=(16, 32))


def test_each_epoch_has_its_size_through_persistent_workers_and_ring_slots(shard_dir):
    crop = Crop(image_size=48, progressive=SCHEDULE)
    grown = loader(shard_dir, crop, workers=Workers(count=2, persistent=True), augment=DEIT)
    # Slots are sized once, for the largest side; smaller epochs use their first bytes.
    assert grown.ring.slot_bytes == 8 * 32 * 32 * 3
    for epoch, side in enumerate([16, 24, 32, 32]):
        assert grown.image_size == side
        batches, from_ring = [], 0
        for images, labels, keys in grown:  # each batch dropped before the next: slots recur
            from_ring += grown.ring.holds(images)
            batches.append((images.clone(), labels, keys))
        assert from_ring == len(batches) == len(grown) > 0
        assert {tuple(images.shape) for images, _, _ in batches} == {(8, 3, side, side)}
        # The same pixels as a loader built at that side, keyed by sample: the crop and the
        # augmentation (translations are a share of the side) are the epoch's.
        fixed = loader(
            shard_dir,
            Crop(image_size=side),
            workers=Workers(count=2, persistent=False),
            augment=DEIT,
        )
        fixed.set_epoch(epoch)
        expected = pixels_by_key(fixed)
        got = pixels_by_key(batches)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[key], expected[key]) for key in got)


def test_a_resume_in_a_later_epoch_continues_at_that_epochs_size(shard_dir):
    crop = Crop(image_size=48, progressive=SCHEDULE)
    full = loader(shard_dir, crop, workers=Workers(count=2))
    full.set_epoch(1)
    reference = list(full)
    interrupted = loader(shard_dir, crop, workers=Workers(count=2))
    list(interrupted)  # epoch 0, at 16 px
    head = list(itertools.islice(interrupted, 3))
    state = interrupted.state_dict()
    assert state["epoch"] == 1
    resumed = loader(shard_dir, crop, workers=Workers(count=2))
    resumed.load_state_dict(state)
    assert resumed.image_size == 24
    rest = list(resumed)
    assert len(head) + len(rest) == len(reference)
    for (images, _, keys), (want, _, want_keys) in zip(head + rest, reference, strict=True):
        assert keys == want_keys and images.shape[-1] == 24 and torch.equal(images, want)
    assert {tuple(images.shape[-2:]) for images, _, _ in resumed} == {(32, 32)}  # epoch 2


def test_eval_keeps_the_image_size_whatever_the_epoch(shard_dir):
    crop = Crop(image_size=40, progressive=SCHEDULE)
    evaluation = loader(shard_dir, crop, split="val", workers=Workers(count=2))
    assert evaluation.ring.slot_bytes == 8 * 40 * 40 * 3
    plain = loader(shard_dir, Crop(image_size=40), split="val", workers=Workers(count=2))
    for epoch in (0, 2):
        evaluation.set_epoch(epoch)
        plain.set_epoch(epoch)
        assert evaluation.image_size == 40
        for (images, _, keys), (want, _, want_keys) in zip(evaluation, plain, strict=True):
            assert keys == want_keys and torch.equal(images, want)
            assert images.shape[-2:] == (40, 40)
