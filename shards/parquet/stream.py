"""Opening a Parquet shard safely: reads within a byte budget, pyarrow's errors as `ShardError`.

The footer and every row group are read through a `WatchedStream`, so a lying
footer cannot make a reader spend more memory than `ReadLimits` allows, and a
network failure of the caller's stream is told apart from corrupt bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from shards.errors import ReadLimits, ShardError
from shards.parquet.pages import iter_page_sizes
from shards.redact import redact_text

# pyarrow opens a file by reading this much of its tail, footer and data alike.
FOOTER_READ_BYTES = 64 * 2**10

# pyarrow's words for a file without Parquet's magic or too short to hold a footer.
_NOT_PARQUET_SIGNS = ("magic bytes", "file size is 0", "minimum file footer")
REBUILD = "rebuild the shard with `preprocess build-shards`"
_HINTS = {
    "not_parquet": f"it is not a Parquet file, or was cut short by a crashed write; {REBUILD}",
    "bad_footer": f"its footer (the file metadata) is corrupt; {REBUILD}",
    "bad_data": f"its column data is corrupt; {REBUILD} and run `preprocess verify`",
}


class WatchedStream:
    """The caller's stream, keeping the exception its own methods raised, with a read budget.

    pyarrow re-raises a Python file's exception as it was, but reports a corrupt file
    with OSError too; the recorded exception is how a network failure (transient,
    propagated as it is) is told apart from bad bytes (`ShardError`).

    The budget caps the bytes read for the footer or one row group, whatever the
    footer claims: a read past it raises the `ShardError` that `refuse(total)`
    builds, before any memory is spent on it. Reading a row group, it also caps what
    its pages decompress to: pyarrow reads each column chunk in one read (no
    pre-buffering, no buffered stream), whose page headers state the size pyarrow
    will allocate for each page (`shards.parquet.pages`); past `unpacked` bytes in
    all, the read raises `refuse_unpacked(total)`, before any page is decompressed.
    """

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream
        self.error: Exception | None = None
        self._left = 0
        self._refuse: Callable[[int], ShardError] | None = None
        self._spent = 0
        self._unpacked: tuple[int, Callable[[int], ShardError]] | None = None
        self._pages = 0  # uncompressed bytes the page headers read so far state
        self._lock = threading.Lock()  # pyarrow may read columns from several threads

    def budget(
        self,
        nbytes: int,
        refuse: Callable[[int], ShardError],
        unpacked: tuple[int, Callable[[int], ShardError]] | None = None,
    ) -> None:
        """Allow `nbytes` more bytes of reads; past them, raise `refuse(bytes asked)`.

        `unpacked`: `(cap, refuse)` when each read is a column chunk: past `cap`
        bytes stated by its page headers, raise `refuse(bytes stated)`.
        """
        with self._lock:
            self._left, self._refuse, self._spent = nbytes, refuse, 0
            self._unpacked, self._pages = unpacked, 0

    def read(self, size: int = -1) -> bytes:
        with self._lock:
            over = self._refuse is not None and size is not None and size > self._left
            self._left -= max(size or 0, 0)
            self._spent += max(size or 0, 0)
            if over:
                self.error = self._refuse(self._spent)
                raise self.error
        try:
            data = self._stream.read(size)
        except Exception as exc:
            self.error = exc
            raise
        if self._unpacked is not None:
            self._check_pages(data)
        return data

    def _check_pages(self, chunk: bytes) -> None:
        cap, refuse = self._unpacked
        stated = 0
        for size in iter_page_sizes(chunk):
            stated += size
            if stated > cap:  # a header stating 2^31 pages of 2^31 bytes stops here
                break
        with self._lock:
            self._pages += stated
            if self._pages > cap:
                self.error = refuse(self._pages)
                raise self.error

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return self._stream.seek(offset, whence)
        except Exception as exc:
            self.error = exc
            raise

    def tell(self) -> int:
        try:
            return self._stream.tell()
        except Exception as exc:
            self.error = exc
            raise

    @property
    def closed(self) -> bool:
        return self._stream.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        """The caller opened the stream and closes it."""


@contextmanager
def arrow_errors(stream: WatchedStream, url: str, reason: str) -> Iterator[None]:
    """pyarrow's errors on bad bytes as `ShardError(reason)`; the stream's own, unchanged."""
    try:
        yield
    # UnicodeDecodeError: pyarrow decodes column names that are not UTF-8.
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        if stream.error is exc:
            raise
        if stream.error is not None:
            raise stream.error from exc
        if reason == "bad_footer" and any(sign in str(exc) for sign in _NOT_PARQUET_SIGNS):
            reason = "not_parquet"
        detail = f"{type(exc).__name__}: {redact_text(str(exc).strip())}; {_HINTS[reason]}"
        raise ShardError(reason, url, detail) from exc


@contextmanager
def open_source(source: BinaryIO | str | os.PathLike) -> Iterator[WatchedStream]:
    if isinstance(source, (str, os.PathLike)):
        # A Python file rather than pyarrow's own, so a disk error stays an OSError
        # of the stream (transient) and is never mistaken for a corrupt shard.
        with open(source, "rb") as file:
            yield WatchedStream(file)
    else:
        yield WatchedStream(source)


def open_parquet(stream: WatchedStream, url: str, limits: ReadLimits) -> pq.ParquetFile:
    budget = limits.row_group_bytes + FOOTER_READ_BYTES
    stream.budget(budget, partial(_footer_too_large, url, budget))
    with arrow_errors(stream, url, "bad_footer"):
        # No pre-buffering and no buffered stream: both copy whole column chunks
        # (pages) a second time. Extension types are never materialised.
        return pq.ParquetFile(
            stream, pre_buffer=False, buffer_size=0, arrow_extensions_enabled=False
        )


def _footer_too_large(url: str, budget: int, size: int) -> ShardError:
    return ShardError(
        "bad_footer",
        url,
        f"opening it reads {size} bytes, over the {budget} allowed (ReadLimits.row_group_bytes "
        f"plus pyarrow's first {FOOTER_READ_BYTES}-byte read of the file's tail); {REBUILD}",
    )


def row_counts(parquet: pq.ParquetFile, stream: WatchedStream, url: str) -> list[int]:
    with arrow_errors(stream, url, "bad_footer"):
        meta = parquet.metadata
        counts = [meta.row_group(group).num_rows for group in range(meta.num_row_groups)]
        total = meta.num_rows
    if any(count < 0 for count in counts) or sum(counts) != total:
        raise ShardError(
            "bad_footer",
            url,
            f"row group counts {counts[:8]}... do not add up to its {total} rows; {REBUILD}",
        )
    return counts


def check_row_group(parquet: pq.ParquetFile, group: int, url: str, limits: ReadLimits) -> int:
    """Row group `group`'s uncompressed size from the footer; refused past the cap.

    Column chunk sizes are not read from pyarrow's metadata objects: on a corrupt
    footer (a size-statistics histogram of the wrong length) pyarrow 26 aborts the
    process there. The bytes the columns really take are capped as they are read,
    by the stream's budget, which a lying footer cannot escape.
    """
    meta = parquet.metadata.row_group(group)
    size, rows = meta.total_byte_size, meta.num_rows
    if size < 0:
        raise ShardError("bad_footer", url, f"row group {group} has a negative size; {REBUILD}")
    if size > limits.row_group_bytes:
        raise row_group_too_large(url, group, rows, limits, size)
    return size


def pages_too_large(
    url: str, group: int, claimed: int, limits: ReadLimits, size: int
) -> ShardError:
    """A row group whose page headers state more than the cap, though its footer did not."""
    return ShardError(
        "bad_data",
        url,
        f"the pages of row group {group} decompress to at least {size} bytes (their headers "
        f"say so), over the cap of {limits.row_group_bytes} (ReadLimits.row_group_bytes), "
        f"though its footer says the group takes {claimed}: a decompression bomb or a "
        f"corrupt file; nothing of it was decompressed. Replace the file; {REBUILD}",
    )


def row_group_too_large(
    url: str, group: int, rows: int, limits: ReadLimits, size: int
) -> ShardError:
    suggested = max(1, rows * limits.row_group_bytes // (2 * max(size, 1)))
    return ShardError(
        "row_group_too_large",
        url,
        f"row group {group} takes at least {size} bytes uncompressed ({rows} rows), over the "
        f"cap of {limits.row_group_bytes} (ReadLimits.row_group_bytes): a reader holds a whole "
        f"row group in memory; rebuild with `preprocess build-shards --row-group-size "
        f"{suggested}` (a file another tool wrote: rewrite it with row groups of at most "
        f"{suggested} rows)",
    )
