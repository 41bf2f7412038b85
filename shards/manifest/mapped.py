"""Side tables read from a local directory, memory-mapped rather than copied."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from pathlib import Path

from shards.storage import open_regular_file

# `(name, recorded byte count) -> the side file's bytes`, at most count + 1 of them.
TableReader = Callable[[str, int], "bytes | MappedFile"]


class LocalTableReader:
    """Reads side tables from a local directory (a `TableReader`), mapped, not copied."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)

    def __call__(self, name: str, size: int) -> MappedFile:
        return MappedFile(self.directory / name)


class MappedFile:
    """A local side table, memory-mapped: hashed in pieces, then only the columns read.

    A million-shard table is ~76 MB; read into memory whole, it would be the peak of
    every process that loads the manifest. Mapped, hashing reads it through a small
    buffer and Parquet touches only the pages of the columns it decodes.
    """

    CHUNK = 1 << 20

    def __init__(self, path: Path) -> None:
        # Kept open until hashed: the bytes hashed are the ones mapped.
        self.file = open_regular_file(path)
        self.size = os.fstat(self.file.fileno()).st_size
        self.map = mmap.mmap(self.file.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""

    def __len__(self) -> int:
        return self.size

    def hexdigest(self) -> str:
        """The file's sha256, read through a small buffer (mapped pages would stay resident)."""
        digest = hashlib.sha256()
        chunk = bytearray(self.CHUNK)
        with self.file:
            self.file.seek(0)
            while read := self.file.readinto(chunk):
                digest.update(memoryview(chunk)[:read])
        return digest.hexdigest()
