"""The page headers of a Parquet column chunk, read before pyarrow decompresses its pages.

A page header (Thrift compact protocol) states the page's uncompressed size, and that is
what pyarrow allocates to decompress it, whatever the footer claims the row group takes:
a 22 KB file whose one zstd page holds 600 MB of zeros passes every footer check. The
stream (`shards.parquet.stream.WatchedStream`) sums these sizes as each column chunk is
read, so a row group whose pages would decompress past `ReadLimits.row_group_bytes` is
refused before one page is decompressed.
"""

from __future__ import annotations

from collections.abc import Iterator

from shards.errors import DataError

# PageHeader's fields (parquet.thrift): 2 uncompressed_page_size, 3 compressed_page_size.
_UNCOMPRESSED, _COMPRESSED = 2, 3
# Thrift compact types.
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY = 0, 1, 2, 3, 4, 5, 6, 7, 8
_LIST, _SET, _MAP, _STRUCT = 9, 10, 11, 12
# Nesting deeper than any page header has: past it the bytes are not a header.
_MAX_DEPTH = 16


class _NotAHeader(DataError):
    """The bytes do not parse as a page header (cut, or not Thrift)."""


def iter_page_sizes(chunk: bytes) -> Iterator[int]:
    """The uncompressed size each page header of a column chunk's bytes states, in order.

    Stops at the end of `chunk`, or at the first header that does not parse or states a
    negative size: pyarrow then refuses the chunk itself (`bad_data`), having allocated
    nothing on the header's word.
    """
    position = 0
    while position < len(chunk):
        try:
            uncompressed, compressed, position = _page_header(chunk, position)
        except _NotAHeader:
            return
        if uncompressed < 0 or compressed < 0:
            return
        yield uncompressed
        position += compressed


def _page_header(data: bytes, position: int) -> tuple[int, int, int]:
    """(uncompressed size, compressed size, end of header) of the header at `position`."""
    sizes = {_UNCOMPRESSED: -1, _COMPRESSED: -1}
    field = 0
    while True:
        kind, field, position = _field_header(data, position, field)
        if kind == _STOP:
            return sizes[_UNCOMPRESSED], sizes[_COMPRESSED], position
        if field in sizes and kind == _I32:
            value, position = _varint(data, position)
            sizes[field] = _unzigzag(value)
        else:
            position = _skip(data, position, kind, 1)


def _field_header(data: bytes, position: int, last: int) -> tuple[int, int, int]:
    """(type, field id, position after) of a struct's next field header."""
    byte = _byte(data, position)
    position += 1
    kind, delta = byte & 0x0F, byte >> 4
    if kind == _STOP:
        return kind, last, position
    if delta:
        return kind, last + delta, position
    value, position = _varint(data, position)
    return kind, _unzigzag(value), position


def _skip(data: bytes, position: int, kind: int, depth: int, in_list: bool = False) -> int:
    """The position after one value of Thrift compact type `kind` (a bool in a list is
    a byte; a struct field's bool is in its header)."""
    if depth > _MAX_DEPTH:
        raise _NotAHeader
    if kind in (_TRUE, _FALSE):
        return position + 1 if in_list else position
    if kind == _BYTE:
        return position + 1
    if kind in (_I16, _I32, _I64):
        return _varint(data, position)[1]
    if kind == _DOUBLE:
        return position + 8
    if kind == _BINARY:
        size, position = _varint(data, position)
        return position + size
    if kind in (_LIST, _SET):
        return _skip_list(data, position, depth)
    if kind == _MAP:
        return _skip_map(data, position, depth)
    if kind == _STRUCT:
        field = 0
        while True:
            inner, field, position = _field_header(data, position, field)
            if inner == _STOP:
                return position
            position = _skip(data, position, inner, depth + 1)
    raise _NotAHeader


def _skip_list(data: bytes, position: int, depth: int) -> int:
    byte = _byte(data, position)
    position += 1
    size, kind = byte >> 4, byte & 0x0F
    if size == 15:
        size, position = _varint(data, position)
    if size > len(data) - position:  # every element takes a byte at least
        raise _NotAHeader
    for _ in range(size):
        position = _skip(data, position, kind, depth + 1, in_list=True)
    return position


def _skip_map(data: bytes, position: int, depth: int) -> int:
    size, position = _varint(data, position)
    if size == 0:
        return position
    if 2 * size > len(data) - position:
        raise _NotAHeader
    kinds = _byte(data, position)
    position += 1
    for _ in range(size):
        position = _skip(data, position, kinds >> 4, depth + 1, in_list=True)
        position = _skip(data, position, kinds & 0x0F, depth + 1, in_list=True)
    return position


def _byte(data: bytes, position: int) -> int:
    if position >= len(data):
        raise _NotAHeader
    return data[position]


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        byte = _byte(data, position)
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
    raise _NotAHeader


def _unzigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)
