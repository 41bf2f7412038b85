"""`Augment`, its grammar and the `Augmenter` it builds: parsing, errors, determinism,
the policies' draws, colour steps, random erasing and the order of the steps."""

from __future__ import annotations

import collections
import functools
import math
import pickle
import random
from io import BytesIO
from statistics import NormalDist

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("cv2")

from pipeline.augment import Augment, Augmenter, build_augmenter  # noqa: E402
from pipeline.augment import policies as policies_module  # noqa: E402
from pipeline.augment.erasing import RandomErasing, quantile_tables  # noqa: E402
from pipeline.augment.grammar import PolicySpec, parse_policy  # noqa: E402
from pipeline.augment.levels import AugmentOp, Hparams  # noqa: E402
from pipeline.augment.policies import (  # noqa: E402
    RAND_INCREASING_OPS,
    RAND_OPS,
    AugMix,
    RandAugment,
    TrivialAugment,
    build_policy,
)
from pipeline.transforms import SampleRandom  # noqa: E402
from shards.flags import SettingError  # noqa: E402
from tests.oddimages import photo_jpeg  # noqa: E402

PHOTO = np.asarray(Image.open(BytesIO(photo_jpeg(96, 80, seed=5))).convert("RGB")).copy()
POLICIES = (
    "rand-m9-mstd0.5-inc1",
    "rand-m7-mstd0.5",
    "rand-m9-n3-mstd101-mmax12",
    "rand-m9-tweights",
    "rand-m9-w0",
    "rand-t3a",
    "rand-n4-t3aw",
    "original",
    "originalr",
    "v0",
    "v0r-mstd0.5",
    "3a",
    "augmix-m5-w3-d2",
    "augmix-m3-w4-a0.5-b1",
    "trivialaugment",
)
MEAN_PIXEL = (124, 116, 104)  # round(255 * ImageNet mean)


def fill_sevens(pixels: np.ndarray, rng: random.Random) -> None:
    """A user op: paint the crop 7 (module-level, so it pickles)."""
    pixels[...] = 7


def add_value(pixels: np.ndarray, rng: random.Random, value: int = 1) -> None:
    np.add(pixels, value, out=pixels)


# --- the grammar -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "rand-m9-mstd0.5-inc1",
            PolicySpec("rand", magnitude=9, magnitude_std=0.5, increasing=True),
        ),
        ("rand-m7-n3-inc0", PolicySpec("rand", magnitude=7, num_layers=3)),
        ("rand-mstd101", PolicySpec("rand", magnitude_std=math.inf)),
        ("rand-m15-mmax15-p0.7", PolicySpec("rand", magnitude=15, magnitude_max=15, prob=0.7)),
        ("rand-m9-w0", PolicySpec("rand", magnitude=9, choices="w0")),
        ("rand-m9-tweights", PolicySpec("rand", magnitude=9, choices="weights")),
        ("rand-t3a", PolicySpec("rand", choices="3a")),
        ("rand-n4-t3aw", PolicySpec("rand", num_layers=4, choices="3aw")),
        ("rand", PolicySpec("rand")),
        ("original", PolicySpec("auto", name="original")),
        ("originalr", PolicySpec("auto", name="originalr")),
        ("v0", PolicySpec("auto", name="v0")),
        ("v0r-mstd0.5", PolicySpec("auto", name="v0r", magnitude_std=0.5)),
        ("3a", PolicySpec("auto", name="3a")),
        ("augmix", PolicySpec("augmix", magnitude=3, magnitude_std=math.inf)),
        (
            "augmix-m5-w4-d2-a0.5-b1-mstd0.3",
            PolicySpec(
                "augmix", magnitude=5, width=4, depth=2, alpha=0.5, blended=True, magnitude_std=0.3
            ),
        ),
        ("trivialaugment", PolicySpec("trivial")),
    ],
)
def test_every_form_of_the_grammar_parses(text, expected):
    assert parse_policy(text) == expected
    assert Augment(auto_augment=text).auto_augment == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "rand-x9",
        "rand-m",
        "rand-m9.5",
        "rand-m-1",
        "rand-inc2",
        "rand-w1",
        "rand-tfoo",
        "rand-m9-m8",
        "rand-p1.5",
        "rand-n16-tweights",
        "rand-n14-w0",
        "augmix-w0",
        "augmix-a0",
        "augmix-inc1",
        "original-m9",
        "v1",
        "RAND-m9",
        "trivialaugment-m9",
        "randaugment",
    ],
)
def test_a_bad_string_is_one_error_naming_field_string_and_grammar(text):
    with pytest.raises(SettingError) as caught:
        Augment(auto_augment=text)
    message = str(caught.value)
    assert message.startswith("Augment.auto_augment ")
    assert repr(text) in message and "grammar: rand[-m{M}]" in message
    assert "\n" not in message


def test_weighted_sets_accept_as_many_layers_as_they_have_distinct_ops():
    Augment(auto_augment="rand-n15-tweights")
    Augment(auto_augment="rand-n13-w0")  # w0 gives Posterize and Invert weight 0


# --- the other settings -----------------------------------------------------------------


def bad_lambda_op():
    return lambda pixels, rng: None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(color_jitter=-0.1), "color_jitter"),
        (dict(color_jitter=(0.4, 0.4)), "color_jitter"),
        (dict(color_jitter=(0.4, 0.4, 0.4, 0.6)), "color_jitter"),
        (dict(color_jitter="0.4"), "color_jitter"),
        (dict(grayscale=1.5), "grayscale"),
        (dict(gaussian_blur=-0.1), "gaussian_blur"),
        (dict(re_prob=True), "re_prob"),
        (dict(re_mode="noise"), "re_mode"),
        (dict(re_count=0), "re_count"),
        (dict(re_area=(0.0, 0.3)), "re_area"),
        (dict(re_area=(0.2, 1.5)), "re_area"),
        (dict(re_ratio=(3.0, 0.3)), "re_ratio"),
        (dict(mean=(0.5, 0.5)), "mean"),
        (dict(std=(0.2, 0.0, 0.2)), "std"),
        (dict(ops=(1,)), "ops"),
        (dict(ops=(bad_lambda_op(),)), "ops"),
        (dict(interpolation="lanczos"), "interpolation"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(SettingError, match=rf"^Augment\.{field}"):
        Augment(**kwargs)


@pytest.mark.parametrize(
    "interpolation, crop, expected",
    [
        (None, "bilinear", ("bilinear",)),  # timm's loaders: the train interpolation
        (None, "bicubic", ("bicubic",)),
        (None, "nearest", ("bilinear", "bicubic")),  # no fixed filter timm's ops take
        (None, None, ("bilinear", "bicubic")),  # a crop of the user's own
        ("random", "bilinear", ("bilinear", "bicubic")),  # timm's train.py default
        ("bicubic", "bilinear", ("bicubic",)),
    ],
)
def test_the_policys_geometric_filter_follows_the_crop_as_timms(interpolation, crop, expected):
    augment = Augment(auto_augment="rand-m9-mstd0.5-inc1", interpolation=interpolation)
    assert augment.policy_resample(crop) == expected
    augmenter = build_augmenter(augment, 64, crop)
    assert {op.hparams.resample for op in augmenter.policy.ops} == {expected}
    rotations = collections.Counter()
    for index in range(400):  # each geometric op's drawn filter is one of `expected`
        for op in augmenter.draw(SampleRandom(f"f{index}")):
            if hasattr(op, "resample"):
                rotations[op.resample] += 1
    assert set(rotations) == set(expected) and min(rotations.values()) > 20


def test_lists_become_tuples_so_the_settings_stay_hashable():
    augment = Augment(color_jitter=[0.4, 0.4, 0.4], re_area=[0.1, 0.2], ops=[fill_sevens])
    assert augment.color_jitter == (0.4, 0.4, 0.4) and augment.re_area == (0.1, 0.2)
    assert augment.ops == (fill_sevens,)
    hash(augment)


def test_enabled_only_when_something_is_asked():
    assert not Augment().enabled and build_augmenter(Augment(), 224) is None
    assert not Augment(color_jitter=0.0).enabled
    for kwargs in (
        dict(auto_augment="3a"),
        dict(color_jitter=0.4),
        dict(grayscale=0.1),
        dict(gaussian_blur=0.1),
        dict(re_prob=0.25),
        dict(ops=(fill_sevens,)),
    ):
        augment = Augment(**kwargs)
        assert augment.enabled and isinstance(build_augmenter(augment, 224), Augmenter)


# --- determinism --------------------------------------------------------------------------


def augmented(augmenter: Augmenter, seed: str, image: np.ndarray = PHOTO) -> np.ndarray:
    pixels = image.copy()
    augmenter(pixels, SampleRandom(seed))
    return pixels


@pytest.mark.parametrize("policy", POLICIES)
def test_same_seed_same_pixels_and_other_seeds_differ(policy):
    augment = Augment(auto_augment=policy, re_prob=0.5, re_mode="pixel", color_jitter=0.3)
    augmenter = build_augmenter(augment, 96)
    respawned = pickle.loads(pickle.dumps(augmenter))  # what a spawned worker gets
    first = [augmented(augmenter, f"0/1/key{i}") for i in range(8)]
    assert all(np.array_equal(a, augmented(respawned, f"0/1/key{i}")) for i, a in enumerate(first))
    distinct = {a.tobytes() for a in first}
    assert len(distinct) >= 7, policy


def test_a_view_into_a_batch_slot_is_augmented_in_place():
    """The loader hands a slot of its batch: contiguous or (channels-first) strided."""
    augmenter = build_augmenter(Augment(auto_augment="rand-m9-mstd0.5-inc1", re_prob=1.0), 96)
    expected = augmented(augmenter, "k")
    batch = np.zeros((2, *PHOTO.shape), np.uint8)
    batch[1] = PHOTO
    augmenter(batch[1], SampleRandom("k"))
    assert np.array_equal(batch[1], expected) and not batch[0].any()
    planar = np.ascontiguousarray(PHOTO.transpose(2, 0, 1))  # CHW memory, HWC view
    view = planar.transpose(1, 2, 0)
    augmenter(view, SampleRandom("k"))
    assert np.array_equal(view, expected)


# --- the policies' draws ----------------------------------------------------------------


def test_randaugment_draws_each_op_uniformly_with_replacement():
    policy = build_policy(parse_policy("rand-m9-mstd0.5-inc1"), Hparams())
    assert [op.name for op in policy.ops] == list(RAND_INCREASING_OPS)
    rng = SampleRandom("uniform")
    counts = collections.Counter(op.name for _ in range(5000) for op in policy.choose(rng))
    expected = 5000 * 2 / len(RAND_OPS)  # 667; sd ~25, so +-15% is over 4 sd
    assert set(counts) == set(RAND_INCREASING_OPS)
    assert all(abs(count - expected) < 0.15 * expected for count in counts.values()), counts


def test_weighted_randaugment_follows_the_weights_without_repeats():
    policy = build_policy(parse_policy("rand-n2-tweights"), Hparams())
    rng = SampleRandom("weighted")
    draws = [policy.choose(rng) for _ in range(5000)]
    assert all(len({op.name for op in ops}) == 2 for ops in draws)
    counts = collections.Counter(op.name for ops in draws for op in ops)
    assert counts["Rotate"] > counts["ShearX"] > counts["TranslateXRel"] > counts["Invert"]
    old = build_policy(parse_policy("rand-n2-w0"), Hparams())
    old_names = {op.name for _ in range(2000) for op in old.choose(rng)}
    assert "Posterize" not in old_names and "Invert" not in old_names  # weight 0 in timm


def test_each_op_applies_with_its_probability():
    op = AugmentOp("Invert", prob=0.4)
    rng = SampleRandom("prob")
    applied = 0
    for _ in range(4000):
        pixels = PHOTO[:2, :2].copy()
        op(pixels, rng)
        applied += not np.array_equal(pixels, PHOTO[:2, :2])
    assert abs(applied / 4000 - 0.4) < 0.03


def test_magnitude_noise_and_clipping_follow_timm():
    rng = SampleRandom("noise")
    noisy = AugmentOp("Rotate", magnitude=9, hparams=Hparams(magnitude_std=0.5))
    draws = [noisy.draw_magnitude(rng) for _ in range(4000)]
    assert max(draws) == 10.0 and min(draws) > 7  # clipped at 10
    assert abs(np.mean(draws) - 8.996) < 0.04  # N(9, 0.5) clipped at 10; 5 sd of the mean
    uniform = AugmentOp("Rotate", magnitude=9, hparams=Hparams(magnitude_std=math.inf))
    draws = [uniform.draw_magnitude(rng) for _ in range(4000)]
    assert 0 <= min(draws) < 0.1 and 8.9 < max(draws) <= 9 and abs(np.mean(draws) - 4.5) < 0.2
    wide = AugmentOp("Rotate", magnitude=15, hparams=Hparams(magnitude_max=12))
    assert wide.draw_magnitude(rng) == 12


def test_trivialaugment_draws_ops_bins_and_signs_uniformly(monkeypatch):
    calls = []
    monkeypatch.setattr(policies_module, "trivial_op", lambda *args: calls.append(args[:2]))
    rng = SampleRandom("trivial")
    for _ in range(7000):
        TrivialAugment()(PHOTO, rng)
    names = collections.Counter(name for name, _ in calls)
    assert len(names) == 14 and all(abs(n - 500) < 90 for n in names.values()), names
    rotations = [magnitude for name, magnitude in calls if name == "Rotate"]
    steps = {round(abs(m) / 4.5, 6) for m in rotations}  # 135 / 30 = 4.5 degrees a bin
    assert steps == set(range(31)) and 0.4 < np.mean([m < 0 for m in rotations]) < 0.6
    solarize = {m for name, m in calls if name == "Solarize"}
    assert min(solarize) == 0.0 and max(solarize) == 255.0  # thresholds 255 down to 0


def test_augmix_mixes_its_chains_as_timm_with_pillows_blend():
    """One op (Invert), depth 1: every chain is the inverse; the mix and blend are timm's."""
    policy = AugMix((AugmentOp("Invert", 1.0),), alpha=1.0, width=3, depth=1)
    pixels = PHOTO.copy()
    policy(pixels, SampleRandom("augmix"))
    draws = SampleRandom("augmix")
    weights = np.array([draws.gammavariate(1.0, 1.0) for _ in range(3)])
    weights = (weights / weights.sum()).astype(np.float32)
    mix = np.float32(draws.betavariate(1.0, 1.0))
    mixed = np.zeros(PHOTO.shape, np.float32)
    for weight in weights:
        mixed += weight * (255 - PHOTO).astype(np.float32)
    mixed = np.clip(mixed, 0, 255).astype(np.uint8)
    expected = Image.blend(Image.fromarray(PHOTO), Image.fromarray(mixed), float(mix))
    assert np.array_equal(pixels, np.asarray(expected))


def test_augmix_chains_start_from_the_original_and_blended_mode_runs():
    for text in ("augmix-m5-w3-d2", "augmix-m3-b1", "augmix-d0-w1"):
        augmenter = build_augmenter(Augment(auto_augment=text), 96)
        out = augmented(augmenter, text)
        assert out.shape == PHOTO.shape and not np.array_equal(out, PHOTO)


def test_3a_picks_one_of_solarize_greyscale_and_blur():
    augmenter = build_augmenter(Augment(auto_augment="3a"), 96)
    kinds = collections.Counter()
    for i in range(600):
        out = augmented(augmenter, f"3a{i}").astype(int)
        if (out[..., 0] == out[..., 1]).all() and (out[..., 1] == out[..., 2]).all():
            kinds["grey"] += 1
        elif np.array_equal(out, np.where(PHOTO < 128, PHOTO, 255 - PHOTO)):
            kinds["solarize"] += 1
        else:
            kinds["blur"] += 1
    assert all(150 < kinds[kind] < 250 for kind in ("grey", "solarize", "blur")), kinds


# --- colour steps -------------------------------------------------------------------------


def test_color_jitter_ranges_are_torchvisions():
    augmenter = build_augmenter(Augment(color_jitter=(0.4, 0.3, 0.2, 0.1)), 96)
    (jitter,) = augmenter.steps
    assert jitter.brightness == (0.6, 1.4) and jitter.contrast == (0.7, 1.3)
    assert jitter.saturation == pytest.approx((0.8, 1.2)) and jitter.hue == (-0.1, 0.1)
    (plain,) = build_augmenter(Augment(color_jitter=0.4), 96).steps
    assert plain.saturation == (0.6, 1.4) and plain.hue is None


@pytest.mark.parametrize("field", ["grayscale", "gaussian_blur"])
def test_grayscale_and_blur_apply_with_their_probability(field):
    augmenter = build_augmenter(Augment(**{field: 0.3}), 96)
    changed = sum(
        not np.array_equal(augmented(augmenter, f"{field}{i}", PHOTO[:16, :16]), PHOTO[:16, :16])
        for i in range(1000)
    )
    assert 240 < changed < 360


# --- random erasing -----------------------------------------------------------------------


def test_erased_boxes_keep_timms_area_aspect_and_count():
    erasing = RandomErasing(1.0, (0.02, 1 / 3), (0.3, 1 / 0.3), "const", max_count=3)
    rng = SampleRandom("boxes")
    counts = collections.Counter()
    for _ in range(3000):
        boxes = erasing.boxes(224, 224, rng)
        counts[len(boxes)] += 1
        for top, left, height, width in boxes:
            assert top >= 0 and top + height <= 224 and left >= 0 and left + width <= 224
            share = height * width / 224**2 * len(boxes)  # area is split over the count
            assert 0.02 * 0.8 < share < 1 / 3 * 1.2 or height * width < 60
            assert 0.3 * 0.8 < height / max(width, 1) < 1 / 0.3 * 1.25 or min(height, width) < 8
    assert set(counts) == {1, 2, 3} and all(900 < n < 1100 for n in counts.values()), counts


def erased_mask(out: np.ndarray, image: np.ndarray) -> np.ndarray:
    return (out != image).any(-1)


def test_erasing_modes_fill_as_timm_after_normalisation():
    flat = np.full((64, 64, 3), 30, np.uint8)  # no channel equals the mean: every erasure shows
    for mode in ("const", "rand", "pixel"):
        augmenter = build_augmenter(Augment(re_prob=1.0, re_mode=mode), 64)
        out = augmented(augmenter, mode, flat)
        box = out[erased_mask(out, flat)]
        assert len(box) > 0.015 * 64 * 64
        if mode == "const":  # normalised 0 is the mean colour
            assert (box == MEAN_PIXEL).all()
        elif mode == "rand":  # one colour a box, mean + std * N(0, 1)
            assert len(np.unique(box, axis=0)) == 1 and not (box[0] == MEAN_PIXEL).all()
        else:  # per-pixel noise of std * 255 around the mean (some clipped at 0 or 255)
            assert 45 < box.astype(float).std(axis=0).mean() < 60
            assert np.abs(box.astype(float).mean(axis=0) - MEAN_PIXEL).max() < 8


def test_pixel_noise_table_is_the_rounded_normal_to_within_its_quantisation():
    """Each uint8 value's share of the 2**16 table entries is its probability under
    round(clip(255 * (mean + std * N(0, 1)))), to within one entry."""
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    for table, m, s in zip(quantile_tables(mean, std), mean, std, strict=True):
        share = np.bincount(table, minlength=256) / len(table)
        normal = NormalDist(255 * m, 255 * s)
        edges = [0.0] + [normal.cdf(v + 0.5) for v in range(255)] + [1.0]
        assert np.abs(share - np.diff(edges)).max() <= 1.01 / len(table)


def test_erasing_probability_and_tiny_images():
    augmenter = build_augmenter(Augment(re_prob=0.25), 64)
    flat = np.full((32, 32, 3), 30, np.uint8)
    erased = sum(erased_mask(augmented(augmenter, f"p{i}", flat), flat).any() for i in range(2000))
    assert 440 < erased < 560
    tiny = build_augmenter(Augment(re_prob=1.0, re_count=3), 8)
    for shape in ((1, 1, 3), (1, 9, 3)):  # a box must be smaller than the image: none fits
        image = np.full(shape, 30, np.uint8)
        assert all(np.array_equal(augmented(tiny, f"t{i}", image), image) for i in range(50))
    image = np.full((2, 2, 3), 30, np.uint8)  # 1x1 boxes fit, as in timm: up to 3 of them
    erased = {int(erased_mask(augmented(tiny, f"t{i}", image), image).sum()) for i in range(50)}
    assert erased <= {0, 1, 2, 3} and len(erased) > 1


# --- the order of the steps -------------------------------------------------------------


def test_steps_run_policy_colour_user_ops_then_erasing():
    augment = Augment(
        auto_augment="3a",
        color_jitter=0.4,
        grayscale=0.5,
        gaussian_blur=0.5,
        ops=(fill_sevens, functools.partial(add_value, value=2)),
        re_prob=1.0,
    )
    augmenter = build_augmenter(augment, 96)
    kinds = [type(step).__name__ for step in (augmenter.policy, *augmenter.steps)]
    assert kinds == [
        "AutoAugment",
        "ColorJitter",
        "RandomGrayscale",
        "RandomGaussianBlur",
        "function",
        "partial",
        "RandomErasing",
    ]
    out = augmented(augmenter, "order")
    erased = (out == MEAN_PIXEL).all(-1)
    assert erased.any() and (out[~erased] == 9).all()  # the user ops overwrote the policy


def test_every_policy_survives_tiny_and_flat_crops():
    for policy in POLICIES:
        augment = Augment(auto_augment=policy, color_jitter=(0.4, 0.4, 0.4, 0.2), grayscale=0.5)
        augment = Augment(**{**augment.__dict__, "gaussian_blur": 0.5, "re_prob": 1.0})
        augmenter = build_augmenter(augment, 224)
        for shape in ((1, 1, 3), (2, 2, 3), (3, 1, 3)):
            for value in (0, 128, 255):
                for seed in range(6):
                    augmented(augmenter, f"{policy}{seed}", np.full(shape, value, np.uint8))
    assert isinstance(build_policy(parse_policy("rand"), Hparams()), RandAugment)
