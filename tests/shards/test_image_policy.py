"""Tests of the one image-decode policy (`shards.image.policy`) that build and loader share."""

from __future__ import annotations

import logging
import multiprocessing
import random
import struct
import subprocess
import sys
from io import BytesIO

import numpy as np
import pytest
from PIL import Image

from pipeline.transforms import RandomResizedCrop
from preprocess.images import ImageConfig, process_image
from shards.image import policy
from shards.image.policy import (
    ALLOWED_FORMATS,
    INPUT_FORMATS,
    check_icon_frames,
    check_image,
    check_max_pixels,
    check_pixels,
    classify_decoder_error,
    open_image,
    sniff_format,
    to_rgb,
)
from shards.sample import SampleError
from tests import oddimages
from tests.oddimages import BAND_SIZE, BAND_X

WHITE = (255, 255, 255)


def reason(call, *args) -> str:
    with pytest.raises(SampleError) as caught:
        call(*args)
    return caught.value.reason


# --- one alpha rule, the same at build and at load -------------------------------------


@pytest.mark.parametrize("name", ["mode_rgba", "mode_la", "mode_p_trns", "mode_rgb_trns"])
def test_loader_and_build_composite_transparency_alike(name):
    """The loader's crop of a transparent PNG shows the colours the build writes for it."""
    data = oddimages.odd_image_bytes()[name][1]
    built = Image.open(BytesIO(process_image(data, ImageConfig(encode="png")).data))
    whole = RandomResizedCrop(size=BAND_SIZE[0], scale=(1, 1), ratio=(2, 2), hflip=0.0)
    loaded = whole(data, random.Random(0))  # the whole 64x32 image, stretched to 64x64
    for x in BAND_X:
        assert np.abs(loaded[32, x].astype(int) - built.getpixel((x, 16))).max() <= 1, (name, x)


def test_rgb_with_a_transparent_colour_is_composited():
    """The rule the loader used to skip: an RGB PNG's tRNS colour becomes the background."""
    image = Image.new("RGB", (2, 1), (0, 255, 0))
    image.putpixel((0, 0), (9, 9, 9))
    image.info["transparency"] = (0, 255, 0)
    out = to_rgb(image)
    assert out.getpixel((0, 0)) == (9, 9, 9) and out.getpixel((1, 0)) == WHITE
    assert to_rgb(image, (0, 0, 0)).getpixel((1, 0)) == (0, 0, 0)


def test_premultiplied_modes_are_composited():
    la = Image.new("LA", (1, 1), (100, 128)).convert("La")
    assert np.abs(np.subtract(to_rgb(la).getpixel((0, 0)), (177,) * 3)).max() <= 2
    rgba = Image.new("RGBa", (1, 1), (128, 0, 0, 128))
    assert np.abs(np.subtract(to_rgb(rgba).getpixel((0, 0)), (255, 127, 127))).max() <= 2


def test_opaque_rgb_is_returned_itself():
    image = Image.new("RGB", (4, 4))
    assert to_rgb(image) is image


# --- truncation, one rule ----------------------------------------------------------------


@pytest.mark.parametrize(
    "error, data, expected",
    [
        (OSError("Truncated File Read"), b"", "truncated"),  # libjpeg, any case
        (OSError("image file is truncated (3 bytes not processed)"), b"", "truncated"),
        (EOFError(), b"", "truncated"),
        (OSError("could not create decoder object"), b"RIFF\xff\x00\x00\x00WEBPVP8 ", "truncated"),
        (OSError("could not create decoder object"), b"RIFF\x04\x00\x00\x00WEBP", "decode_error"),
        (SyntaxError("broken PNG file"), b"", "decode_error"),
    ],
)
def test_classify_decoder_error(error, data, expected):
    classified = classify_decoder_error(error, data)
    assert classified.reason == expected
    assert type(error).__name__ in classified.detail


@pytest.mark.parametrize("fmt", ALLOWED_FORMATS)
def test_a_cut_image_is_truncated_at_build_and_at_load(fmt):
    data = oddimages.truncated(oddimages.encode(oddimages.noise_image(96, 64), fmt), 0.5)
    assert reason(check_image, data) == "truncated"
    assert reason(process_image, data, ImageConfig()) == "truncated"


# --- formats and the pixel cap -----------------------------------------------------------


@pytest.mark.parametrize("fmt", INPUT_FORMATS)
def test_shards_refuse_every_input_format_but_their_own(fmt):
    data = oddimages.encode(Image.new("RGB", (16, 16), (1, 2, 3)), fmt)
    if fmt in ALLOWED_FORMATS:
        assert check_image(data) == (16, 16)
    else:  # verify and the loader judge shards alike: a foreign format is unidentified
        with pytest.raises(SampleError) as caught:
            check_image(data)
        assert caught.value.reason == "unidentified" and fmt in caught.value.detail


def test_sniff_format_runs_no_parser(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a parser ran")

    monkeypatch.setattr(Image, "open", forbidden)
    monkeypatch.setattr(subprocess, "Popen", forbidden)
    assert sniff_format(oddimages.eps_bytes()) == "EPS/PostScript"
    assert sniff_format(oddimages.pdf_bytes()) == "PDF"
    assert sniff_format(b"P5\n4 4\n255\n" + bytes(16)) == "PPM"
    assert sniff_format(b"P7\nWIDTH 4\n") is None  # PAM: Pillow has no reader
    assert sniff_format(b"just text") is None


def test_pixel_cap_and_its_configuration():
    check_pixels(100, 100, 10_000)
    with pytest.raises(SampleError, match="101x100 = 10100 pixels > 10000"):
        check_pixels(101, 100, 10_000)
    check_max_pixels(Image.MAX_IMAGE_PIXELS)
    for bad in (0, Image.MAX_IMAGE_PIXELS + 1):
        with pytest.raises(ValueError, match="MAX_IMAGE_PIXELS"):
            check_max_pixels(bad)


def test_icon_frames_are_capped_from_their_own_headers():
    check_icon_frames(oddimages.icon_bytes(), 48 * 48)
    with pytest.raises(SampleError, match="9000x9000"):
        check_icon_frames(oddimages.icon_with_bomb_frame(), policy.MAX_PIXELS)
    # A BMP (DIB) frame: BITMAPINFOHEADER with 20000 x (2 x 20000) for image and mask.
    dib = struct.pack("<IiiHH", 40, 20_000, 40_000, 1, 32) + bytes(24)
    icon = struct.pack("<HHH", 0, 1, 1) + struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, 64, 22)
    with pytest.raises(SampleError, match="20000x20000"):
        check_icon_frames(icon + dib, policy.MAX_PIXELS)
    assert reason(open_image, icon + dib, policy.MAX_PIXELS, INPUT_FORMATS) == ("too_many_pixels")


# --- the fast backends: decided and imported in one place -------------------------------


def test_importing_the_policy_imports_no_backend():
    code = (
        "import sys, shards.image.policy, pipeline.decode, preprocess.images; "
        "bad = [m for m in ('cv2', 'simplejpeg', 'torch') if m in sys.modules]; "
        "print(bad); sys.exit(bool(bad))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_missing_fast_backend_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "simplejpeg", None)
    monkeypatch.setattr(policy._FastModules, "cv2", None)  # as in a fresh process
    with pytest.raises(ImportError, match=r"pip install simplejpeg opencv-python-headless"):
        policy.load_fast_backends()


def test_fast_backends_load_once_per_process():
    pytest.importorskip("simplejpeg")
    cv2 = pytest.importorskip("cv2")
    assert policy.fast_backend_available()
    first = policy.load_fast_backends()
    assert policy.load_fast_backends() == first  # the same modules, imported once
    assert first[1] is cv2 and cv2.getNumThreads() == 1


def _threads_in_a_forked_child(queue) -> None:
    forgotten = policy._FastModules.cv2 is None
    queue.put((forgotten, policy.load_fast_backends()[1].getNumThreads()))


def test_a_forked_child_sets_opencvs_threads_again():
    """A fork forgets the loaded modules, so the child sets one thread itself, whatever
    its parent's pool (a pool inherited through fork is not safe to use)."""
    cv2 = pytest.importorskip("cv2")
    pytest.importorskip("simplejpeg")
    policy.load_fast_backends()
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    cv2.setNumThreads(2)  # as a parent that had its own pool
    try:
        child = context.Process(target=_threads_in_a_forked_child, args=(queue,))
        child.start()
        forgotten, threads = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        cv2.setNumThreads(1)
    assert forgotten and threads == 1
    assert policy._FastModules.cv2 is cv2  # the parent keeps its own


def test_auto_backend_is_one_rule_for_build_and_loader(monkeypatch, caplog):
    # `auto` is fast where the packages import and the caller's fast path can do the job;
    # missing packages are said (Pillow is about half as fast), a filter choice is not.
    assert policy.resolve_backend("pillow") == "pillow"
    assert policy.resolve_backend("auto", fast_can_run=False) == "pillow"
    monkeypatch.setattr(policy, "fast_backend_available", lambda: True)
    assert policy.resolve_backend("auto") == "fast" == policy.resolve_backend("fast")
    monkeypatch.setattr(policy, "fast_backend_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="shards"):
        assert policy.resolve_backend("auto") == "pillow"
        assert "about half as fast" in caplog.text and "pip install simplejpeg" in caplog.text
        caplog.clear()
        assert policy.resolve_backend("auto", fast_can_run=False) == "pillow"
        assert not caplog.records
    with pytest.raises(ImportError, match=r"backend='fast'.*or use backend='pillow'"):
        policy.resolve_backend("fast")
