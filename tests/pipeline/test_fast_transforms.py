"""Tests for the simplejpeg + OpenCV crops (`pipeline.fast_transforms`) against the Pillow ones."""

from __future__ import annotations

import pickle
import random
import struct

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("simplejpeg")
pytest.importorskip("cv2")

from pipeline.config import Batching, Crop, Workers
from pipeline.fast_transforms import (  # noqa: E402
    FastCenterCrop,
    FastRandomResizedCrop,
    pillow_fallbacks,
)
from pipeline.loader import LoaderConfig, build_loader  # noqa: E402
from pipeline.transforms import CenterCrop, RandomResizedCrop, SampleRandom  # noqa: E402
from shards.image import policy  # noqa: E402
from shards.image.bands import restart_interval  # noqa: E402
from shards.sample import SampleError  # noqa: E402
from shards.tar import TarShardWriter  # noqa: E402
from tests.oddimages import (  # noqa: E402
    BANDS,
    banded,
    encode,
    noise_image,
    odd_image_bytes,
    photo_jpeg,
    truncated,
)
from tests.pipeline.conftest import loader_for  # noqa: E402

# Mean absolute difference to Pillow's output, in grey levels, that still means "same pixels":
# the filters differ slightly (OpenCV's bilinear vs Pillow's antialiased one). A wrong box or
# a wrong flip gives tens of grey levels (see test_tolerance_detects_a_wrong_crop).
TOLERANCE = 1.5
SIZES = [(256, 341), (341, 256), (1024, 768), (100, 75), (300, 257)]


def mean_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def outcome(transform, data: bytes, seed: int = 0):
    """The output array, or the SampleError reason."""
    try:
        return transform(data, random.Random(seed))
    except SampleError as error:
        return error.reason


def jpeg_with_size(width: int, height: int) -> bytes:
    """A real 16x16 JPEG whose SOF0 header is patched to claim `width` x `height`."""
    data = bytearray(encode(noise_image(16, 16), "JPEG", quality=90))
    at = data.index(b"\xff\xc0")  # SOF0: marker, length(2), precision(1), height(2), width(2)
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


# --- same pixels as the Pillow transforms ------------------------------------------------


@pytest.mark.parametrize("width,height", SIZES)
@pytest.mark.parametrize(
    "fast,pillow",
    [
        (FastRandomResizedCrop(), RandomResizedCrop()),
        (FastRandomResizedCrop(draft=False), RandomResizedCrop(draft=False)),
        (
            FastRandomResizedCrop(size=96, resample="bicubic"),
            RandomResizedCrop(size=96, resample="bicubic"),
        ),
        (FastCenterCrop(), CenterCrop()),
        (FastCenterCrop(size=64, crop_fraction=0.5), CenterCrop(size=64, crop_fraction=0.5)),
    ],
)
def test_matches_pillow_geometry(width, height, fast, pillow):
    for seed in range(6):
        data = photo_jpeg(width, height, seed=seed)
        ours, theirs = fast(data, random.Random(seed)), pillow(data, random.Random(seed))
        assert ours.shape == theirs.shape == (fast.size, fast.size, 3)
        assert mean_abs(ours, theirs) < TOLERANCE, (width, height, seed)


def test_tolerance_detects_a_wrong_crop():
    data = photo_jpeg(341, 256)
    ours = FastRandomResizedCrop()(data, random.Random(1))
    assert mean_abs(ours, RandomResizedCrop()(data, random.Random(2))) > 5 * TOLERANCE
    flipped = RandomResizedCrop(hflip=1.0)(data, random.Random(1))
    unflipped = RandomResizedCrop(hflip=0.0)(data, random.Random(1))
    assert mean_abs(flipped, unflipped) > 5 * TOLERANCE


@pytest.mark.parametrize("width,height", [(256, 341), (341, 256), (256, 256)])
def test_center_crop_of_256_px_shards_is_exact(width, height):
    data = photo_jpeg(width, height)
    assert np.array_equal(
        FastCenterCrop()(data, random.Random()), CenterCrop()(data, random.Random())
    )


def test_consumes_rng_exactly_like_pillow():
    data = photo_jpeg(341, 256)
    for seed in range(20):
        ours, theirs = random.Random(seed), random.Random(seed)
        FastRandomResizedCrop()(data, ours)
        RandomResizedCrop()(data, theirs)
        assert ours.getstate() == theirs.getstate()


def test_nearest_is_bit_exact_on_whole_pixel_boxes():
    data = photo_jpeg(256, 341, seed=3)
    for seed in range(10):
        fast = FastRandomResizedCrop(resample="nearest")(data, random.Random(seed))
        pillow = RandomResizedCrop(resample="nearest")(data, random.Random(seed))
        assert np.array_equal(fast, pillow)


# --- determinism, flip, output contract --------------------------------------------------


def test_deterministic_for_a_seed_and_different_across_seeds():
    data = photo_jpeg(341, 256)
    transform = FastRandomResizedCrop()
    first = transform(data, random.Random(7))
    assert np.array_equal(first, transform(data, random.Random(7)))
    assert not np.array_equal(first, transform(data, random.Random(8)))


@pytest.mark.parametrize("width,height", [(341, 256), (300, 257), (1024, 768)])
def test_flip_mirrors_the_same_crop(width, height):
    data = photo_jpeg(width, height)
    for seed in range(5):
        plain = FastRandomResizedCrop(hflip=0.0)(data, random.Random(seed))
        flipped = FastRandomResizedCrop(hflip=1.0)(data, random.Random(seed))
        assert np.abs(flipped.astype(int) - plain[:, ::-1].astype(int)).max() <= 1


def test_flip_decisions_match_pillow():
    data = photo_jpeg(341, 256)
    flips = 0
    for seed in range(20):
        ours = FastRandomResizedCrop()(data, random.Random(seed))
        assert mean_abs(ours, RandomResizedCrop()(data, random.Random(seed))) < TOLERANCE
        unflipped = RandomResizedCrop(hflip=0.0)(data, random.Random(seed))
        flips += mean_abs(ours, unflipped[:, ::-1]) < TOLERANCE
    assert 0 < flips < 20  # both decisions occurred, and each matched Pillow's


@pytest.mark.parametrize("transform", [FastRandomResizedCrop(size=96), FastCenterCrop(size=64)])
def test_output_is_writable_contiguous_uint8(transform):
    out = transform(photo_jpeg(300, 257), random.Random(0))
    assert out.dtype == np.uint8 and out.flags.c_contiguous and out.flags.writeable
    assert out.shape == (transform.size, transform.size, 3)


def test_transforms_pickle_for_spawned_workers():
    for transform in (FastRandomResizedCrop(size=64, hflip=0.3), FastCenterCrop(size=32)):
        copy = pickle.loads(pickle.dumps(transform))
        assert copy == transform
        data = photo_jpeg(341, 256)
        assert np.array_equal(copy(data, random.Random(1)), transform(data, random.Random(1)))


def test_arguments_are_validated_like_pillow():
    with pytest.raises(ValueError, match="resample"):
        FastRandomResizedCrop(resample="box")
    with pytest.raises(ValueError, match="scale"):
        FastRandomResizedCrop(scale=(0.5, 0.1))
    with pytest.raises(ValueError, match="crop_fraction"):
        FastCenterCrop(crop_fraction=0.0)


# --- bad input and fallbacks -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data")  # Pillow, on exif_broken_ifd
@pytest.mark.parametrize("name", sorted(odd_image_bytes()))
def test_odd_images_give_the_pillow_outcome(name):
    """Every odd or hostile file: the same reason as the Pillow transform, or the same pixels."""
    _, data, _ = odd_image_bytes()[name]
    ours, theirs = (
        outcome(FastRandomResizedCrop(size=32), data),
        outcome(RandomResizedCrop(size=32), data),
    )
    if isinstance(theirs, str):
        assert ours == theirs
    else:
        assert not isinstance(ours, str), ours
        assert mean_abs(ours, theirs) < TOLERANCE


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.999])
def test_truncated_jpeg_is_truncated(fraction):
    data = truncated(photo_jpeg(341, 256), fraction)
    assert outcome(FastRandomResizedCrop(), data) == "truncated"
    assert outcome(FastCenterCrop(), data) == "truncated"


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"", "unidentified"),
        (b"not an image at all", "unidentified"),
        (b"\xff\xd8\xff" + b"garbage" * 20, "unidentified"),
        # A cut header: Pillow's "Truncated File Read", truncation as in build-shards (before
        # the one decode policy the loader called it `decode_error`).
        (photo_jpeg(64, 64)[:40], "truncated"),
    ],
)
def test_garbage_gives_the_decode_reasons(data, reason):
    assert outcome(FastRandomResizedCrop(), data) == reason == outcome(RandomResizedCrop(), data)


def test_pixel_cap_is_checked_on_the_header_before_decoding(monkeypatch):
    import simplejpeg

    def refuse(*args, **kwargs):
        raise AssertionError("decoded past the pixel cap")

    monkeypatch.setattr(simplejpeg, "decode_jpeg", refuse)
    bomb = jpeg_with_size(60_000, 60_000)
    for transform in (FastRandomResizedCrop(), FastCenterCrop()):
        assert outcome(transform, bomb) == "too_many_pixels"
    real = photo_jpeg(100, 100)
    assert outcome(FastRandomResizedCrop(max_pixels=9_999), real) == "too_many_pixels"


@pytest.mark.parametrize("fmt", ["PNG", "WEBP"])
@pytest.mark.parametrize(
    "fast,pillow",
    [
        (FastRandomResizedCrop(size=48), RandomResizedCrop(size=48)),
        (FastCenterCrop(size=48), CenterCrop(size=48)),
    ],
)
def test_png_and_webp_fall_back_to_pillow(fmt, fast, pillow):
    data = encode(noise_image(120, 90), fmt)
    for seed in range(3):
        assert np.array_equal(fast(data, random.Random(seed)), pillow(data, random.Random(seed)))


def test_cmyk_jpeg_falls_back_to_pillow():
    data = encode(banded("CMYK", BANDS["CMYK"]), "JPEG")
    fast, pillow = FastRandomResizedCrop(size=32), RandomResizedCrop(size=32)
    assert np.array_equal(fast(data, random.Random(2)), pillow(data, random.Random(2)))


def test_grey_jpeg_becomes_rgb():
    data = encode(Image.new("L", (80, 60), 77), "JPEG")
    out = FastCenterCrop(size=32)(data, random.Random())
    assert out.shape == (32, 32, 3)
    assert np.abs(out.astype(int) - 77).max() <= 1


def test_missing_packages_name_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "simplejpeg", None)
    monkeypatch.setattr(policy._FastModules, "cv2", None)  # as in a fresh process
    with pytest.raises(ImportError, match=r"pip install simplejpeg opencv-python-headless"):
        FastRandomResizedCrop()


# --- through the loader ------------------------------------------------------------------


def test_loader_accepts_the_fast_transform(shard_dir):
    # 96 px, not the fixture's 32: 8x shrinks of tiny outputs differ more between the filters.
    fast = loader_for(
        shard_dir, crop=Crop(image_size=96, transform=FastRandomResizedCrop(size=96)), seed=3
    )
    pillow = loader_for(shard_dir, seed=3, crop=Crop(image_size=96, backend="pillow"))
    batches = 0
    for (images, labels, keys), (ref_images, ref_labels, ref_keys) in zip(
        fast, pillow, strict=True
    ):
        assert images.shape == ref_images.shape and images.dtype == ref_images.dtype
        assert keys == ref_keys and labels.tolist() == ref_labels.tolist()
        assert mean_abs(images.numpy(), ref_images.numpy()) < TOLERANCE
        batches += 1
    assert batches == len(pillow) > 0


def test_loader_defaults_to_the_fast_crops(shard_dir):
    train = loader_for(shard_dir)
    assert isinstance(train.dataset.transform, FastRandomResizedCrop)
    assert isinstance(loader_for(shard_dir, train=False).dataset.transform, FastCenterCrop)
    pillow = loader_for(shard_dir, crop=Crop(image_size=32, backend="pillow"))
    assert type(pillow.dataset.transform) is RandomResizedCrop
    with pytest.raises(ValueError, match="backend 'turbo' is not one of auto, fast, pillow"):
        loader_for(shard_dir, crop=Crop(image_size=32, backend="turbo"))


def test_auto_backend_without_the_packages_uses_pillow(shard_dir, monkeypatch):
    monkeypatch.setattr("shards.image.policy.fast_backend_available", lambda: False)
    assert type(loader_for(shard_dir).dataset.transform) is RandomResizedCrop
    with pytest.raises(ImportError, match="backend='pillow'"):
        loader_for(shard_dir, crop=Crop(image_size=32, backend="fast"))


def mixed_shard(path, count: int = 12) -> dict[str, str]:
    """A tar shard whose odd samples are PNG (`jpg` member names, as img2dataset may write)."""
    kinds = {}
    with open(path, "wb") as file:
        writer = TarShardWriter(file)
        for index in range(count):
            fmt = "PNG" if index % 2 else "JPEG"
            image = noise_image(64, 48, seed=index)
            key = f"{index:06d}"
            writer.write({"__key__": key, "jpg": encode(image, fmt), "cls": b"1"})
            kinds[key] = fmt
        writer.close()
    return kinds


@pytest.mark.parametrize("backend,expected", [("auto", 6), ("pillow", 0)])
def test_pillow_fallbacks_are_counted_in_the_loader_stats(tmp_path, backend, expected):
    mixed_shard(tmp_path / "mixed-000000.tar")
    config = LoaderConfig(
        source=str(tmp_path / "mixed-000000.tar"),
        batch=Batching(size=4),
        crop=Crop(image_size=32, backend=backend),
        workers=Workers(count=0, pin_memory=False),
    )
    loader = build_loader(config)
    for _epoch in range(2):  # counts are per epoch, not cumulative
        images = [batch[0] for batch in loader]
        assert sum(len(batch) for batch in images) == 12
        assert loader.stats.pillow_fallbacks == expected
        assert loader.stats.summary()["pillow_fallbacks"] == expected


def test_fast_crop_writes_into_the_given_slot_and_counts_fallbacks():
    slot = np.zeros((2, 224, 224, 3), np.uint8)
    transform = FastRandomResizedCrop(hflip=1.0)
    data = photo_jpeg(341, 256)
    out = transform(data, SampleRandom("k"), out=slot[1])
    assert out is slot[1] or np.shares_memory(out, slot)
    np.testing.assert_array_equal(slot[1], transform(data, SampleRandom("k")))
    assert not slot[0].any()
    before = pillow_fallbacks()
    png = encode(noise_image(300, 200), "PNG")
    transform(png, SampleRandom("k"), out=slot[0])
    assert pillow_fallbacks() == before + 1
    np.testing.assert_array_equal(slot[0], transform.pillow(png, SampleRandom("k")))


class CopyingCrop:
    """The default crop without `writes_into`: the stream must stack its outputs instead."""

    def __init__(self, size: int) -> None:
        self.crop = FastRandomResizedCrop(size=size)

    def __call__(self, data: bytes, rng) -> np.ndarray:
        return self.crop(data, rng)


@pytest.mark.parametrize("channels_last", [True, False])
def test_batches_written_in_place_equal_stacked_ones(shard_dir, channels_last):
    direct = loader_for(shard_dir, batch=Batching(size=8, channels_last=channels_last))
    stacked = loader_for(
        shard_dir,
        batch=Batching(size=8, channels_last=channels_last),
        crop=Crop(image_size=32, transform=CopyingCrop(32)),
    )
    for (images, labels, keys), (ref, ref_labels, ref_keys) in zip(direct, stacked, strict=True):
        assert keys == ref_keys and labels.tolist() == ref_labels.tolist()
        assert images.stride() == ref.stride()
        assert torch.equal(images, ref)


def test_sample_random_is_deterministic_and_keeps_the_random_api():
    first, again = SampleRandom("aug:0:1:k:0"), SampleRandom("aug:0:1:k:0")
    draws = [first.random() for _ in range(40)]  # past one hash block of eight words
    assert draws == [again.random() for _ in range(40)]
    assert draws != [SampleRandom("aug:0:1:k:1").random() for _ in range(40)]
    assert all(0.0 <= value < 1.0 for value in draws)
    rng = SampleRandom(7)
    assert 0 <= rng.randint(0, 9) <= 9 and rng.choice("abc") in "abc"
    assert rng.getrandbits(130) < 2**130
    items = list(range(10))
    rng.shuffle(items)
    assert sorted(items) == list(range(10))
    state = rng.getstate()
    ahead = [rng.random() for _ in range(10)]
    rng.setstate(state)
    assert [rng.random() for _ in range(10)] == ahead
    uniform = [SampleRandom(f"u{key}").random() for key in range(4000)]
    assert abs(np.mean(uniform) - 0.5) < 0.02


def test_sample_random_choice_draws_as_randoms_own():
    """Its inline `choice` gives `random.Random.choice`'s picks from the same words, sizes
    with rejected draws (3, 15, 17) and across hash blocks included."""
    for size in (1, 2, 3, 15, 16, 17, 1000):
        items = list(range(size))
        ours, reference = SampleRandom(f"c{size}"), SampleRandom(f"c{size}")
        picks = [ours.choice(items) for _ in range(50)]
        assert picks == [random.Random.choice(reference, items) for _ in range(50)]
        assert ours.random() == reference.random()  # the same words used
    with pytest.raises(IndexError):
        SampleRandom("c").choice([])


# --- plain chroma upsampling for box-averaged crops (PLAIN_UPSAMPLING_WHEN_AVERAGED) -------


def exact_psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_only_box_averaged_crops_use_plain_upsampling(monkeypatch):
    from pipeline import fast_transforms

    data = photo_jpeg(500, 375, seed=3)
    # Boxes of ~250 px to 96, decoded at full size (DCT scaling would upsample the chroma
    # itself, and plain upsampling would change nothing).
    averaged = FastRandomResizedCrop(size=96, scale=(0.4, 0.5), draft=False)
    bilinear = FastRandomResizedCrop(size=224, scale=(0.4, 0.5))  # ~1.2x: not averaged
    centre = FastCenterCrop(size=224)  # 375 px to 256, then the centre: ~1.3x
    transforms = (averaged, bilinear, centre)
    default = [t(data, SampleRandom("k")) for t in transforms]
    assert np.array_equal(default[0], averaged(data, SampleRandom("k")))  # deterministic
    monkeypatch.setattr(fast_transforms, "PLAIN_UPSAMPLING_WHEN_AVERAGED", False)
    exact = [t(data, SampleRandom("k")) for t in transforms]
    assert not np.array_equal(default[0], exact[0])  # the switch reaches the decoder
    assert exact_psnr(default[0], exact[0]) > 45  # the average hides the repeated chroma
    np.testing.assert_array_equal(default[1], exact[1])
    np.testing.assert_array_equal(default[2], exact[2])


def test_decode_jpeg_scaled_fast_upsample_differs_from_the_exact_decode():
    data = photo_jpeg(64, 48, seed=1)
    exact = policy.decode_jpeg_scaled(data, 64, 48, 1)
    fast = policy.decode_jpeg_scaled(data, 64, 48, 1, fast_upsample=True)
    assert exact.shape == fast.shape == (48, 64, 3)
    assert not np.array_equal(exact, fast) and exact_psnr(exact, fast) > 30


def test_large_shrinks_take_the_integral_box_path_and_still_match_pillow(monkeypatch):
    # Crops shrunk by more than AREA_SHRINK (without DCT scaling to bring them below it) are
    # resized linearly to k x the output, then box-averaged k:1 (INTER_AREA is slow at
    # fractional ratios): Pillow's antialiased result within the usual tolerance.
    from pipeline import fast_transforms

    calls = []
    original = fast_transforms._to_integral_shrink

    def spy(cv2, region, size, shrink):
        calls.append(shrink)
        result = original(cv2, region, size, shrink)
        assert result.shape[0] == result.shape[1] == max(2, int(shrink)) * size
        return result

    monkeypatch.setattr(fast_transforms, "_to_integral_shrink", spy)
    data = photo_jpeg(1024, 768)
    for seed in range(12):
        ours = FastRandomResizedCrop(hflip=0.0, draft=False)(data, random.Random(seed))
        pillow = RandomResizedCrop(hflip=0.0, draft=False)(data, random.Random(seed))
        assert mean_abs(ours, pillow) < TOLERANCE
    assert len(calls) >= 6 and all(shrink > fast_transforms.AREA_SHRINK for shrink in calls)


def test_mild_shrinks_stay_bilinear_and_match_pillow(monkeypatch):
    # Up to AREA_SHRINK (1.5x) OpenCV's bilinear runs alone, within the usual tolerance:
    # that is nearly every crop of a 256-px shard's image.
    from pipeline import fast_transforms

    monkeypatch.setattr(fast_transforms, "_to_integral_shrink", None)  # must not be called
    for seed in range(12):
        data = photo_jpeg(341, 256, seed=seed)
        ours = FastRandomResizedCrop(hflip=0.0, scale=(0.8, 0.95))(data, random.Random(seed))
        pillow = RandomResizedCrop(hflip=0.0, scale=(0.8, 0.95))(data, random.Random(seed))
        assert mean_abs(ours, pillow) < TOLERANCE


# --- only the restart intervals a crop needs (JPEGs whose rows start intervals) ----------


def marked_jpeg(
    width: int, height: int, seed: int = 0, subsampling: int = 2, layout: str = "columns"
) -> bytes:
    """Restart intervals of a few MCUs whatever the width (`columns`: build-shards' for
    rows of 24 MCUs or more, and for any row before it kept narrow rows whole), or an
    interval per MCU row (`rows`)."""
    if layout == "rows":
        params = {"restart_marker_rows": 1}
    else:
        interval = restart_interval(width, 8 if subsampling == 0 else 16, min_mcus=0)
        params = {"restart_marker_blocks": interval}
    return photo_jpeg(width, height, seed, subsampling=subsampling, **params)


def record_band_cuts(monkeypatch) -> list[bool]:
    """From now on, whether each `crop_band` call cut a band (appended per call)."""
    from pipeline import fast_transforms

    cuts: list[bool] = []
    original = fast_transforms.crop_band

    def spy(*args):
        band = original(*args)
        cuts.append(band is not None)
        return band

    monkeypatch.setattr(fast_transforms, "crop_band", spy)
    return cuts


def whole_file_crops(monkeypatch, transform, data: bytes, seeds) -> list[np.ndarray]:
    """The same crops with the band cut disabled: every JPEG decoded whole."""
    from pipeline import fast_transforms

    with monkeypatch.context() as patch:
        patch.setattr(fast_transforms, "crop_band", lambda *args: None)
        return [transform(data, SampleRandom(f"k{seed}")) for seed in seeds]


@pytest.mark.parametrize(
    "transform",
    [
        FastRandomResizedCrop(),
        FastRandomResizedCrop(draft=False),
        FastRandomResizedCrop(size=96, resample="bicubic"),
        FastRandomResizedCrop(size=300, resample="lanczos"),
        FastCenterCrop(),
        FastCenterCrop(size=64, crop_fraction=0.55),
    ],
    ids=["rrc", "rrc-no-draft", "bicubic-96", "lanczos-300", "center", "center-fraction"],
)
@pytest.mark.parametrize(
    "width,height,subsampling", [(341, 256, 2), (500, 375, 2), (1024, 768, 2), (333, 257, 0)]
)
@pytest.mark.parametrize("layout", ["rows", "columns"])
def test_band_decodes_give_the_whole_decodes_pixels_exactly(
    monkeypatch, transform, width, height, subsampling, layout
):
    data = marked_jpeg(width, height, seed=width, subsampling=subsampling, layout=layout)
    seeds = range(25)
    expected = whole_file_crops(monkeypatch, transform, data, seeds)
    cuts = record_band_cuts(monkeypatch)
    for seed, want in zip(seeds, expected, strict=True):
        np.testing.assert_array_equal(transform(data, SampleRandom(f"k{seed}")), want)
    if isinstance(transform, FastRandomResizedCrop):
        assert sum(cuts) >= 10, cuts  # most random crops leave rows out


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9, 0.999])
def test_a_truncated_marked_jpeg_is_still_truncated_wherever_the_crop_is(fraction, layout):
    data = truncated(marked_jpeg(500, 375, layout=layout), fraction)
    for seed in range(8):
        assert outcome(FastRandomResizedCrop(), data, seed) == "truncated"
    assert outcome(FastCenterCrop(), data) == "truncated"


def test_the_loader_decodes_bands_of_marked_shards_and_delivers_the_same_batches(
    tmp_path, monkeypatch
):
    # The same shard with and without the band cut: identical batches, bit for bit.
    from pipeline import fast_transforms

    shard = tmp_path / "train-000000.tar"
    with shard.open("wb") as file:
        writer = TarShardWriter(file)
        for index in range(48):
            layout = "rows" if index % 4 == 0 else "columns"
            image = marked_jpeg(341 + index % 3 * 80, 256, seed=index, layout=layout)
            writer.write({"__key__": f"s{index:04d}", "jpg": image, "cls": b"%d" % (index % 4)})
        writer.close()

    def batches() -> list[torch.Tensor]:
        config = LoaderConfig(
            source=str(shard), batch=Batching(size=16), workers=Workers(count=0), seed=3
        )
        return [batch[0].clone() for batch in build_loader(config)]

    cuts = record_band_cuts(monkeypatch)
    with_bands = batches()
    assert sum(cuts) > len(cuts) // 2
    monkeypatch.setattr(fast_transforms, "crop_band", lambda *args: None)
    for ours, whole in zip(with_bands, batches(), strict=True):
        assert torch.equal(ours, whole)


@pytest.mark.parametrize("resample", ["bilinear", "bicubic", "lanczos"])
def test_a_warped_fractional_box_reads_pixels_beyond_it_and_gets_them_exact(monkeypatch, resample):
    # A fractional box is warped, and the warp's kernel reads pixels beyond it (4 for
    # Lanczos). With the box's edges 2 pixels inside an MCU row's or an interval's start
    # (64 px: 4 MCUs), the guard alone would leave them out of the band: `_WARP_REACH`
    # must bring them in.
    from pipeline.fast_transforms import JpegCrop

    data = marked_jpeg(500, 375, seed=7)
    boxes = [
        (10.5, 18.25, 210.5, 218.25),
        (40.25, 50.5, 300.25, 306.75),
        (3.5, 130.5, 203.5, 330.5),
        (66.5, 18.25, 254.25, 206.0),
        (130.25, 34.5, 318.5, 222.75),
    ]
    cuts = record_band_cuts(monkeypatch)
    for box in boxes:
        size = round(box[3] - box[1])
        args = (box, size, resample, False, True, policy.MAX_PIXELS)
        banded = JpegCrop(data, 500, 375, "YCbCr").decode(*args)
        whole = JpegCrop(data, 500, 375, "YCbCr", band_decode=False).decode(*args)
        np.testing.assert_array_equal(banded, whole)
    assert all(cuts), cuts


# --- files the band must not cut, and files simplejpeg cannot take -------------------------


def hidden_banner_jpeg(seed: int) -> bytes:
    """Flat grey above, a red banner below, and an end marker put before the banner's first
    MCU row: every whole decode shows flat grey from there on (the issue's crafted file)."""
    rng = np.random.default_rng(seed)
    pixels = np.full((192, 256, 3), 128, np.uint8)
    pixels[32:] = (220, 20, 20)
    pixels[100:150, 40:200] = rng.integers(200, 256, (50, 160, 3), dtype=np.uint8)
    data = encode(Image.fromarray(pixels), "JPEG", quality=90, restart_marker_rows=1)
    at = data.index(b"\xff\xd1") + 2  # after RST1: MCU row 2, y = 32
    return data[:at] + b"\xff\xd9" + data[at:]


def test_a_crop_never_shows_what_the_whole_decode_hides(monkeypatch):
    # Through the loader's train batches: the same pixels with and without the band cut,
    # and no red anywhere (a band spliced past the end marker showed the banner: mean 175).
    from pipeline import fast_transforms

    data = [hidden_banner_jpeg(seed) for seed in range(4)]
    transform = FastRandomResizedCrop(size=64, scale=(0.05, 0.3))
    seeds = [f"k{seed}" for seed in range(40)]
    crops = [transform(data[i % 4], SampleRandom(seed)) for i, seed in enumerate(seeds)]
    # A box above the marker is decoded whole too: the proof covers the whole scan, so a
    # file's verdict is the same for every crop (issue 29; before, its band was cut).
    cuts = record_band_cuts(monkeypatch)
    top = fast_transforms.JpegCrop(data[0], 256, 192, "YCbCr")
    top.decode((0, 0, 256, 12), 64, "bilinear", False, False, policy.MAX_PIXELS)
    assert cuts == [False]
    monkeypatch.setattr(fast_transforms, "crop_band", lambda *args: None)
    for i, (seed, crop) in enumerate(zip(seeds, crops, strict=True)):
        np.testing.assert_array_equal(crop, transform(data[i % 4], SampleRandom(seed)))
        red = crop[..., 0].astype(int) - crop[..., 1]
        assert red.max() < 20, seed


def test_the_loader_never_shows_what_the_whole_decode_hides(tmp_path):
    shard = tmp_path / "train-000000.tar"
    with shard.open("wb") as file:
        writer = TarShardWriter(file)
        for index in range(32):
            image = hidden_banner_jpeg(index)
            writer.write({"__key__": f"s{index:04d}", "jpg": image, "cls": b"%d" % (index % 4)})
        writer.close()
    config = LoaderConfig(
        source=str(shard),
        batch=Batching(size=16),
        crop=Crop(image_size=64, scale=(0.05, 0.3)),
        workers=Workers(count=0),
        seed=3,
    )
    images = torch.cat([batch[0] for batch in build_loader(config)]).float()
    assert len(images) == 32
    # Grey, as Pillow shows these files: no red banner, no bright patch.
    assert (images[:, 0] - images[:, 1]).abs().max() < 20
    assert abs(images.mean().item() - 128) < 3


# Sampling factors (luma first) libjpeg-turbo and Pillow decode but simplejpeg cannot read:
# 4:4:1 (`decode_jpeg_header` raised KeyError: 6, out of the crop as a traceback) and
# factors TurboJPEG cannot classify (ValueError).
ODD_SAMPLING = {
    "4:4:1": ((1, 4), (1, 1), (1, 1)),
    "3x1": ((3, 1), (1, 1), (1, 1)),
    "1x3": ((1, 3), (1, 1), (1, 1)),
    "4x2": ((4, 2), (1, 1), (1, 1)),
    "chroma 2x1": ((2, 2), (2, 1), (1, 1)),
}


@pytest.mark.parametrize("name", ODD_SAMPLING)
@pytest.mark.parametrize("restart", [0, 5])
@pytest.mark.parametrize("transform", [FastRandomResizedCrop(64), FastCenterCrop(64)])
def test_subsamplings_simplejpeg_cannot_read_are_decoded_by_pillow(name, restart, transform):
    from tests.jpegcraft import dc_jpeg

    data = dc_jpeg(320, 240, ODD_SAMPLING[name], restart=restart)
    before = pillow_fallbacks()
    for seed in range(3):
        ours = transform(data, SampleRandom(f"k{seed}"))
        np.testing.assert_array_equal(ours, transform.pillow(data, SampleRandom(f"k{seed}")))
    assert pillow_fallbacks() - before == 3


@pytest.mark.parametrize("transform", [FastRandomResizedCrop(64), FastCenterCrop(64)])
def test_12_bit_and_arithmetic_jpegs_are_decoded_or_skipped_with_a_reason(transform):
    from tests.jpegcraft import dc_jpeg

    # 12-bit: libjpeg-turbo reads the header but decodes 8-bit only; Pillow cannot open it.
    for factors in (((2, 2), (1, 1), (1, 1)), ((1, 1),)):
        data = dc_jpeg(320, 240, factors, precision=12)
        assert outcome(transform, data) == outcome(transform.pillow, data) == "unidentified"
    # An arithmetic-coding frame header (SOF9): no band (never cut), decoded by libjpeg-turbo
    # or by Pillow, whichever takes it.
    data = dc_jpeg(320, 240, frame_marker=0xC9, restart=20)
    assert policy.read_jpeg_header(data) is not None
    result = outcome(transform, data)
    assert isinstance(result, np.ndarray) and result.shape == (64, 64, 3)
