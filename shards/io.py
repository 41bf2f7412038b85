"""Atomic, checksummed file output for shards and their manifests.

Every file is written under a temporary name in its final directory, flushed
and fsynced, then renamed, so a crash never leaves a partial file under a final
name (Ray's datasinks and webdataset's ShardWriter write in place; we do not).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

TMP_MARK = ".tmp-"
_HASH_CHUNK = 4 * 2**20


def temp_path_for(final: Path) -> Path:
    """A unique hidden sibling of `final`; readers and resume ignore such names."""
    return final.with_name(f".{final.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """True for names made by `temp_path_for`."""
    return name.startswith(".") and TMP_MARK in name


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable; some filesystems refuse O_RDONLY on dirs.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path; on success it becomes `final` atomically.

    On any exception the temporary file is removed and the exception propagates,
    so an existing file at `final` is left untouched.
    """
    final = Path(final)
    tmp = temp_path_for(final)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    """Write a small file (manifest, marker) atomically."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def remove_stale_temps(directory: str | os.PathLike) -> list[Path]:
    """Delete temporary files left by a crashed writer; returns what was removed."""
    removed = []
    for entry in Path(directory).iterdir():
        if entry.is_file() and is_temp_name(entry.name):
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
