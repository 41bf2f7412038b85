"""Per-sample augmentation in the loader's workers: the same pixels for a sample on any
worker, rank or resume; in place on the batch slot, on every decode path; never in eval."""

from __future__ import annotations

import itertools
import tracemalloc
from collections import Counter

import numpy as np
import pytest
import torch

from pipeline import Augment, Batching, Crop, LoaderConfig, Workers
from pipeline.augment import build_augmenter
from pipeline.transforms import SampleRandom
from shards.errors import UsageError
from shards.sample import Field, SampleError
from tests.pipeline.conftest import loader_for

DEIT = Augment(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)


def invert(pixels: np.ndarray, rng) -> None:
    """A user op: every pixel inverted, in place."""
    np.subtract(255, pixels, out=pixels)


def stamp(pixels: np.ndarray, rng) -> None:
    """A user op that writes its first draw into the top-left pixel."""
    pixels[0, 0, 0] = int(rng.random() * 256)


def read_only_crop(data: bytes, rng) -> np.ndarray:
    """A user transform returning a read-only array (as Pillow's bytes are)."""
    pixels = np.full((32, 32, 3), 100, np.uint8)
    pixels.flags.writeable = False
    return pixels


def float_crop(data: bytes, rng) -> np.ndarray:
    return np.zeros((32, 32, 3), np.float32)


def pixels_by_key(loader, limit=None) -> dict[str, torch.Tensor]:
    """Each delivered sample's image, by key (clones: the ring's slots are reused)."""
    out = {}
    for images, _, keys in itertools.islice(loader, limit):
        for key, image in zip(keys, images, strict=True):
            out[key] = image.clone()
    return out


def same_pixels(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.fixture(scope="module")
def reference(shard_dir) -> dict[str, torch.Tensor]:
    """Every train sample once, augmented, read in the main process."""
    return pixels_by_key(
        loader_for(
            shard_dir, augment=DEIT, batch=Batching(size=8, epoch_rule="uneven", drop_last=False)
        )
    )


@pytest.mark.parametrize("workers", [2, 4])
def test_a_sample_gets_the_same_augmentation_on_any_number_of_workers(
    shard_dir, reference, workers
):
    loader = loader_for(
        shard_dir,
        augment=DEIT,
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
        workers=Workers(count=workers, persistent=False),
    )
    assert same_pixels(pixels_by_key(loader), reference)
    plain = pixels_by_key(
        loader_for(shard_dir, batch=Batching(size=8, epoch_rule="uneven", drop_last=False))
    )
    changed = sum(not torch.equal(plain[key], reference[key]) for key in plain)
    assert changed > len(plain) / 2  # RandAugment and erasing did change most images


@pytest.mark.parametrize("rule", ["pad", "uneven"])
def test_ranks_split_the_epoch_exactly_and_augment_alike(shard_dir, reference, rule):
    seen: Counter = Counter()
    merged, counts = {}, []
    for rank in range(2):
        loader = loader_for(
            shard_dir,
            augment=DEIT,
            rank=rank,
            world_size=2,
            batch=Batching(size=8, epoch_rule=rule, drop_last=rule == "pad"),
            workers=Workers(count=2),
        )
        batches = list(loader)
        counts.append(len(batches))
        assert len(batches) == len(loader)
        if rule == "pad":  # equal batches: every one full, as many on each rank
            assert {len(keys) for *_, keys in batches} == {8}
        for images, _, keys in batches:
            seen.update(keys)
            merged.update({k: image.clone() for k, image in zip(keys, images, strict=True)})
    if rule == "pad":
        assert counts[0] == counts[1]
    else:  # exactly once: the whole split, no sample twice
        assert seen == Counter(reference.keys())
    assert all(torch.equal(merged[key], reference[key]) for key in merged)


def test_a_mid_epoch_resume_delivers_the_same_augmented_batches(shard_dir):
    def build():
        return loader_for(shard_dir, augment=DEIT, workers=Workers(count=2, persistent=False))

    full = [(images.clone(), keys) for images, _, keys in build()]
    interrupted = build()
    head = [(images.clone(), keys) for images, _, keys in itertools.islice(interrupted, 5)]
    resumed = build()
    resumed.load_state_dict(interrupted.state_dict())
    rest = [(images.clone(), keys) for images, _, keys in resumed]
    assert len(head + rest) == len(full)
    for (images, keys), (want, want_keys) in zip(head + rest, full, strict=True):
        assert keys == want_keys and torch.equal(images, want)


def test_user_ops_run_in_place_after_the_crop_with_the_samples_own_draws(shard_dir):
    plain = pixels_by_key(loader_for(shard_dir), limit=4)
    inverted = pixels_by_key(loader_for(shard_dir, augment=Augment(ops=(invert,))), limit=4)
    # The crop draws from its own rng: augmenting leaves the crop boxes and flips alone.
    assert same_pixels(inverted, {k: 255 - v for k, v in plain.items()})
    stamped = pixels_by_key(loader_for(shard_dir, augment=Augment(ops=(stamp,))), limit=2)
    for key, image in stamped.items():
        draw = SampleRandom(f"augment:11:0:{key}:0").random()
        assert int(image[0, 0, 0]) == int(draw * 256)  # seed 11, epoch 0, repeat 0


def test_pillow_crops_are_augmented_in_place_too(shard_dir):
    plain = pixels_by_key(
        loader_for(shard_dir, crop=Crop(image_size=32, backend="pillow")), limit=4
    )
    augment = Augment(ops=(invert,))
    inverted = pixels_by_key(
        loader_for(shard_dir, crop=Crop(image_size=32, backend="pillow"), augment=augment), limit=4
    )
    assert same_pixels(inverted, {k: 255 - v for k, v in plain.items()})


def test_nchw_batches_hold_the_same_augmented_pixels(shard_dir, reference):
    loader = loader_for(
        shard_dir,
        augment=DEIT,
        batch=Batching(size=8, channels_last=False, epoch_rule="uneven", drop_last=False),
    )
    assert same_pixels(pixels_by_key(loader), reference)


def test_a_custom_transforms_read_only_output_is_augmented_on_a_copy(shard_dir):
    loader = loader_for(
        shard_dir,
        crop=Crop(image_size=32, transform=read_only_crop),
        augment=Augment(ops=(invert,)),
    )
    images, _, _ = next(iter(loader))
    assert images.shape == (8, 3, 32, 32) and set(images.unique().tolist()) == {155}
    bad = loader_for(
        shard_dir, crop=Crop(image_size=32, transform=float_crop), augment=Augment(ops=(invert,))
    )
    with pytest.raises(UsageError, match="Crop.transform returned ndarray float32"):
        next(iter(bad))


def test_augment_time_is_counted_and_nothing_runs_without_it(shard_dir):
    loader = loader_for(shard_dir, augment=DEIT, workers=Workers(count=2))
    list(loader)
    assert all(w["augment_s"] > 0 for w in loader.stats.workers.values())
    plain = loader_for(shard_dir, augment=Augment(), workers=Workers(count=2))
    assert plain.settings.augment is None  # not enabled: no per-sample call at all
    list(plain)
    assert all(w["augment_s"] == 0 for w in plain.stats.workers.values())


def test_eval_never_augments(shard_dir):
    with pytest.raises(UsageError, match="LoaderConfig.augment.*eval"):
        LoaderConfig(source=str(shard_dir), split="val", augment=DEIT)
    with pytest.raises(UsageError, match="LoaderConfig.augment.*eval"):
        LoaderConfig(source=str(shard_dir), split="train", train=False, augment=DEIT)
    # A disabled group is the default, for eval too; None means it.
    evaluation = loader_for(shard_dir, split="val", augment=Augment(), crop=Crop(image_size=32))
    assert evaluation.settings.augment is None
    assert LoaderConfig(source=str(shard_dir), split="val", augment=None).augment == Augment()
    with pytest.raises(UsageError, match="LoaderConfig.augment must be an Augment"):
        LoaderConfig(source=str(shard_dir), augment="rand-m9")


@pytest.mark.parametrize(
    "policy", ["rand-m9-mstd0.5-inc1", "original", "trivialaugment", "3a", "augmix-m5-w3-d2"]
)
def test_a_batch_augmented_op_by_op_gets_each_images_own_pixels(policy):
    """`run_batch` runs the k-th ops of all images grouped by op, then each step over all
    images: every image still gets what augmenting it alone gives, ops in its order and
    steps (jitter, erasing, a user op) drawing from its own rng."""
    augment = Augment(auto_augment=policy, color_jitter=0.4, ops=(stamp,), re_prob=0.5)
    augmenter = build_augmenter(augment, 48)
    crops = np.random.default_rng(1).integers(0, 256, (40, 48, 48, 3), dtype=np.uint8)
    alone = crops.copy()
    batch, depths = [], Counter()
    for index, pixels in enumerate(crops.copy()):
        augmenter(alone[index], SampleRandom(f"augment:0:0:{index}:0"))
        rng = SampleRandom(f"augment:0:0:{index}:0")
        drawn = augmenter.draw(rng)
        depths[len(drawn)] += 1
        batch.append((pixels, rng, drawn))
    augmenter.run_batch(batch)
    assert all(np.array_equal(pixels, alone[i]) for i, (pixels, _, _) in enumerate(batch))
    assert len(depths) > 1 or policy in ("3a", "augmix-m5-w3-d2")  # images of 0, 1, 2 ops


def refuse_dark(pixels: np.ndarray, rng) -> None:
    """A careless user op: raises on some crops (a skip it cannot make)."""
    if pixels.mean() < 120:
        raise SampleError("too_dark", "a dark crop")


def broken(pixels: np.ndarray, rng) -> None:
    raise ValueError("a bug in the op")


@pytest.mark.parametrize("op", [refuse_dark, broken])
def test_an_op_that_raises_stops_the_loader_in_one_line_naming_it_and_the_sample(shard_dir, op):
    """Ops run after the batch is cropped, so an op cannot skip its sample: whatever it
    raises (a SampleError too) is one UsageError naming the op, the sample and its shard."""
    loader = loader_for(shard_dir, augment=Augment(auto_augment="3a", ops=(op,)))
    with pytest.raises(UsageError) as raised:
        list(loader)
    message = str(raised.value)
    assert op.__name__ in message and "Crop.transform" in message
    assert "on sample " in message and ".tar" in message
    # one image on its own: the op's own error, as it raised it
    augmenter = build_augmenter(Augment(ops=(op,)), 8)
    with pytest.raises((SampleError, ValueError)):
        augmenter(np.zeros((8, 8, 3), np.uint8), SampleRandom("k"))


class SkipLabelOne:
    """A label field's transform: samples of class 1 are a counted skip."""

    def __call__(self, label: int, rng) -> int:
        if label == 1:
            raise SampleError("class_one", "class 1 is left out")
        return label


def test_a_sample_skipped_after_its_crop_leaves_no_augmentation_behind(shard_dir, reference):
    """A label that fails after its image's crop filled the batch slot: the next sample
    takes the slot, and only that sample's own augmentation runs there (the batch's ops
    run once the batch is decoded)."""
    fields = (Field("image", "image"), Field("label", "label", transform=SkipLabelOne()))
    loader = loader_for(
        shard_dir,
        augment=DEIT,
        fields=fields,
        batch=Batching(size=8, epoch_rule="uneven", drop_last=False),
        max_skip_fraction=0.5,  # a class of four
    )
    first = {}  # a worker whose stream ran dry refills with new draws: keep the originals
    for images, _, keys in loader:
        for key, image in zip(keys, images, strict=True):
            first.setdefault(key, image.clone())
    assert loader.stats.skipped["class_one"] > 0 and first
    assert all(torch.equal(image, reference[key]) for key, image in first.items())


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "augmix-m5-w3-d2"])
def test_augmentation_holds_at_most_the_documented_temporaries(policy):
    """docs/LOADER.md's memory bound: at most 20 crops' worth, one sample at a time."""
    side = 224
    augmenter = build_augmenter(Augment(auto_augment=policy, re_prob=0.25), side)
    crop = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    peak = 0
    for index in range(40):
        pixels = crop.copy()
        tracemalloc.start()
        augmenter(pixels, SampleRandom(f"augment:0:0:{index}:0"))
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert 0 < peak <= 20 * side * side * 3
