"""One worker role's batches of an epoch, the same wherever it runs (`iter_role_batches`).

A role is one slot of the epoch plan (`pipeline.epoch`): the DataLoader's worker `w` plays
it in a worker process (`pipeline.dataset.ShardStream`, which passes the role in), the
main process plays the only one without workers, and a Ray actor (`pipeline.remote`)
plays the one it is given. The chain, stage by stage: plan slice -> per source, its
shard pieces (`pipeline.stages.ShardReader`) as the plan's copies, or its draws -> its
shuffle buffer -> the sources merged in the plan's order (one source: as it is) -> skip
what was delivered -> decode + augment -> batches (`pipeline.assemble`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from pipeline.assemble import BatchAssembler, BatchMemory, iter_batch_sizes
from pipeline.epoch import EpochPlan, WorkerPlan, draw_rng, plan_epoch, source_rng
from pipeline.fetch import plan_shards
from pipeline.plan import Partition, Segment, shuffle_buffer
from pipeline.sources import ShardSpec
from pipeline.stages import (
    Draws,
    ShardReader,
    SourceShards,
    StreamSettings,
    iter_draws,
    iter_source,
    merge_sources,
    skip_delivered,
)
from pipeline.stats import WorkerStats
from shards.sample import Sample


@dataclass(frozen=True, eq=False)
class StreamSource:
    """What every role of a loader reads: its settings, the crop, and its sources' shards
    with their sample counts (O(shards): all a plan needs). Picklable: a Ray actor gets
    it whole."""

    settings: StreamSettings
    transform: Callable
    sources: SourceShards

    @property
    def total(self) -> int:
        """Samples of a whole epoch (resampled: of one pass over the source)."""
        return self.sources.plan.total

    def every_shard(self) -> Iterator[ShardSpec]:
        """Every shard any role may read (the fetcher's cache plans by them)."""
        return itertools.chain(*self.sources.shards)

    def partition(self, num_workers: int) -> Partition:
        s = self.settings
        return Partition.of(s.batch, s.shuffle, s.world_size, num_workers)

    def plan_epoch(self, part: Partition, epoch: int, segments: Sequence[Segment]) -> EpochPlan:
        """This rank's `plan_epoch`: the main process, the workers and remote roles ask
        here, so they plan alike."""
        s = self.settings
        return plan_epoch(self.sources.plan, part, s.rank, s.seed, epoch, segments, s.epoch_samples)

    def build_reader(self) -> ShardReader:
        """A reader for one process (its fetcher's threads are that process's)."""
        first = self.sources.shards[0]
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
    # Only the slot's plan outlives this line: the epoch's layouts (4 bytes a shard) and
    # the rank's positions are not held while the epoch is read (`SourceEpoch.bare`).
    slot = source.plan_epoch(part, task.epoch, task.segments).worker(task.role)
    stats.fetch = reader.fetcher.schedule(plan_shards(slot, source.sources), source.every_shard())
    stats.budget = max(10, int(slot.samples * source.settings.max_skip_fraction))
    samples = iter_role_samples(source, task, slot, reader, stats)
    skipped = min(task.delivered * part.batch_size, slot.samples)
    samples = skip_delivered(samples, skipped)
    sizes = iter_batch_sizes(slot.samples, slot.batches, part.batch_size, task.delivered)
    assembler = BatchAssembler(source.settings, source.transform, reader.skip_hint, memory)
    return assembler.iter_batches(samples, sizes, task.epoch, stats)


def iter_role_samples(
    source: StreamSource,
    task: RoleTask,
    slot: WorkerPlan,
    reader: ShardReader,
    stats: WorkerStats,
) -> Iterator[Sample]:
    """The role's encoded samples in delivery order: each source's read (or drawn) and
    shuffled in a buffer of its own, merged in the plan's order."""
    s, sources = source.settings, source.sources
    streams = []
    for part in slot.parts:
        if part.pieces is None:  # resampled: drawn with replacement, shards by size
            rng = draw_rng(s.seed, task.epoch, len(task.segments), s.rank, task.role, part.name)
            counts = sources.plan.counts[part.source].tolist()
            shards, remap = sources.shards[part.source], sources.remaps[part.source]
            draws = Draws(shards, counts, s.class_weights, s.fields, part.name, remap)
            samples = iter_draws(reader, draws, rng, stats, part.samples)
        else:
            samples = iter_source(reader, sources, part, stats)
        rng = source_rng(s.seed, task.epoch, slot.shuffle_rank, task.role, part.name)
        streams.append(shuffle_buffer(samples, part.buffer, part.initial, rng))
    return merge_sources(slot.iter_sources(), streams)
