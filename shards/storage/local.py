"""Local reads: only a regular file is opened, and never in a way that can block.

A FIFO or device planted under a shard's, manifest's or side table's name is refused
at once (opened `O_NONBLOCK`, checked with `fstat`) instead of blocking `open()` forever.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from shards.errors import DataError
from shards.storage.retry import ObjectNotFoundError, ShardReadError, size_mismatch

LOCAL_BUFFER_SIZE = 1 << 20


class NotRegularFileError(DataError, OSError):
    """A path names a FIFO, device or directory where a file is expected."""


def open_regular_file(path: str | os.PathLike, buffering: int = -1) -> BinaryIO:
    """Open a local file for reading; only a regular file is one.

    Raises:
        NotRegularFileError: it is not a regular file.
        OSError: it cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(
                f"{Path(path).name} is not a regular file (a FIFO, device or directory)"
            )
        os.set_blocking(fd, True)
        return open(fd, "rb", buffering=buffering)  # noqa: SIM115 - the caller closes it
    except BaseException:
        os.close(fd)
        raise


def read_regular_file(path: str | os.PathLike) -> bytes:
    """All bytes of a local regular file (`open_regular_file`)."""
    with open_regular_file(path) as stream:
        return stream.read()


def open_local(path: str, expected_size: int | None = None) -> BinaryIO:
    """Open a local shard as `open_stream` does: every failure a `ShardReadError`.

    Raises:
        ObjectNotFoundError: nothing is there.
        ShardReadError: not a regular file, not readable, or larger than `expected_size`.
    """
    try:
        file = open_regular_file(path, LOCAL_BUFFER_SIZE)
    except NotRegularFileError:
        raise ShardReadError(path, "not a regular file (a FIFO, device or directory)") from None
    except FileNotFoundError as exc:
        raise ObjectNotFoundError(path, f"FileNotFoundError: {exc.strerror or exc}") from exc
    except OSError as exc:
        raise ShardReadError(path, f"{type(exc).__name__}: {exc.strerror or exc}") from exc
    size = os.fstat(file.fileno()).st_size
    if expected_size is not None and size > expected_size:
        file.close()
        raise ShardReadError(path, size_mismatch(size, expected_size))
    return file
