"""Tests of the per-image step of build-shards: bad inputs, modes, orientation, geometry."""

from __future__ import annotations

import errno
import logging
import subprocess
import warnings
from io import BytesIO

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image, ImageCms, ImageFile, ImageOps, JpegImagePlugin

from preprocess import images
from preprocess.images import (
    ImageConfig,
    draft_request,
    plan_resize,
    process_image,
    read_source,
)
from shards.image import policy as image_policy
from shards.image.policy import INPUT_FORMATS, read_orientation, sniff_format, to_rgb
from shards.sample import SampleError
from tests import oddimages
from tests.oddimages import BAND_X, QUADRANTS

PNG_OUT = ImageConfig(encode="png", backend="pillow")  # lossless, exact golden pixels


@pytest.fixture(scope="module")
def odd() -> dict[str, tuple[str, bytes, str | None]]:
    return oddimages.odd_image_bytes()


@pytest.fixture(scope="module")
def big_photo() -> bytes:
    return oddimages.photo_jpeg(2400, 1800)


def decode(data: bytes) -> Image.Image:
    image = Image.open(BytesIO(data))
    image.load()
    return image


def reason_error(data: bytes, config: ImageConfig = PNG_OUT) -> SampleError:
    with pytest.raises(SampleError) as caught:
        process_image(data, config)
    return caught.value


def reason_of(data: bytes, config: ImageConfig = PNG_OUT) -> str:
    return reason_error(data, config).reason


def band_pixels(result: images.ProcessedImage) -> list[tuple[int, int, int]]:
    image = decode(result.data)
    assert image.size == oddimages.BAND_SIZE
    return [image.getpixel((x, 16)) for x in BAND_X]


def pixels(image: Image.Image) -> list[tuple[int, ...]]:
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]


def assert_close(got, expected, tolerance: int) -> None:
    assert np.abs(np.subtract(got, expected)).max() <= tolerance, (got, expected)


# --- the whole odd set -----------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(oddimages.odd_image_bytes()))
def test_each_odd_image_has_its_expected_outcome(odd, name):
    _, data, expected = odd[name]
    if expected is None:
        result = process_image(data, ImageConfig())
        out = decode(result.data)
        assert out.format == "JPEG" and out.mode == "RGB"
        assert out.size == (result.width, result.height)
    else:
        assert reason_of(data, ImageConfig()) == expected


def test_make_odd_images_writes_readable_files(tmp_path):
    written = oddimages.make_odd_images(tmp_path / "odd")
    assert set(written) == set(oddimages.odd_image_bytes())
    for name, (path, expected) in written.items():
        assert path.parent == tmp_path / "odd" and path.suffix in {
            ".jpg",
            ".png",
            ".webp",
            ".gif",
            ".tif",
            ".pbm",
            ".pgm",
            ".ppm",
            ".mpo",
            ".ico",
            ".avif",
        }
        try:
            process_image(read_source(str(path), 2**20), ImageConfig())
            outcome = None
        except SampleError as error:
            outcome = error.reason
        assert outcome == expected, name


def test_odd_images_are_small(odd):
    assert max(len(data) for _, data, _ in odd.values()) < 400_000


# --- bombs: refused from the header, before any decode --------------------------------


def test_png_bomb_is_a_real_bomb_to_plain_pillow():
    bomb = oddimages.png_bomb()
    assert len(bomb) < 300_000
    with pytest.raises(Image.DecompressionBombError):
        Image.open(BytesIO(bomb))


@pytest.mark.parametrize(
    "size, detail",
    [
        ((40_000, 40_000), "178956970"),  # > 2 x MAX_IMAGE_PIXELS: DecompressionBombError
        ((10_000, 10_000), "89478485"),  # between MAX and 2 x MAX: the warning, made an error
        ((8_100, 8_100), "> 64000000"),  # above our cap, below Pillow's: our header check
    ],
)
def test_bombs_are_skipped_without_decoding(monkeypatch, size, detail):
    def no_load(self):
        raise AssertionError("decoded a bomb")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    filters_before = list(warnings.filters)
    with pytest.raises(SampleError) as caught:
        process_image(oddimages.png_bomb(*size), PNG_OUT)
    assert caught.value.reason == "too_many_pixels"
    assert detail in caught.value.detail  # each guard is exercised, not just the last one
    assert warnings.filters == filters_before  # the warning is an error only inside the call
    assert Image.MAX_IMAGE_PIXELS is not None


def test_pixel_cap_is_configurable():
    png = oddimages.encode(oddimages.noise_image(40, 40), "PNG")
    assert reason_of(png, ImageConfig(max_pixels=40 * 40 - 1)) == "too_many_pixels"
    assert process_image(png, ImageConfig(max_pixels=40 * 40)).width == 40


# --- truncation ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "GIF", "BMP", "TIFF", "WEBP"])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_truncated_files_are_skipped_not_grey_filled(fmt, fraction):
    data = oddimages.encode(oddimages.noise_image(96, 64), fmt)
    assert reason_of(oddimages.truncated(data, fraction)) == "truncated"
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


# --- formats: allowlist and no subprocess ----------------------------------------------


def test_disallowed_formats_never_reach_pillow_or_a_subprocess(monkeypatch, odd):
    def forbidden(*args, **kwargs):
        raise AssertionError("must not be called")

    monkeypatch.setattr(subprocess, "Popen", forbidden)
    monkeypatch.setattr(EpsImagePlugin, "Ghostscript", forbidden)
    monkeypatch.setattr(images.Image, "open", forbidden)
    for name in ("eps", "pdf", "psd", "fits"):
        assert reason_of(odd[name][1]) == "format_not_allowed", name


@pytest.mark.parametrize("name, pillow_format", [("eps", "EPS"), ("psd", "PSD"), ("fits", "FITS")])
def test_disallowed_samples_are_real_files_pillow_would_open(monkeypatch, odd, name, pillow_format):
    monkeypatch.setattr(subprocess, "Popen", None)  # identifying must not need a subprocess
    with Image.open(BytesIO(odd[name][1])) as image:
        assert image.format == pillow_format


@pytest.mark.parametrize(
    "data, name",
    [
        (b"\x00\x00\x00\x0cjP  \r\n\x87\n" + bytes(20), "JPEG 2000"),
        (b"\x00\x00\x00\x1cftypheic" + bytes(20), "HEIF"),
        (b"\x00\x00\x02\x00\x01\x00" + bytes(20), "CUR"),
        (b"%!PS-Adobe-3.0\n", "EPS/PostScript"),
    ],
)
def test_sniff_format_names_foreign_formats(data, name):
    assert sniff_format(data) == name
    error = reason_error(data)
    assert error.reason == "format_not_allowed" and name in error.detail


@pytest.mark.parametrize("fmt", INPUT_FORMATS)
def test_sniff_format_names_each_input_format_as_pillow_does(fmt):
    data = oddimages.encode(Image.new("RGB", (16, 16), (1, 2, 3)), fmt)
    assert sniff_format(data) == fmt
    assert process_image(data, PNG_OUT).orig_format == fmt


def test_unidentified_names_a_broken_header_of_an_allowed_signature():
    with pytest.raises(SampleError) as caught:
        process_image(b"\x89PNG\r\n\x1a\n" + bytes(10), PNG_OUT)
    assert caught.value.reason == "unidentified" and "PNG signature" in caught.value.detail


# --- EXIF orientation ------------------------------------------------------------------


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_gives_an_upright_image(orientation):
    data = oddimages.oriented_jpeg(orientation)
    # Independent oracle: Pillow's exif_transpose sees the same upright card.
    oracle = ImageOps.exif_transpose(decode(data))
    result = process_image(data, PNG_OUT)
    out = decode(result.data)
    assert out.size == oracle.size == oddimages.CARD_SIZE
    assert (result.orig_width, result.orig_height) == oddimages.CARD_SIZE
    for point, colour in QUADRANTS.items():
        assert_close(out.getpixel(point), colour, 12)
        assert_close(oracle.getpixel(point), colour, 12)


@pytest.mark.parametrize(
    "data_name", ["exif_orientation_99", "exif_orientation_text", "exif_broken_ifd"]
)
def test_malformed_exif_means_no_rotation(odd, data_name):
    out = decode(process_image(odd[data_name][1], PNG_OUT).data)
    for point, colour in QUADRANTS.items():
        assert_close(out.getpixel(point), colour, 12)


def test_read_orientation_survives_exif_that_raises(monkeypatch):
    image = decode(oddimages.oriented_jpeg(6))
    assert read_orientation(image) == 6

    def broken(self):
        raise SyntaxError("bad IFD")

    monkeypatch.setattr(Image.Image, "getexif", broken)
    assert read_orientation(image) == 1


def test_output_carries_no_metadata():
    icc = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    exif = Image.Exif()
    exif[0x0112] = 6
    exif[0x010F] = "camera maker"
    source = oddimages.encode(
        oddimages.orientation_card(), "JPEG", exif=exif.tobytes(), icc_profile=icc, comment=b"hi"
    )
    for encoding in ("jpeg", "webp", "png"):
        out = decode(process_image(source, ImageConfig(encode=encoding)).data)
        assert not out.getexif()
        assert "icc_profile" not in out.info and "exif" not in out.info
        assert "comment" not in out.info


# --- modes -----------------------------------------------------------------------------

WHITE, BLACK = (255, 255, 255), (0, 0, 0)
MODE_GOLDEN = {  # odd image -> expected RGB of the four bands, (tolerance)
    "mode_l": ([(0,) * 3, (77,) * 3, (200,) * 3, (255,) * 3], 0),
    "mode_la": ([(50,) * 3, WHITE, (152,) * 3, (200,) * 3], 1),
    "mode_rgba": ([(255, 0, 0), WHITE, (255, 127, 127), (0, 0, 255)], 1),
    "mode_p_trns": ([(255, 0, 0), WHITE, (127, 127, 255), BLACK], 1),
    "mode_rgb_trns": ([(255, 0, 0), WHITE, (0, 0, 255), BLACK], 0),
    "mode_cmyk_tiff": ([(255, 0, 0), (0, 255, 0), WHITE, BLACK], 0),
    "mode_cmyk_jpeg": ([(255, 0, 0), (0, 255, 0), WHITE, BLACK], 8),  # Adobe-inverted
    # 16-bit keeps its high byte; clipping would give 0, 255, 255, 255.
    "mode_i16": ([(0,) * 3, (1,) * 3, (128,) * 3, (255,) * 3], 0),
    "mode_i16b": ([(0,) * 3, (1,) * 3, (128,) * 3, (255,) * 3], 0),
    "mode_rgb48": ([(0, 128, 255), (1, 1, 1), (255, 0, 0), (0, 0, 64)], 0),
    "mode_1": ([BLACK, WHITE, BLACK, WHITE], 0),
    "mode_f": ([(0,) * 3, (64,) * 3, (128,) * 3, (255,) * 3], 0),  # 0..1 -> x 255
    "mode_f_wide": ([(0,) * 3, (64,) * 3, (128,) * 3, (255,) * 3], 0),  # -1..3 min-max
    "mode_i": ([(0,) * 3, (2,) * 3, (128,) * 3, (255,) * 3], 0),  # 0..140000 min-max
}


@pytest.mark.parametrize("name", sorted(MODE_GOLDEN))
def test_every_mode_becomes_rgb_with_golden_pixels(odd, name):
    expected, tolerance = MODE_GOLDEN[name]
    result = process_image(odd[name][1], PNG_OUT)
    assert decode(result.data).mode == "RGB"
    for got, want in zip(band_pixels(result), expected, strict=True):
        assert_close(got, want, tolerance)


def test_cmyk_jpeg_sample_is_adobe_inverted(odd):
    data = odd["mode_cmyk_jpeg"][1]
    assert b"Adobe" in data  # APP14 marker: stored inverted, so the golden test covers it
    assert decode(data).mode == "CMYK"


def test_background_colour_replaces_transparency(odd):
    result = process_image(odd["mode_rgba"][1], ImageConfig(encode="png", background=(0, 0, 0)))
    assert band_pixels(result)[1] == BLACK


@pytest.mark.parametrize(
    "mode, value, expected",
    [
        ("YCbCr", (76, 85, 255), (254, 0, 0)),
        ("RGBX", (10, 20, 30, 0), (10, 20, 30)),
        ("RGBa", (128, 0, 0, 128), (255, 127, 127)),
        ("HSV", (0, 255, 255), (255, 0, 0)),
    ],
)
def test_to_rgb_in_memory_modes(mode, value, expected):
    out = to_rgb(Image.new(mode, (4, 4), value), (255, 255, 255))
    assert out.mode == "RGB"
    assert_close(out.getpixel((0, 0)), expected, 2)


def test_to_rgb_composites_palette_alpha_and_grey_transparency():
    pa = Image.new("PA", (2, 1))
    pa.putpalette([255, 0, 0] * 256)
    pa.putpixel((0, 0), (0, 255))
    pa.putpixel((1, 0), (0, 0))
    assert pixels(to_rgb(pa, (255, 255, 255))) == [(255, 0, 0), WHITE]
    grey = Image.new("L", (2, 1), 7)
    grey.putpixel((1, 0), 9)
    grey.info["transparency"] = 9
    assert pixels(to_rgb(grey, (0, 0, 255))) == [(7, 7, 7), (0, 0, 255)]


def test_to_rgb_returns_rgb_input_itself():
    image = Image.new("RGB", (4, 4))
    assert to_rgb(image, (255, 255, 255)) is image


@pytest.mark.parametrize(
    "values, expected",
    [
        ([np.nan, 0.0, 0.5, np.inf], [0, 0, 128, 255]),  # NaN -> 0, inf saturates
        ([5.0, 5.0, 5.0, 5.0], [5, 5, 5, 5]),  # constant, already in range
        ([-5.0, -5.0, -5.0, -5.0], [0, 0, 0, 0]),  # constant out of range: no division by 0
        ([0.0, 10.0, 100.0, 255.0], [0, 10, 100, 255]),  # 0..255 floats kept
    ],
)
def test_float_scaling(values, expected):
    image = Image.fromarray(np.array([values], dtype=np.float32))
    assert [p[0] for p in pixels(to_rgb(image, WHITE))] == expected


def test_int32_in_16_bit_range_is_shifted():
    image = Image.fromarray(np.array([[0, 300, 32768, 65535]], dtype=np.int32))
    assert [p[0] for p in pixels(to_rgb(image, WHITE))] == [0, 1, 128, 255]


# --- frames ----------------------------------------------------------------------------


def test_animation_uses_the_first_frame_only(odd):
    for name in ("animated_gif", "gif_broken_tail", "multipage_tiff"):
        out = decode(process_image(odd[name][1], PNG_OUT).data)
        assert out.getpixel((8, 8)) == oddimages.ANIMATED_FIRST_COLOUR, name


def test_mpo_uses_the_first_picture():
    pictures = [Image.new("RGB", (64, 32), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    data = oddimages.encode(pictures[0], "MPO", save_all=True, append_images=pictures[1:])
    result = process_image(data, PNG_OUT)
    assert result.orig_format == "MPO"
    assert_close(decode(result.data).getpixel((32, 16)), (255, 0, 0), 4)


# --- widely used formats beyond JPEG, PNG and WEBP --------------------------------------

FOREIGN_GOLDEN = {  # odd image -> expected RGB of the four bands, tolerance
    "pbm": ([BLACK, WHITE, BLACK, WHITE], 0),
    "pgm": ([(0,) * 3, (77,) * 3, (200,) * 3, (255,) * 3], 0),
    "pgm16": ([(0,) * 3, (1,) * 3, (128,) * 3, (255,) * 3], 0),  # 16-bit keeps its high byte
    "ppm": ([(255, 0, 0), (0, 255, 0), (0, 0, 255), BLACK], 0),
    "avif": ([(255, 0, 0), (0, 255, 0), (0, 0, 255), WHITE], 12),  # lossy
}


@pytest.mark.parametrize("name", sorted(FOREIGN_GOLDEN))
def test_pnm_and_avif_inputs_decode_with_golden_pixels(odd, name):
    if name == "avif" and not oddimages.AVIF_SUPPORTED:
        assert reason_of(odd[name][1]) == "format_not_allowed"
        return
    expected, tolerance = FOREIGN_GOLDEN[name]
    result = process_image(odd[name][1], PNG_OUT)
    assert result.orig_format == sniff_format(odd[name][1]) == ("AVIF" if name == "avif" else "PPM")
    for got, want in zip(band_pixels(result), expected, strict=True):
        assert_close(got, want, tolerance)


def test_icon_gives_its_largest_frame_composited():
    result = process_image(oddimages.icon_bytes(), PNG_OUT)
    out = decode(result.data)
    assert result.orig_format == "ICO" and out.size == (48, 48)
    assert out.getpixel((4, 24)) == (255, 0, 0) and out.getpixel((44, 24)) == (0, 0, 255)


def test_icon_frame_header_is_capped_before_decoding(monkeypatch):
    def no_load(self):
        raise AssertionError("decoded an icon frame past the pixel cap")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_load)
    error = reason_error(oddimages.icon_with_bomb_frame())
    assert error.reason == "too_many_pixels" and "9000x9000" in error.detail


def test_mpo_file_reads_the_first_picture(odd):
    result = process_image(odd["mpo"][1], PNG_OUT)
    assert result.orig_format == "MPO"
    assert_close(band_pixels(result)[3], (255, 0, 0), 4)


@pytest.mark.parametrize(
    "data",
    [
        oddimages.encode(Image.new("RGB", (16, 16)), "TGA"),  # no magic bytes: no plugin tries
        b"\x00\x00\x00\x1cftypheic" + bytes(20),
    ],
    ids=["tga", "heif"],
)
def test_formats_outside_the_policy_are_refused(data):
    assert reason_of(data) in ("unidentified", "format_not_allowed")


# --- geometry --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, policy, image_size, expected_size, expected_box",
    [
        ((400, 300), "shorter", 256, (341, 256), (0, 0, 400, 300)),
        ((300, 400), "shorter", 256, (256, 341), (0, 0, 300, 400)),
        ((400, 300), "longer", 256, (256, 192), (0, 0, 400, 300)),
        ((400, 300), "center-crop", 256, (256, 256), (50, 0, 350, 300)),
        ((400, 300), "none", 256, (400, 300), (0, 0, 400, 300)),
        ((200, 100), "shorter", 256, (200, 100), (0, 0, 200, 100)),  # never upscaled
        ((200, 100), "longer", 256, (200, 100), (0, 0, 200, 100)),
        ((200, 100), "center-crop", 256, (256, 256), (50, 0, 150, 100)),  # upscaled
        ((2000, 20), "shorter", 256, (400, 20), (800, 0, 1200, 20)),  # aspect bounded at 20
        ((2000, 20), "shorter", 16, (320, 16), (800, 0, 1200, 20)),
        ((20, 2000), "longer", 100, (5, 100), (0, 800, 20, 1200)),
        ((100_000, 1000), "shorter", 256, (5120, 256), (40_000, 0, 60_000, 1000)),
    ],
)
def test_plan_resize(size, policy, image_size, expected_size, expected_box):
    plan = plan_resize(*size, ImageConfig(resize=policy, image_size=image_size))
    assert plan.size == expected_size
    assert plan.box == expected_box


@pytest.mark.parametrize("policy", ["shorter", "longer", "center-crop", "none"])
def test_plan_resize_is_symmetric_in_its_axes(policy):
    config = ImageConfig(resize=policy, image_size=97, max_aspect=3.5)
    rng = np.random.default_rng(0)
    for width, height in rng.integers(8, 3000, (200, 2)):
        plan = plan_resize(int(width), int(height), config)
        mirrored = plan_resize(int(height), int(width), config)
        assert mirrored.size == plan.size[::-1]
        left, top, right, bottom = plan.box
        assert mirrored.box == (top, left, bottom, right)


def bands_png(width: int, height: int) -> bytes:
    """Left third red, middle green, right third blue."""
    image = Image.new("RGB", (width, height), (0, 255, 0))
    image.paste((255, 0, 0), (0, 0, width // 3, height))
    image.paste((0, 0, 255), (width - width // 3, 0, width, height))
    return oddimages.encode(image, "PNG")


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("shorter", (341, 256)),
        ("longer", (256, 192)),
        ("center-crop", (256, 256)),
        ("none", (400, 300)),
    ],
)
def test_resize_policies_end_to_end(policy, expected):
    result = process_image(bands_png(400, 300), ImageConfig(resize=policy, encode="png"))
    out = decode(result.data)
    assert out.size == (result.width, result.height) == expected
    assert (result.orig_width, result.orig_height) == (400, 300)
    assert_close(out.getpixel((out.width // 2, out.height // 2)), (0, 255, 0), 2)
    if policy == "center-crop":  # the crop keeps 50..350 of 400: a red and a blue edge remain
        assert_close(out.getpixel((2, 128)), (255, 0, 0), 2)
        assert_close(out.getpixel((253, 128)), (0, 0, 255), 2)


def test_center_crop_of_a_drafted_jpeg_exactly_half_size():
    """1024x512 -> 256 square: DCT scaling by 2 leaves exactly the crop, no resize."""
    data = oddimages.encode(decode(bands_png(1024, 512)), "JPEG", quality=95)
    out = decode(process_image(data, ImageConfig(resize="center-crop", encode="png")).data)
    assert out.size == (256, 256)
    # The crop keeps 256..768 of 1024: red to 341, green, blue from 683.
    for x, colour in ((10, (255, 0, 0)), (128, (0, 255, 0)), (245, (0, 0, 255))):
        assert_close(out.getpixel((x, 128)), colour, 8)


@pytest.mark.parametrize("resample", ["bilinear", "bicubic", "lanczos"])
def test_resample_choices_give_the_same_geometry(resample):
    result = process_image(oddimages.photo_jpeg(), ImageConfig(resample=resample))
    assert (result.width, result.height) == (341, 256)


def test_extreme_aspect_is_bounded():
    strip = oddimages.encode(Image.new("RGB", (2000, 20), (9, 9, 9)), "PNG")
    small = process_image(strip, PNG_OUT)  # not upscaled, long side cut to 20 x 20
    assert (small.width, small.height) == (400, 20)
    result = process_image(strip, ImageConfig(image_size=16))
    assert (result.width, result.height) == (320, 16)
    assert (result.orig_width, result.orig_height) == (2000, 20)


def test_too_small_uses_min_side():
    tiny = oddimages.encode(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG")
    assert reason_of(tiny) == "too_small"
    assert (process_image(tiny, ImageConfig(min_side=1)).width) == 1


def test_webp_output_side_limit_is_a_skip():
    wide = oddimages.encode(Image.new("RGB", (17_000, 8)), "PNG")
    assert reason_of(wide, ImageConfig(resize="none", encode="webp")) == "too_many_pixels"


# --- JPEG draft ------------------------------------------------------------------------


def test_draft_request_keeps_enough_pixels_for_a_downscale():
    """Simulate Pillow's choice of DCT scale for many sizes and policies."""
    rng = np.random.default_rng(1)
    for policy in ("shorter", "longer", "center-crop"):
        config = ImageConfig(resize=policy, image_size=int(rng.integers(32, 512)))
        for width, height in rng.integers(64, 8000, (300, 2)):
            width, height = int(width), int(height)
            request = draft_request(width, height, config)
            if request is None:
                continue
            scale = min(width // request[0], height // request[1])
            factor = max(s for s in (1, 2, 4, 8) if s <= scale)
            assert factor >= 2  # a request is only made when it saves decoding
            plan = plan_resize(width, height, config)
            drafted = (-(-width // factor), -(-height // factor))
            box_width = (plan.box[2] - plan.box[0]) * drafted[0] / width
            box_height = (plan.box[3] - plan.box[1]) * drafted[1] / height
            assert box_width >= plan.size[0] and box_height >= plan.size[1]


def test_draft_request_is_none_when_it_cannot_help():
    assert draft_request(500, 375, ImageConfig()) is None
    assert draft_request(300, 200, ImageConfig(resize="center-crop")) is None
    assert draft_request(4000, 3000, ImageConfig(resize="none")) is None


@pytest.mark.parametrize("orientation", [1, 6])
def test_jpeg_draft_decodes_smaller_and_keeps_the_size_right(monkeypatch, big_photo, orientation):
    photo = decode(big_photo)
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = oddimages.encode(photo, "JPEG", quality=95, exif=exif.tobytes())
    drafted = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        result = original(self, mode, size)
        drafted.append(self.size)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    result = process_image(data, ImageConfig(encode="png", backend="pillow"))
    upright = (2400, 1800) if orientation == 1 else (1800, 2400)
    expected = (341, 256) if orientation == 1 else (256, 341)
    assert drafted == [(600, 450)]  # DCT-scaled by 4, still above 341x256
    assert (result.width, result.height) == expected
    assert (result.orig_width, result.orig_height) == upright
    # Same picture as a full decode resized by Pillow.
    reference = ImageOps.exif_transpose(decode(data)).resize(expected, Image.Resampling.BILINEAR)
    difference = np.abs(np.asarray(decode(result.data), float) - np.asarray(reference, float))
    assert difference.mean() < 3


# --- encoding and determinism ----------------------------------------------------------


@pytest.mark.parametrize(
    "encoding, ext, pillow_format",
    [("jpeg", "jpg", "JPEG"), ("webp", "webp", "WEBP"), ("png", "png", "PNG")],
)
def test_encodings(encoding, ext, pillow_format):
    result = process_image(oddimages.photo_jpeg(), ImageConfig(encode=encoding, quality=80))
    assert result.ext == ext
    out = decode(result.data)
    assert out.format == pillow_format and out.mode == "RGB"


@pytest.mark.parametrize("encoding", ["jpeg", "webp", "png"])
def test_output_is_deterministic(odd, encoding):
    for name in ("orientation_6", "mode_rgba", "mode_cmyk_jpeg", "animated_gif"):
        data = odd[name][1]
        first = process_image(data, ImageConfig(encode=encoding))
        again = process_image(bytes(data), ImageConfig(encode=encoding))
        assert first == again, name
    photo = oddimages.photo_jpeg(1200, 900)
    assert process_image(photo, ImageConfig(encode=encoding)) == process_image(
        photo, ImageConfig(encode=encoding)
    )


def test_jpeg_quality_is_applied():
    photo = oddimages.photo_jpeg()
    low = process_image(photo, ImageConfig(quality=30)).data
    high = process_image(photo, ImageConfig(quality=95)).data
    assert len(low) < len(high)


# --- exception classification ----------------------------------------------------------


@pytest.mark.parametrize(
    "error", [SyntaxError, ValueError, OverflowError, NotImplementedError, MemoryError]
)
def test_decoder_exceptions_are_decode_errors_naming_the_class(monkeypatch, error):
    def failing_load(self):
        raise error("boom")

    monkeypatch.setattr(ImageFile.ImageFile, "load", failing_load)
    with pytest.raises(SampleError) as caught:
        process_image(oddimages.photo_jpeg(), PNG_OUT)
    assert caught.value.reason == "decode_error"
    assert error.__name__ in caught.value.detail
    assert isinstance(caught.value.__cause__, error)


@pytest.mark.parametrize("error", [TypeError("bug"), KeyboardInterrupt()])
def test_code_errors_propagate(monkeypatch, error):
    def failing_load(self):
        raise error

    monkeypatch.setattr(ImageFile.ImageFile, "load", failing_load)
    with pytest.raises(type(error)):
        process_image(oddimages.photo_jpeg(), PNG_OUT)


def test_errors_after_decoding_are_not_data_errors(monkeypatch):
    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(OSError) as caught:
        process_image(oddimages.photo_jpeg(), PNG_OUT)
    assert not isinstance(caught.value, SampleError)


# --- configuration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"resize": "fit"},
        {"encode": "gif"},
        {"resample": "nearest"},
        {"quality": 0},
        {"quality": 101},
        {"image_size": 0},
        {"max_pixels": Image.MAX_IMAGE_PIXELS + 1},
        {"max_pixels": 0},
        {"max_aspect": 0.5},
        {"background": (255, 255)},
        {"background": (0, 0, 256)},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        ImageConfig(**kwargs)


def test_default_config_respects_pillows_bomb_limit():
    assert ImageConfig().max_pixels <= Image.MAX_IMAGE_PIXELS


# --- read_source -----------------------------------------------------------------------


def test_read_source_reads_paths_and_urls(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"abc")
    assert read_source(str(path), 10) == b"abc"
    assert read_source(path.as_uri(), 10) == b"abc"


def test_read_source_reads_fsspec_urls():
    fsspec = pytest.importorskip("fsspec")
    with fsspec.open("memory://images/test_read_source.jpg", "wb") as file:
        file.write(b"xyz")
    assert read_source("memory://images/test_read_source.jpg", 10) == b"xyz"
    with pytest.raises(SampleError) as caught:
        read_source("memory://images/absent.jpg", 10)
    assert caught.value.reason == "missing"


def test_read_source_data_errors(tmp_path):
    big = tmp_path / "big.jpg"
    big.write_bytes(b"x" * 11)
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    cases = {
        str(tmp_path / "absent.jpg"): "missing",
        str(big / "below-a-file.jpg"): "missing",
        str(tmp_path): "missing",  # a directory is not an input
        str(big): "too_large_file",
        str(empty): "empty",
    }
    for path, reason in cases.items():
        with pytest.raises(SampleError) as caught:
            read_source(path, 10)
        assert caught.value.reason == reason, path


def test_read_source_environment_errors_propagate(tmp_path, monkeypatch):
    path = tmp_path / "a.jpg"
    path.write_bytes(b"abc")

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(images, "open", denied, raising=False)
    with pytest.raises(PermissionError):
        read_source(str(path), 10)


def test_process_image_refuses_oversized_and_empty_bytes():
    assert reason_of(b"") == "empty"
    assert reason_of(oddimages.photo_jpeg(), ImageConfig(max_file_bytes=100)) == "too_large_file"


def test_auto_backend_says_when_missing_packages_make_it_pillow(monkeypatch, caplog):
    # build-shards' `auto` is the loader's rule (`shards.image.policy.resolve_backend`): without
    # simplejpeg and OpenCV it builds with Pillow and says so; it used to say nothing.
    monkeypatch.setattr(image_policy, "fast_backend_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert ImageConfig().backend == "pillow"
        assert "decoding with Pillow, about half as fast" in caplog.text
        caplog.clear()
        assert ImageConfig(resample="lanczos").backend == "pillow"  # chosen: nothing to say
        assert not caplog.records
