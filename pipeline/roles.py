"""One worker role's batches of an epoch, the same wherever it runs (`iter_role_batches`).

A role is one slot of the epoch plan (`pipeline.plan`): the DataLoader's worker `w` plays
it in a worker process (`pipeline.dataset.ShardStream`, which passes the role in), the
main process plays the only one without workers, and a Ray actor (`pipeline.remote`)
plays the one it is given. The chain, stage by stage: plan slice -> shard pieces
(`pipeline.stages.ShardReader`) -> the plan's copies, draws or merged sources -> shuffle
buffer -> skip what was delivered -> decode + augment -> batches (`pipeline.assemble`).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.assemble import BatchAssembler, BatchMemory, iter_batch_sizes
from pipeline.fetch import plan_shards
from pipeline.mixing import MixedWorkerPlan
from pipeline.plan import (
    Partition,
    Segment,
    WorkerPlan,
    plan_epoch,
    shuffle_buffer,
    worker_rng,
)
from pipeline.sources import ShardSpec
from pipeline.stages import (
    Draws,
    MixedShards,
    ShardReader,
    StreamSettings,
    iter_copies,
    iter_draws,
    iter_mixed,
    mix_rngs,
    skip_delivered,
)
from pipeline.stats import WorkerStats
from shards.sample import Sample


@dataclass(frozen=True, eq=False)
class StreamSource:
    """What every role of a loader reads: its settings, the crop, and one source's shards
    with their sample counts (O(shards): all a plan needs) or a mix's (`mix`). Picklable:
    a Ray actor gets it whole."""

    settings: StreamSettings
    transform: Callable
    shards: Sequence[ShardSpec] = ()
    counts: np.ndarray | None = None
    mix: MixedShards | None = None

    def __post_init__(self) -> None:
        if self.counts is None:
            counts = np.fromiter((s.samples for s in self.shards), np.int64, len(self.shards))
            object.__setattr__(self, "counts", counts)
        object.__setattr__(self, "counts", np.asarray(self.counts, dtype=np.int64))
        # The one place one source and a mix differ here: what the plan is made of
        # (a source's counts, or the mix's `Mix`) and the lists of shards read.
        if self.mix is None:
            planned, lists, total = self.counts, (self.shards,), int(self.counts.sum())
        else:
            planned, lists, total = self.mix.plan, self.mix.shards, self.mix.plan.total
        object.__setattr__(self, "planned", planned)  # what `plan_epoch` plans from
        object.__setattr__(self, "shard_lists", lists)  # one list, or one a source
        object.__setattr__(self, "total", total)  # samples of a whole epoch

    def every_shard(self) -> Iterator[ShardSpec]:
        """Every shard any role may read (the fetcher's cache plans by them)."""
        return itertools.chain(*self.shard_lists)

    def partition(self, num_workers: int) -> Partition:
        s = self.settings
        return Partition.of(s.batch, s.shuffle, s.world_size, num_workers)

    def plan_epoch(self, part: Partition, epoch: int, segments: Sequence[Segment]):
        """This rank's `plan_epoch` of one source or of the mix: the main process, the
        workers and remote roles ask here, so they plan alike."""
        s = self.settings
        return plan_epoch(self.planned, part, s.rank, s.seed, epoch, segments, s.epoch_samples)

    def build_reader(self) -> ShardReader:
        """A reader for one process (its fetcher's threads are that process's)."""
        first = self.shard_lists[0]
        return ShardReader(self.settings, first[0] if len(first) else None)


@dataclass(frozen=True)
class RoleTask:
    """Which share of which epoch a role delivers.

    Args:
        role: the plan's worker slot, `0 <= role < num_workers`.
        segments: the epoch's earlier partitions and what they consumed (a resume).
        delivered: batches this role delivered under this partition before this start
            (a resume: `pipeline.plan.roles_consumed`; a role restarted on another node:
            what the trainer received from it).
    """

    role: int
    num_workers: int
    epoch: int
    segments: tuple[Segment, ...] = ()
    delivered: int = 0


def iter_role_batches(
    source: StreamSource,
    task: RoleTask,
    reader: ShardReader | None = None,
    memory: BatchMemory | None = None,
    worker: int | None = None,
) -> Iterator[tuple]:
    """The batches role `task.role` delivers of `task.epoch` from where it stands
    (`pipeline.assemble.BatchAssembler` says what each is).

    Args:
        reader: this process's reader (made here when None; a worker keeps its own
            across epochs so its fetcher and cache persist).
        memory: where image batches are written (a DataLoader worker's ring or shared
            memory; plain memory by default).
        worker: the id the role's stats carry (default: the role).
    """
    reader = source.build_reader() if reader is None else reader
    memory = BatchMemory() if memory is None else memory
    part = source.partition(task.num_workers)
    stats = WorkerStats(worker=task.role if worker is None else worker)
    # Only the slot's plan outlives this line: the epoch's layout (4 bytes a shard) and
    # the rank's positions are not held while the epoch is read.
    slot = source.plan_epoch(part, task.epoch, task.segments).worker(task.role)
    stats.fetch = reader.fetcher.schedule(
        plan_shards(slot, source.shards, source.mix), source.every_shard()
    )
    stats.budget = max(10, int(slot.samples * source.settings.max_skip_fraction))
    samples = iter_role_samples(source, task, part, slot, reader, stats)
    skipped = min(task.delivered * part.batch_size, slot.samples)
    samples = skip_delivered(samples, skipped)
    sizes = iter_batch_sizes(slot.samples, slot.batches, part.batch_size, task.delivered)
    assembler = BatchAssembler(source.settings, source.transform, reader.skip_hint, memory)
    return assembler.iter_batches(samples, sizes, task.epoch, stats)


def iter_role_samples(
    source: StreamSource,
    task: RoleTask,
    part: Partition,
    slot: WorkerPlan | MixedWorkerPlan,
    reader: ShardReader,
    stats: WorkerStats,
) -> Iterator[Sample]:
    """The role's encoded samples in delivery order: read, copied or drawn, shuffled."""
    s = source.settings
    if isinstance(slot, MixedWorkerPlan):
        rngs = mix_rngs(slot, s.seed, task.epoch, s.rank, task.role)
        return iter_mixed(reader, source.mix, slot, rngs, stats)
    if slot.pieces is None:
        # Resampled mode draws with replacement (shards weighted by size): a resumed
        # epoch is not replayed, a new partition simply continues drawing, from a
        # source of its own.
        rng = random.Random(
            f"resample:{s.seed}:{task.epoch}:{len(task.segments)}:{s.rank}:{task.role}"
        )
        draws = Draws(source.shards, source.counts.tolist(), s.class_weights, s.fields)
        samples = iter_draws(reader, draws, rng, stats, slot.samples)
    elif slot.repeats is not None:
        samples = iter_copies(reader, slot, source.shards, stats)
    else:
        samples = reader.iter_pieces(slot.pieces, source.shards, stats)
    # Repeated augmentation: ranks reading one lane each shuffle alike (the plan).
    rank = s.rank if slot.shuffle_rank is None else slot.shuffle_rank
    rng = worker_rng(s.seed, task.epoch, rank, task.role)
    return shuffle_buffer(samples, part.shuffle_buffer, part.shuffle_initial, rng)
