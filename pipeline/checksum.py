"""Open a shard for its reader, optionally proving its bytes match the manifest's sha256 first.

With `LoaderConfig(verify_checksums=True)` a tampered or bit-rotted shard is a bad
shard (`ShardError("checksum")`) before any of its samples is delivered, so a
mismatch never reaches training half-read. A local file is hashed in place and then
read (the second read comes from the page cache); a remote one is downloaded once
into an unnamed temporary file while being hashed, and read from there, so it is
never fetched twice. The cost is measured in docs/RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

from shards.errors import ShardError
from shards.storage import RetryPolicy, is_remote, open_stream

if TYPE_CHECKING:
    from pipeline.sources import ShardSpec

HASH_CHUNK = 4 * 2**20


@contextlib.contextmanager
def open_shard(
    spec: ShardSpec,
    retry: RetryPolicy,
    storage_options: dict[str, Any] | None,
    verify: bool = False,
) -> Iterator[BinaryIO]:
    """Yield a readable stream of `spec`'s shard, seekable when its format needs it.

    Raises:
        ShardError: `checksum` when `verify` is set and the bytes differ from the
            manifest's sha256 (a shard without a recorded checksum is read unchecked).
        ShardReadError: the shard could not be read.
    """
    random_access = spec.format.random_access
    with open_stream(
        spec.url,
        retry,
        storage_options=storage_options,
        random_access=random_access,
        expected_size=spec.bytes,
    ) as stream:
        if not verify or spec.sha256 is None:
            yield stream
            return
        if not is_remote(spec.url):
            check_digest(spec, hash_stream(stream))
            stream.seek(0)
            yield stream
            return
        with tempfile.TemporaryFile() as spool:
            check_digest(spec, hash_stream(stream, spool))
            spool.seek(0)
            yield spool


def hash_stream(stream: BinaryIO, copy_to: BinaryIO | None = None) -> str:
    """Hex sha256 of the rest of `stream`, copying the bytes to `copy_to` when given."""
    digest = hashlib.sha256()
    while chunk := stream.read(HASH_CHUNK):
        digest.update(chunk)
        if copy_to is not None:
            copy_to.write(chunk)
    return digest.hexdigest()


def check_digest(spec: ShardSpec, found: str) -> None:
    if found != spec.sha256:
        raise ShardError(
            "checksum",
            spec.url,
            f"sha256 {found[:16]}... differs from the manifest's {spec.sha256[:16]}...: the "
            "shard is corrupt or was replaced; check it with `preprocess verify`",
        )
