"""Cut the part of a JPEG a crop needs out of it, where restart markers allow.

Why: a random-resized crop uses ~44% of an image's pixels, yet a JPEG is decoded whole, and
the Huffman (entropy) decoding alone is ~60% of a decode at quality 90: a decoder cannot
skip to an MCU without reading everything before it. A restart marker resets the decoder's
state (the DC predictions), so the entropy data between two markers, one restart interval,
decodes on its own. When every MCU row starts an interval (the interval divides the MCUs
of a row), the intervals under a box are the same columns of every row: those columns of
those rows, with the header's width and height changed and the markers renumbered from
RST0, are a valid, smaller JPEG. build-shards writes intervals of about 64 px in rows of
24 MCUs or more and one per row in narrower ones (`restart_interval`); builds made before
wrote one per MCU row (libjpeg's `restart_in_rows = 1`), which gives whole rows, or 64-px
intervals in narrow rows too. The band's pixels are bit-identical
to the whole decode's, except within one pixel of its edges, where libjpeg's "fancy" chroma
upsampling reads the chroma sample beyond; `crop_band` keeps `EDGE_GUARD` pixels of margin,
so every pixel asked for is exact. The decoders (libjpeg-turbo through simplejpeg) stay
unchanged: this only moves bytes.

Before a band is cut, the whole entropy data, from the scan's first byte to the end
marker, is proven to hold nothing a whole decode would stop or turn at: every 0xFF in it
is a stuffed byte (FF 00) or a restart marker, the markers read RST0, RST1, ... in turn,
one before each interval, and the image's last interval ends at the end marker. So a whole
decode reaches each of the band's intervals at the same byte with its state reset, as the
band's decode does, and reaches the end of the image as a decode of an intact file does
(docs/RELIABILITY.md, "Band decode: the proof"). Anything else, or anything unexpected,
returns None and the caller decodes the whole file as before: no restart markers (other
writers' shards), progressive or arithmetic-coded JPEGs, an interval that does not divide
a row, a marker missing, extra or out of order, any other marker anywhere in the scan (an
end of image, a comment, tables, a second scan, a DNL, fill bytes FF FF), no end marker (a
truncated file) or bytes after it. Proving the whole file rather than the bytes up to the band's end costs
within noise (docs/RELIABILITY.md), and makes a file's verdict the same for every crop of
it. The band is decoded in strict mode, so a damaged interval inside it is refused too.
What a band cannot see is bad entropy coding inside intervals outside it (no marker
changed): such a file yields this crop as an intact file would (`preprocess verify`
decodes every image whole).
"""

from __future__ import annotations

import re
import struct
from itertools import islice
from typing import NamedTuple

import numpy as np

# Decoded pixels at a band's edges that may differ from the whole decode (fancy upsampling's
# chroma context is one chroma sample: up to 2 luma pixels with 4:2:0), in output pixels of
# the DCT-scaled decode.
EDGE_GUARD = 2
_EOI = b"\xff\xd9"
_STUFFED = b"\xff\x00"
_RST0 = b"\xff\xd0"
_SOI = b"\xff\xd8\xff"
# Baseline and extended sequential Huffman frames: the only ones a band is cut from.
_SEQUENTIAL_HUFFMAN = (0xC0, 0xC1)
# Other frame types (progressive, lossless, arithmetic-coded, hierarchical) and the
# arithmetic-coding conditioning table (0xCC): decoded whole. 0xC4 (DHT) and 0xC8 (JPG,
# reserved) are not frames.
_OTHER_FRAMES = frozenset(range(0xC2, 0xD0)) - {0xC4, 0xC8}
# MCUs per restart interval that build-shards aims for: 64-px columns of a 4:2:0 JPEG.
# Measured on 512-px shards (a prototype of benchmarks/band_decode.py, 600 re-encoded
# JPEGs): a crop 1.08x the marker-less limit with 4-MCU intervals, 1.05x with 8, 0.98x
# with one interval per row, for files 1.75%, 0.9% and 0.2% larger than without markers.
# Shorter intervals are not written: 2 MCUs gave 1.10x at 512 px for files 3.3% larger.
# On 256-px shards (22 MCUs a row: only 2 or 11 divide it) 2-MCU intervals for those rows
# made the loader ~2.5% faster end to end (`moonshot.py --workers 1`, 5 rounds) for files
# 1.8% larger, and slowed every whole decode of them (any other reader's) by ~7%: such rows
# keep one interval per row.
TARGET_INTERVAL_MCUS = 4
_INTERVAL_CHOICES = range(4, 9)
# Rows of fewer MCUs keep one interval per row: their column bands cost more than they save.
# Measured on the portrait images of a 256-px build (16 MCUs a row, 1,500 JPEGs interleaved
# by 50, 5 rounds): the loader's crop took 10.5% less time on the files with one interval per
# row than on those with 4-MCU intervals, and 2% less when the latter were cut by whole rows
# only (their many restarts slow the band's decode); the whole decode of either cost the
# same. At 512 px (32 MCUs) column bands make the crop 1.12x faster than row bands. 24 MCUs
# (384 px) splits the difference.
MIN_COLUMN_MCUS = 24


def restart_interval(width: int, mcu_width: int = 16, min_mcus: int = MIN_COLUMN_MCUS) -> int:
    """MCUs per restart interval for a JPEG `width` px wide: what build-shards writes.

    An interval must divide the MCUs of a row, so each row starts a new interval and a band
    can take the same interval columns from every row: the divisor in 4..8 nearest to
    `TARGET_INTERVAL_MCUS` (the larger on a tie: fewer markers), else the whole row (a
    count of MCUs with no such divisor, 22 or 43: only rows can be cut). Rows of fewer than
    `min_mcus` MCUs keep one interval per row (`MIN_COLUMN_MCUS`); `min_mcus=0` is what
    builds made before that rule wrote.
    """
    mcus = -(-width // mcu_width)
    divisors = [k for k in _INTERVAL_CHOICES if mcus % k == 0 and k < mcus]
    if not divisors or mcus < min_mcus:
        return mcus
    return min(divisors, key=lambda k: (abs(k - TARGET_INTERVAL_MCUS), -k))


class Band(NamedTuple):
    """A smaller JPEG of whole restart intervals, and where it sits in the original."""

    data: bytearray
    left: int  # first column of the band, in the original's pixels
    top: int  # first row of the band, in the original's pixels
    width: int  # columns in the band, in the original's pixels
    height: int  # rows in the band, in the original's pixels


class _Layout(NamedTuple):
    size_at: int  # offset of the frame header's 2-byte height (the width follows)
    width: int
    height: int
    mcu_width: int
    mcu_height: int
    interval: int  # MCUs per restart interval: a divisor of a row's MCUs
    scan_at: int  # first byte of the entropy-coded data
    rows: int  # MCU rows
    columns: int  # MCUs in a row


def crop_band(
    data: bytes, left: int, top: int, right: int, bottom: int, scale: int = 1
) -> Band | None:
    """The restart intervals holding pixels `[left, right) x [top, bottom)` as their own JPEG.

    A file with one interval per row gives whole rows; one whose rows hold several
    intervals (build-shards' default, `restart_interval`) also gives only the interval
    columns under the box. The band's markers are renumbered from RST0 and its frame header
    holds its own size, so libjpeg decodes it as any JPEG.

    Args:
        left, top, right, bottom: the pixels the caller will read, in the original's
            pixels; the band covers them with `EDGE_GUARD` decoded pixels to spare on each
            side.
        scale: the DCT scale (1, 2, 4 or 8) the band will be decoded at: the margin is in
            decoded pixels.

    Returns:
        None when the file has no usable markers (see the module docstring) or the band
        would be the whole image.
    """
    layout = _layout(data)
    if layout is None:
        return None
    guard, per_row = EDGE_GUARD * scale, layout.columns // layout.interval
    span = layout.mcu_width * layout.interval  # pixels of one interval
    first = max(0, (top - guard) // layout.mcu_height)
    last = min(layout.rows, -(-(bottom + guard) // layout.mcu_height))  # exclusive
    first_column = max(0, (left - guard) // span)
    last_column = min(per_row, -(-(right + guard) // span))  # exclusive
    if first >= last or first_column >= last_column:
        return None
    if (first, last, first_column, last_column) == (0, layout.rows, 0, per_row):
        return None
    # The band reads where intervals end from the one before its first (-1: none, the band
    # starts the scan) through its last.
    before = first * per_row + first_column - 1
    scanned = _interval_ends(data, layout)
    if scanned is None:
        return None
    ends = scanned[max(0, before) :]
    if before < 0:  # the scan's first byte, as if after a marker
        ends.insert(0, layout.scan_at - 2)
    band = _splice(data, layout, ends, last - first, (first_column, last_column))
    band_left, band_top = first_column * span, first * layout.mcu_height
    band_width = min(layout.width, last_column * span) - band_left
    band_height = min(layout.height, last * layout.mcu_height) - band_top
    struct.pack_into(">HH", band, layout.size_at, band_height, band_width)
    return Band(band, band_left, band_top, band_width, band_height)


def _splice(
    data: bytes, layout: _Layout, ends: list[int], rows: int, columns: tuple[int, int]
) -> bytearray:
    """The header, then intervals `columns` of `rows` MCU rows, markers renumbered from RST0.

    `ends` holds where intervals end (their marker's 0xFF), from the one before the band's
    first through the last of its last row. Each row's intervals lie one after the other in
    the file, their own markers between them, so a row is one piece (whole rows are all one
    piece); a marker goes between two pieces. Then the band's markers are numbered RST0,
    RST1, ... in turn.
    """
    first_column, last_column = columns
    per_row = layout.columns // layout.interval
    view = memoryview(data)
    if first_column == 0 and last_column == per_row:  # whole rows: one piece
        start, stop = ends[0] + 2, ends[rows * per_row]
        band = bytearray().join((view[: layout.scan_at], view[start:stop], _EOI))
        shift = layout.scan_at + 1 - start
        markers = [end + shift for end in ends[1 : rows * per_row]]
    else:
        width = last_column - first_column
        pieces = [view[: layout.scan_at]]
        markers = []  # where each of the band's marker codes is
        at = layout.scan_at  # where the next piece lands in the band
        for row in range(0, rows * per_row, per_row):
            start, stop = ends[row] + 2, ends[row + width]
            if row:
                pieces.append(_RST0)
                markers.append(at + 1)
                at += 2
            shift = at + 1 - start
            markers += [end + shift for end in ends[row + 1 : row + width]]
            pieces.append(view[start:stop])
            at += stop - start
        pieces.append(_EOI)
        band = bytearray().join(pieces)
    if markers:
        np.frombuffer(band, np.uint8)[markers] = _rst_array(len(markers))
    return band


def _interval_ends(data: bytes, layout: _Layout) -> list[int] | None:
    """Where each interval's entropy data ends (the next marker's 0xFF, the end marker's
    for the image's last interval), found by scanning the whole scan, or None.

    The scan is the band's proof: from the scan's first byte to the end marker, every 0xFF
    must be stuffed (FF 00) or a restart marker, and interval i must start after
    RST((i - 1) % 8). None when any other marker is there (an end of image, a comment,
    tables, a second scan, FF FF fill bytes), a restart marker is missing, extra or
    misnumbered, or the image's last interval is not followed by the end marker that ends
    the file (a cut file, bytes after the image): such files are decoded whole, and judged.
    """
    total = layout.rows * (layout.columns // layout.interval)
    ends = _markers(data, layout.scan_at, len(data), total - 1)
    if ends is None or len(ends) < total - 1:
        return None
    # The image's last interval ends at the first marker after it, which must end the image
    # and the file: every 0xFF before the end marker is stuffed (bytes.count runs at memchr
    # speed), and nothing follows it (an end marker put inside the last interval would cut
    # it short for a whole decode, the interval's own bytes trailing after it).
    last_start = ends[-1] + 2 if ends else layout.scan_at
    image_end = len(data) - 2
    if (
        image_end < last_start
        or data[image_end:] != _EOI
        or data.count(b"\xff", last_start, image_end) != data.count(_STUFFED, last_start, image_end)
    ):
        return None
    return [*ends, image_end]


def _markers(data: bytes, start: int, stop: int, count: int, first: int = 0) -> list[int] | None:
    """Offsets (of the 0xFF) of the first `count` markers wholly in `data[start:stop]`,
    fewer if it holds fewer; None unless they read RST(first % 8), RST((first + 1) % 8), ...

    In entropy-coded data a 0xFF is followed by 0x00 (a stuffed byte) or by a marker's code
    (or by another 0xFF, a fill byte before a marker), so every 0xFF not followed by 0x00
    is a marker, and each must be the restart marker next in turn. A regex walk finds a few
    markers sooner; a numpy pass over the bytes costs less per marker (measured: one
    interval per row of a 256-px JPEG, ~16 markers, 4 us against 18; 64-px intervals of a
    512-px one, ~250, 60 us against 25).
    """
    if count <= _FEW_MARKERS:
        found = [match.start() for match in islice(_MARKER.finditer(data, start, stop), count)]
        codes = bytes(data[at + 1] for at in found)
    else:
        scan = np.frombuffer(data, np.uint8, count=max(0, stop - start), offset=start)
        fills = np.flatnonzero(scan[:-1] == 0xFF)
        where = fills[scan[fills + 1] != 0][:count]
        codes, found = scan[where + 1].tobytes(), (where + start).tolist()
    return found if codes == _rst_codes(first, len(found)) else None


def _rst_codes(first: int, count: int) -> bytes:
    """The code bytes of `count` restart markers in turn from RST(first % 8)."""
    turn = first & 7
    if turn + count <= len(_RST_CODES):
        return _RST_CODES[turn : turn + count]
    return (_RST_CODES[:8] * (-(-(turn + count) // 8)))[turn : turn + count]


def _rst_array(count: int) -> np.ndarray:
    """`_rst_codes(0, count)` as a uint8 array, for any count (a 2,400-px-square grey JPEG
    with one-block intervals has 90,000 markers)."""
    if count <= len(_RST_ARRAY):
        return _RST_ARRAY[:count]
    return np.resize(_RST_ARRAY[:8], count)


# Any 0xFF not stuffed: a marker (or a fill byte before one) in entropy-coded data.
_MARKER = re.compile(rb"\xff[^\x00]")
_FEW_MARKERS = 48
# The code bytes of restart markers in turn, RST0, RST1, ... RST7, RST0, ...: 65,536 of them
# at hand (a 4096-px-square image with 64-px intervals has 16,384); more are built on demand.
_RST_CODES = bytes(0xD0 + (k & 7) for k in range(1 << 16))
_RST_ARRAY = np.frombuffer(_RST_CODES, np.uint8)


def _layout(data: bytes) -> _Layout | None:
    """The frame and scan facts a band needs, or None unless every row starts an interval."""
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
    """The layout when the one scan holds every component and every MCU row starts an
    interval (the interval divides a row's MCUs)."""
    if frame is None or interval == 0:
        return None
    height_at, height, width, components, mcu_width, mcu_height = frame
    if end - at < 3 or data[at + 4] != components:
        return None  # several scans (one per component): decoded whole
    columns = -(-width // mcu_width)
    if columns % interval:
        return None
    rows = -(-height // mcu_height)
    return _Layout(height_at, width, height, mcu_width, mcu_height, interval, end, rows, columns)
