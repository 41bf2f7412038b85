"""Tests for per-sample decoding and the crop transforms (`pipeline.decode`, `pipeline.transforms`)."""

from __future__ import annotations

import io
import math
import pickle
import random
import struct
import subprocess
import warnings
import zlib

import numpy as np
import pytest
from PIL import Image

from pipeline.decode import decode_crop, draft_scale
from pipeline.transforms import (
    CenterCrop,
    RandomResizedCrop,
    center_crop_box,
    sample_crop_box,
)
from shards.image.policy import open_image
from shards.sample import SampleError, decode_label, image_field_of


def encode(array: np.ndarray, fmt: str = "JPEG", **options) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, fmt, **options)
    return out.getvalue()


def ramp(width: int, height: int) -> np.ndarray:
    """RGB image whose red grows with x and green with y, both 0..255 across the image."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return np.stack([x, y, np.full_like(x, 128)], axis=-1).round().astype(np.uint8)


def smooth(width: int, height: int) -> np.ndarray:
    """A photo-like smooth RGB image: low-frequency waves, JPEG-friendly."""
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    red = 128 + 100 * np.sin(2 * math.pi * 3 * x) * np.cos(2 * math.pi * 2 * y)
    green = 128 + 100 * np.cos(2 * math.pi * 5 * (x + y))
    blue = 255 * x
    return np.stack([red, green, blue], axis=-1).round().astype(np.uint8)


def expected_ramp(box: tuple[float, ...], size: int, width: int, height: int) -> np.ndarray:
    """Red and green values a resize of `box` of `ramp(width, height)` to size x size gives."""
    scale_x, scale_y = (box[2] - box[0]) / size, (box[3] - box[1]) / size
    centres = np.arange(size) + 0.5
    red = (box[0] + centres * scale_x - 0.5) * 255 / (width - 1)
    green = (box[1] + centres * scale_y - 0.5) * 255 / (height - 1)
    return np.stack(np.broadcast_arrays(red[None, :], green[:, None]), axis=-1)


def png_header(width: int, height: int) -> bytes:
    """A PNG whose valid IHDR declares `width` x `height`, followed by a tiny IDAT: a bomb header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def jpeg_with_size(width: int, height: int) -> bytes:
    """A real 16x16 JPEG whose SOF0 header is patched to claim `width` x `height`."""
    data = bytearray(encode(smooth(16, 16)))
    at = data.index(b"\xff\xc0")  # SOF0: marker, length(2), precision(1), height(2), width(2)
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


@pytest.fixture(scope="module")
def jpeg_256() -> bytes:
    return encode(smooth(341, 256), quality=90)


# --- shapes, determinism, flip -----------------------------------------------------------


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
@pytest.mark.parametrize(
    "transform", [RandomResizedCrop(), RandomResizedCrop(size=96, hflip=1.0), CenterCrop(size=64)]
)
def test_output_is_contiguous_uint8_rgb(fmt, transform):
    data = encode(smooth(300, 200), fmt)
    out = transform(data, random.Random(0))
    assert out.shape == (transform.size, transform.size, 3)
    assert out.dtype == np.uint8
    assert out.flags.c_contiguous and out.flags.writeable
    assert out.std() > 10  # real pixels, not a blank canvas


def test_same_seed_same_crop_different_seeds_differ(jpeg_256):
    transform = RandomResizedCrop(size=64)
    first = transform(jpeg_256, random.Random(123))
    again = transform(jpeg_256, random.Random(123))
    np.testing.assert_array_equal(first, again)
    others = [transform(jpeg_256, random.Random(seed)) for seed in range(1, 6)]
    assert all(not np.array_equal(first, other) for other in others)


def test_transform_consumes_rng_like_box_sampler_then_flip(jpeg_256):
    """The box comes first from the rng, then one draw for the flip: order is part of the contract."""
    rng = random.Random(9)
    RandomResizedCrop(size=32)(jpeg_256, rng)
    reference = random.Random(9)
    sample_crop_box(341, 256, (0.08, 1.0), (3 / 4, 4 / 3), reference)
    reference.random()
    assert rng.random() == reference.random()


def test_flip_golden_pixels():
    # Left half red, right half blue, a green bar on top: asymmetric left-right only in colour.
    image = np.zeros((64, 64, 3), np.uint8)
    image[:, :32] = (255, 0, 0)
    image[:, 32:] = (0, 0, 255)
    image[:8] = (0, 255, 0)
    data = encode(image, "PNG")
    whole = {"size": 64, "scale": (1.0, 1.0), "ratio": (1.0, 1.0)}
    plain = RandomResizedCrop(**whole, hflip=0.0)(data, random.Random(0))
    flipped = RandomResizedCrop(**whole, hflip=1.0)(data, random.Random(0))
    np.testing.assert_array_equal(plain, image)
    assert tuple(flipped[40, 2]) == (0, 0, 255)
    assert tuple(flipped[40, 61]) == (255, 0, 0)
    assert tuple(flipped[2, 2]) == (0, 255, 0)  # still on top: a left-right flip only
    np.testing.assert_array_equal(flipped, plain[:, ::-1])


def test_hflip_probability_is_honoured():
    image = np.zeros((32, 32, 3), np.uint8)
    image[:, :16] = 255
    data = encode(image, "PNG")
    transform = RandomResizedCrop(size=32, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.5)
    flips = sum(transform(data, random.Random(seed))[16, 0, 0] == 0 for seed in range(200))
    assert 70 < flips < 130


# --- crop geometry -------------------------------------------------------------------------


def test_random_resized_crop_equals_hand_written_pillow(jpeg_256):
    """Without draft (no crop of a 256-px shard is 2x 224) it is open -> resize(box) -> flip."""
    transform = RandomResizedCrop(size=224)
    for seed in range(10):
        rng = random.Random(seed)
        box = sample_crop_box(341, 256, transform.scale, transform.ratio, rng)
        image = Image.open(io.BytesIO(jpeg_256))
        out = image.resize((224, 224), Image.Resampling.BILINEAR, box=box)
        if rng.random() < transform.hflip:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        np.testing.assert_array_equal(transform(jpeg_256, random.Random(seed)), np.asarray(out))


def test_box_sampler_stays_within_scale_and_ratio_bounds():
    rng = random.Random(0)
    width, height = 500, 375
    scale, ratio = (0.08, 1.0), (3 / 4, 4 / 3)
    areas, aspects, lefts, rights = [], [], [], []
    for _ in range(5000):
        left, top, right, bottom = sample_crop_box(width, height, scale, ratio, rng)
        assert 0 <= left < right <= width and 0 <= top < bottom <= height
        assert all(isinstance(v, int) for v in (left, top, right, bottom))
        w, h = right - left, bottom - top
        areas.append(w * h / (width * height))
        aspects.append(w / h)
        lefts.append(left)
        rights.append(right)
    # Rounding each side to whole pixels moves area and aspect by at most ~1 px of a side.
    assert min(areas) > 0.08 * 0.97 and max(areas) <= 1.0
    assert min(aspects) > 0.75 * 0.97 and max(aspects) < 4 / 3 * 1.03
    assert np.quantile(areas, 0.05) < 0.15 and np.quantile(areas, 0.95) > 0.7
    assert min(lefts) == 0 and max(rights) == width  # positions reach both edges


def test_box_sampler_aspect_is_log_uniform():
    # On a square image rejection is symmetric, so log(aspect) is uniform on log(ratio).
    rng = random.Random(1)
    logs = []
    for _ in range(5000):
        left, top, right, bottom = sample_crop_box(400, 400, (0.08, 1.0), (3 / 4, 4 / 3), rng)
        logs.append(math.log((right - left) / (bottom - top)))
    assert abs(np.mean(logs)) < 0.01
    counts, _ = np.histogram(logs, bins=4, range=(math.log(3 / 4), math.log(4 / 3)))
    assert counts.min() > 0.8 * counts.max()


def test_box_sampler_falls_back_to_clamped_centre_crop():
    # A 10:1 strip: no crop of 90-100% area with aspect <= 4/3 fits, so every attempt fails.
    box = sample_crop_box(1000, 100, (0.9, 1.0), (3 / 4, 4 / 3), random.Random(0))
    assert box == (433, 0, 566, 100)  # width round(100 * 4/3) = 133, centred
    tall = sample_crop_box(100, 1000, (0.9, 1.0), (3 / 4, 4 / 3), random.Random(0))
    assert tall == (0, 433, 100, 566)
    whole = sample_crop_box(120, 100, (2.0, 3.0), (3 / 4, 4 / 3), random.Random(0))
    assert whole == (0, 0, 120, 100)  # aspect already within bounds: the whole image


def test_random_crop_maps_box_to_output_pixels():
    """Output pixels come from the sampled box, resized (checked on a linear ramp)."""
    width, height, size = 480, 360, 64
    data = encode(ramp(width, height), "PNG")
    for seed in range(5):
        for hflip in (0.0, 1.0):
            transform = RandomResizedCrop(size=size, hflip=hflip)
            out = transform(data, random.Random(seed)).astype(float)
            box = sample_crop_box(
                width, height, transform.scale, transform.ratio, random.Random(seed)
            )
            expected = expected_ramp(box, size, width, height)
            if hflip:
                expected = expected[:, ::-1]
            # Interior only: at the borders the filter's support is clipped by the image.
            error = np.abs(out[2:-2, 2:-2, :2] - expected[2:-2, 2:-2])
            assert error.max() < 1.6, (seed, box)


def test_center_crop_box_golden():
    # 500x375 -> Resize(256) gives 341x256 (torchvision truncates), crop offset (58, 16).
    box = center_crop_box(500, 375, 224, 0.875)
    sx, sy = 500 / 341, 375 / 256
    assert box == pytest.approx((58 * sx, 16 * sy, 282 * sx, 240 * sy))
    assert center_crop_box(256, 256, 224, 0.875) == (16, 16, 240, 240)
    portrait = center_crop_box(375, 500, 224, 0.875)
    assert portrait == pytest.approx((16 * sy, 58 * sx, 240 * sy, 282 * sx))
    assert center_crop_box(300, 200, 100, 1.0) == pytest.approx((50, 0, 250, 200))
    # 256 * 500 / 300 = 426.7 is truncated to 426, not rounded to 427, as torchvision does.
    sx, sy = 500 / 426, 300 / 256
    assert center_crop_box(500, 300, 224, 0.875) == pytest.approx(
        (101 * sx, 16 * sy, 325 * sx, 240 * sy)
    )


def test_center_crop_matches_resize_then_crop():
    width, height = 500, 375
    data = encode(ramp(width, height), "PNG")
    out = CenterCrop(size=224)(data, random.Random(0)).astype(float)
    expected = expected_ramp(center_crop_box(width, height, 224, 0.875), 224, width, height)
    assert np.abs(out[2:-2, 2:-2, :2] - expected[2:-2, 2:-2]).max() < 1.6
    # The two-step torchvision recipe on a real picture gives the same pixels.
    picture = smooth(width, height)
    two_step = np.asarray(Image.fromarray(picture).resize((341, 256), Image.Resampling.BILINEAR))
    two_step = two_step[16:240, 58:282].astype(float)
    one_step = CenterCrop(size=224)(encode(picture, "PNG"), random.Random(0)).astype(float)
    assert np.abs(one_step - two_step).mean() < 1.0


# --- DCT-scaled (draft) decoding -----------------------------------------------------------


def test_draft_scale_keeps_the_crop_at_least_output_size():
    assert draft_scale(447, 1000, (224, 224)) == 1
    assert draft_scale(448, 448, (224, 224)) == 2
    assert draft_scale(900, 1000, (224, 224)) == 4
    assert draft_scale(1792, 1792, (224, 224)) == 8
    assert draft_scale(5000, 5000, (224, 224)) == 8
    assert draft_scale(5000, 900, (224, 224)) == 4
    for box_side in range(1, 3000, 7):
        scale = draft_scale(box_side, box_side, (224, 224))
        assert box_side / scale >= 224 or scale == 1


def test_draft_decodes_smaller_and_maps_the_box():
    data = encode(smooth(1024, 768), quality=90)
    image = open_image(data, 64_000_000)
    out = decode_crop(image, (100, 50, 1000, 750), (224, 224))
    # The 900x700 box is over 2x but under 4x the output on its short side: decoded at 1/2.
    assert image.size == (512, 384)
    assert out.shape == (224, 224, 3)
    reference = decode_crop(
        open_image(data, 64_000_000), (100, 50, 1000, 750), (224, 224), draft=False
    )
    assert np.abs(out.astype(float) - reference).mean() < 6


@pytest.mark.parametrize(
    "transform",
    [RandomResizedCrop(scale=(0.5, 1.0)), CenterCrop()],
    ids=["random_resized_crop", "center_crop"],
)
def test_draft_path_matches_full_decode(transform):
    data = encode(smooth(1024, 1024), quality=90)
    no_draft = type(transform)(**{**transform.__dict__, "draft": False})
    for seed in range(3):
        drafted = transform(data, random.Random(seed)).astype(float)
        reference = no_draft(data, random.Random(seed)).astype(float)
        assert np.abs(drafted - reference).mean() < 6
        # A wrong box mapping would shift the picture by many pixels; this shows it did not.
        assert (
            np.abs(drafted - np.roll(reference, 4, axis=1)).mean()
            > np.abs(drafted - reference).mean()
        )


def test_draft_is_skipped_when_the_crop_is_small():
    data = encode(smooth(1024, 768), quality=90)
    image = open_image(data, 64_000_000)
    decode_crop(image, (0, 0, 400, 400), (224, 224))
    assert image.size == (1024, 768)  # 400 / 224 < 2: a DCT-scaled decode would upscale


# --- bad data ------------------------------------------------------------------------------


def reason_of(data: bytes, transform=None) -> SampleError:
    with pytest.raises(SampleError) as caught:
        (transform or RandomResizedCrop())(data, random.Random(0))
    return caught.value


@pytest.mark.parametrize(
    "data", [b"", b"not an image at all", bytes(range(256)) * 4, b"<html><body>404</body></html>"]
)
def test_garbage_is_unidentified(data):
    error = reason_of(data)
    assert error.reason == "unidentified"
    assert "UnidentifiedImageError" in error.detail


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.9])
def test_truncated_jpeg(cut):
    data = encode(smooth(256, 256), quality=90)
    error = reason_of(data[: int(len(data) * cut)])
    assert error.reason == "truncated"
    assert "OSError" in error.detail


def test_truncated_png_and_webp():
    for fmt in ("PNG", "WEBP"):
        data = encode(smooth(256, 256), fmt)
        error = reason_of(data[: len(data) // 2])
        assert error.reason == "truncated", fmt


def test_truncated_images_stay_disallowed():
    from PIL import ImageFile

    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


@pytest.mark.parametrize(
    ("data", "exception"),
    [
        (png_header(9000, 8000), ""),  # 72 MP: over our 64 MP cap, under Pillow's
        (png_header(10_000, 10_000), "DecompressionBombWarning"),  # Pillow warns: an error here
        (png_header(20_000, 20_000), "DecompressionBombError"),
        (jpeg_with_size(65_000, 65_000), "DecompressionBombError"),
        (jpeg_with_size(8_500, 8_500), ""),
    ],
)
def test_bomb_headers_are_refused_before_decoding(data, exception):
    filters_before = list(warnings.filters)
    error = reason_of(data)
    assert error.reason == "too_many_pixels"
    assert exception in error.detail
    assert warnings.filters == filters_before  # no process-wide warning state left behind


def test_max_pixels_is_configurable(jpeg_256):
    error = reason_of(jpeg_256, CenterCrop(max_pixels=10_000))
    assert error.reason == "too_many_pixels"
    assert "341x256" in error.detail


def refuse_process(*args, **kwargs):
    raise AssertionError("a decoder tried to start a process")


@pytest.mark.parametrize(
    "data",
    [
        encode(smooth(32, 32), "BMP"),
        encode(smooth(32, 32), "GIF"),
        encode(smooth(32, 32), "TIFF"),
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 32 32\nshowpage\n",
        b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n",
    ],
    ids=["bmp", "gif", "tiff", "eps", "pdf"],
)
def test_disallowed_formats_are_never_parsed(data, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", refuse_process)
    assert reason_of(data).reason == "unidentified"


def test_programming_errors_propagate(jpeg_256):
    image = open_image(jpeg_256, 64_000_000)
    with pytest.raises(ValueError, match="box"):
        decode_crop(image, (0, 0, 5000, 5000), (32, 32))  # our bug, not bad data


# --- non-RGB inputs ------------------------------------------------------------------------


def test_grey_jpeg_becomes_rgb():
    grey = smooth(200, 150)[..., 0]
    out = CenterCrop(size=64)(encode(grey, quality=95), random.Random(0))
    assert out.shape == (64, 64, 3)
    np.testing.assert_array_equal(out[..., 0], out[..., 1])
    np.testing.assert_array_equal(out[..., 0], out[..., 2])


def test_rgba_png_is_composited_on_white():
    rgba = np.zeros((64, 64, 4), np.uint8)
    rgba[:, :32] = (255, 0, 0, 255)  # opaque red left, fully transparent right
    out = CenterCrop(size=64, crop_fraction=1.0)(encode(rgba, "PNG"), random.Random(0))
    assert tuple(out[32, 5]) == (255, 0, 0)
    assert tuple(out[32, 60]) == (255, 255, 255)


def test_grey_and_palette_and_16bit_png():
    grey = np.full((32, 32), 77, np.uint8)
    whole = CenterCrop(size=32, crop_fraction=1.0)
    assert tuple(whole(encode(grey, "PNG"), random.Random(0))[5, 5]) == (77, 77, 77)
    palette = Image.fromarray(smooth(32, 32)).quantize(16)
    buffer = io.BytesIO()
    palette.save(buffer, "PNG")
    out = whole(buffer.getvalue(), random.Random(0))
    np.testing.assert_array_equal(out, np.asarray(palette.convert("RGB")))
    deep = np.full((32, 32), 0x8040, np.uint16)  # 16-bit grey keeps its high byte, 0x80
    assert tuple(whole(encode(deep, "PNG"), random.Random(0))[5, 5]) == (128, 128, 128)


# --- sample fields -------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "label"), [(b"3", 3), (b" 42\n", 42), ("7", 7), (5, 5)])
def test_decode_label(value, label):
    assert decode_label({"__key__": "k", "cls": value}) == label


@pytest.mark.parametrize(
    "value",
    [b"abc", b"-1", b"", b"1e3", b"3.0", b"\xff\xfe", b"1" * 40, "\u0663", None, -2, b"+4"],
)
def test_decode_label_garbage(value):
    with pytest.raises(SampleError) as caught:
        decode_label({"__key__": "k7", "cls": value})
    assert caught.value.reason == "bad_label"
    assert "k7" in caught.value.detail


def test_decode_label_missing():
    with pytest.raises(SampleError) as caught:
        decode_label({"__key__": "k", "jpg": b""})
    assert caught.value.reason == "no_label"


def test_image_field_of():
    assert image_field_of({"__key__": "k", "jpg": b"", "cls": b"1"}) == "jpg"
    assert image_field_of({"__key__": "k", "png": b""}) == "png"
    assert image_field_of({"__key__": "k", "png": b"", "webp": b""}) == "webp"
    with pytest.raises(SampleError) as caught:
        image_field_of({"__key__": "k9", "__url__": "u", "cls": b"1", "json": b"{}"})
    assert caught.value.reason == "no_image"
    assert "k9" in caught.value.detail and "cls, json" in caught.value.detail


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"size": 0},
        {"scale": (0.5, 0.1)},
        {"scale": (0.0, 1.0)},
        {"ratio": (4 / 3, 3 / 4)},
        {"hflip": 1.5},
        {"resample": "cubic-ish"},
        {"max_pixels": 0},
        {"max_pixels": 10**12},
    ],
)
def test_random_resized_crop_rejects_bad_config(options):
    with pytest.raises(ValueError):
        RandomResizedCrop(**options)


@pytest.mark.parametrize("options", [{"crop_fraction": 0.0}, {"crop_fraction": 1.2}, {"size": -1}])
def test_center_crop_rejects_bad_config(options):
    with pytest.raises(ValueError):
        CenterCrop(**options)


def test_transforms_pickle_for_spawned_workers(jpeg_256):
    for transform in (RandomResizedCrop(size=48, hflip=0.3), CenterCrop(size=40)):
        clone = pickle.loads(pickle.dumps(transform))
        assert clone == transform
        np.testing.assert_array_equal(
            clone(jpeg_256, random.Random(2)), transform(jpeg_256, random.Random(2))
        )


# --- real shards ---------------------------------------------------------------------------


@pytest.mark.slow
def test_decodes_every_sample_of_built_tar_shards(built_shards):
    from shards.tar import iter_tar_samples

    tars = sorted(built_shards.output.rglob("*.tar"))
    assert tars
    decoded = 0
    transform = RandomResizedCrop(size=32)
    for path in tars:
        with open(path, "rb") as stream:
            for sample in iter_tar_samples(stream, str(path)):
                out = transform(sample[image_field_of(sample)], random.Random(decoded))
                assert out.shape == (32, 32, 3)
                assert 0 <= decode_label(sample) < 4
                decoded += 1
    assert decoded == sum(split.samples for split in built_shards.manifest.splits.values())


@pytest.mark.parametrize("make", [RandomResizedCrop, CenterCrop])
def test_read_only_output_holds_the_same_pixels(jpeg_256, make):
    copy = make(size=64)(jpeg_256, random.Random(3))
    view = make(size=64, writable=False)(jpeg_256, random.Random(3))
    assert copy.flags.writeable and not view.flags.writeable
    assert view.flags.c_contiguous and np.array_equal(copy, view)


# --- every valid JPEG decodes or is a counted skip -----------------------------------------


@pytest.mark.parametrize(
    "factors",
    [((1, 4), (1, 1), (1, 1)), ((3, 1), (1, 1), (1, 1)), ((2, 2), (2, 1), (1, 1))],
    ids=["4:4:1", "3x1", "chroma-2x1"],
)
def test_subsamplings_the_fast_crops_hand_to_pillow_decode_exactly(factors):
    # What the fast crops send here when simplejpeg cannot read the header: Pillow's decode
    # is libjpeg-turbo's, pixel for pixel (an identity box), and the crops run.
    import simplejpeg

    from tests.jpegcraft import dc_jpeg

    data = dc_jpeg(320, 240, factors, restart=4)
    image = open_image(data, 64_000_000)
    pixels = decode_crop(image, (0, 0, 320, 240), (320, 240), draft=False)
    if factors[0] == (1, 4):  # the one simplejpeg decodes (its header reader refuses it)
        np.testing.assert_array_equal(pixels, simplejpeg.decode_jpeg(data, "RGB"))
    for transform in (RandomResizedCrop(64), CenterCrop(64)):
        assert transform(data, random.Random(0)).shape == (64, 64, 3)


def test_12_bit_jpegs_are_skipped_and_arithmetic_headers_decoded():
    from tests.jpegcraft import dc_jpeg

    for factors in (((2, 2), (1, 1), (1, 1)), ((1, 1),)):
        error = reason_of(dc_jpeg(320, 240, factors, precision=12))
        assert error.reason == "unidentified" and "JPEG signature" in error.detail
    arithmetic = dc_jpeg(320, 240, frame_marker=0xC9)
    assert RandomResizedCrop(64)(arithmetic, random.Random(0)).shape == (64, 64, 3)
