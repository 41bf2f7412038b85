"""A node-local cache of fetched shards, shared by every process on the node through flock.

Layout under the cache directory:

- `<key>.shard`: a complete, checked shard. `<key>` is a hash of the URL, the
  manifest's sha256 and size, so no URL can name a path outside the directory and a
  rebuilt shard gets a new entry. Readers hold `LOCK_SH` on it while reading; the
  evictor takes `LOCK_EX | LOCK_NB`, so a shard in use is never evicted. Its mtime is
  its last use (least-recently-used eviction).
- `<key>.<pid>.<random>.part`: a download in progress, sized to the shard up front
  (so the total under `limit` counts it) and held with `LOCK_EX` by its writer. It
  becomes `<key>.shard` by an atomic rename once its bytes are checked. A part whose
  lock can be taken has no live writer (a killed job): it is removed.
- `claims/<key>`: taken with `LOCK_EX` by the one process downloading that shard;
  others wait on it and then find the shard. The kernel drops the lock of a killed
  holder, so nobody waits on a dead one.
- `.lock`: held briefly around a reservation (usage count, eviction, new part), so
  the total of all processes stays under `limit`.

Eviction is scan-resistant: a reservation names the entries its job reads (`keep`, the
keys of every shard of its sources), and only other entries are evicted, least recently
used first. A job whose data is larger than the limit fills the cache once and streams
the rest: under plain LRU each epoch's pass would evict exactly the shards the next pass
reads first, fetching the whole dataset every epoch; this way it saves what it holds.

Disk errors (a full disk, a read-only or unwritable directory) are raised as
`OSError` for the caller, which turns caching off (`is_disk_error`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from shards.storage.retry import ShardReadError

SHARD_SUFFIX = ".shard"
PART_SUFFIX = ".part"
CLAIMS = "claims"
LOCK_FILE = ".lock"
CLAIM_POLL_S = 0.05
DISK_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EFBIG}
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(text: str) -> int:
    """A byte count from the command line: `1000000`, `500M`, `200G`, `1.5TiB` (powers of 1024).

    Raises:
        ValueError: not a byte count.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a byte count (e.g. 1000000, 500M, 200G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** _UNITS[unit])


def is_disk_error(exc: BaseException) -> bool:
    """Whether `exc` is the cache's disk failing (full, read-only, not ours), not a read."""
    return (
        isinstance(exc, OSError)
        and not isinstance(exc, ShardReadError)
        and exc.errno in DISK_ERRNOS
    )


def cache_key(url: str, sha256: str | None, size: int | None) -> str:
    """The entry name of a shard: a hash, never a path taken from the URL."""
    text = f"{url}\0{sha256 or ''}\0{'' if size is None else size}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclass
class Part:
    """A download in progress: an open, exclusively locked `.part` file."""

    key: str
    path: str
    file: BinaryIO
    reserved: int


class ShardCache:
    """The cache directory `root`, holding at most `limit` bytes of shards (None: the disk)."""

    def __init__(self, root: str, limit: int | None) -> None:
        self.root = os.path.abspath(root)
        self.limit = limit

    def prepare(self) -> None:
        """Create the directory, prove it writable, and remove a killed job's partial files.

        Raises:
            OSError: the directory cannot be made or written (`is_disk_error`).
        """
        os.makedirs(os.path.join(self.root, CLAIMS), exist_ok=True)
        with self._locked():
            self._remove_dead_parts()

    def path(self, key: str) -> str:
        return os.path.join(self.root, key + SHARD_SUFFIX)

    def lookup(self, key: str, size: int | None) -> BinaryIO | None:
        """The cached shard, open and share-locked (close it when done), or None.

        An entry of the wrong size (never written by this cache) is removed.
        """
        path = self.path(key)
        try:
            file = open(path, "rb")  # noqa: SIM115 - returned to the caller, who closes it
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(file, fcntl.LOCK_SH)
            stat = os.fstat(file.fileno())
            if stat.st_nlink == 0:  # evicted between the open and the lock
                file.close()
                return None
            if size is not None and stat.st_size != size:
                file.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return None
            with contextlib.suppress(OSError):
                os.utime(path)  # its last use, for least-recently-used eviction
            return file
        except BaseException:
            file.close()
            raise

    @contextlib.contextmanager
    def claim(self, key: str, wait_s: float) -> Iterator[bool]:
        """Hold the right to download `key` (True), or False when `wait_s` passed first.

        A holder that is killed loses its lock with its process, so a waiter takes over
        instead of hanging.
        """
        with open(os.path.join(self.root, CLAIMS, key), "a+b") as file:
            until = time.monotonic() + wait_s
            while True:
                try:
                    fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= until:
                        yield False
                        return
                    time.sleep(CLAIM_POLL_S)
            try:
                yield True
            finally:
                fcntl.flock(file, fcntl.LOCK_UN)

    def reserve(self, key: str, size: int, keep: frozenset[str] = frozenset()) -> Part | None:
        """A new `.part` file of `size` bytes, after evicting what must go; None if it cannot fit.

        Entries in `keep` (the job's own shards) are never evicted for it.

        Raises:
            OSError: the disk refused (`is_disk_error`).
        """
        if self.limit is not None and size > self.limit:
            return None
        with self._locked():
            if not self._make_room(size, keep):
                return None
            path = os.path.join(
                self.root, f"{key}.{os.getpid()}.{secrets.token_hex(4)}{PART_SUFFIX}"
            )
            file = open(path, "w+b")  # noqa: SIM115 - owned by the Part
            try:
                fcntl.flock(file, fcntl.LOCK_EX)
                allocate(file.fileno(), size)
            except BaseException:
                file.close()
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise
            return Part(key, path, file, size)

    def commit(self, part: Part, size: int, keep: frozenset[str] = frozenset()) -> BinaryIO | None:
        """Publish a fully written, checked part as its shard; return it open and share-locked.

        None: a part reserved without knowing its size (0) came out larger than the
        limit allows once the other shards not in use are evicted; it stays unpublished.

        Raises:
            OSError: the disk refused the flush or rename (`is_disk_error`).
        """
        file = part.file
        if size != part.reserved:
            with self._locked():
                file.truncate(size)
                if not self._make_room(0, keep):
                    return None
        file.flush()
        os.fsync(file.fileno())
        # Under the lock: a rename during another process's usage count could hide the
        # entry from its directory scan (seen under neither name), and it would then
        # reserve past the limit.
        with self._locked():
            os.rename(part.path, self.path(part.key))
        fcntl.flock(file, fcntl.LOCK_SH)  # from exclusive: readable, not evictable
        file.seek(0)
        return file

    def unpublished(self, part: Part) -> BinaryIO:
        """The part's file, kept open for one read, its name removed so nobody else uses it."""
        with contextlib.suppress(OSError):
            os.unlink(part.path)
        part.file.seek(0)
        return part.file

    def remove(self, key: str) -> None:
        """Drop a shard found bad; readers that have it open keep their copy."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(key))

    def discard(self, part: Part) -> None:
        """Remove a part that will not be published."""
        with contextlib.suppress(OSError):
            os.unlink(part.path)
        part.file.close()

    def usage(self) -> int:
        """Bytes held by shards and reserved by parts."""
        return sum(size for _, size, _ in self._entries(PART_SUFFIX)) + sum(
            size for _, size, _ in self._entries(SHARD_SUFFIX)
        )

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(os.path.join(self.root, LOCK_FILE), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _entries(self, suffix: str) -> list[tuple[str, int, float]]:
        found = []
        with os.scandir(self.root) as entries:
            for entry in entries:
                if entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(FileNotFoundError):
                        stat = entry.stat(follow_symlinks=False)
                        found.append((entry.path, stat.st_size, stat.st_mtime))
        return found

    def _remove_dead_parts(self) -> None:
        for path, _, _ in self._entries(PART_SUFFIX):
            _remove_unlocked(path)

    def _make_room(self, size: int, keep: frozenset[str]) -> bool:
        """Evict least-recently-used shards not in use nor in `keep` until `size` more bytes fit."""
        if self.limit is None:
            return True
        self._remove_dead_parts()
        used = self.usage()
        if used + size <= self.limit:
            return True
        for path, bytes_, _ in sorted(self._entries(SHARD_SUFFIX), key=lambda e: e[2]):
            if os.path.basename(path)[: -len(SHARD_SUFFIX)] in keep:
                continue
            if _remove_unlocked(path):
                used -= bytes_
                if used + size <= self.limit:
                    return True
        return False


def _remove_unlocked(path: str) -> bool:
    """Unlink `path` if no process holds a lock on it; whether it was removed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    try:
        if os.fstat(fd).st_nlink:
            os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def allocate(fd: int, size: int) -> None:
    """Give the file `size` bytes of disk now, so a full disk fails here, not mid-download."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a file system without fallocate: sized, sparse
