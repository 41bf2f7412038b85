"""`shards.jpegband`: the MCU rows a crop needs, cut from a JPEG with a marker per row.

The oracle is the whole decode: every row a band is asked for must decode bit-identically,
and any file whose structure is not exactly as expected must give None (decoded whole).
"""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import simplejpeg
from PIL import Image

from shards.imagedata import decode_jpeg_scaled
from shards.jpegband import ROW_GUARD, crop_rows
from tests.oddimages import photo_jpeg

# Pillow's subsampling codes: 0 = 4:4:4, 1 = 4:2:2, 2 = 4:2:0.
LAYOUTS = [
    (341, 256, 2),
    (256, 341, 2),
    (500, 375, 2),
    (333, 257, 1),
    (300, 203, 0),
    (64, 48, 2),
]


def marked(width: int, height: int, subsampling: int = 2, seed: int = 0) -> bytes:
    """A photo-like JPEG with a restart marker at every MCU row, as build-shards writes."""
    return photo_jpeg(width, height, seed, subsampling=subsampling, restart_marker_rows=1)


def grey_marked(width: int, height: int) -> bytes:
    image = Image.open(io.BytesIO(photo_jpeg(width, height))).convert("L")
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90, restart_marker_rows=1)
    return buffer.getvalue()


def whole(data: bytes, scale: int = 1) -> np.ndarray:
    height, width = simplejpeg.decode_jpeg_header(data)[:2]
    return decode_jpeg_scaled(data, width, height, scale)


def band_rows(data: bytes, top: int, bottom: int, scale: int = 1) -> np.ndarray:
    """Rows [top, bottom) (original pixels, multiples of `scale`) decoded from the band."""
    band = crop_rows(data, top, bottom, scale)
    assert band is not None
    width = simplejpeg.decode_jpeg_header(data)[1]
    pixels = decode_jpeg_scaled(band.data, width, band.height, scale)
    assert pixels is not None, "the band must decode strictly"
    return pixels[(top - band.top) // scale : (bottom - band.top) // scale]


@pytest.mark.parametrize("width,height,subsampling", LAYOUTS)
def test_every_asked_row_is_bit_identical_to_the_whole_decode(width, height, subsampling):
    data = marked(width, height, subsampling)
    full = whole(data)
    rng = random.Random(width * height)
    cut = 0
    for _ in range(60):
        top = rng.randrange(0, height - 1)
        bottom = rng.randrange(top + 1, height + 1)
        band = crop_rows(data, top, bottom)
        if band is None:  # the band would be the whole image
            continue
        cut += 1
        assert band.top <= top - ROW_GUARD or band.top == 0
        assert len(band.data) < len(data)
        np.testing.assert_array_equal(band_rows(data, top, bottom), full[top:bottom])
    assert cut >= 20


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_bands_decoded_at_a_dct_scale_match_the_scaled_whole_decode(scale):
    data = marked(1024, 768, 2, seed=3)
    full = whole(data, scale)
    rng = random.Random(scale)
    for _ in range(30):
        top = rng.randrange(0, 700) // scale * scale
        bottom = min(768, top + rng.randrange(1, 500) // scale * scale + scale)
        rows = band_rows(data, top, bottom, scale) if crop_rows(data, top, bottom, scale) else None
        if rows is not None:
            np.testing.assert_array_equal(rows, full[top // scale : bottom // scale])


def test_grey_jpegs_have_8_row_bands():
    data = grey_marked(300, 200)
    band = crop_rows(data, 100, 120)
    assert band is not None and band.top % 8 == 0 and band.top > 0 and band.height < 60
    height, width = 200, 300
    full = simplejpeg.decode_jpeg(data, "GRAY")
    part = simplejpeg.decode_jpeg(band.data, "GRAY", strict=True)
    assert part.shape[1] == width and band.top + band.height <= height
    np.testing.assert_array_equal(part[100 - band.top : 120 - band.top], full[100:120])


def test_a_band_is_only_the_rows_it_needs():
    data = marked(500, 375)
    band = crop_rows(data, 160, 200)
    assert band is not None
    # 16-row MCUs: rows 160-199 lie in MCU rows 10-12, plus the guard rows' MCU row 9.
    assert band.top == 144 and band.height == 64
    assert len(band.data) < len(data) / 3


# --- anything unexpected is decoded whole -----------------------------------------------


def test_files_without_row_markers_are_not_cut():
    assert crop_rows(photo_jpeg(500, 375), 100, 150) is None  # no DRI at all
    every_two_rows = photo_jpeg(500, 375, restart_marker_blocks=64)  # 32 MCUs a row: no
    assert crop_rows(every_two_rows, 100, 150) is None


def test_progressive_jpegs_are_not_cut():
    data = photo_jpeg(500, 375, progressive=True, restart_marker_rows=1)
    assert crop_rows(data, 100, 150) is None


def test_the_whole_image_is_not_cut():
    assert crop_rows(marked(341, 256), 0, 256) is None
    assert crop_rows(marked(341, 256), 1, 255) is None  # the guards reach both edges


def test_a_truncated_file_is_not_cut_even_above_the_cut():
    data = marked(500, 375)
    for fraction in (0.3, 0.6, 0.95):
        cut = data[: int(len(data) * fraction)]
        assert crop_rows(cut, 16, 40) is None
        assert crop_rows(cut, 300, 340) is None
    assert crop_rows(data[:-2], 16, 40) is None  # only the end marker missing


def test_a_missing_or_misnumbered_marker_is_never_spliced_silently():
    data = marked(500, 375)
    fifth = data.index(b"\xff\xd4")  # the marker before MCU row 5
    removed = data[:fifth] + data[fifth + 2 :]
    band = crop_rows(removed, 60, 120)  # walking the markers in order finds RST4 no more
    assert band is None or whole_or_none(band) is None
    renumbered = data[:fifth] + b"\xff\xd5" + data[fifth + 2 :]
    band = crop_rows(renumbered, 60, 120)
    assert band is None or whole_or_none(band) is None


def whole_or_none(band) -> np.ndarray | None:
    """The band decoded strictly, or None where libjpeg-turbo refuses it."""
    try:
        return simplejpeg.decode_jpeg(band.data, "RGB", strict=True)
    except ValueError:
        return None


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d[:2] + b"\x00" + d[3:],  # not a marker after SOI
        lambda d: d.replace(b"\xff\xdd\x00\x04", b"\xff\xdd\x00\x05", 1),  # DRI length
        lambda d: d.replace(b"\xff\xdd\x00\x04", b"\xff\xdd\x00\x04\x00\x00", 1)[:-4],
        lambda d: b"\xff\xd8\xff\xe0\xff\xff" + d[6:],  # segment longer than the file
        lambda d: b"",
        lambda d: b"\xff\xd8\xff",
    ],
)
def test_broken_headers_are_not_cut(damage):
    assert crop_rows(damage(marked(500, 375)), 100, 150) is None


def test_random_bytes_and_cut_headers_never_raise():
    data = marked(341, 256)
    header_end = data.index(b"\xff\xda")
    rng = random.Random(0)
    for _ in range(400):
        mutated = bytearray(data[: header_end + 40])
        for _ in range(rng.randrange(1, 6)):
            mutated[rng.randrange(2, len(mutated))] = rng.randrange(256)
        crop_rows(bytes(mutated) + data[header_end + 40 :], 50, 120)
        crop_rows(bytes(mutated[: rng.randrange(len(mutated))]), 50, 120)
