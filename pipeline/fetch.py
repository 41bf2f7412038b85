"""`ShardFetcher`: a worker's remote shards fetched ahead of its reading, through the cache.

While a worker decodes one shard, background threads fetch the next ones of its
plan (`schedule`) over parallel ranged requests (`shards.storage.ranged`), up to
`ReadOptions.prefetch_bytes` fetched ahead and not yet read, into the node's shard
cache (`ReadOptions.cache_dir`, `shards.storage.cache`) or, without one, into
temporary files, so read-ahead costs disk, not memory. `open` hands the reader a
seekable local file. A local shard is never copied: it is opened in place
(`pipeline.checksum.open_shard`), as is every shard when neither prefetch nor the
cache is on.

A fetched shard's size is checked against the manifest's; a shard going into the
cache is checked against the manifest's sha256 too (when the source gives it),
before any process reads it. A cache hit is served from a private copy checked
against the digest recorded when it was fetched (`ShardCache.lookup`); an entry that
fails is removed and the shard fetched again (`cache_rejected`), and a lock held past
the shard deadline sends the shard past the cache (`cache_timeouts`), never a bad
shard. A fetch that fails is raised by `open`, so it ends as today's counted bad
shard naming the URL. A full disk, an unwritable cache, a directory others may write
or a `.lock` held past the deadline turns the cache off with one warning per
process, and reading goes on without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from pipeline.checksum import check_digest, hash_stream, open_shard
from pipeline.sources import ShardSpec
from shards.storage import is_remote
from shards.storage.cache import CacheBypass, Part, ShardCache, cache_key, is_disk_error
from shards.storage.ranged import fetch_into

log = logging.getLogger("pipeline")

# Shards fetched at once per worker, each over `fetch_connections`. A store capping each
# connection (20 MB/s behind a +50 ms first byte in benchmarks/remote_loader.py) kept
# two shards in flight behind a 2-worker loader reading 130 MB/s (epoch 1 at 0.91x local
# disk); four keep ahead of it (0.97x). What is in flight stays within `prefetch_bytes`.
FETCH_THREADS = 4


def plan_shards(slot: Any, sources: Any) -> list[ShardSpec]:
    """The shards a worker's slot (`pipeline.epoch.WorkerPlan`) reads, in about the order
    it reads them: each source's pieces merged by how far into its share of the slot
    they start, which is how the interleave consumes them (one source: in read order).
    Resampled draws (no pieces) are planned as they are drawn (`ShardFetcher.plan_ahead`).

    Args:
        sources: the `pipeline.stages.SourceShards` the slot's pieces index into.
    """
    parts = [part for part in slot.parts if part.pieces is not None]
    if len(parts) == 1:  # one source is read in its pieces' order: nothing to merge
        shards = sources.shards[parts[0].source]
        return [shards[piece.shard] for piece in parts[0].pieces.ahead()]
    timed = []
    for part in parts:
        source_shards = sources.shards[part.source]
        total = max(1, part.samples)
        done = 0
        for order, piece in enumerate(part.pieces.ahead()):  # whole passes: the first
            timed.append((done / total, part.source, order, source_shards[piece.shard]))
            done += piece.stop - piece.start
    return [spec for *_, spec in sorted(timed, key=lambda t: t[:3])]


class FetchJob:
    """One shard being fetched (or found in the cache); `file` once done, else `error`."""

    def __init__(self, spec: ShardSpec, reserved: int) -> None:
        self.spec = spec
        self.reserved = reserved  # bytes it counts against the budget while ahead
        self.done = threading.Event()
        self.file: BinaryIO | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.lock = threading.Lock()

    def finish(self, file: BinaryIO | None, error: BaseException | None) -> None:
        with self.lock:
            self.file, self.error = file, error
            self.done.set()
            if self.cancelled:
                self.close()

    def cancel(self) -> None:
        """Nobody will read it: close its file now, or when its fetch ends."""
        with self.lock:
            self.cancelled = True
            if self.done.is_set():
                self.close()

    def close(self) -> None:
        file, self.file = self.file, None
        if file is not None:
            file.close()


class ShardFetcher:
    """Fetches a worker's upcoming remote shards ahead of it, within a byte budget.

    Made in the main process with the `ShardStream`; pickled into each DataLoader
    worker as its options only, so threads and files are per process and start on
    first use.
    """

    def __init__(self, io: Any) -> None:
        self.io = io
        self._reset()

    def __getstate__(self) -> dict:
        return {"io": self.io}

    def __setstate__(self, state: dict) -> None:
        self.io = state["io"]
        self._reset()

    def _reset(self) -> None:
        self._pid: int | None = None
        self._lock = threading.Lock()
        self._jobs: dict[str, FetchJob] = {}  # url -> started, not yet opened
        self._upcoming: deque[ShardSpec] = deque()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._ahead = 0
        self._cache: ShardCache | None = None
        self._cache_ready = False
        self._cache_warned = False
        self._bypasses = 0  # shards this process read past the cache, for its log
        self._keep: frozenset[str] | None = None  # cache keys of every shard of the job
        self._counts_lock = threading.Lock()
        self.counts: dict[str, Any] = new_counts(self.io.prefetch_bytes)

    @property
    def active(self) -> bool:
        """Whether remote shards go through the fetcher (prefetch or the cache is on)."""
        return self.io.prefetch_bytes > 0 or self.io.cache_dir is not None

    def schedule(
        self, specs: Iterable[ShardSpec], job_shards: Iterable[ShardSpec] = ()
    ) -> dict[str, Any]:
        """Set the shards the worker reads next, in order, and start fetching the first ones.

        `job_shards`, every shard of the job's sources (read once per process), are the
        cache entries it never evicts for its own fetches (`ShardCache.reserve`).

        Returns:
            This epoch's fetch counters, updated live (`WorkerStats.fetch`).
        """
        remote = self._remote(specs)
        if self._keep is None and self.io.cache_dir is not None:
            self._keep = frozenset(
                cache_key(s.url, s.sha256, s.bytes) for s in job_shards if is_remote(s.url)
            )
        with self._lock:
            self.counts = new_counts(self.io.prefetch_bytes)
            self.counts["cache_off"] = int(self._cache_warned)
            self._set_upcoming(remote)
        return self.counts

    def plan_ahead(self, specs: Iterable[ShardSpec]) -> None:
        """Replace the shards the worker reads next (resampled mode, as it draws them),
        keeping this epoch's counters; fetches no longer wanted are cancelled."""
        remote = self._remote(specs)
        with self._lock:
            self._set_upcoming(remote)

    def _remote(self, specs: Iterable[ShardSpec]) -> list[ShardSpec]:
        """The remote ones of `specs`, which go through the fetcher (none when it is off)."""
        self._own_process()
        return [spec for spec in specs if is_remote(spec.url)] if self.active else []

    def _set_upcoming(self, remote: list[ShardSpec]) -> None:
        wanted = {spec.url for spec in remote}
        for url in [url for url in self._jobs if url not in wanted]:
            job = self._jobs.pop(url)
            self._ahead -= job.reserved
            job.cancel()
        self._upcoming = deque(remote)
        if self.io.prefetch_bytes > 0:
            self._fill()

    @contextlib.contextmanager
    def open(self, spec: ShardSpec) -> Iterator[BinaryIO]:
        """A readable, seekable (when the format needs it) stream of `spec`'s shard.

        Raises:
            ShardReadError: it could not be fetched (named by its redacted URL).
            ShardError: `checksum`: its bytes differ from the manifest's sha256.
        """
        if not (self.active and is_remote(spec.url)):
            with open_shard(spec, self.io.retry, self.io.storage_options, self.io.checksums) as f:
                yield f
            return
        self._own_process()
        with self._lock:
            job = self._jobs.pop(spec.url, None)
            if job is not None:
                self._ahead -= job.reserved
            with contextlib.suppress(ValueError):
                self._upcoming.remove(spec)
            if self.io.prefetch_bytes > 0:
                self._fill()
        waited = time.perf_counter()
        if job is None:  # not fetched ahead (resampled mode, or out of plan): fetch it now
            file = self._fetch(spec)
        else:
            job.done.wait()
            if job.error is not None:
                raise job.error
            file = job.file
        self.count("wait_s", time.perf_counter() - waited)
        try:
            yield file
        finally:
            file.close()

    def count(self, name: str, amount: float = 1) -> None:
        """Add to one of this epoch's counters (fetch threads and the reader share them)."""
        with self._counts_lock:
            self.counts[name] += amount

    def _own_process(self) -> None:
        """Forget threads and jobs inherited across a fork: they belong to the parent."""
        if self._pid != os.getpid():
            if self._pid is not None:
                state = {"io": self.io}
                self.__setstate__(state)
            self._pid = os.getpid()

    def _fill(self) -> None:
        """Start the next upcoming shards while what is fetched ahead fits the budget."""
        budget = self.io.prefetch_bytes
        for spec in list(self._upcoming):
            if spec.url in self._jobs:
                continue
            size = spec.bytes if spec.bytes is not None else budget
            if self._jobs and self._ahead + size > budget:
                break
            self._jobs[spec.url] = self._start(spec, reserved=size)
            self._ahead += size
            with self._counts_lock:
                self.counts["ahead_peak"] = max(self.counts["ahead_peak"], self._ahead)

    def _start(self, spec: ShardSpec, reserved: int) -> FetchJob:
        job = FetchJob(spec, reserved)
        if len(self._threads) < FETCH_THREADS:
            thread = threading.Thread(target=self._work, name="shard-fetch", daemon=True)
            self._threads.append(thread)
            thread.start()
        self._queue.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job.cancelled:
                job.finish(None, None)
                continue
            try:
                file = self._fetch(job.spec)
            except BaseException as exc:  # raised in the reading thread by `open`
                job.finish(None, exc)
            else:
                job.finish(file, None)

    def _fetch(self, spec: ShardSpec) -> BinaryIO:
        """The shard as a local file: from the cache, or fetched (into the cache when it can)."""
        cache = self._shard_cache()
        if cache is not None:
            try:
                file = self._through_cache(cache, spec)
            except CacheBypass as exc:
                self._bypassed(spec, exc)
                file = None
            except OSError as exc:
                if not is_disk_error(exc):
                    raise
                self._disable_cache(exc)
                file = None
            if file is not None:
                return file
            self.count("uncached")
        return self._to_temporary(spec)

    def _through_cache(self, cache: ShardCache, spec: ShardSpec) -> BinaryIO | None:
        """The cached shard, fetched into the cache first when missing; None: not cacheable.

        Each wait on a lock (the entry, its claim, `.lock`) lasts at most the shard deadline.
        """
        key = cache_key(spec.url, spec.sha256, spec.bytes)
        file = self._hit(cache, key, spec)
        if file is None:
            with cache.claim(key) as claimed:
                file = self._hit(cache, key, spec)  # another process may have fetched it
                if file is None and claimed:
                    return self._fill_entry(cache, key, spec)
                if file is None:
                    self.count("cache_timeouts")
        return file

    def _hit(self, cache: ShardCache, key: str, spec: ShardSpec) -> BinaryIO | None:
        """A checked private copy of the cached shard, or None: not cached, or a bad entry
        just removed (counted), so the caller fetches it into the cache again."""
        try:
            file = cache.lookup(key, spec.bytes, spec.sha256)
        except CacheBypass as exc:
            if not exc.removed:
                raise
            self._bypassed(spec, exc)
            return None
        if file is not None:
            self.count("cache_hits")
        return file

    def _fill_entry(self, cache: ShardCache, key: str, spec: ShardSpec) -> BinaryIO | None:
        """Fetch `spec` into a new cache entry, checked; its private copy, or None when
        it does not fit."""
        keep = self._keep or frozenset()
        part = cache.reserve(key, spec.bytes or 0, keep)
        if part is None:
            return None  # larger than the limit, or the rest is in use
        try:
            got = self._download(spec, part.file)
            if spec.bytes is not None and got != spec.bytes:
                # Not the manifest's shard: read once, uncached, where the shard reader
                # reports the truncation as for a streamed read.
                self.count("uncached")
                return cache.unpublished(part)
            copy, digest = cache.copy_part(part, got)
        except BaseException:
            cache.discard(part)
            raise
        try:
            if spec.sha256 is not None:
                check_digest(spec, digest)
            published = self._publish(cache, part, got, digest)
        except BaseException:
            copy.close()
            cache.discard(part)
            raise
        if not published:
            cache.discard(part)
            self.count("uncached")
        return copy

    def _publish(self, cache: ShardCache, part: Part, size: int, digest: str) -> bool:
        """Publish a checked part; False when it cannot be (the copy is served all the same)."""
        try:
            return cache.commit(part, size, digest, self._keep or frozenset())
        except CacheBypass as exc:
            self._bypassed(spec=None, exc=exc)
            return False

    def _bypassed(self, spec: ShardSpec | None, exc: CacheBypass) -> None:
        """Count a shard read past the cache (or an entry replaced); log the first and
        every hundredth of this process; turn the cache off when it is the whole cache."""
        if exc.counter is not None:
            self.count(exc.counter)
        if exc.whole_cache:
            self._disable_cache(exc)
            return
        with self._counts_lock:
            self._bypasses += 1
            seen = self._bypasses
        if seen == 1 or seen % 100 == 0:
            where = f"shard {spec.display}: " if spec is not None else ""
            log.warning("%sshard cache: %s (%d so far in this process)", where, exc, seen)

    def _to_temporary(self, spec: ShardSpec) -> BinaryIO:
        """`spec` fetched into an unnamed temporary file (gone when closed)."""
        spool = tempfile.TemporaryFile()  # noqa: SIM115 - handed to the reader
        try:
            got = self._download(spec, spool)
            if self.io.checksums and spec.sha256 is not None and got == spec.bytes:
                self._check(spec, spool)
            spool.seek(0)
            return spool
        except BaseException:
            spool.close()
            raise

    def _download(self, spec: ShardSpec, file: BinaryIO) -> int:
        def landed(count: int) -> None:
            self.count("bytes_fetched", count)

        got = fetch_into(
            spec.url,
            file.fileno(),
            self.io.retry,
            size=spec.bytes,
            storage_options=self.io.storage_options,
            connections=self.io.fetch_connections,
            progress=landed,
        )
        self.count("shards_fetched")
        return got

    def _check(self, spec: ShardSpec, file: BinaryIO) -> None:
        """The manifest's sha256 (when known) holds for `file`, else a bad shard."""
        if spec.sha256 is not None:
            file.seek(0)
            check_digest(spec, hash_stream(file))
        file.seek(0)

    def _shard_cache(self) -> ShardCache | None:
        if self.io.cache_dir is None:
            return None
        with self._lock:
            if not self._cache_ready:
                self._cache_ready = True
                cache = ShardCache(self.io.cache_dir, self.io.cache_limit, self.io.retry.deadline)
                try:
                    cache.prepare()
                    self._cache = cache
                except (OSError, CacheBypass) as exc:
                    cache.close()
                    self._disable_cache(exc)
            return self._cache

    def _disable_cache(self, exc: OSError | CacheBypass) -> None:
        """Stop caching in this process; warn the first time only."""
        self._cache = None
        with self._counts_lock:
            if self._cache_warned:
                return
            self._cache_warned = True
            self.counts["cache_off"] = 1
        hint = (
            ""
            if isinstance(exc, CacheBypass)
            else (" (free space or fix the directory's permissions to cache again)")
        )
        log.warning(
            "shard cache %s turned off: %s; reading goes on without it%s",
            self.io.cache_dir,
            f"{type(exc).__name__}: {exc}",
            hint,
        )


def new_counts(budget: int) -> dict[str, Any]:
    """A worker's fetch counters for one epoch (`WorkerStats.fetch`)."""
    return {
        "budget": budget,  # bytes allowed ahead
        "ahead_peak": 0,  # most bytes fetched ahead at once (in flight or fetched, unread)
        "bytes_fetched": 0,  # bytes downloaded from servers and stores
        "shards_fetched": 0,
        "cache_hits": 0,  # shards read from the cache instead
        "uncached": 0,  # shards fetched past the cache (too large, all in use, a lock held)
        "cache_rejected": 0,  # cache entries that failed their checks (removed, fetched again)
        "cache_timeouts": 0,  # cache locks still held at the shard deadline
        "cache_off": 0,  # 1 once a disk error turned the cache off in this process
        "wait_s": 0.0,  # reading blocked on a fetch
    }
