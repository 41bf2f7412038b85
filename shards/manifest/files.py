"""A manifest's files in a directory or an `OutputStore`: `read_manifest` and `write_manifest`."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from shards.manifest.errors import ManifestError
from shards.manifest.mapped import LocalTableReader
from shards.manifest.model import Manifest
from shards.manifest.names import INLINE_MAX_SHARDS, MANIFEST_NAME, MAX_MANIFEST_BYTES
from shards.storage import NotRegularFileError, open_regular_file
from shards.storage.write import OutputStore, atomic_write_bytes


def write_manifest(
    target: str | Path | OutputStore,
    manifest: Manifest,
    *,
    inline_max_shards: int = INLINE_MAX_SHARDS,
) -> Path | str:
    """Write the side tables, then `manifest.json` (the dataset's commit point), atomically.

    `target` is a directory or an `OutputStore`; returns where the manifest went.
    """
    files = manifest.to_files(inline_max_shards)
    if isinstance(target, OutputStore):
        for name, data in files:
            target.write_bytes_atomic(name, data)
        return target.location(MANIFEST_NAME)
    directory = Path(target)
    for name, data in files:
        atomic_write_bytes(directory / name, data)
    return directory / MANIFEST_NAME


def missing_manifest(location: str) -> str:
    """Why a manifest may be missing, and what to do: a build of ours that did not finish,
    or shards another tool wrote (which need none, or `preprocess index` to save one)."""
    return (
        f"no manifest at {location}: a `preprocess build-shards` output without one did not "
        "finish (rerun the same command); shards written by other tools are read without "
        "one, or get one from `preprocess index` on their directory"
    )


def read_manifest(
    path: str | Path,
    *,
    splits: Collection[str] | None = None,
    formats: Collection[str] | None = None,
    shard_class_counts: bool = True,
) -> Manifest:
    """Read and validate a local manifest file or the manifest inside a shard directory.

    Side tables are read from the manifest's directory. `splits`, `formats` and
    `shard_class_counts` read a subset, as for `Manifest.from_json`.

    Raises:
        FileNotFoundError: there is no manifest (`missing_manifest` says why it may be).
        ManifestError: the file is larger than `MAX_MANIFEST_BYTES`, not a regular
            file (a FIFO: refused, never waited on) or not a valid manifest, or a side
            table it names is missing, not a regular file, or invalid.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.exists():
        raise FileNotFoundError(missing_manifest(str(path)))
    try:
        file = open_regular_file(path)
    except NotRegularFileError as error:
        problem = f"{error}; a manifest is a file"
        raise ManifestError(path, "(file)", problem) from error
    with file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    return Manifest.from_json(
        data,
        path,
        read_table=LocalTableReader(path.parent),
        splits=splits,
        formats=formats,
        shard_class_counts=shard_class_counts,
    )
