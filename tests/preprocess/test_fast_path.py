"""Tests of the `fast` image backend: same geometry, skips and metadata as the Pillow backend."""

from __future__ import annotations

from io import BytesIO

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("simplejpeg")
pytest.importorskip("cv2")

import simplejpeg  # noqa: E402

from preprocess import images  # noqa: E402
from preprocess.cli import build_config_from_args, build_parser  # noqa: E402
from preprocess.images import ImageConfig, ProcessedImage, process_image  # noqa: E402
from shards.image import policy  # noqa: E402
from shards.sample import SampleError  # noqa: E402
from tests import oddimages  # noqa: E402
from tests.oddimages import QUADRANTS  # noqa: E402

PILLOW = ImageConfig(backend="pillow")
FAST = ImageConfig(backend="fast")
ODD = oddimages.odd_image_bytes()


def outcome(data: bytes, config: ImageConfig) -> ProcessedImage | str:
    """The processed image, or the skip reason."""
    try:
        return process_image(data, config)
    except SampleError as error:
        return error.reason


def pixels(result: ProcessedImage) -> np.ndarray:
    with Image.open(BytesIO(result.data)) as image:
        return np.asarray(image.convert("RGB"), dtype=np.int16)


def describe(result: ProcessedImage) -> tuple:
    return (
        result.ext,
        result.width,
        result.height,
        result.orig_width,
        result.orig_height,
        result.orig_format,
        result.orig_mode,
    )


@pytest.fixture
def pillow_calls(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Records every input that reaches the Pillow path."""
    calls: list[bytes] = []
    original = images._process_pillow

    def spy(source, data, config):
        calls.append(data)
        return original(source, data, config)

    monkeypatch.setattr(images, "_process_pillow", spy)
    return calls


def gradient_jpeg(width: int, height: int, orientation: int = 1) -> bytes:
    """A smooth, asymmetric JPEG (so a wrong flip, crop or channel order shows)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    red = xx / width * 255
    green = yy / height * 255
    blue = 128 + 100 * np.sin(xx / 37.0) * np.cos(yy / 23.0)
    array = np.clip(np.stack([red, green, blue], -1), 0, 255).astype(np.uint8)
    image = Image.fromarray(array)
    if orientation == 1:
        return oddimages.encode(image, "JPEG", quality=92)
    exif = Image.Exif()
    exif[0x0112] = orientation
    return oddimages.encode(image, "JPEG", quality=92, exif=exif.tobytes())


@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_images_get_the_same_outcome_as_pillow(name: str) -> None:
    _, data, expected = ODD[name]
    fast, pillow = outcome(data, FAST), outcome(data, PILLOW)
    if expected is not None:
        assert fast == pillow == expected
    else:
        assert describe(fast) == describe(pillow)


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.98, -2])
def test_truncated_jpeg_is_skipped_never_a_grey_image(cut: float) -> None:
    data = oddimages.photo_jpeg(500, 375)
    data = data[:cut] if cut < 0 else oddimages.truncated(data, cut)
    assert outcome(data, FAST) == "truncated"


def test_plain_jpeg_never_reaches_pillow(pillow_calls: list[bytes]) -> None:
    result = process_image(oddimages.photo_jpeg(500, 375), FAST)
    assert (result.width, result.height) == (341, 256)
    assert pillow_calls == []


@pytest.mark.parametrize(
    "name", ["mode_cmyk_jpeg", "mode_rgba", "mode_p_trns", "animated_gif", "jpeg_truncated_50"]
)
def test_other_inputs_fall_back_to_pillow(name: str, pillow_calls: list[bytes]) -> None:
    outcome(ODD[name][1], FAST)
    assert pillow_calls == [ODD[name][1]]


def test_tolerated_libjpeg_warning_falls_back_and_is_kept(pillow_calls: list[bytes]) -> None:
    # Two stray bytes before SOS: libjpeg warns ("extraneous bytes"), Pillow decodes it.
    data = oddimages.photo_jpeg(128, 96).replace(b"\xff\xda", b"\x00\x00\xff\xda", 1)
    assert describe(outcome(data, FAST)) == describe(outcome(data, PILLOW))
    assert pillow_calls == [data, data]


def test_pixel_cap_is_checked_before_libjpeg_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("decoded an image over the pixel cap")

    monkeypatch.setattr(simplejpeg, "decode_jpeg", refuse)
    data = oddimages.photo_jpeg(500, 375)
    assert outcome(data, ImageConfig(backend="fast", max_pixels=100_000)) == "too_many_pixels"


@pytest.mark.parametrize(
    ("size", "resize"),
    [
        ((500, 375), "shorter"),
        ((375, 500), "shorter"),
        ((501, 377), "longer"),
        ((640, 480), "center-crop"),
        ((200, 150), "center-crop"),  # upscaled
        ((300, 200), "none"),
        ((2400, 1800), "shorter"),  # DCT-scaled by 4
        ((3000, 120), "shorter"),  # aspect bound: long side centre-cropped
    ],
)
def test_geometry_and_content_match_pillow(size: tuple[int, int], resize: str) -> None:
    data = gradient_jpeg(*size)
    fast = process_image(data, ImageConfig(backend="fast", resize=resize))
    pillow = process_image(data, ImageConfig(resize=resize))
    assert describe(fast) == describe(pillow)
    # Same picture, not only the same size: a wrong crop, flip or channel order moves far more.
    assert np.abs(pixels(fast) - pixels(pillow)).mean() < 3.0


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_matches_pillow(orientation: int, pillow_calls: list[bytes]) -> None:
    card = process_image(oddimages.oriented_jpeg(orientation), ImageConfig(backend="fast"))
    assert pillow_calls == []
    assert (card.width, card.height) == oddimages.CARD_SIZE
    upright = pixels(card)
    for (x, y), colour in QUADRANTS.items():
        assert np.abs(upright[y, x] - colour).max() < 40, (orientation, (x, y))
    data = gradient_jpeg(500, 375, orientation)
    fast, pillow = process_image(data, FAST), process_image(data, PILLOW)
    assert describe(fast) == describe(pillow)
    assert np.abs(pixels(fast) - pixels(pillow)).mean() < 3.0


def test_huge_source_takes_the_area_filter_and_matches_pillow() -> None:
    # 4800x4400 -> 279x256: after 1/8 DCT scaling the source is still over twice the output.
    data = gradient_jpeg(4800, 4400)
    fast, pillow = process_image(data, FAST), process_image(data, PILLOW)
    assert describe(fast) == describe(pillow)
    assert np.abs(pixels(fast) - pixels(pillow)).mean() < 3.0


@pytest.mark.parametrize("encode", ["webp", "png"])
def test_other_output_encodings(encode: str) -> None:
    data = gradient_jpeg(500, 375)
    fast = process_image(data, ImageConfig(backend="fast", encode=encode))
    pillow = process_image(data, ImageConfig(encode=encode))
    assert describe(fast) == describe(pillow)
    with Image.open(BytesIO(fast.data)) as image:
        assert image.format == encode.upper()
        assert not image.info.get("exif")


def test_grey_jpeg_becomes_rgb() -> None:
    data = oddimages.encode(Image.fromarray(np.full((96, 128), 77, np.uint8)), "JPEG")
    result = process_image(data, FAST)
    assert result.orig_mode == "L"
    assert np.abs(pixels(result) - 77).max() <= 2


def test_output_is_deterministic() -> None:
    data = gradient_jpeg(1000, 700, orientation=6)
    first = process_image(data, FAST).data
    process_image(oddimages.photo_jpeg(640, 480), FAST)  # state between calls must not matter
    assert process_image(data, FAST).data == first


def test_config_rejects_what_the_fast_backend_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="bilinear"):
        ImageConfig(backend="fast", resample="lanczos")
    with pytest.raises(ValueError, match="backend"):
        ImageConfig(backend="turbo")
    monkeypatch.setattr(policy, "fast_backend_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install simplejpeg opencv-python-headless"):
        ImageConfig(backend="fast")


def test_cli_passes_the_backend() -> None:
    args = build_parser().parse_args(
        ["build-shards", "--input", "in", "--output", "out", "--backend", "fast"]
    )
    config = build_config_from_args(args)
    assert config.image.backend == "fast"
    assert config.output_shaping()["image"]["backend"] == "fast"  # resume must match it


def test_header_size_disagreement_falls_back(
    monkeypatch: pytest.MonkeyPatch, pillow_calls: list[bytes]
) -> None:
    # libjpeg-turbo must decode only the size whose pixel count was capped on Pillow's header.
    monkeypatch.setattr(
        simplejpeg, "decode_jpeg_header", lambda data: (20_000, 20_000, "YCbCr", "420")
    )
    data = oddimages.photo_jpeg(128, 96)
    assert describe(process_image(data, FAST)) == describe(process_image(data, PILLOW))
    assert pillow_calls == [data, data]


# --- the default backend, fallbacks and quality against LANCZOS ------------------------------

# 8-bit PSNR of the default (fast) build against Pillow's LANCZOS, PNG output, photo-like
# JPEGs to 341x256. Measured: 42.7 dB from 500x375, 46 dB from 1024x768, 48.3 dB from
# 2400x1800 (Pillow's bilinear: 46.5 / 48.8 / 52 dB).
MIN_PSNR_VS_LANCZOS_DB = 41.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_default_backend_is_fast_and_recorded_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ImageConfig().backend == "fast"
    assert ImageConfig(resample="lanczos").backend == "pillow"  # fast resizes bilinear only
    monkeypatch.setattr(policy, "fast_backend_available", lambda: False)
    assert ImageConfig().backend == "pillow"  # a platform without the wheels still builds
    args = build_parser().parse_args(["build-shards", "--input", "in", "--output", "out"])
    assert build_config_from_args(args).output_shaping()["image"]["backend"] in ("fast", "pillow")


def test_default_build_is_the_fast_path(pillow_calls: list[bytes]) -> None:
    result = process_image(oddimages.photo_jpeg(), ImageConfig())
    assert pillow_calls == [] and not result.pillow_fallback


@pytest.mark.parametrize("name", ["mode_cmyk_jpeg", "mode_rgba", "ppm"])
def test_fallbacks_are_marked(name: str) -> None:
    data = ODD[name][1]
    assert process_image(data, ImageConfig()).pillow_fallback
    assert not process_image(data, PILLOW).pillow_fallback  # not a fallback: chosen


@pytest.mark.parametrize("size", [(500, 375), (1024, 768), (2400, 1800)])
def test_default_build_is_close_to_lanczos(size: tuple[int, int]) -> None:
    data = oddimages.photo_jpeg(*size, quality=95)
    fast = process_image(data, ImageConfig(encode="png"))
    lanczos = process_image(data, ImageConfig(encode="png", resample="lanczos"))
    assert describe(fast) == describe(lanczos)
    assert psnr(pixels(fast), pixels(lanczos)) > MIN_PSNR_VS_LANCZOS_DB


def test_a_default_build_counts_the_inputs_pillow_decoded_and_a_rerun_keeps_the_count(
    sample_dir, tmp_path
):
    from preprocess.cli import format_summary
    from preprocess.job import run_build
    from tests.conftest import small_build_config

    # The sample mixes plain JPEGs with PNG, WebP, BMP, TIFF, CMYK and grey inputs.
    expected = 0
    for path in sorted(p for p in sample_dir.rglob("*") if p.is_file()):
        expected += process_image(path.read_bytes(), ImageConfig(image_size=64)).pillow_fallback
    first = run_build(small_build_config(sample_dir, tmp_path / "out"))
    assert 0 < first.pillow_fallbacks == expected < first.manifest.written
    assert f"inputs decoded by Pillow (not plain JPEG: PNG, CMYK, ...): {expected} (" in (
        format_summary(first)
    )
    again = run_build(small_build_config(sample_dir, tmp_path / "out"))
    assert again.shards_built == 0 and again.pillow_fallbacks == expected


# --- every valid JPEG decodes or is a counted skip -------------------------------------------

# Sampling factors (luma first) Pillow decodes but simplejpeg's header reader cannot name:
# 4:4:1 raised `KeyError: 6` out of the fast backend and failed the build.
ODD_SAMPLING = {
    "4:4:1": ((1, 4), (1, 1), (1, 1)),
    "3x1": ((3, 1), (1, 1), (1, 1)),
    "chroma 2x1": ((2, 2), (2, 1), (1, 1)),
}


@pytest.mark.parametrize("name", ODD_SAMPLING)
def test_subsamplings_simplejpeg_cannot_read_are_built_by_pillow(name: str) -> None:
    from tests.jpegcraft import dc_jpeg

    data = dc_jpeg(320, 240, ODD_SAMPLING[name], restart=4)
    fast, pillow = process_image(data, FAST), process_image(data, PILLOW)
    assert fast.pillow_fallback and fast.data == pillow.data
    assert describe(fast) == describe(pillow)


def test_12_bit_and_arithmetic_jpegs_are_built_or_skipped_with_a_reason() -> None:
    from tests.jpegcraft import dc_jpeg

    for factors in (((2, 2), (1, 1), (1, 1)), ((1, 1),)):
        data = dc_jpeg(320, 240, factors, precision=12)  # Pillow and TurboJPEG: 8-bit only
        assert outcome(data, FAST) == outcome(data, PILLOW) == "unidentified"
    arithmetic = dc_jpeg(320, 240, frame_marker=0xC9)  # an arithmetic-coding frame header
    fast, pillow = process_image(arithmetic, FAST), process_image(arithmetic, PILLOW)
    assert describe(fast) == describe(pillow)


def test_a_build_with_odd_jpegs_finishes_and_counts_them(tmp_path) -> None:
    from preprocess.job import run_build
    from tests.conftest import small_build_config
    from tests.jpegcraft import dc_jpeg

    inputs = tmp_path / "images"
    files = {
        "a/plain.jpg": oddimages.photo_jpeg(320, 240),
        "a/441.jpg": dc_jpeg(320, 240, ODD_SAMPLING["4:4:1"]),
        "b/3x1.jpg": dc_jpeg(320, 240, ODD_SAMPLING["3x1"], seed=2),
        "b/12bit.jpg": dc_jpeg(320, 240, precision=12),
        "b/plain.jpg": oddimages.photo_jpeg(320, 240, seed=1),
    }
    for name, data in files.items():
        (inputs / name).parent.mkdir(parents=True, exist_ok=True)
        (inputs / name).write_bytes(data)
    config = small_build_config(inputs, tmp_path / "out", val_fraction=0.0, max_skip_fraction=0.5)
    summary = run_build(config)
    assert summary.manifest.skipped == {"unidentified": 1}  # the 12-bit file
    assert summary.manifest.written == 4 and summary.pillow_fallbacks == 2
