"""WebDataset-compatible tar shards: a deterministic writer and a hardened streaming reader.

Writer output is readable by stock `webdataset.WebDataset` and `tar tf`; members
carry fixed metadata (mtime 0, uid 0, mode 0444) so identical samples give
byte-identical shards. The reader streams (`r|`), never touches the
filesystem, reads only allowlisted fields, caps member sizes and never emits
a partial sample.
"""

from __future__ import annotations

import tarfile
import zlib
from collections.abc import Iterator
from typing import BinaryIO

from shards.sample import ALLOWED_FIELDS, Sample, SampleError, check_key

BLOCK = 512
MAX_MEMBER_BYTES = 64 * 2**20
MAX_MEMBERS_PER_SAMPLE = 16


class TarShardWriter:
    """Writes samples as `{key}.{field}` members of one uncompressed tar stream.

    Headers are packed here rather than by `tarfile`, whose per-member TarInfo
    copying and field encoding cost ~0.3 ms a sample, a tenth of a build's time
    per image; the bytes are the same as `tarfile`'s ustar output (a test checks).
    Names too long for ustar get a pax header, as `tarfile` would write.

    Args:
        fileobj: a binary file opened for writing; written sequentially, never seeked.
    """

    def __init__(self, fileobj: BinaryIO) -> None:
        self._out = fileobj
        self._written = 0
        self.count = 0

    def write(self, sample: Sample) -> None:
        """Append one sample; fields are written in sorted order for determinism."""
        key = check_key(sample["__key__"])
        for field in sorted(f for f in sample if not f.startswith("__")):
            data = sample[field]
            if not isinstance(data, bytes):
                raise TypeError(
                    f"field {field!r} of {key} must be bytes, got {type(data).__name__}"
                )
            self._write_member(f"{key}.{field}", data)
        self.count += 1

    def _write_member(self, name: str, data: bytes) -> None:
        padding = -len(data) % BLOCK
        self._out.write(member_header(name, len(data)))
        self._out.write(data)
        if padding:
            self._out.write(bytes(padding))
        self._written += BLOCK + len(data) + padding

    def close(self) -> None:
        """End the archive as `tarfile` does: two zero blocks, padded to a 10 KiB record."""
        end = 2 * BLOCK
        end += -(self._written + end) % tarfile.RECORDSIZE
        self._out.write(bytes(end))
        self._written += end


# The constant fields of every member header: mode 0444, uid/gid 0, mtime 0,
# a regular file, ustar magic, empty user and group names and device numbers.
_HEADER_TAIL = (
    b"0000444\0" + b"0000000\0" + b"0000000\0",  # mode, uid, gid (after the name)
    b"00000000000\0",  # mtime (after the size)
    b"0" + bytes(100) + b"ustar\x0000" + bytes(64 + 16 + 167),
)
_CHECKSUM_BASE = sum(_HEADER_TAIL[0]) + sum(_HEADER_TAIL[1]) + sum(_HEADER_TAIL[2]) + 8 * 32


def member_header(name: str, size: int) -> bytes:
    """The ustar header block of a regular file `name` of `size` bytes (pax if needed)."""
    encoded = name.encode("utf-8")
    if len(encoded) > 100 or size >= 8**11:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode, info.uid, info.gid = size, 0, 0o444, 0, 0
        info.uname = info.gname = ""
        return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
    size_field = b"%011o\0" % size
    checksum = _CHECKSUM_BASE + sum(encoded) + sum(size_field)
    return b"".join(
        (
            encoded.ljust(100, b"\0"),
            _HEADER_TAIL[0],
            size_field,
            _HEADER_TAIL[1],
            b"%06o\0 " % checksum,
            _HEADER_TAIL[2],
        )
    )


class TarFormatError(ValueError):
    """The stream is not a well-formed, complete tar archive."""


MAX_HEADER_DATA = 1 * 2**20  # pax and GNU long-name payloads
_REGULAR = (b"0", b"\0", b"7")
_SKIP_CHUNK = 1 * 2**20


def split_member_name(name: str) -> tuple[str, str]:
    """`dir/abc.jpg` -> (`dir/abc`, `jpg`); the key ends at the first dot of the basename."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def _read_exact(stream: BinaryIO, size: int, what: str) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        # Streams may return short reads; keep reading until EOF before giving up.
        parts = [data]
        got = len(data)
        while got < size:
            more = stream.read(size - got)
            if not more:
                raise TarFormatError(f"truncated tar: unexpected end of data in {what}")
            parts.append(more)
            got += len(more)
        data = b"".join(parts)
    return data


def _skip(stream: BinaryIO, size: int, what: str) -> None:
    while size > 0:
        size -= len(_read_exact(stream, min(size, _SKIP_CHUNK), what))


def _parse_number(field: bytes, what: str) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for large values
        value = int.from_bytes(field[1:], "big")
        if field[0] & 0x40:
            raise TarFormatError(f"negative {what} in tar header")
        return value
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError as error:
        raise TarFormatError(f"bad {what} field {field!r} in tar header") from error


def header_checksum(header: bytes) -> int:
    """The ustar checksum: the sum of the header's bytes, its checksum field read as spaces.

    zlib's Adler-32 starts from 1 and keeps the byte sum modulo 65521 in its low 16
    bits, which is the exact sum for up to 256 bytes (at most 65,280). Three such
    pieces cost ~0.3 us against ~3 us for Python's `sum` over 504 bytes, three times
    a sample.
    """
    pieces = (
        (zlib.adler32(header[:148]) & 0xFFFF)
        + (zlib.adler32(header[156:412]) & 0xFFFF)
        + (zlib.adler32(header[412:BLOCK]) & 0xFFFF)
    )
    return pieces - 3 + 8 * 32


def _parse_pax(data: bytes) -> dict[str, str]:
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            break
        length = int(data[pos:space])
        if length <= 0:
            raise TarFormatError("bad pax record length")
        record = data[space + 1 : pos + length - 1]
        key, _, value = record.partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def iter_tar_members(stream: BinaryIO) -> Iterator[tuple[str, bool, int]]:
    """Yield `(name, is_regular, size)` for each member; the caller must then call
    `read_member` or `skip_member` exactly once before advancing.

    Our own parser instead of `tarfile` because `tarfile` in stream mode ends
    silently on a truncated archive and returns short member data (a truncated
    shard would look complete), and because it loops forever on crafted negative
    offsets before Python 3.13.6 (CVE-2025-8194). This one checks header
    checksums, requires the end-of-archive block, and rejects negative sizes.
    """
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = stream.read(BLOCK)
        if len(header) < BLOCK:
            header += stream.read(BLOCK - len(header)) if header else b""
            if len(header) < BLOCK:
                raise TarFormatError("truncated tar: no end-of-archive block")
        if header == b"\0" * BLOCK:
            return
        if _parse_number(header[148:156], "checksum") != header_checksum(header):
            raise TarFormatError("not a tar archive (header checksum mismatch)")
        size = _parse_number(header[124:136], "size")
        kind = header[156:157]
        if kind in (b"x", b"g", b"L", b"K"):
            if size > MAX_HEADER_DATA:
                raise TarFormatError(f"tar extended header of {size} bytes exceeds the cap")
            data = _read_exact(stream, size, "extended header")
            _skip(stream, -size % BLOCK, "padding")
            if kind == b"x":
                pax = _parse_pax(data)
            elif kind == b"L":
                long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            continue
        name = header[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if header[257:262] == b"ustar":
            prefix = header[345:500].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
            if prefix:
                name = f"{prefix}/{name}"
        name = pax.get("path", long_name or name)
        if "size" in pax:
            size = int(pax["size"])
        long_name, pax = None, {}
        yield name, kind in _REGULAR, size


def iter_tar_samples(
    stream: BinaryIO,
    url: str,
    *,
    fields: frozenset[str] = ALLOWED_FIELDS,
    max_member_bytes: int = MAX_MEMBER_BYTES,
    start: int = 0,
) -> Iterator[Sample]:
    """Yield samples from a tar stream, grouping adjacent members by key.

    The first `start` samples are passed over without reading their data
    (seeking when the stream can), so a loader can begin mid-shard cheaply.

    Non-regular members (links, devices, dirs) and fields outside `fields` are
    skipped unread. A sample is only yielded once the next key starts or the
    archive ends cleanly, so a truncated shard never leaks a partial sample.

    Raises:
        TarFormatError: the stream is not a complete tar (truncated, garbage).
        SampleError: `duplicate_field`, `too_many_fields` or `non_adjacent_key`
            (the shard is malformed; the caller decides whether to skip it).

    A sample with an oversized member is yielded with `__error__` set to a
    `SampleError("member_too_large")` and without that member's bytes, so the
    consumer counts it as one skipped sample and the rest of the shard survives.
    """
    seen_keys: set[str] = set()
    pending: Sample | None = None
    index = -1
    for name, regular, size in iter_tar_members(stream):
        padded = size + (-size % BLOCK)
        key, field = split_member_name(name)
        if not regular or field not in fields:
            _pass_over(stream, padded, name)
            continue
        if pending is None or key != pending["__key__"]:
            if pending is not None and index >= start:
                yield pending
            if key in seen_keys:
                raise SampleError("non_adjacent_key", f"{key} appears twice in {url}")
            seen_keys.add(key)
            pending = {"__key__": key, "__url__": url}
            index += 1
        if index < start:
            _pass_over(stream, padded, name)
            continue
        if size > max_member_bytes:
            pending["__error__"] = SampleError(
                "member_too_large", f"{name} in {url} is {size} bytes (cap {max_member_bytes})"
            )
            _pass_over(stream, padded, name)
            continue
        if field in pending:
            raise SampleError("duplicate_field", f"{name} twice in {url}")
        if len(pending) > MAX_MEMBERS_PER_SAMPLE:
            raise SampleError("too_many_fields", f"{key} in {url}")
        pending[field] = _read_exact(stream, size, name)
        _skip(stream, padded - size, name)
    if pending is not None and index >= start:
        yield pending


def _pass_over(stream: BinaryIO, size: int, name: str) -> None:
    """Skip member data: seek where possible (a truncation then shows at the next header)."""
    if size and stream.seekable():
        stream.seek(size, 1)
    else:
        _skip(stream, size, name)


def count_tar_samples(
    stream: BinaryIO, url: str = "", limits=None, fields: frozenset[str] = ALLOWED_FIELDS
) -> int:
    """Count samples (distinct adjacent keys with an allowlisted field) by reading headers only.

    Seeks over member data when the stream can seek, so counting a local shard
    reads a few KB per sample at most.
    """
    count, last_key = 0, None
    for name, regular, size in iter_tar_members(stream):
        _pass_over(stream, size + (-size % BLOCK), name)
        key, field = split_member_name(name)
        if regular and field in fields and key != last_key:
            count += 1
            last_key = key
    return count
