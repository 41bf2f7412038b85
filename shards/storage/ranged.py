"""Fetch a whole remote shard into a file over parallel ranged requests.

A store that caps one connection's bandwidth (or adds tens of milliseconds before
each first byte) caps a single stream; `fetch_into` splits the object into spans
and reads them over `connections` requests at once (HTTP `Range`, object-store
ranged GETs through fsspec), writing each span at its offset. Every request is a
`RetryingStream` or `RetryingFsspecFile`, so retries, stall limits and redaction are
those of a streamed read. All the requests of one fetch share two things: one
`ObjectIdentity`, pinned by the first response (size, and ETag, else Last-Modified), so
an object replaced between spans is never spliced (the fetch starts over once from the
new version, then fails with `ObjectChangedError`), and one wall clock started with
the fetch, so the policy's deadline covers all the spans together. The file is what
the caller gives: a cache entry or a temporary file, never memory.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

from shards.storage.read import open_stream
from shards.storage.registry import TRANSPORTS, Transport
from shards.storage.retry import (
    ObjectChangedError,
    ObjectIdentity,
    RetryPolicy,
    ShardReadError,
    StreamClock,
)
from shards.storage.urls import is_remote, url_scheme, validate_url

DEFAULT_PREFETCH_BYTES = 256 * 2**20  # per worker, fetched ahead and not yet read
DEFAULT_CONNECTIONS = 4  # ranged requests in parallel per shard
MAX_SPAN = 8 * 2**20  # one request's bytes at most (the usual S3 ranged-GET size)
MIN_SPAN = 1 * 2**20  # ... and at least, unless the shard is smaller
COPY_CHUNK = 1 * 2**20


def fetch_into(
    url: str,
    fd: int,
    retry: RetryPolicy,
    *,
    size: int | None,
    storage_options: Mapping[str, Any] | None = None,
    connections: int = DEFAULT_CONNECTIONS,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Write the bytes at `url` into `fd` at their offsets; return how many there were.

    Args:
        size: the manifest's byte count: the most that is fetched. Without one the
            shard is streamed over one connection (a size is needed to split it).
        progress: called with each chunk's byte count as it lands (for stats).

    Returns:
        The byte count written: `size`, or fewer when the server holds a shorter
        object (the caller decides; the shard reader reports the truncation).

    Raises:
        ObjectChangedError: the object was replaced during the fetch, and again
            during its one restart.
        ShardReadError: a request failed past the retry budget, the shard deadline
            (one clock for the whole fetch) passed, or the server holds more bytes
            than `size`.
        ValueError: the URL is not allowed.
    """
    url = validate_url(url)
    tick = progress or (lambda count: None)
    transport = TRANSPORTS[url_scheme(url)]
    if size is None or type(transport).open_span is Transport.open_span:
        with open_stream(url, retry, storage_options=storage_options, expected_size=size) as f:
            return _copy(f, fd, 0, None, tick)
    if size == 0:
        return 0
    clock = StreamClock(retry, started=time.monotonic())
    try:
        return _fetch_spans(url, fd, retry, size, storage_options, connections, tick, clock)
    except ObjectChangedError:
        # Replaced mid-fetch: start over from the new version, under the same deadline,
        # leaving nothing of the old in the file. A second change is the shard's error.
        os.ftruncate(fd, 0)
        return _fetch_spans(url, fd, retry, size, storage_options, connections, tick, clock)


@contextlib.contextmanager
def local_copy(
    url: str,
    retry: RetryPolicy,
    *,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Iterator[str]:
    """A local path holding the bytes at `url`, for code that reads files (verify, index).

    A local path is itself; a remote shard is fetched whole (`fetch_into`: the store's
    retries, deadline and pinned identity) into a temporary folder under its own file
    name, so messages naming the file name the shard, and removed on exit.

    Raises:
        ObjectNotFoundError, ShardReadError: as `fetch_into`.
    """
    url = validate_url(url)
    if not is_remote(url):
        yield url
        return
    folder = tempfile.mkdtemp(prefix=".shardpipe-copy-")
    try:
        name = posixpath.basename(unquote(urlsplit(url).path)) or "object"
        path = os.path.join(folder, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fetch_into(
                url, fd, retry, size=None, storage_options=storage_options, progress=progress
            )
        finally:
            os.close(fd)
        yield path
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _fetch_spans(
    url: str,
    fd: int,
    retry: RetryPolicy,
    size: int,
    storage_options: Mapping[str, Any] | None,
    connections: int,
    tick: Callable[[int], None],
    clock: StreamClock,
) -> int:
    """One try of `fetch_into`'s ranged fetch: spans over `connections` threads, each
    request pinned to the first response's version and timed by `clock`."""
    span = min(MAX_SPAN, max(MIN_SPAN, -(-size // connections)))
    opener = _RangeOpener(url, retry, size, storage_options or {}, clock)
    # The first span is read here: its response tells the object's real size.
    first, total = opener.open(0, min(span, size))
    total = min(size, total if total is not None else size)
    spans = [(start, min(start + span, total)) for start in range(span, total, span)]
    lock = threading.Lock()
    failures: list[BaseException] = []

    def next_span() -> tuple[int, int] | None:
        with lock:
            if failures or not spans:
                return None
            if clock.remaining() <= 0:
                failures.append(ShardReadError(url, _deadline_reason(retry, total)))
                return None
            return spans.pop(0)

    def run(reader: Any = None, start: int = 0, stop: int = 0) -> None:
        try:
            while True:
                if reader is None:
                    job = next_span()
                    if job is None:
                        return
                    start, stop = job
                    reader, _ = opener.open(start, stop)
                with reader:
                    # Where each read is one request (an object-store ranged GET), the
                    # span goes in one read: one request, not one per copy chunk.
                    whole = opener.transport.request_per_read
                    chunk = stop - start if whole else COPY_CHUNK
                    _copy(reader, fd, start, stop - start, tick, url, chunk)
                reader = None
        except BaseException as exc:  # handed to the caller's thread below
            if reader is not None:
                reader.close()
            with lock:
                failures.append(exc)

    helpers = [
        threading.Thread(target=run, daemon=True, name="shard-range")
        for _ in range(min(connections - 1, len(spans)))
    ]
    for thread in helpers:
        thread.start()
    run(first, 0, min(span, total))
    for thread in helpers:
        thread.join()
    if failures:
        # A change anywhere means the other failures are its consequence (412s, short
        # bodies): the caller restarts on it.
        changed = [exc for exc in failures if isinstance(exc, ObjectChangedError)]
        raise (changed or failures)[0]
    return total


class _RangeOpener:
    """Opens one retrying reader positioned at a span's start through the URL's transport;
    all its readers share one deadline clock and one pinned object identity."""

    def __init__(
        self,
        url: str,
        retry: RetryPolicy,
        size: int,
        options: Mapping[str, Any],
        clock: StreamClock,
    ):
        self.url, self.retry, self.size, self.clock = url, retry, size, clock
        self.options = options
        self.identity = ObjectIdentity()
        self.transport = TRANSPORTS[url_scheme(url)]

    def open(self, start: int, stop: int) -> tuple[Any, int | None]:
        """A reader at `start` (its requests end at `stop` where ranges allow) and the
        object's size."""
        reader = self.transport.open_span(
            self.url,
            self.retry,
            storage_options=self.options,
            size=self.size,
            start=start,
            stop=stop,
            clock=self.clock,
            identity=self.identity,
        )
        return reader, reader.size


def _copy(
    reader: Any,
    fd: int,
    offset: int,
    count: int | None,
    tick: Callable[[int], None],
    url: str = "",
    chunk: int = COPY_CHUNK,
) -> int:
    """Copy `count` bytes (None: to the end) from `reader` to `fd` at `offset`, `chunk`
    bytes a read: a retrying reader's own bytes are written as they come (no second
    buffer of a span), anything else's through one buffer."""
    read_chunk = getattr(reader, "read_chunk", None)
    buffer = None if read_chunk else memoryview(bytearray(chunk))
    done = 0
    while count is None or done < count:
        want = chunk if count is None else min(chunk, count - done)
        if read_chunk:
            view = memoryview(read_chunk(want))
        else:
            view = buffer[: reader.readinto(buffer[:want])]
        got = len(view)
        if not got:
            if count is None:
                break
            raise ShardReadError(url, f"the body ended at byte {offset + done}, short of its span")
        written = 0
        while written < got:
            written += os.pwrite(fd, view[written:got], offset + done + written)
        done += got
        tick(got)
    return done


def _deadline_reason(retry: RetryPolicy, size: int) -> str:
    return (
        f"the {retry.deadline:g} s shard deadline passed while fetching its {size} bytes; "
        "if the shard is large or the link slow, raise it with RetryPolicy(deadline=...)"
    )
