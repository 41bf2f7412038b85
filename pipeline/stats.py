"""Loader measurements: what each worker role counts (`WorkerStats`, `count_skips`) and
what the trainer reads, aggregated (`LoaderStats`: time to first batch, images/s, waits,
skips)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from shards.errors import DataError
from shards.sample import skip_budget_hint


class LoaderDataError(DataError, RuntimeError):
    """Too much bad data: the skip budget of the epoch was exceeded."""


@dataclass
class WorkerStats:
    """Counters a worker ships with each batch; the loader aggregates them."""

    worker: int = 0
    samples: int = 0
    skipped: Counter = field(default_factory=Counter)
    bad_shards: Counter = field(default_factory=Counter)  # reason -> shards
    bad_shard_examples: list = field(default_factory=list)  # the first few, named
    refilled: int = 0
    unfilled: int = 0  # exactly-once epochs: planned slots left empty (their samples were bad)
    decode_s: float = 0.0  # decoding every field of the samples, augmentation included
    augment_s: float = 0.0  # the part of decode_s spent augmenting images (`LoaderConfig.augment`)
    pillow_fallbacks: int = 0  # samples the fast crops handed to Pillow (non-JPEG, CMYK, ...)
    sources: Counter = field(default_factory=Counter)  # a mix: samples delivered per source
    source_skipped: Counter = field(default_factory=Counter)  # a mix: skips per source
    fetch: dict = field(default_factory=dict)  # remote reads: bytes, cache hits, in flight
    budget: int = 10  # skips allowed before the worker stops

    def snapshot(self) -> dict:
        return {
            "worker": self.worker,
            "samples": self.samples,
            "skipped": dict(self.skipped),
            "bad_shards": dict(self.bad_shards),
            "bad_shard_examples": list(self.bad_shard_examples),
            "refilled": self.refilled,
            "unfilled": self.unfilled,
            "decode_s": self.decode_s,
            "augment_s": self.augment_s,
            "pillow_fallbacks": self.pillow_fallbacks,
            "sources": dict(self.sources),
            "source_skipped": dict(self.source_skipped),
            "fetch": dict(self.fetch),
        }


def count_skips(
    stats: WorkerStats,
    reason: str,
    count: int,
    where: str,
    hint: Callable[[Mapping[str, int]], str] | None = None,
) -> None:
    """Count skipped samples; past the worker's budget, stop with what, where and what to do
    (a field whose member no sample has is named: the data is not bad, the field is)."""
    stats.skipped[reason] += count
    skipped = sum(stats.skipped.values())
    if skipped > stats.budget:
        raise LoaderDataError(
            f"worker {stats.worker} skipped {skipped} samples, over its budget of {stats.budget} "
            f"({dict(stats.skipped)}); last: {where}. "
            + (hint(stats.skipped) if hint else skip_budget_hint((), stats.skipped))
        )


@dataclass
class LoaderStats:
    """Aggregated over the current epoch; `last_wait_s` is the latest batch's wait.

    Wait time is how long the consumer was blocked in `next()`: near zero when
    workers keep up, large when the input pipeline is the bottleneck.
    """

    first_batch_s: float | None = None
    batches: int = 0
    samples: int = 0
    wait_s: float = 0.0
    last_wait_s: float = 0.0
    epoch_started: float = 0.0
    elapsed_s: float = 0.0
    workers: dict[int, dict] = field(default_factory=dict)

    def start_epoch(self) -> None:
        self.first_batch_s = None
        self.batches = self.samples = 0
        self.wait_s = self.last_wait_s = 0.0
        self.epoch_started = time.perf_counter()
        self.workers = {}

    def record_batch(self, wait_s: float, size: int, worker: dict, started: float) -> None:
        now = time.perf_counter()
        if self.first_batch_s is None:
            self.first_batch_s = now - started
        self.batches += 1
        self.samples += size
        self.wait_s += wait_s
        self.last_wait_s = wait_s
        self.elapsed_s = now - self.epoch_started
        self.workers[worker["worker"]] = worker

    def record_worker(self, worker: dict) -> None:
        """A worker's latest counts, without a batch (an exactly-once worker ending short)."""
        self.workers[worker["worker"]] = worker

    def end_epoch(self) -> None:
        self.elapsed_s = time.perf_counter() - self.epoch_started

    @property
    def images_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def skipped(self) -> Counter:
        total: Counter = Counter()
        for worker in self.workers.values():
            total.update(worker["skipped"])
        return total

    @property
    def bad_shards(self) -> Counter:
        """Shards (reads of one piece) that failed, by reason: corrupt, short, long, ..."""
        total: Counter = Counter()
        for worker in self.workers.values():
            total.update(worker.get("bad_shards", {}))
        return total

    @property
    def bad_shard_examples(self) -> list[str]:
        """The first bad shards each worker met, named (redacted) with the reason."""
        return [text for w in self.workers.values() for text in w.get("bad_shard_examples", [])]

    @property
    def refilled(self) -> int:
        return sum(w["refilled"] for w in self.workers.values())

    @property
    def unfilled(self) -> int:
        """Planned batch slots an exactly-once (eval) epoch left empty rather than repeat a
        sample: its last batches came short by this many (the skipped samples)."""
        return sum(w.get("unfilled", 0) for w in self.workers.values())

    @property
    def pillow_fallbacks(self) -> int:
        """Samples the fast crops handed to Pillow this epoch (non-JPEG, CMYK, rare JPEGs)."""
        return sum(w.get("pillow_fallbacks", 0) for w in self.workers.values())

    @property
    def sources(self) -> dict[str, dict]:
        """A mix: per source, samples delivered, samples skipped and samples/s this epoch
        (its share of the loader's rate); empty for one source."""
        samples: Counter = Counter()
        skipped: Counter = Counter()
        for worker in self.workers.values():
            samples.update(worker.get("sources", {}))
            skipped.update(worker.get("source_skipped", {}))
        rate = 1 / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return {
            name: {
                "samples": samples[name],
                "skipped": skipped[name],
                "images_per_s": samples[name] * rate,
            }
            for name in sorted(set(samples) | set(skipped))
        }

    @property
    def fetch(self) -> dict:
        """Remote shard reads this epoch, summed over workers (`pipeline.fetch.new_counts`):
        bytes fetched, shards fetched, cache hits, read-ahead peak (the largest worker's) and
        budget per worker, seconds readers waited on a fetch."""
        total: dict = {}
        for worker in self.workers.values():
            for name, value in worker.get("fetch", {}).items():
                keep_max = name in ("budget", "ahead_peak", "cache_off")
                total[name] = (
                    max(total.get(name, 0), value) if keep_max else total.get(name, 0) + value
                )
        return total

    def summary(self) -> dict:
        return {
            "first_batch_s": self.first_batch_s,
            "batches": self.batches,
            "samples": self.samples,
            "images_per_s": self.images_per_s,
            "wait_s": self.wait_s,
            "skipped": dict(self.skipped),
            "bad_shards": dict(self.bad_shards),
            "bad_shard_examples": self.bad_shard_examples,
            "refilled": self.refilled,
            "unfilled": self.unfilled,
            "pillow_fallbacks": self.pillow_fallbacks,
            "sources": self.sources,
            "fetch": self.fetch,
        }
