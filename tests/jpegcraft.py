"""A tiny baseline JPEG writer for files no library here writes: any sampling factors, 12-bit.

Pillow writes 4:4:4, 4:2:2 and 4:2:0 only, and OpenCV adds 4:1:1 and 4:4:0; libjpeg-turbo
decodes more (4:4:1, 3x1 factors, 12-bit precision). Every 8 x 8 block here is flat (its DC
coefficient only, AC all zero), which keeps the writer to a page while the file stays a
valid JPEG whose pixels vary block by block, so a decoder that gets the layout wrong shows
it. `frame_marker=0xC9` writes the same bytes under an arithmetic-coding frame header: not a
valid arithmetic-coded scan, but what a reader meets in the header.
"""

from __future__ import annotations

import struct

import numpy as np

# One DC Huffman table for categories 0..15 (12-bit DC differences reach 15): 14 codes of 4
# bits and 2 of 5, none all ones. One AC table holding only the end-of-block code, "0".
_DC_COUNTS = (0, 0, 0, 14, 2) + (0,) * 11
_DC_SYMBOLS = bytes(range(16))
_AC_COUNTS = (1,) + (0,) * 15
_AC_SYMBOLS = b"\x00"


def _dc_codes() -> dict[int, tuple[int, int]]:
    """category -> (code, length), canonical from `_DC_COUNTS`."""
    codes, code, symbol = {}, 0, 0
    for length, count in enumerate(_DC_COUNTS, start=1):
        for _ in range(count):
            codes[_DC_SYMBOLS[symbol]] = (code, length)
            code, symbol = code + 1, symbol + 1
        code <<= 1
    return codes


_DC_CODES = _dc_codes()


def block_levels(
    width: int, height: int, factors: tuple[tuple[int, int], ...], precision: int, seed: int
) -> list[np.ndarray]:
    """Per component, the level of each 8 x 8 block (padded to whole MCUs): a gradient with
    stripes and noise, so neighbouring blocks differ."""
    rng = np.random.default_rng(seed)
    hmax, vmax = max(h for h, _ in factors), max(v for _, v in factors)
    top = (1 << precision) - 1
    levels = []
    for index, (h, v) in enumerate(factors):
        if len(factors) == 1:
            rows, columns = -(-height // 8), -(-width // 8)
        else:
            rows, columns = -(-height // (8 * vmax)) * v, -(-width // (8 * hmax)) * h
        yy, xx = np.mgrid[0:rows, 0:columns].astype(np.float64)
        base = (xx / max(1, columns - 1) + yy / max(1, rows - 1)) / 2 * top
        base = base * (1 - 0.3 * index) + 0.15 * top * np.sin(xx / 3 + index)
        base += rng.normal(0, top / 40, base.shape)
        levels.append(np.clip(np.rint(base), 0, top).astype(np.int64))
    return levels


class _Bits:
    """Huffman bits, packed MSB first, with 0xFF stuffed as FF 00."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.value = 0
        self.count = 0

    def put(self, code: int, length: int) -> None:
        self.value = (self.value << length) | (code & ((1 << length) - 1))
        self.count += length
        while self.count >= 8:
            self.count -= 8
            byte = (self.value >> self.count) & 0xFF
            self.out += b"\xff\x00" if byte == 0xFF else bytes((byte,))
        self.value &= (1 << self.count) - 1

    def flush(self) -> None:
        """Pad the last byte with 1 bits, as libjpeg does before a marker."""
        if self.count:
            self.put((1 << (8 - self.count)) - 1, 8 - self.count)


def _put_block(bits: _Bits, difference: int) -> None:
    category = abs(difference).bit_length()
    bits.put(*_DC_CODES[category])
    if category:
        bits.put(difference if difference > 0 else difference - 1, category)
    bits.put(0, 1)  # end of block: every AC coefficient is zero


def _scan(levels: list[np.ndarray], factors, precision: int, restart: int) -> bytes:
    """The entropy-coded data, MCU by MCU, with RST markers every `restart` MCUs."""
    shift = 1 << (precision - 1)
    if len(levels) == 1:
        units = [
            [(0, (r, c))] for r in range(levels[0].shape[0]) for c in range(levels[0].shape[1])
        ]
    else:
        h0, v0 = factors[0]
        mcu_rows, mcu_columns = levels[0].shape[0] // v0, levels[0].shape[1] // h0
        units = []
        for r in range(mcu_rows):
            for c in range(mcu_columns):
                unit = []
                for index, (h, v) in enumerate(factors):
                    unit += [(index, (r * v + y, c * h + x)) for y in range(v) for x in range(h)]
                units.append(unit)
    bits, out = _Bits(), bytearray()
    predictions = [0] * len(levels)
    for number, unit in enumerate(units):
        if restart and number and number % restart == 0:
            bits.flush()
            out += bits.out + bytes((0xFF, 0xD0 + (number // restart - 1) % 8))
            bits.out, predictions = bytearray(), [0] * len(levels)
        for index, at in unit:
            # Quantizer 8: the stored DC is the block's level minus the level shift.
            dc = int(levels[index][at]) - shift
            _put_block(bits, dc - predictions[index])
            predictions[index] = dc
    bits.flush()
    return bytes(out + bits.out)


def _segment(marker: int, body: bytes) -> bytes:
    return struct.pack(">BBH", 0xFF, marker, len(body) + 2) + body


def dc_jpeg(
    width: int,
    height: int,
    factors: tuple[tuple[int, int], ...] = ((2, 2), (1, 1), (1, 1)),
    *,
    precision: int = 8,
    restart: int = 0,
    frame_marker: int | None = None,
    seed: int = 0,
) -> bytes:
    """A `width` x `height` JPEG of flat blocks with the components' (h, v) `factors`.

    Args:
        factors: one (grey) or three (YCbCr) components' sampling factors.
        precision: 8, or 12 (written as an extended sequential frame, SOF1).
        restart: MCUs per restart interval (0: no markers).
        frame_marker: the frame header's marker byte (default SOF0, or SOF1 for 12-bit).
    """
    if frame_marker is None:
        frame_marker = 0xC0 if precision == 8 else 0xC1
    levels = block_levels(width, height, factors, precision, seed)
    ids = range(1, len(factors) + 1)
    frame = struct.pack(">BHHB", precision, height, width, len(factors))
    frame += b"".join(bytes((i, (h << 4) | v, 0)) for i, (h, v) in zip(ids, factors, strict=True))
    parts = [
        b"\xff\xd8",
        _segment(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"),
        _segment(0xDB, b"\x00" + bytes((8,) + (1,) * 63)),
        _segment(frame_marker, frame),
    ]
    if frame_marker != 0xC9:  # arithmetic coding needs no Huffman tables
        parts.append(_segment(0xC4, b"\x00" + bytes(_DC_COUNTS) + _DC_SYMBOLS))
        parts.append(_segment(0xC4, b"\x10" + bytes(_AC_COUNTS) + _AC_SYMBOLS))
    if restart:
        parts.append(_segment(0xDD, struct.pack(">H", restart)))
    scan = bytes((len(factors),)) + b"".join(bytes((i, 0)) for i in ids) + b"\x00\x3f\x00"
    parts += [_segment(0xDA, scan), _scan(levels, factors, precision, restart), b"\xff\xd9"]
    return b"".join(parts)
