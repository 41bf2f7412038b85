"""A manifest's files in any store: `read_manifest` (the one reader every package uses) and
`write_manifest` (a directory or an `OutputStore`)."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from shards.manifest.errors import ManifestError, ManifestNotFoundError
from shards.manifest.mapped import SideTableReader
from shards.manifest.model import Manifest
from shards.manifest.names import INLINE_MAX_SHARDS, MANIFEST_NAME, MAX_MANIFEST_BYTES
from shards.redact import redact_url
from shards.storage import (
    DEFAULT_RETRY,
    NotRegularFileError,
    ObjectNotFoundError,
    RetryPolicy,
    is_remote,
    open_regular_file,
    open_stream,
)
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


def manifest_url(location: str | os.PathLike) -> str:
    """The manifest a location names: itself when a `.json` file or URL (a presigned URL's
    query is not its path), else the `manifest.json` inside the directory or prefix."""
    text = os.fspath(location)
    if not is_remote(text):
        return str(Path(text) / MANIFEST_NAME) if os.path.isdir(text) else text
    parts = urlsplit(text)
    if parts.path.endswith(".json"):
        return text
    path = parts.path.rstrip("/") + "/" + MANIFEST_NAME
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


def manifest_base(url: str | os.PathLike) -> str:
    """The directory shard names in a manifest are relative to (no query string)."""
    text = os.fspath(url)
    if not is_remote(text):
        return os.path.dirname(os.path.abspath(text))
    parts = urlsplit(text)
    return urlunsplit((parts.scheme, parts.netloc, posixpath.dirname(parts.path), "", ""))


def read_manifest(
    location: str | os.PathLike,
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
    splits: Collection[str] | None = None,
    formats: Collection[str] | None = None,
    shard_class_counts: bool = True,
    shard_digests: bool = True,
) -> Manifest:
    """Read and validate a manifest from any store: a `manifest.json` path or URL, or the
    directory (prefix) holding one; its side tables are read beside it (`SideTableReader`).

    Remote reads get the storage layer's `retry` (retries, stall limit, deadline) and
    `storage_options`. `splits`, `formats`, `shard_class_counts` and `shard_digests` read a
    subset, as for `Manifest.from_json`.

    Raises:
        ManifestNotFoundError: there is no manifest (`missing_manifest` says why it may
            be); a `FileNotFoundError`, as it always was, and one of our `DataError`s.
        ManifestError: the file is larger than `MAX_MANIFEST_BYTES`, not a regular
            file (a FIFO: refused, never waited on) or not a valid manifest, or a side
            table it names is missing, not a regular file, or invalid.
        ShardReadError: a remote manifest could not be read past the retry budget.
    """
    url = manifest_url(location)
    data = _read_remote(url, retry, storage_options) if is_remote(url) else _read_local(url)
    return Manifest.from_json(
        data,
        url,
        read_table=SideTableReader(manifest_base(url), retry, storage_options),
        splits=splits,
        formats=formats,
        shard_class_counts=shard_class_counts,
        shard_digests=shard_digests,
    )


def _read_local(path: str) -> bytes:
    if not os.path.exists(path):
        raise ManifestNotFoundError(missing_manifest(path))
    try:
        file = open_regular_file(path)
    except NotRegularFileError as error:
        raise ManifestError(path, "(file)", f"{error}; a manifest is a file") from error
    with file:
        return file.read(MAX_MANIFEST_BYTES + 1)


def _read_remote(url: str, retry: RetryPolicy, storage_options: Mapping[str, Any] | None) -> bytes:
    try:
        with open_stream(url, retry, storage_options=storage_options) as stream:
            return stream.read(MAX_MANIFEST_BYTES + 1)
    except ObjectNotFoundError:
        raise ManifestNotFoundError(missing_manifest(redact_url(url))) from None
