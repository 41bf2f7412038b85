"""Side tables read beside their manifest: memory-mapped when local, through storage when remote."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from shards.storage import DEFAULT_RETRY, RetryPolicy, is_remote, open_regular_file, open_stream

# `(name, recorded byte count) -> the side file's bytes`, at most count + 1 of them.
TableReader = Callable[[str, int], "bytes | MappedFile"]


class SideTableReader:
    """Reads side tables beside their manifest (a `TableReader`): mapped, not copied, from
    a local directory; through `shards.storage.open_stream` from any store (the shards'
    retries, deadline and redaction, and no more than the manifest's byte count)."""

    def __init__(
        self,
        directory: str | os.PathLike,
        retry: RetryPolicy = DEFAULT_RETRY,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.directory = os.fspath(directory).rstrip("/") or "/"
        self.retry, self.storage_options = retry, storage_options

    def __call__(self, name: str, size: int) -> bytes | MappedFile:
        if not is_remote(self.directory):
            return MappedFile(Path(self.directory) / name)
        url = f"{self.directory}/{name}"
        options = self.storage_options
        with open_stream(url, self.retry, storage_options=options, expected_size=size) as stream:
            return stream.read(size + 1)


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
