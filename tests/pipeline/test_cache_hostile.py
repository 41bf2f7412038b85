"""The shard cache under hostile directory states: a table of what others may leave in it.

The cache directory is shared by every job of a node and often sits in /tmp, so each
row plants one state (changed bytes, symlinks, FIFOs, held locks, foreign files, a
directory others may write) and fetches a real shard through `ShardFetcher` from the
localhost server. Every row must end the same way: the origin's exact bytes within a
bound (never a hang, never a counted bad shard), nothing outside `cache_dir` created,
changed or given a new mtime, and, where the state could be cleared, a cache that
serves the shard again on the next read without fetching it. `HOSTILE` lists which
rows failed on the code before this suite (issue 29); docs/RELIABILITY.md has the
table.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline.config import ReadOptions
from pipeline.fetch import ShardFetcher
from pipeline.sources import ShardSpec
from shards.storage import cache as cache_module
from shards.storage.cache import PART_SUFFIX, SHARD_SUFFIX, cache_key
from shards.storage.retry import RetryPolicy
from tests.conftest import shard_files
from tests.httpserver import LocalHTTPServer

DEADLINE_S = 1.0  # the shard deadline: every lock wait gives up here
BOUND_S = 20.0  # a read not done by then hangs


@dataclass
class Ctx:
    """One row's world: a cache directory, a directory outside it, and one shard."""

    tmp: Path
    cache_dir: Path
    outside: Path
    spec: ShardSpec
    origin: bytes
    held: list[int] = field(default_factory=list)  # fds holding locks, closed at the end
    options: dict = field(default_factory=dict)  # ReadOptions of this row's fetchers

    @property
    def key(self) -> str:
        return cache_key(self.spec.url, self.spec.sha256, self.spec.bytes)

    @property
    def entry(self) -> Path:
        return self.cache_dir / (self.key + SHARD_SUFFIX)

    @property
    def claim(self) -> Path:
        return self.cache_dir / "claims" / self.key

    def fetcher(self) -> ShardFetcher:
        options = dict(
            cache_dir=str(self.cache_dir),
            prefetch_bytes=0,
            retry=RetryPolicy(deadline=DEADLINE_S),
        )
        options.update(self.options)
        return ShardFetcher(ReadOptions(**options))

    def hold(self, path: Path, lock: int = fcntl.LOCK_EX) -> None:
        """Hold `lock` on `path` as another (stopped) process would: the kernel's flock
        locks belong to the open file, so one held here blocks this process's others."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, lock)
        self.held.append(fd)


def read(ctx: Ctx, after_open: Callable[[Ctx], None] | None = None) -> tuple[bytes, dict]:
    """The shard through a fresh fetcher (a new job), and its counters; fails on a hang."""
    fetcher = ctx.fetcher()
    result: list = []

    def run() -> None:
        try:
            counts = fetcher.schedule([ctx.spec])
            with fetcher.open(ctx.spec) as stream:
                if after_open is not None:
                    after_open(ctx)
                result.append((stream.read(), counts))
        except BaseException as exc:  # reported in the test's thread
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive(), f"the read hung for {BOUND_S} s"
    assert time.monotonic() - started < BOUND_S
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def warm(ctx: Ctx) -> None:
    """Cache the shard as a first job would."""
    data, _ = read(ctx)
    assert data == ctx.origin and ctx.entry.is_file()


def snapshot(root: Path) -> dict:
    """Every name under `root` with its type, size, mtime and content hash."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        content = ""
        if stat.S_ISREG(info.st_mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        found[str(path.relative_to(root))] = (
            stat.S_IFMT(info.st_mode),
            info.st_size,
            info.st_mtime_ns,
            content,
        )
    return found


# The plants. Each gets the row's world before the read; most first cache the shard.


def flip_byte(ctx: Ctx) -> None:
    warm(ctx)
    with open(ctx.entry, "r+b") as file:  # in place: same inode, same size
        file.seek(600)
        byte = file.read(1)
        file.seek(600)
        file.write(bytes([byte[0] ^ 0x01]))


def right_size_garbage(ctx: Ctx) -> None:
    warm(ctx)
    size = ctx.entry.stat().st_size
    ctx.entry.write_bytes(os.urandom(size))


def rewrite_in_place(ctx: Ctx) -> None:
    """After the read was handed its stream (every check done), rewrite the entry."""
    with open(ctx.entry, "r+b") as file:
        file.write(b"\0" * 1024)


def empty_directory(ctx: Ctx) -> None:
    ctx.entry.mkdir()


def full_directory(ctx: Ctx) -> None:
    ctx.entry.mkdir()
    (ctx.entry / "inside").write_bytes(b"x")


def socket_at_entry(ctx: Ctx) -> None:
    # Bound by its name relative to the cache: a socket's path may hold only ~100 bytes.
    with socket.socket(socket.AF_UNIX) as sock, contextlib.chdir(ctx.cache_dir):
        sock.bind(ctx.entry.name)


def link_to(target: Path, name: Callable[[Ctx], Path]) -> Callable[[Ctx], None]:
    def plant(ctx: Ctx) -> None:
        path = name(ctx)
        real = target if target.is_absolute() else ctx.outside / target
        path.symlink_to(real)

    return plant


def hardlink_outside(ctx: Ctx) -> None:
    ctx.entry.hardlink_to(ctx.outside / "right.tar")


def claims_dir_symlink(ctx: Ctx) -> None:
    (ctx.cache_dir / "claims").rmdir()
    (ctx.cache_dir / "claims").symlink_to(ctx.outside / "claims-elsewhere")


def fifo_at(name: Callable[[Ctx], Path]) -> Callable[[Ctx], None]:
    def plant(ctx: Ctx) -> None:
        os.mkfifo(name(ctx))

    return plant


def symlink_to_fifo(ctx: Ctx) -> None:
    os.mkfifo(ctx.outside / "fifo")
    ctx.entry.symlink_to(ctx.outside / "fifo")


def hold_lock(ctx: Ctx) -> None:
    ctx.hold(ctx.cache_dir / ".lock")


def hold_entry(ctx: Ctx) -> None:
    warm(ctx)
    ctx.hold(ctx.entry)


def hold_claim(ctx: Ctx) -> None:
    ctx.hold(ctx.claim)


def foreign_file(name: str) -> Callable[[Ctx], None]:
    def plant(ctx: Ctx) -> None:
        (ctx.cache_dir / name).write_bytes(b"someone else's")

    return plant


def open_to_others(ctx: Ctx) -> None:
    ctx.cache_dir.chmod(0o777)


def claims_open_to_others(ctx: Ctx) -> None:
    (ctx.cache_dir / "claims").chmod(0o777)


def claim_directory(ctx: Ctx) -> None:
    ctx.claim.mkdir()
    (ctx.claim / "inside").write_bytes(b"x")


def lock_directory(ctx: Ctx) -> None:
    (ctx.cache_dir / ".lock").mkdir()


def truncate(ctx: Ctx) -> None:
    warm(ctx)
    os.truncate(ctx.entry, ctx.entry.stat().st_size // 2)


def oversize(ctx: Ctx) -> None:
    warm(ctx)
    with open(ctx.entry, "ab") as file:
        file.write(b"x" * 4096)


def empty(ctx: Ctx) -> None:
    ctx.entry.write_bytes(b"")


def stale_claim(ctx: Ctx) -> None:
    ctx.claim.write_bytes(b"")


def dead_part(ctx: Ctx) -> None:
    (ctx.cache_dir / f"{ctx.key}.999999.deadbeef{PART_SUFFIX}").write_bytes(b"x" * 100)


def live_part(ctx: Ctx) -> None:
    ctx.hold(ctx.cache_dir / f"{ctx.key}.{os.getpid()}.0badcafe{PART_SUFFIX}")


def read_only_dir(ctx: Ctx) -> None:
    ctx.cache_dir.chmod(0o500)


def small_limit(ctx: Ctx) -> None:
    ctx.options["cache_limit"] = 100


def full_disk(ctx: Ctx) -> None:
    def refuse(fd, size):
        raise OSError(28, "No space left on device")

    ctx.options["_patch"] = refuse


def checksums_on(ctx: Ctx) -> None:
    ctx.options["checksums"] = True


def both(*plants: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    def plant(ctx: Ctx) -> None:
        for one in plants:
            one(ctx)

    return plant


def no_manifest_sha(ctx: Ctx) -> None:
    ctx.spec = ShardSpec(ctx.spec.url, ctx.spec.fmt, ctx.spec.samples, bytes=ctx.spec.bytes)


# The checks a row adds to the common ones.


def counted(name: str) -> Callable[[Ctx, dict], None]:
    def check(ctx: Ctx, counts: dict) -> None:
        assert counts.get(name, 0) >= 1, counts

    return check


def untouched(*names: str) -> Callable[[Ctx, dict], None]:
    def check(ctx: Ctx, counts: dict) -> None:
        for name in names:
            assert (ctx.cache_dir / name).read_bytes() == b"someone else's"

    return check


def cache_turned_off(ctx: Ctx, counts: dict) -> None:
    assert counts["cache_off"] == 1 and not ctx.entry.exists()


def dead_part_gone(ctx: Ctx, counts: dict) -> None:
    assert not list(ctx.cache_dir.glob("*.999999.deadbeef" + PART_SUFFIX))


def live_part_kept(ctx: Ctx, counts: dict) -> None:
    assert list(ctx.cache_dir.glob(f"*.0badcafe{PART_SUFFIX}"))


def nothing_cached(ctx: Ctx, counts: dict) -> None:
    assert not ctx.entry.exists() and counts["uncached"] == 1


@dataclass(frozen=True)
class Row:
    """One hostile state: how to plant it, whether the cache heals (serves the shard
    again without fetching on the next read), what else to check, and whether it failed
    on the code before issue 29 (`before`: "failed" or "held")."""

    plant: Callable[[Ctx], None]
    before: str
    heals: bool = True
    check: Callable[[Ctx, dict], None] | None = None
    after_open: Callable[[Ctx], None] | None = None


def entry(ctx: Ctx) -> Path:
    return ctx.entry


def claim(ctx: Ctx) -> Path:
    return ctx.claim


def lock(ctx: Ctx) -> Path:
    return ctx.cache_dir / ".lock"


HOSTILE: dict[str, Row] = {
    # Content, not size.
    "one byte changed": Row(flip_byte, "failed", check=counted("cache_rejected")),
    "one byte changed, no manifest sha256": Row(
        both(no_manifest_sha, flip_byte), "failed", check=counted("cache_rejected")
    ),
    "one byte changed, checksums on": Row(both(checksums_on, flip_byte), "failed"),
    "rewritten in place after its check, checksums on": Row(
        both(checksums_on, warm), "failed", heals=False, after_open=rewrite_in_place
    ),
    "rewritten in place after the hit, checksums off": Row(
        warm, "failed", heals=False, after_open=rewrite_in_place
    ),
    "right-size garbage": Row(right_size_garbage, "failed", check=counted("cache_rejected")),
    "right-size garbage, checksums on": Row(both(checksums_on, right_size_garbage), "failed"),
    "empty directory at the entry": Row(empty_directory, "failed"),
    "directory with a file at the entry": Row(full_directory, "failed", heals=False),
    "socket at the entry": Row(socket_at_entry, "failed"),
    # Never followed.
    "entry symlink to an outside file of the shard's size": Row(
        link_to(Path("victim.bin"), entry), "failed"
    ),
    "entry symlink to an outside copy of the shard": Row(
        link_to(Path("right.tar"), entry), "failed"
    ),
    "entry symlink to an outside directory": Row(
        link_to(Path("claims-elsewhere"), entry), "failed"
    ),
    "entry hard link to an outside copy of the shard": Row(hardlink_outside, "failed"),
    "claims/<key> symlink to an outside path": Row(link_to(Path("planted-claim"), claim), "failed"),
    "claims/ symlink to an outside directory": Row(claims_dir_symlink, "failed"),
    ".lock symlink to an outside path": Row(link_to(Path("planted-lock"), lock), "failed"),
    # No hangs.
    "FIFO at the entry": Row(fifo_at(entry), "failed"),
    "entry symlink to an outside FIFO": Row(symlink_to_fifo, "failed"),
    ".lock held by a live process": Row(
        both(hold_lock), "failed", heals=False, check=counted("cache_timeouts")
    ),
    "entry held exclusively by a live process": Row(
        hold_entry, "failed", heals=False, check=counted("cache_timeouts")
    ),
    # Only its own part names go.
    "movie.mkv.part at open": Row(
        foreign_file("movie.mkv.part"), "failed", check=untouched("movie.mkv.part")
    ),
    "rsync-tmp.part at open": Row(
        foreign_file("rsync-tmp.part"), "failed", check=untouched("rsync-tmp.part")
    ),
    "a part-shaped name of no key at open": Row(
        foreign_file("data.123.0badf00d.part"), "failed", check=untouched("data.123.0badf00d.part")
    ),
    # The directory itself.
    "cache_dir writable by every user (0777)": Row(
        open_to_others, "failed", heals=False, check=cache_turned_off
    ),
    "claims/ writable by every user (0777)": Row(
        claims_open_to_others, "failed", heals=False, check=cache_turned_off
    ),
    "claims/<key> a directory with a file": Row(claim_directory, "failed", heals=False),
    # Held before, kept.
    "claim held by a live process": Row(hold_claim, "held", heals=False),
    "truncated entry": Row(truncate, "held"),
    "oversized entry": Row(oversize, "held"),
    "empty entry": Row(empty, "held"),
    "dangling entry symlink": Row(link_to(Path("nowhere"), entry), "held"),
    "entry symlink to /dev/zero": Row(link_to(Path("/dev/zero"), entry), "held"),
    "entry symlink to /dev/null": Row(link_to(Path("/dev/null"), entry), "held"),
    "FIFO at claims/<key>": Row(fifo_at(claim), "failed"),
    "FIFO at .lock": Row(fifo_at(lock), "failed"),
    ".lock a directory": Row(lock_directory, "held", heals=False),
    "stale claim file": Row(stale_claim, "held"),
    "part of a dead process": Row(dead_part, "held", check=dead_part_gone),
    "part of a live process": Row(live_part, "held", check=live_part_kept),
    "read-only cache_dir": Row(read_only_dir, "held", heals=False, check=cache_turned_off),
    "full disk": Row(full_disk, "held", heals=False, check=cache_turned_off),
    "limit below the shard": Row(small_limit, "held", heals=False, check=nothing_cached),
}


@pytest.fixture(scope="module")
def origin(shard_dir):
    tar = shard_files(shard_dir, "tar", "train")[0]
    with LocalHTTPServer(shard_dir) as base:
        yield base, shard_dir, tar


@pytest.fixture
def world(origin, tmp_path):
    base, shard_dir, tar = origin
    data = tar.read_bytes()
    url = f"{base}/{tar.relative_to(shard_dir).as_posix()}"
    spec = ShardSpec(url, "tar", 1, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    outside = tmp_path / "outside"
    (outside / "claims-elsewhere").mkdir(parents=True)
    (outside / "victim.bin").write_bytes(os.urandom(len(data)))
    (outside / "right.tar").write_bytes(data)
    cache_dir = tmp_path / "cache"
    (cache_dir / "claims").mkdir(parents=True)
    ctx = Ctx(tmp_path, cache_dir, outside, spec, data)
    yield ctx
    for fd in ctx.held:
        os.close(fd)
    for path in (cache_dir, cache_dir / "claims"):
        with contextlib.suppress(OSError):
            path.chmod(0o700)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_cache_state_never_delivers_other_bytes_hangs_or_reaches_outside(
    world, name, monkeypatch, caplog
):
    row = HOSTILE[name]
    if name == "read-only cache_dir" and os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    row.plant(world)
    patch = world.options.pop("_patch", None)
    if patch is not None:
        monkeypatch.setattr(cache_module, "allocate", patch)
    before = snapshot(world.outside)
    with caplog.at_level(logging.WARNING, logger="pipeline"):
        data, counts = read(world, row.after_open)
        assert data == world.origin
        if row.check is not None:
            row.check(world, counts)
        assert snapshot(world.outside) == before
    off = [r for r in caplog.records if "turned off" in r.getMessage()]
    assert len(off) <= 1  # one warning per process (here: per fetcher), naming the directory
    assert all(str(world.cache_dir) in r.getMessage() for r in off)
    # Never a bad shard for good: the next job reads it too, from the cache where the
    # state could be cleared.
    world.options.pop("checksums", None)
    data, counts = read(world)
    assert data == world.origin
    assert snapshot(world.outside) == before
    if row.heals:
        assert counts["shards_fetched"] == 0 and counts["cache_hits"] == 1, counts


def test_the_table_covers_every_class_of_the_issue():
    failed = [name for name, row in HOSTILE.items() if row.before == "failed"]
    held = [name for name, row in HOSTILE.items() if row.before == "held"]
    assert len(failed) >= 16 and len(held) >= 10 and len(HOSTILE) >= 35
