"""Atomic, checksummed file output, local or in an object store: the writing half of storage.

Every file this project commits goes through here: shards and manifests, the sample
tree, the trainer's metrics and checkpoints.

Every file is written under a temporary name in its final directory, flushed
and fsynced, then renamed, so a crash never leaves a partial file under a final
name (Ray's datasinks and webdataset's ShardWriter write in place; we do not).
In an object store the file is staged locally, then uploaded with one PUT (or
one multipart upload), which the store makes visible all at once or not at all.
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shards.errors import UsageError
from shards.storage.local import read_regular_file
from shards.storage.registry import Transport, transport_of
from shards.storage.retry import DEFAULT_RETRY, ObjectNotFoundError
from shards.storage.urls import is_remote, local_path, url_scheme

TMP_MARK = ".tmp-"
_HASH_CHUNK = 4 * 2**20
STAGING_PREFIX = ".shardpipe-staging-"


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
def atomic_path(final: str | os.PathLike, *, durable: bool = True) -> Iterator[Path]:
    """Yield a temporary path; on success it becomes `final` atomically.

    On any exception the temporary file is removed and the exception propagates,
    so an existing file at `final` is left untouched.

    Args:
        durable: fsync the file and its directory, so the rename survives a power
            loss. A writer of many small files (`make-sample`'s tree) passes False and
            calls `os.sync()` once at the end: two fsyncs an image halved its speed.
    """
    final = Path(final)
    tmp = temp_path_for(final)
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if durable:
            _fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_bytes(final: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """Write a small file (manifest, marker, metrics, config) atomically (`atomic_path`)."""
    with atomic_path(final, durable=durable) as tmp:
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


@dataclass(frozen=True)
class StoredInfo:
    """What a store knows about one stored file without reading it.

    Attributes:
        size: bytes.
        etag: the object store's version tag, which changes whenever the object
            is rewritten (with other content); None for local files.
    """

    size: int
    etag: str | None = None


class OutputStore(abc.ABC):
    """Where a build writes: a local directory or an object-store prefix.

    Names are relative, `/`-separated (`train-000000.tar`, `_build/config.json`).
    Every write is atomic: a reader sees the whole file under its name or nothing.
    """

    url: str  # the directory or URL, for messages; never holds credentials

    def location(self, name: str) -> str:
        """Path or URL of `name`, for messages and for readers."""
        return f"{self.url.rstrip('/')}/{name}"

    @abc.abstractmethod
    def info(self, name: str) -> StoredInfo | None:
        """Size and version tag of `name`, or None when it does not exist."""

    @abc.abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The content of a small file; raises FileNotFoundError when missing."""

    @abc.abstractmethod
    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        """Write a small file (marker, manifest) all at once."""

    @abc.abstractmethod
    def staged(self, name: str) -> contextlib.AbstractContextManager[Path]:
        """Context manager yielding a local temporary path that becomes `name` on success.

        On an exception nothing appears under `name` (an existing file there is
        left untouched) and the temporary file is removed.
        """

    @abc.abstractmethod
    def sha256(self, name: str) -> str:
        """Hex sha256 of a stored file, read in chunks."""

    @abc.abstractmethod
    def list(self) -> list[str]:
        """Every file name under the root, recursively, sorted."""

    @abc.abstractmethod
    def is_empty(self) -> bool:
        """True when the root does not exist or holds nothing."""

    @abc.abstractmethod
    def remove(self, name: str) -> None:
        """Delete one file; a missing file is not an error."""

    @abc.abstractmethod
    def remove_tree(self, name: str) -> None:
        """Delete a directory (a prefix) and everything under it; missing is fine."""

    @abc.abstractmethod
    def remove_stale_temps(self) -> list[str]:
        """Delete temporary files a crashed writer left (at the root and in its format
        directories); returns their names."""


class LocalStore(OutputStore):
    """A local (or shared network) directory: temp file, fsync, rename."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root).resolve()
        self.url = str(self.root)

    def location(self, name: str) -> str:
        return str(self.root / name)

    def info(self, name: str) -> StoredInfo | None:
        try:
            return StoredInfo((self.root / name).stat().st_size)
        except FileNotFoundError:
            return None

    def read_bytes(self, name: str) -> bytes:
        return read_regular_file(self.root / name)

    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(self.root / name, data)

    @contextlib.contextmanager
    def staged(self, name: str) -> Iterator[Path]:
        (self.root / name).parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.root / name) as tmp:
            yield tmp

    def sha256(self, name: str) -> str:
        return file_sha256(self.root / name)

    def list(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()
        )

    def is_empty(self) -> bool:
        return not self.root.exists() or not any(self.root.iterdir())

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def remove_tree(self, name: str) -> None:
        import shutil

        shutil.rmtree(self.root / name, ignore_errors=True)

    def remove_stale_temps(self) -> list[str]:
        """At the root and one level down, where a `by_format` build's shards are."""
        if not self.root.exists():
            return []
        removed = remove_stale_temps(self.root)
        for entry in sorted(self.root.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                removed += remove_stale_temps(entry)
        return [p.relative_to(self.root).as_posix() for p in removed]


class FsspecStore(OutputStore):
    """An object-store prefix (`s3://bucket/prefix`) written through fsspec.

    Files are staged in the local temp directory (`TMPDIR`) and uploaded once
    complete; S3 commits a PUT or a multipart upload atomically, so no partial
    object ever exists under a final key, and no temp object needs cleaning.
    Credentials and the endpoint come from the client's standard environment
    and config (for S3: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
    `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`, `~/.aws/config`), or from
    `storage_options`; they never appear in `url` or in messages.
    """

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        import fsspec  # lazily: local builds never pay for it

        scheme = url.split("://", 1)[0].lower()
        # A fresh instance that reads the environment now, and no listing cache:
        # a resumed build must see what is in the store, not what was listed before.
        options = {"skip_instance_cache": True, "use_listings_cache": False}
        options.update(storage_options or {})
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")
        self.url = f"{scheme}://{self.root}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def info(self, name: str) -> StoredInfo | None:
        try:
            details = self.fs.info(self._path(name))
        except FileNotFoundError:
            return None
        if details.get("type") == "directory":
            return None
        etag = details.get("ETag") or details.get("etag")
        return StoredInfo(int(details["size"]), str(etag) if etag else None)

    def read_bytes(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        self.fs.pipe_file(self._path(name), data)  # one PUT: all or nothing

    @contextlib.contextmanager
    def staged(self, name: str) -> Iterator[Path]:
        handle, tmp_name = tempfile.mkstemp(prefix=STAGING_PREFIX, suffix=f"-{Path(name).name}")
        os.close(handle)
        tmp = Path(tmp_name)
        try:
            yield tmp
            # One PUT below the multipart threshold, else one multipart upload
            # that the client aborts on failure; either way the key appears whole.
            self.fs.put_file(str(tmp), self._path(name))
        finally:
            tmp.unlink(missing_ok=True)

    def sha256(self, name: str) -> str:
        digest = hashlib.sha256()
        with self.fs.open(self._path(name), "rb", block_size=_HASH_CHUNK) as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
        return digest.hexdigest()

    def list(self) -> list[str]:
        try:
            paths = self.fs.find(self.root)
        except FileNotFoundError:
            return []
        prefix = self.root + "/"
        return sorted(p[len(prefix) :] for p in paths if p.startswith(prefix))

    def is_empty(self) -> bool:
        return not self.list()

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path(name))

    def remove_tree(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path(name), recursive=True)

    def remove_stale_temps(self) -> list[str]:
        return []  # nothing is ever written under a temporary key


class TransportStore(OutputStore):
    """An `OutputStore` over any transport that can write, list and read (`Transport`):
    small files (manifests, client files) written whole; a shard is staged locally, then
    written in one `write_bytes`."""

    def __init__(self, transport: Transport, url: str, options: Mapping[str, Any]) -> None:
        self.transport, self.options = transport, options
        self.url = url.rstrip("/")

    def location(self, name: str) -> str:
        return f"{self.url}/{name}"

    def info(self, name: str) -> Any:
        try:
            return StoredInfo(len(self.read_bytes(name)))
        except FileNotFoundError:
            return None

    def read_bytes(self, name: str) -> bytes:
        try:
            with self._open(name, DEFAULT_RETRY) as stream:
                return stream.read()
        except ObjectNotFoundError as exc:
            raise FileNotFoundError(self.location(name)) from exc

    def write_bytes_atomic(self, name: str, data: bytes) -> None:
        self.transport.write_bytes(self.location(name), data, self.options)

    @contextlib.contextmanager
    def staged(self, name: str) -> Iterator[Path]:
        handle, tmp_name = tempfile.mkstemp(prefix=STAGING_PREFIX)
        os.close(handle)
        tmp = Path(tmp_name)
        try:
            yield tmp
            self.write_bytes_atomic(name, tmp.read_bytes())
        finally:
            tmp.unlink(missing_ok=True)

    def sha256(self, name: str) -> str:
        return hashlib.sha256(self.read_bytes(name)).hexdigest()

    def list(self) -> list[str]:
        names = []
        for relative, _, files in self.transport.walk(self.url, DEFAULT_RETRY, self.options):
            names += [f"{relative}/{name}" if relative else name for name in files]
        return sorted(names)

    def is_empty(self) -> bool:
        return not self.list()

    def remove(self, name: str) -> None:
        self.transport.remove(self.location(name), self.options)

    def remove_tree(self, name: str) -> None:
        for file in self.list():
            if file.startswith(f"{name}/"):
                self.remove(file)

    def remove_stale_temps(self) -> list[str]:
        return []  # nothing is written under a temporary name

    def _open(self, name: str, retry: Any) -> BinaryIO:
        return self.transport.open(self.location(name), retry, storage_options=self.options)


def open_output_store(
    location: str | os.PathLike, storage_options: Mapping[str, Any] | None = None
) -> OutputStore:
    """The store for a build's `--output` (or `index`'s): a directory, `file://` or a URL
    of a store its transport can write (`s3://`, `gs://`, ...).

    Raises:
        UsageError: no store is registered for the scheme, or it cannot be written.
    """
    text = os.fspath(location)
    if not is_remote(text):
        return LocalStore(local_path(text))
    transport = transport_of(url_scheme(text))
    if transport is None:
        raise UsageError(f"cannot write to {url_scheme(text)}:// URLs: no store serves them")
    store = transport.output_store(text, storage_options)
    return store if store is not None else TransportStore(transport, text, storage_options or {})
