"""Makers of odd and hostile image files, made on purpose for tests of the image path.

`make_odd_images(directory)` writes the whole set and says what `process_image` should do
with each; the single makers return bytes. Everything is small and made in milliseconds.
"""

from __future__ import annotations

import struct
import zlib
from io import BytesIO
from pathlib import Path

import numpy as np
from PIL import Image, features

# Upright test card for EXIF orientation: four solid quadrants, each 32x16, aligned to JPEG's
# 16 px blocks in both orientations so colours survive compression.
CARD_SIZE = (64, 32)
QUADRANTS = {  # (x, y) at the centre of each upright quadrant -> colour
    (16, 8): (255, 0, 0),
    (48, 8): (0, 255, 0),
    (16, 24): (0, 0, 255),
    (48, 24): (255, 255, 255),
}
# Mode images are 64x32 with four vertical bands of 16 px; sample at (BAND_X[i], 16).
BAND_SIZE = (64, 32)
BAND_X = (8, 24, 40, 56)
BANDS = {
    "L": (0, 77, 200, 255),
    "LA": ((50, 255), (50, 0), (50, 128), (200, 255)),
    "RGBA": ((255, 0, 0, 255), (255, 0, 0, 0), (255, 0, 0, 128), (0, 0, 255, 255)),
    "P": ((255, 0, 0), (0, 255, 0), (0, 0, 255), (0, 0, 0)),  # palette entries 0-3
    "P_ALPHA": (255, 0, 128, 255),  # tRNS alpha of those entries
    "RGB_TRNS": ((255, 0, 0), (0, 255, 0), (0, 0, 255), (0, 0, 0)),  # (0,255,0) transparent
    "CMYK": ((0, 255, 255, 0), (255, 0, 255, 0), (0, 0, 0, 0), (0, 0, 0, 255)),
    "I;16": (0, 256, 32768, 65535),
    "RGB48": ((0x0000, 0x80FF, 0xFFFF), (0x0100, 0x0100, 0x0100), (0xFFFF, 0, 0), (0, 0, 0x4000)),
    "1": (0, 1, 0, 1),
    "F": (0.0, 0.25, 0.5, 1.0),
    "F_WIDE": (-1.0, 0.0, 1.0, 3.0),
    "I": (0, 1000, 70000, 140000),
}
ANIMATED_FIRST_COLOUR = (255, 0, 0)

# Inverse of the EXIF transposition: storing `inverse(upright)` with orientation n makes a
# correct reader show `upright`. 2, 3, 4, 5 and 7 are their own inverses.
_STORE_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_90,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_270,
}
_ORIENTATION_TAG = 0x0112


def encode(image: Image.Image, fmt: str, **params) -> bytes:
    """Encode `image` with Pillow and return the bytes."""
    buffer = BytesIO()
    image.save(buffer, fmt, **params)
    return buffer.getvalue()


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """RGB noise: incompressible, so most of a file made from it is pixel data."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def photo_jpeg(
    width: int = 500, height: int = 375, seed: int = 0, quality: int = 90, **params
) -> bytes:
    """A photo-like JPEG: gradients, stripes and mild noise (`params`: more Pillow options)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width * 255, yy / height * 255, (xx + yy) / (width + height) * 255], -1)
    base += 30 * np.sin(xx[..., None] / rng.uniform(5, 40)) + rng.normal(0, 8, base.shape)
    image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    return encode(image, "JPEG", quality=quality, **params)


def truncated(data: bytes, fraction: float) -> bytes:
    """The first `fraction` of `data`."""
    return data[: int(len(data) * fraction)]


def png_bytes(width: int, height: int, bit_depth: int, colour_type: int, raw: bytes) -> bytes:
    """A PNG from already-filtered scanlines `raw` (each row starts with its filter byte)."""
    header = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    return _png_file(header, zlib.compress(raw, 6))


def png_bomb(width: int = 40_000, height: int = 40_000) -> bytes:
    """A valid 1-bit black PNG of `width` x `height`, built without inflating it in memory.

    Deflate output for one zero block repeats exactly after a full flush, so the stream is
    the first block, copies of the second, and a tail whose Adler-32 we compute directly:
    for n zero bytes it is (n mod 65521) << 16 | 1. 40000x40000 is ~200 MB raw, ~200 KB here.
    """
    row = 1 + (width + 7) // 8  # filter byte + packed bits
    total = row * height
    block = 1 << 20
    full, rest = divmod(total, block)
    compressor = zlib.compressobj(9)
    zero = bytes(block)
    first = compressor.compress(zero) + compressor.flush(zlib.Z_FULL_FLUSH)
    repeat = compressor.compress(zero) + compressor.flush(zlib.Z_FULL_FLUSH)
    tail = compressor.compress(bytes(rest)) + compressor.flush(zlib.Z_FINISH)
    adler = ((total % 65521) << 16) | 1
    stream = first + repeat * (full - 1) + tail[:-4] + struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return _png_file(header, stream)


def _png_file(ihdr: bytes, idat: bytes, extra: tuple[tuple[bytes, bytes], ...] = ()) -> bytes:
    chunks = [(b"IHDR", ihdr), *extra, (b"IDAT", idat), (b"IEND", b"")]
    out = [b"\x89PNG\r\n\x1a\n"]
    for kind, body in chunks:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        out.append(struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc))
    return b"".join(out)


def eps_bytes() -> bytes:
    """A minimal EPS that Pillow identifies (and would hand to Ghostscript on load)."""
    return (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 64 32\n%%EndComments\n"
        b"newpath 0 0 moveto 64 32 lineto stroke\nshowpage\n%%EOF\n"
    )


def pdf_bytes() -> bytes:
    """A minimal one-page PDF."""
    return (
        b"%PDF-1.4\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
        b"2 0 obj<</Type/Pages/Kids[3 0 R]/Count 1>>endobj\n"
        b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 64 32]>>endobj\ntrailer<</Root 1 0 R>>\n%%EOF\n"
    )


def psd_bytes(width: int = 16, height: int = 16) -> bytes:
    """A minimal uncompressed 8-bit RGB Photoshop file that Pillow identifies."""
    header = b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, height, width, 8, 3)
    sections = struct.pack(">III", 0, 0, 0)  # colour mode data, resources, layers: empty
    return header + sections + struct.pack(">H", 0) + bytes(3 * width * height)


def fits_bytes(width: int = 16, height: int = 16) -> bytes:
    """A minimal 8-bit FITS image that Pillow identifies."""
    cards = [
        "SIMPLE  =                    T",
        "BITPIX  =                    8",
        "NAXIS   =                    2",
        f"NAXIS1  = {width:20d}",
        f"NAXIS2  = {height:20d}",
        "END",
    ]
    header = "".join(card.ljust(80) for card in cards).ljust(2880).encode("ascii")
    data = bytes(width * height)
    return header + data + bytes(-len(data) % 2880)


def orientation_card() -> Image.Image:
    """The upright test card: red, green / blue, white quadrants."""
    card = Image.new("RGB", CARD_SIZE)
    for (x, y), colour in QUADRANTS.items():
        card.paste(colour, (x - 16, y - 8, x + 16, y + 8))
    return card


def oriented_jpeg(orientation: int) -> bytes:
    """The test card stored so that EXIF `orientation` (1-8) turns it upright."""
    card = orientation_card()
    stored = card.transpose(_STORE_TRANSPOSE[orientation]) if orientation > 1 else card
    exif = Image.Exif()
    exif[_ORIENTATION_TAG] = orientation
    return encode(stored, "JPEG", quality=95, exif=exif.tobytes())


def jpeg_with_exif(exif: Image.Exif | bytes) -> bytes:
    """The upright test card, carrying arbitrary (possibly malformed) EXIF."""
    raw = exif.tobytes() if isinstance(exif, Image.Exif) else exif
    return encode(orientation_card(), "JPEG", quality=95, exif=raw)


def bad_orientation_jpeg(value: int = 99) -> bytes:
    """Orientation tag with an out-of-range value."""
    exif = Image.Exif()
    exif[_ORIENTATION_TAG] = value
    return jpeg_with_exif(exif)


def text_orientation_jpeg() -> bytes:
    """Orientation tag typed ASCII ("6") instead of SHORT, written by hand."""
    entry = struct.pack("<HHI4s", _ORIENTATION_TAG, 2, 2, b"6\x00\x00\x00")
    ifd = struct.pack("<H", 1) + entry + struct.pack("<I", 0)
    return jpeg_with_exif(b"Exif\x00\x00II*\x00" + struct.pack("<I", 8) + ifd)


def broken_ifd_jpeg() -> bytes:
    """EXIF whose first IFD offset points far past the end of the block."""
    return jpeg_with_exif(b"Exif\x00\x00II*\x00" + struct.pack("<I", 0x7FFF_FFF0))


def banded(mode: str, values: tuple) -> Image.Image:
    """A `BAND_SIZE` image of `mode` with four vertical bands of the given pixel values."""
    image = Image.new(mode, BAND_SIZE)
    for index, value in enumerate(values):
        image.paste(value, (16 * index, 0, 16 * index + 16, BAND_SIZE[1]))
    return image


def palette_trns_png() -> bytes:
    """P image with a tRNS chunk: entry 0 opaque red, 1 transparent green, 2 half blue."""
    image = banded("L", (0, 1, 2, 3)).convert("P")
    palette = [channel for colour in BANDS["P"] for channel in colour]
    image.putpalette(palette + [0] * (768 - len(palette)))
    return encode(image, "PNG", transparency=bytes(BANDS["P_ALPHA"]))


def rgb_trns_png() -> bytes:
    """RGB PNG whose tRNS chunk makes pure green transparent."""
    return encode(banded("RGB", BANDS["RGB_TRNS"]), "PNG", transparency=(0, 255, 0))


def i16_png() -> bytes:
    """16-bit grey PNG (mode I;16): 0, 0x0100, 0x8000, 0xFFFF."""
    row = np.repeat(np.array(BANDS["I;16"], dtype=np.uint16), 16)
    return encode(Image.fromarray(np.tile(row, (BAND_SIZE[1], 1))), "PNG")


def i16b_tiff() -> bytes:
    """Big-endian 16-bit grey TIFF (mode I;16B), same values as `i16_png`."""
    row = np.repeat(np.array(BANDS["I;16"], dtype=">u2"), 16)
    pixels = np.tile(row, (BAND_SIZE[1], 1))
    return encode(Image.frombytes("I;16B", BAND_SIZE, pixels.tobytes()), "TIFF")


def rgb48_png() -> bytes:
    """16-bit-per-channel RGB PNG, written by hand (Pillow cannot save it)."""
    bands = np.array(BANDS["RGB48"], dtype=">u2")  # 4 x 3
    row = np.repeat(bands, 16, axis=0).reshape(-1).tobytes()
    raw = b"".join(b"\x00" + row for _ in range(BAND_SIZE[1]))
    return png_bytes(*BAND_SIZE, 16, 2, raw)


def array_tiff(values: tuple, dtype: str) -> bytes:
    """A single-channel TIFF (mode I or F) with four bands of `values`."""
    row = np.repeat(np.array(values, dtype=dtype), 16)
    return encode(Image.fromarray(np.tile(row, (BAND_SIZE[1], 1))), "TIFF")


def animated_gif(frames: int = 1000) -> bytes:
    """A 16x16 GIF of `frames` frames; only the first is red."""
    colours = [(0, 0, 255), (0, 255, 0)]
    first = Image.new("RGB", (16, 16), ANIMATED_FIRST_COLOUR)
    rest = [Image.new("RGB", (16, 16), colours[i % 2]) for i in range(frames - 1)]
    return encode(first, "GIF", save_all=True, append_images=rest, duration=10, loop=0)


def gif_with_broken_tail() -> bytes:
    """A 3-frame GIF cut in the middle of its last frame: fine if only frame 0 is read."""
    data = animated_gif(3)
    return data[: len(data) - 20]


def multipage_tiff() -> bytes:
    """Two-page TIFF: a red page, then a blue one."""
    pages = [Image.new("RGB", (16, 16), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    return encode(pages[0], "TIFF", save_all=True, append_images=pages[1:])


def pgm16_bytes() -> bytes:
    """16-bit binary PGM (P5, maxval 65535), written by hand: the `I;16` band values."""
    row = np.repeat(np.array(BANDS["I;16"], dtype=">u2"), 16)
    pixels = np.tile(row, (BAND_SIZE[1], 1)).tobytes()
    return f"P5\n{BAND_SIZE[0]} {BAND_SIZE[1]}\n65535\n".encode() + pixels


def mpo_bytes() -> bytes:
    """A two-picture MPO (a stereo camera's JPEG): a red picture, then a blue one."""
    pictures = [Image.new("RGB", BAND_SIZE, colour) for colour in ((255, 0, 0), (0, 0, 255))]
    return encode(pictures[0], "MPO", save_all=True, append_images=pictures[1:])


def icon_bytes() -> bytes:
    """An ICO of 16, 32 and 48 px frames of a red-left, blue-right RGBA square."""
    image = Image.new("RGBA", (48, 48), (0, 0, 255, 255))
    image.paste((255, 0, 0, 255), (0, 0, 24, 48))
    return encode(image, "ICO", sizes=[(16, 16), (32, 32), (48, 48)])


def icon_with_bomb_frame(width: int = 9_000, height: int = 9_000) -> bytes:
    """An ICO whose directory says 16x16 but whose PNG frame's own header says `width` x `height`."""
    frame = png_bomb(width, height)
    directory = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", 16, 16, 0, 0, 1, 32, len(frame), 6 + 16)
    return directory + entry + frame


def avif_bytes() -> bytes:
    """An AVIF of the `RGBA` bands' colours made opaque (where this Pillow can write AVIF)."""
    return encode(banded("RGB", ((255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255))), "AVIF")


AVIF_SUPPORTED = features.check("avif")


def foreign_format_bytes() -> dict[str, tuple[str, bytes, str | None]]:
    """Widely used image types beyond JPEG/PNG/WEBP: name -> (file name, bytes, reason).

    PBM/PGM/PPM, MPO and ICO are read (reason None); AVIF where this Pillow has libavif,
    else `format_not_allowed`; an icon whose frame hides a huge header is `too_many_pixels`.
    """
    items = {
        "pbm": ("mode_1.pbm", encode(banded("1", BANDS["1"]), "PPM"), None),
        "pgm": ("mode_l.pgm", encode(banded("L", BANDS["L"]), "PPM"), None),
        "pgm16": ("mode_i16.pgm", pgm16_bytes(), None),
        "ppm": ("mode_p.ppm", encode(banded("RGB", BANDS["P"]), "PPM"), None),
        "mpo": ("camera.mpo", mpo_bytes(), None),
        "ico": ("icon.ico", icon_bytes(), None),
        "ico_bomb_frame": ("icon_bomb_frame.ico", icon_with_bomb_frame(), "too_many_pixels"),
    }
    if AVIF_SUPPORTED:
        items["avif"] = ("photo.avif", avif_bytes(), None)
    else:  # a real AVIF cannot be made here; its signature alone is refused unparsed
        brand = b"\x00\x00\x00\x1cftypavif" + bytes(20)
        items["avif"] = ("photo.avif", brand, "format_not_allowed")
    return items


def _solid_png(width: int, height: int) -> bytes:
    return encode(Image.new("RGB", (width, height), (10, 200, 30)), "PNG")


def odd_image_bytes() -> dict[str, tuple[str, bytes, str | None]]:
    """Every odd image: name -> (file name, bytes, reason expected from `process_image`).

    The reason is None when the image must be processed. File names use image suffixes even
    for non-images, as misnamed uploads do, so input listers keep them.
    """
    jpeg = encode(noise_image(128, 96), "JPEG", quality=90)
    png = encode(noise_image(128, 96), "PNG")
    webp = encode(noise_image(128, 96), "WEBP", quality=90)
    items: dict[str, tuple[str, bytes, str | None]] = {
        "zero_byte": ("zero_byte.jpg", b"", "empty"),
        "text": ("text.jpg", b"just some text, not a picture\n" * 4, "unidentified"),
        "html": ("html.jpg", b"<!DOCTYPE html><html><body>404</body></html>\n", "unidentified"),
        "random": ("random.jpg", np.random.default_rng(1).bytes(4096), "unidentified"),
        "png_bomb": ("png_bomb.png", png_bomb(), "too_many_pixels"),
        "eps": ("eps.jpg", eps_bytes(), "format_not_allowed"),
        "pdf": ("pdf.jpg", pdf_bytes(), "format_not_allowed"),
        "psd": ("psd.png", psd_bytes(), "format_not_allowed"),
        "fits": ("fits.jpg", fits_bytes(), "format_not_allowed"),
        "webp_truncated_50": ("webp_truncated_50.webp", truncated(webp, 0.5), "truncated"),
        "exif_orientation_99": ("exif_orientation_99.jpg", bad_orientation_jpeg(99), None),
        "exif_orientation_text": ("exif_orientation_text.jpg", text_orientation_jpeg(), None),
        "exif_broken_ifd": ("exif_broken_ifd.jpg", broken_ifd_jpeg(), None),
        "mode_cmyk_jpeg": ("mode_cmyk.jpg", encode(banded("CMYK", BANDS["CMYK"]), "JPEG"), None),
        "mode_cmyk_tiff": ("mode_cmyk.tif", encode(banded("CMYK", BANDS["CMYK"]), "TIFF"), None),
        "mode_p_trns": ("mode_p_trns.png", palette_trns_png(), None),
        "mode_rgb_trns": ("mode_rgb_trns.png", rgb_trns_png(), None),
        "mode_la": ("mode_la.png", encode(banded("LA", BANDS["LA"]), "PNG"), None),
        "mode_rgba": ("mode_rgba.png", encode(banded("RGBA", BANDS["RGBA"]), "PNG"), None),
        "mode_i16": ("mode_i16.png", i16_png(), None),
        "mode_i16b": ("mode_i16b.tif", i16b_tiff(), None),
        "mode_rgb48": ("mode_rgb48.png", rgb48_png(), None),
        "mode_1": ("mode_1.png", encode(banded("1", BANDS["1"]), "PNG"), None),
        "mode_f": ("mode_f.tif", array_tiff(BANDS["F"], "float32"), None),
        "mode_f_wide": ("mode_f_wide.tif", array_tiff(BANDS["F_WIDE"], "float32"), None),
        "mode_i": ("mode_i.tif", array_tiff(BANDS["I"], "int32"), None),
        "mode_l": ("mode_l.png", encode(banded("L", BANDS["L"]), "PNG"), None),
        "animated_gif": ("animated.gif", animated_gif(), None),
        "gif_broken_tail": ("gif_broken_tail.gif", gif_with_broken_tail(), None),
        "multipage_tiff": ("multipage.tif", multipage_tiff(), None),
        "tiny_1x1": ("tiny_1x1.png", _solid_png(1, 1), "too_small"),
        "strip_1x5000": ("strip_1x5000.png", _solid_png(1, 5000), "too_small"),
        "strip_5000x3": ("strip_5000x3.png", _solid_png(5000, 3), "too_small"),
    }
    for percent in (10, 50, 90):
        for name, suffix, data in (("jpeg", "jpg", jpeg), ("png", "png", png)):
            cut = truncated(data, percent / 100)
            items[f"{name}_truncated_{percent}"] = (
                f"{name}_truncated_{percent}.{suffix}",
                cut,
                "truncated",
            )
    for orientation in range(1, 9):
        items[f"orientation_{orientation}"] = (
            f"orientation_{orientation}.jpg",
            oriented_jpeg(orientation),
            None,
        )
    items.update(foreign_format_bytes())
    return items


def make_odd_images(directory: str | Path) -> dict[str, tuple[Path, str | None]]:
    """Write every odd image into `directory` (created if needed).

    Returns:
        name -> (path, expected `SampleError.reason`, or None when it must be processed).
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    written = {}
    for name, (filename, data, reason) in odd_image_bytes().items():
        path = root / filename
        path.write_bytes(data)
        written[name] = (path, reason)
    return written
