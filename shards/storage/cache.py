"""A node-local cache of fetched shards, shared by one user's jobs on a node through flock.

Layout under the cache directory (made 0700; docs/RELIABILITY.md, "Shard cache trust
model"):

- `<key>.shard`: a complete shard, then a 48-byte trailer: `MAGIC` and the sha256 of the
  shard's bytes as they were fetched. `<key>` is a hash of the URL, the manifest's
  sha256 and size, so no URL can name a path outside the directory and a rebuilt shard
  gets a new entry. Readers hold `LOCK_SH` on it while copying it; the evictor takes
  `LOCK_EX | LOCK_NB`, so a shard being read is never evicted. Its mtime is its last use
  (least-recently-used eviction).
- `<key>.<pid>.<hex>.part`: a download in progress, sized up front (so the total under
  `limit` counts it) and held with `LOCK_EX` by its writer. It becomes `<key>.shard` by
  an atomic rename once its bytes are checked. A part whose lock can be taken has no
  live writer (a killed job): it is removed. No other name is ever removed.
- `claims/<key>`: taken with `LOCK_EX` by the one process downloading that shard; others
  wait on it and then find the shard. The kernel drops the lock of a killed holder.
- `.lock`: held briefly around a reservation (usage count, eviction, new part), so the
  total of all processes stays under `limit`.

Trust. The directory and `claims/` must be real directories owned by this user that no
one else may write (`CacheBypass` turns the cache off otherwise). Every name is opened
relative to the directory's descriptor with `O_NOFOLLOW` (and `O_NONBLOCK`, so a FIFO
never blocks) and checked with `fstat`: a regular file of this user with one link, or it
is refused: an entry is rejected and its name removed (never what a link points at), a
`.lock` or claim of the wrong kind is replaced. mtimes are set through the descriptor.
Every lock is polled without blocking for at most `wait_s` (the shard deadline).

What a hit serves: the entry is copied, in one pass, into an unnamed temporary file while
it is hashed, and the copy is handed over only if the hash equals the trailer's digest
(and the manifest's sha256, when known) and the file ended where it should. The reader
reads only that private copy, so a rewrite of the entry after the check cannot reach it:
the bytes checked are the bytes served (no time-of-check to time-of-use gap), at the
cost of one read of the entry, one sha256 pass and one write into the page cache, never
a second read of the entry. A download is copied out of its part the same way before it
is published, so the digest recorded is of exactly the bytes the fetching job served.

Disk errors (a full disk, a read-only or unwritable directory) are raised as `OSError`
for the caller, which turns caching off (`is_disk_error`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from shards.errors import DataError
from shards.storage.retry import DEFAULT_RETRY, ShardReadError

SHARD_SUFFIX = ".shard"
PART_SUFFIX = ".part"
CLAIMS = "claims"
LOCK_FILE = ".lock"
MAGIC = b"shardpipe-cache1"
TRAILER_BYTES = len(MAGIC) + hashlib.sha256().digest_size
COPY_CHUNK = 4 * 2**20
# A held lock is tried again after 1 ms, doubling to 50 ms: short waits (a reservation,
# a commit's rename) cost little, long ones (another download) poll gently.
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.05
DISK_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EFBIG}
)
_KEY = r"[0-9a-f]{40}"
_ENTRY_NAME = re.compile(rf"{_KEY}\{SHARD_SUFFIX}")
_PART_NAME = re.compile(rf"{_KEY}\.[0-9]+\.[0-9a-f]{{8}}\{PART_SUFFIX}")
# Opening a name that is not a regular file: a symlink (ELOOP under O_NOFOLLOW), a
# directory opened for writing (EISDIR), a socket (ENXIO).
_UNFIT_ERRNOS = frozenset({errno.ELOOP, errno.EISDIR, errno.ENXIO})
_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = {"d": "a directory", "l": "a symlink", "p": "a FIFO", "s": "a socket"}
_KINDS.update({"c": "a character device", "b": "a block device"})


class CacheBypass(DataError):
    """The cache cannot serve a shard now (or at all: `whole_cache`); it is read from its
    origin instead. The message names the cache file or directory and what was found.

    Attributes:
        path: the cache file or directory at fault.
        counter: the fetcher's counter it adds to (`cache_rejected`, `cache_timeouts`), if any.
        removed: a rejected entry's name was removed, so the shard can be cached again now.
        whole_cache: nothing can be cached in this directory by this process.
    """

    def __init__(
        self,
        path: str,
        problem: str,
        counter: str | None = None,
        *,
        removed: bool = False,
        whole_cache: bool = False,
    ) -> None:
        self.path = path
        self.counter = counter
        self.removed = removed
        self.whole_cache = whole_cache
        super().__init__(f"{path} {problem}")


class _Unfit(DataError):
    """A name in the cache is not what the cache made there (the text says what it is)."""


def is_disk_error(exc: BaseException) -> bool:
    """Whether `exc` is the cache's disk failing (full, read-only, not ours), not a read."""
    return (
        isinstance(exc, OSError)
        and not isinstance(exc, ShardReadError)
        and exc.errno in DISK_ERRNOS
    )


def cache_key(url: str, sha256: str | None, size: int | None) -> str:
    """The entry name of a shard: a hash, never a path taken from the URL.

    `v2`: entries carry the digest trailer; older entries are other names, evicted as
    any other job's shards.
    """
    text = f"v2\0{url}\0{sha256 or ''}\0{'' if size is None else size}"
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclass
class Part:
    """A download in progress: an open, exclusively locked `.part` file."""

    key: str
    name: str
    file: BinaryIO
    reserved: int  # bytes allocated: the shard's and its trailer's


class ShardCache:
    """The cache directory `root`, holding at most `limit` bytes of shards (None: the disk).

    `prepare` opens it; every other call works relative to the descriptors it holds.
    Each wait on a lock held by another process lasts at most `wait_s` (the fetcher
    gives its shard deadline, as the claim wait always had).
    """

    def __init__(
        self, root: str, limit: int | None, wait_s: float = DEFAULT_RETRY.deadline
    ) -> None:
        self.root = os.path.abspath(root)
        self.limit = limit
        self.wait_s = wait_s
        self._dir_fd = -1
        self._claims_fd = -1

    def prepare(self) -> None:
        """Open the directory (creating it 0700), check it is ours, remove dead parts.

        Raises:
            OSError: the directory cannot be made or written (`is_disk_error`).
            CacheBypass: it or `claims/` is not a directory of this user's own, closed
                to others' writes, or `.lock` cannot be made a regular file.
        """
        os.makedirs(os.path.dirname(self.root), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.root, 0o700)
        # The root's own path is the user's setting and may be a link; nothing under it is.
        self._dir_fd = self._open_dir(None, self.root)
        self._claims_fd = self._claims_dir()
        os.close(self._lock_file())  # proves the directory writable
        with contextlib.suppress(CacheBypass), self._locked(0.0):
            self._remove_dead_parts()  # never waited for: a busy lock's holder cleans up

    def close(self) -> None:
        for fd in (self._dir_fd, self._claims_fd):
            if fd >= 0:
                os.close(fd)
        self._dir_fd = self._claims_fd = -1

    def __del__(self) -> None:
        self.close()

    def path(self, key: str) -> str:
        return os.path.join(self.root, key + SHARD_SUFFIX)

    def lookup(self, key: str, size: int | None, sha256: str | None) -> BinaryIO | None:
        """A private, checked copy of the cached shard (an unnamed temporary file at
        offset 0, the caller's to close), or None when there is no entry.

        Raises:
            CacheBypass: `cache_rejected`: the entry is not a shard this cache wrote, or
                its bytes differ from its recorded digest or `sha256`; its name was removed
                (`removed`) if it could be. `cache_timeouts`: it stayed locked
                exclusively for `wait_s`.
        """
        name = key + SHARD_SUFFIX
        try:
            fd = _open_checked(self._dir_fd, name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except _Unfit as exc:
            raise self._rejected(name, str(exc)) from exc
        try:
            if not _flock_within(fd, fcntl.LOCK_SH, self.wait_s):
                raise CacheBypass(self._path(name), _HELD, "cache_timeouts")
            found = os.fstat(fd)
            if found.st_nlink == 0:  # evicted between the open and the lock
                return None
            length = found.st_size - TRAILER_BYTES
            if length < 0 or (size is not None and length != size):
                shard = "a shard" if size is None else f"the shard's {size}"
                raise _Unfit(f"holds {found.st_size} bytes, not {shard} and a trailer")
            copy = _copy_checked(fd, length, sha256)
            with contextlib.suppress(OSError):
                os.utime(fd)  # its last use, for least-recently-used eviction; never by name
            return copy
        except _Unfit as exc:
            raise self._rejected(name, str(exc)) from exc
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def claim(self, key: str) -> Iterator[bool]:
        """Hold the right to download `key` (True), or False when `wait_s` passed first.

        A holder that is killed loses its lock with its process, so a waiter takes over
        instead of hanging.

        Raises:
            CacheBypass: the claim's name holds something that cannot be replaced.
        """
        try:
            fd = _own_file(self._claims_fd, key)
        except _Unfit as exc:
            raise CacheBypass(self._path(CLAIMS, key), str(exc), "cache_rejected") from exc
        try:
            yield _flock_within(fd, fcntl.LOCK_EX, self.wait_s)
        finally:
            os.close(fd)

    def reserve(self, key: str, size: int, keep: frozenset[str] = frozenset()) -> Part | None:
        """A new `.part` file for a shard of `size` bytes (0: unknown), after evicting what
        must go; None if it cannot fit. Entries in `keep` (the job's own shards) are never
        evicted for it.

        Raises:
            OSError: the disk refused (`is_disk_error`).
            CacheBypass: `.lock` stayed held for `wait_s` (`whole_cache`).
        """
        need = size + TRAILER_BYTES if size else 0
        if self.limit is not None and need > self.limit:
            return None
        with self._locked():
            if not self._make_room(need, keep):
                return None
            name = f"{key}.{os.getpid()}.{secrets.token_hex(4)}{PART_SUFFIX}"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(name, flags, 0o600, dir_fd=self._dir_fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # a new file nobody else has: never waits
                allocate(fd, need)
                file = os.fdopen(fd, "r+b")
            except BaseException:
                os.close(fd)
                self._unlink(name)
                raise
            return Part(key, name, file, need)

    def copy_part(self, part: Part, size: int) -> tuple[BinaryIO, str]:
        """The part's `size` downloaded bytes copied into an unnamed temporary file, and
        their sha256 (hex): what the fetching job serves, and what `commit` records."""
        fd = part.file.fileno()
        os.lseek(fd, 0, os.SEEK_SET)
        spool = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the reader
        try:
            digest = _copy_hashed(fd, size, spool)
        except BaseException:
            spool.close()
            raise
        spool.seek(0)
        return spool, digest.hex()

    def commit(
        self, part: Part, size: int, sha256: str, keep: frozenset[str] = frozenset()
    ) -> bool:
        """Record `sha256` (the part's bytes, from `copy_part`) and publish the part as
        its shard. False: a part reserved without knowing its size came out larger than
        the limit allows, or the entry's name is taken by what cannot be replaced; the
        part is then the caller's to `discard`.

        Raises:
            OSError: the disk refused the write, flush or rename (`is_disk_error`).
            CacheBypass: `.lock` stayed held for `wait_s` (`whole_cache`).
        """
        fd = part.file.fileno()
        os.pwrite(fd, MAGIC + bytes.fromhex(sha256), size)
        if size + TRAILER_BYTES != part.reserved:
            with self._locked():
                os.ftruncate(fd, size + TRAILER_BYTES)
                if not self._make_room(0, keep):
                    return False
        os.fsync(fd)
        # Under the lock: a rename during another process's usage count could hide the
        # entry from its directory scan (seen under neither name), and it would then
        # reserve past the limit.
        with self._locked():
            try:
                os.rename(
                    part.name,
                    part.key + SHARD_SUFFIX,
                    src_dir_fd=self._dir_fd,
                    dst_dir_fd=self._dir_fd,
                )
            except OSError as exc:
                if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise
                return False  # a directory planted at the entry's name since the lookup
        part.file.close()
        return True

    def unpublished(self, part: Part) -> BinaryIO:
        """The part's file, kept open for one read, its name removed so nobody else uses it."""
        self._unlink(part.name)
        part.file.seek(0)
        return part.file

    def discard(self, part: Part) -> None:
        """Remove a part that will not be published."""
        self._unlink(part.name)
        part.file.close()

    def usage(self) -> int:
        """Bytes held by shards and reserved by parts."""
        return sum(size for _, size, _ in self._entries(_PART_NAME)) + sum(
            size for _, size, _ in self._entries(_ENTRY_NAME)
        )

    @contextlib.contextmanager
    def _locked(self, wait_s: float | None = None) -> Iterator[None]:
        fd = self._lock_file()
        try:
            if not _flock_within(fd, fcntl.LOCK_EX, self.wait_s if wait_s is None else wait_s):
                raise CacheBypass(self._path(LOCK_FILE), _HELD, "cache_timeouts", whole_cache=True)
            yield
        finally:
            os.close(fd)

    def _lock_file(self) -> int:
        try:
            return _own_file(self._dir_fd, LOCK_FILE)
        except _Unfit as exc:
            raise CacheBypass(self._path(LOCK_FILE), str(exc), whole_cache=True) from exc

    def _open_dir(self, dir_fd: int | None, name: str) -> int:
        """A directory's descriptor, once it is checked to be this user's own, closed to others."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
        if dir_fd is not None:
            flags |= os.O_NOFOLLOW
        fd = os.open(name, flags, dir_fd=dir_fd)
        problem = _directory_problem(os.fstat(fd))
        if problem is not None:
            os.close(fd)
            raise CacheBypass(
                self._path(name) if dir_fd is not None else name,
                f"{problem}: another user could plant or hold its entries, so the cache is "
                "not used; give a directory of your own (mkdir -m 700) as the cache directory",
                whole_cache=True,
            )
        return fd

    def _claims_dir(self) -> int:
        """`claims/`, made 0700; a symlink or file at its name is replaced by a directory."""
        try:
            return self._make_dir(CLAIMS)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
        _remove_name(self._dir_fd, CLAIMS)
        return self._make_dir(CLAIMS)

    def _make_dir(self, name: str) -> int:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=self._dir_fd)
        return self._open_dir(self._dir_fd, name)

    def _rejected(self, name: str, problem: str) -> CacheBypass:
        removed = _remove_name(self._dir_fd, name)
        then = "removed; fetched again" if removed else "cannot be removed; read past the cache"
        return CacheBypass(
            self._path(name), f"{problem}: {then}", "cache_rejected", removed=removed
        )

    def _path(self, *names: str) -> str:
        return os.path.join(self.root, *names)

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self._dir_fd)

    def _entries(self, pattern: re.Pattern) -> list[tuple[str, int, float]]:
        """(name, size, mtime) of the regular files whose names the cache makes."""
        found = []
        # A descriptor of its own: scandir reads through a duplicate, which would share
        # its position in the directory with every other scan of the same descriptor.
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self._dir_fd)
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                        with contextlib.suppress(FileNotFoundError):
                            info = entry.stat(follow_symlinks=False)
                            found.append((entry.name, info.st_size, info.st_mtime))
        finally:
            os.close(fd)
        return found

    def _remove_dead_parts(self) -> None:
        for name, _, _ in self._entries(_PART_NAME):
            _remove_unlocked(self._dir_fd, name)

    def _make_room(self, size: int, keep: frozenset[str]) -> bool:
        """Evict least-recently-used shards not in use nor in `keep` until `size` more bytes fit."""
        if self.limit is None:
            return True
        self._remove_dead_parts()
        used = self.usage()
        if used + size <= self.limit:
            return True
        for name, bytes_, _ in sorted(self._entries(_ENTRY_NAME), key=lambda e: e[2]):
            if name[: -len(SHARD_SUFFIX)] in keep:
                continue
            if _remove_unlocked(self._dir_fd, name):
                used -= bytes_
                if used + size <= self.limit:
                    return True
        return False


_HELD = (
    "was still locked by another process at the shard's deadline (RetryPolicy.deadline): "
    "a stopped or hung job holds it; the shard is read from its origin"
)


def _flock_within(fd: int, operation: int, wait_s: float) -> bool:
    """Take `operation` on `fd`, trying without blocking for `wait_s`; whether it was taken."""
    until = time.monotonic() + wait_s
    pause = POLL_FIRST_S
    while True:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            left = until - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(2 * pause, POLL_MAX_S)


def _open_checked(dir_fd: int, name: str, flags: int) -> int:
    """`name` under `dir_fd`, never followed and never blocking, if it is a regular file
    of this user with one link.

    Raises:
        _Unfit: it is something else (the text says what).
        FileNotFoundError: there is nothing at the name (without `O_CREAT`).
    """
    try:
        fd = os.open(name, flags | _NO_FOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in _UNFIT_ERRNOS:
            raise
        kind = "a symlink" if exc.errno == errno.ELOOP else f"not a file ({exc.strerror})"
        raise _Unfit(f"is {kind}") from exc
    try:
        problem = _file_problem(os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise _Unfit(problem)
    return fd


def _own_file(dir_fd: int, name: str) -> int:
    """`name` under `dir_fd` opened (created 0600 if missing) as a regular file of ours;
    anything else at the name is removed once and the file made again.

    Raises:
        _Unfit: what is at the name is not a file of ours and cannot be removed.
    """
    try:
        return _open_checked(dir_fd, name, os.O_RDWR | os.O_CREAT)
    except _Unfit as exc:
        if not _remove_name(dir_fd, name):
            raise _Unfit(f"{exc} and cannot be removed") from exc
    return _open_checked(dir_fd, name, os.O_RDWR | os.O_CREAT)


def _file_problem(info: os.stat_result) -> str | None:
    if not stat.S_ISREG(info.st_mode):
        return f"is {_KINDS.get(stat.filemode(info.st_mode)[0], 'not a regular file')}"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_nlink > 1:
        return f"has {info.st_nlink} hard links (the name of a file elsewhere)"
    return None


def _directory_problem(info: os.stat_result) -> str | None:
    if not stat.S_ISDIR(info.st_mode):
        return f"is {_KINDS.get(stat.filemode(info.st_mode)[0], 'not a directory')}"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not this user ({os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _remove_name(dir_fd: int, name: str) -> bool:
    """Remove the name (a link's own name, never its target; a directory only if empty);
    whether nothing is left there."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except OSError:
            return False
    except OSError:
        return False
    return True


def _copy_hashed(fd: int, length: int, into: BinaryIO) -> bytes:
    """The sha256 of the next `length` bytes of `fd`, copied into `into` as they are read.

    Raises:
        _Unfit: the file ended first (cut while it was read).
    """
    digest = hashlib.sha256()
    view = memoryview(bytearray(max(1, min(COPY_CHUNK, length))))
    left = length
    while left:
        got = os.readv(fd, [view[: min(left, len(view))]])
        if not got:
            raise _Unfit(f"ended {left} bytes early")
        digest.update(view[:got])
        into.write(view[:got])
        left -= got
    return digest.digest()


def _copy_checked(fd: int, length: int, sha256: str | None) -> BinaryIO:
    """The entry's `length` shard bytes copied into an unnamed temporary file, at offset 0,
    if their hash is the trailer's (and `sha256`, when known) and the file ends there.

    Raises:
        _Unfit: it is not so (the text says how).
    """
    spool = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the reader
    try:
        digest = _copy_hashed(fd, length, spool)
        trailer = os.read(fd, TRAILER_BYTES + 1)
        if len(trailer) != TRAILER_BYTES or not trailer.startswith(MAGIC):
            raise _Unfit("has no trailer of this cache (not written by it, or cut)")
        if trailer[len(MAGIC) :] != digest:
            raise _Unfit("differs from the sha256 recorded when it was fetched (changed on disk)")
        if sha256 is not None and digest.hex() != sha256:
            raise _Unfit("differs from the manifest's sha256")
    except BaseException:
        spool.close()
        raise
    spool.seek(0)
    return spool


def _remove_unlocked(dir_fd: int, name: str) -> bool:
    """Unlink `name` if it is a regular file no process holds a lock on; whether it was removed."""
    try:
        fd = os.open(name, os.O_RDONLY | _NO_FOLLOW, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not info.st_nlink:
            return False
        os.unlink(name, dir_fd=dir_fd)
        return True
    except (BlockingIOError, FileNotFoundError):
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
