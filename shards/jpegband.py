"""Cut the MCU rows a crop needs out of a JPEG that has a restart marker at every row.

Why: a random-resized crop uses ~44% of an image's pixels, yet a JPEG is decoded whole, and
the Huffman (entropy) decoding alone is ~60% of a decode at quality 90: a decoder cannot
skip to a row without reading everything before it. A restart marker at the start of every
MCU row (libjpeg's `restart_in_rows = 1`, what build-shards writes) resets the decoder's
state, so the rows between two markers decode on their own: the rows a crop needs, with
the header's height changed and the markers renumbered from RST0, are a valid, smaller
JPEG. Its pixels are bit-identical to those rows of the whole decode, except within one
row of the band's top and bottom edge, where libjpeg's "fancy" chroma upsampling reads
the chroma row beyond; `crop_rows` keeps `ROW_GUARD` rows of margin, so every row asked
for is exact. The decoders (libjpeg-turbo through simplejpeg) stay unchanged: this only
moves bytes.

Anything else, or anything unexpected, returns None and the caller decodes the whole file
as before: no restart markers (other writers' shards), progressive or arithmetic-coded
JPEGs, an interval other than one row, a marker missing or out of place, no end marker (a
truncated file). The band is decoded in strict mode, so a damaged row inside it is refused
too. What a band cannot see is damage to the entropy data of rows outside it: such a file
yields this crop as an intact file would (`preprocess verify` decodes every image whole).
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

# Decoded rows at a band's top and bottom edge that may differ from the whole decode (fancy
# upsampling's chroma context is one chroma row: up to 2 luma rows with 4:2:0), in output
# rows of the DCT-scaled decode.
ROW_GUARD = 2
_EOI = b"\xff\xd9"
_RST_MARKER = re.compile(rb"\xff[\xd0-\xd7]")
_SOI = b"\xff\xd8\xff"
# Baseline and extended sequential Huffman frames: the only ones a band is cut from.
_SEQUENTIAL_HUFFMAN = (0xC0, 0xC1)
# Other frame types (progressive, lossless, arithmetic-coded, hierarchical) and the
# arithmetic-coding conditioning table (0xCC): decoded whole. 0xC4 (DHT) and 0xC8 (JPG,
# reserved) are not frames.
_OTHER_FRAMES = frozenset(range(0xC2, 0xD0)) - {0xC4, 0xC8}
# MCUs per restart interval that build-shards aims for: 64-px columns of a 4:2:0 JPEG.
# Measured on 512-px shards (benchmarks/row_band.py): a crop's decode 421 us with 4-MCU
# intervals against 563 us with one per row and 476 with 8, for files 2.0% larger than with
# row intervals (8: 1.1%, 2: 3.9%, 1: 7.1%, whose markers also slow the decode).
TARGET_INTERVAL_MCUS = 4
_INTERVAL_CHOICES = range(2, 9)


def restart_interval(width: int, mcu_width: int = 16) -> int:
    """MCUs per restart interval for a JPEG `width` px wide: what build-shards writes.

    An interval must divide the MCUs of a row, so each row starts a new interval and a band
    can take the same interval columns from every row: the divisor in 2..8 nearest to
    `TARGET_INTERVAL_MCUS` (the larger on a tie: fewer markers), else the whole row (a
    prime count of MCUs: only rows can be cut).
    """
    mcus = -(-width // mcu_width)
    divisors = [k for k in _INTERVAL_CHOICES if mcus % k == 0 and k < mcus]
    if not divisors:
        return mcus
    return min(divisors, key=lambda k: (abs(k - TARGET_INTERVAL_MCUS), -k))


class Band(NamedTuple):
    """A smaller JPEG of whole MCU rows, and where it sits in the original."""

    data: bytearray
    top: int  # first row of the band, in the original's pixels
    height: int  # rows in the band, in the original's pixels


class _Layout(NamedTuple):
    height_at: int  # offset of the frame header's 2-byte height
    height: int
    mcu_height: int
    scan_at: int  # first byte of the entropy-coded data
    rows: int  # MCU rows


def crop_rows(data: bytes, top: int, bottom: int, scale: int = 1) -> Band | None:
    """The MCU rows holding pixel rows `[top, bottom)` (original pixels) as their own JPEG.

    Args:
        top, bottom: the rows the caller will read, in the original's pixels; the band
            covers them with `ROW_GUARD` decoded rows to spare on each side.
        scale: the DCT scale (1, 2, 4 or 8) the band will be decoded at: the margin is in
            decoded rows.

    Returns:
        None when the file has no usable row markers (see the module docstring) or the
        band would be the whole image.
    """
    layout = _row_layout(data)
    if layout is None:
        return None
    mcu, guard = layout.mcu_height, ROW_GUARD * scale
    first = max(0, (top - guard) // mcu)
    last = min(layout.rows, -(-(bottom + guard) // mcu))  # exclusive
    if first == 0 and last == layout.rows:
        return None
    # Row r's entropy data starts after the marker RST((r - 1) % 8): take them in order (no
    # 0xFF in entropy data is followed by anything but 0x00, so each match is a marker).
    starts = [layout.scan_at]
    markers = _RST_MARKER.finditer(data, layout.scan_at)
    for row in range(1, min(last + 1, layout.rows)):
        marker = next(markers, None)
        if marker is None or data[marker.start() + 1] != 0xD0 + ((row - 1) & 7):
            return None
        starts.append(marker.end())
    pos = starts[-1]
    end = data.find(_EOI, pos) if last == layout.rows else starts[last] - 2
    if end < 0 or data.rfind(_EOI) < pos:
        return None  # no end marker after the band: a cut file, decoded whole (and refused)
    band_top = first * mcu
    band_height = min(layout.height, last * mcu) - band_top
    band = bytearray(memoryview(data)[: layout.scan_at])
    band[layout.height_at : layout.height_at + 2] = struct.pack(">H", band_height)
    offset = layout.scan_at - starts[first]  # where the original's bytes land in the band
    band += memoryview(data)[starts[first] : end]
    if first & 7:  # the band's markers count from RST0 again
        for row in range(first + 1, last):
            band[starts[row] + offset - 1] = 0xD0 + ((row - first - 1) & 7)
    band += _EOI
    return Band(band, band_top, band_height)


def _row_layout(data: bytes) -> _Layout | None:
    """The frame and scan facts a band needs, or None unless the file has a marker per row."""
    if not data.startswith(_SOI):
        return None
    size, at = len(data), 2
    frame = None
    interval = 0
    while at + 4 <= size:
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        length = (data[at + 2] << 8) | data[at + 3]
        end = at + 2 + length
        if length < 2 or end > size:
            return None
        if marker in _SEQUENTIAL_HUFFMAN:
            frame = _frame(data, at, length)
            if frame is None:
                return None
        elif marker in _OTHER_FRAMES:
            return None
        elif marker == 0xDD:  # DRI
            if length != 4:
                return None
            interval = (data[at + 4] << 8) | data[at + 5]
        elif marker == 0xDA:  # SOS: the header ends here
            return _scan_layout(data, at, end, frame, interval)
        elif not 0xE0 <= marker <= 0xFE and marker not in (0xC4, 0xDB):
            return None  # no other marker belongs before the scan in files we cut
        at = end
    return None


def _frame(data: bytes, at: int, length: int) -> tuple[int, int, int, int, int, int] | None:
    """(height_at, height, width, components, mcu_width, mcu_height) of an 8-bit frame."""
    if length < 8:
        return None
    precision = data[at + 4]
    height, width = struct.unpack_from(">HH", data, at + 5)
    count = data[at + 9]
    if precision != 8 or count not in (1, 3) or length != 8 + 3 * count:
        return None
    if height == 0 or width == 0:  # a height in a DNL segment: decoded whole
        return None
    factors = [data[at + 11 + 3 * k] for k in range(count)]
    hmax, vmax = max(f >> 4 for f in factors), max(f & 15 for f in factors)
    if not (1 <= hmax <= 4 and 1 <= vmax <= 4):
        return None
    # One component: the scan is not interleaved and its MCU is one 8 x 8 block.
    mcu_width, mcu_height = (8, 8) if count == 1 else (8 * hmax, 8 * vmax)
    return at + 5, height, width, count, mcu_width, mcu_height


def _scan_layout(data: bytes, at: int, end: int, frame, interval: int) -> _Layout | None:
    """The layout when the one scan holds every component and restarts at every MCU row."""
    if frame is None or interval == 0:
        return None
    height_at, height, width, components, mcu_width, mcu_height = frame
    if end - at < 3 or data[at + 4] != components:
        return None  # several scans (one per component): decoded whole
    if interval != -(-width // mcu_width):
        return None
    return _Layout(height_at, height, mcu_height, end, -(-height // mcu_height))
