"""`ShardStream`: the DataLoader's adapter of `pipeline.roles.iter_role_batches`.

Inside each DataLoader worker `__iter__` learns what only the DataLoader knows: the
worker's id (which role it plays after a resume), the epoch and resume point the main
process wrote into `SharedState`, and the worker's `BatchRing` slots. The batches
themselves come from the role's stage chain, the same one the main process and a Ray
actor run: every worker yields exactly its planned number of batches, refilling from
recent samples when data is bad, so DDP ranks stay in step to the end of the epoch; an
exactly-once epoch (eval, the `uneven` rule) never repeats a sample and ends short
instead (`StreamSettings.exactly_once`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from pipeline.assemble import BatchMemory
from pipeline.batchring import BatchRing
from pipeline.plan import SEGMENT_INTS, Partition, Segment, roles_consumed
from pipeline.roles import RoleTask, StreamSource, iter_role_batches
from pipeline.sharedbytes import SharedBytes
from pipeline.stages import SourceShards, StreamSettings

MAX_SEGMENTS = 8


class SharedState:
    """Epoch number and resume segments, shared with (persistent) worker processes.

    Workers read it in `__iter__`, which the DataLoader calls at the start of
    every epoch even when workers persist, so `set_epoch` always reaches them. One
    writer (the main process); a version number, odd while a write is under way, lets a
    reader that overlapped a write read again rather than take half of each.
    """

    def __init__(self) -> None:
        self._memory = SharedBytes(8 * (3 + MAX_SEGMENTS * SEGMENT_INTS))

    def _values(self) -> np.ndarray:
        if self._memory.mapping is None:
            raise RuntimeError("this loader state is detached (a copy pickled for another process)")
        return np.frombuffer(self._memory.mapping, np.int64)

    def write(self, epoch: int, segments: list[Segment]) -> None:
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"more than {MAX_SEGMENTS} resumes within one epoch")
        values = [epoch, len(segments)]
        for segment in segments:
            values += segment.to_ints()
        shared = self._values()
        shared[0] += 1
        shared[1 : 1 + len(values)] = values
        shared[0] += 1

    def read(self) -> tuple[int, list[Segment]]:
        shared = self._values()
        while True:
            version = int(shared[0])
            values = shared[1:].tolist()
            if version % 2 == 0 and int(shared[0]) == version:
                break
            time.sleep(0.001)
        epoch, count = values[0], values[1]
        starts = range(2, 2 + count * SEGMENT_INTS, SEGMENT_INTS)
        return epoch, [Segment.from_ints(values[i : i + SEGMENT_INTS]) for i in starts]


class ShardStream(IterableDataset):
    """Yields the batches of the role this DataLoader worker plays
    (`pipeline.assemble.BatchAssembler` says what each is)."""

    def __init__(
        self,
        sources: SourceShards,
        settings: StreamSettings,
        transform: Callable,
        shared: SharedState,
        ring: BatchRing | None = None,
        num_roles: int | None = None,
    ) -> None:
        """`num_roles`: the roles of the epoch plan when more than this DataLoader's
        workers (remote roles play the rest, `pipeline.remote`); default: its workers."""
        super().__init__()
        self.num_roles = num_roles
        # Samples per shard of each source, read once: planning an epoch needs only
        # these, O(shards), never O(samples).
        self.source = StreamSource(settings, transform, sources)
        self.sources, self.transform = sources, transform
        self.total = self.source.total
        self.shared = shared
        self.ring = ring
        self.reader = self.source.build_reader()  # per process: threads start on first use
        self.read_limits = self.reader.read_limits

    def partition(self, num_workers: int) -> Partition:
        return self.source.partition(num_workers)

    def plan_epoch(self, part: Partition, epoch: int, segments: Sequence[Segment]):
        """This rank's plan of the epoch (`StreamSource.plan_epoch`)."""
        return self.source.plan_epoch(part, epoch, segments)

    def __iter__(self) -> Iterator[tuple]:
        info = get_worker_info()
        worker, local = (info.id, info.num_workers) if info else (0, 1)
        num_workers = self.num_roles or local  # roles 0 .. local - 1 are this DataLoader's
        epoch, segments = self.shared.read()
        resumed = 0
        if segments and segments[-1].partition == self.partition(num_workers):
            resumed = segments[-1].consumed
            segments = segments[:-1]
        # After resuming at batch c the DataLoader restarts its round robin at worker 0,
        # which plays the first local role the epoch asks for from batch c on: with only
        # local roles, physical worker w plays role (w + c) % num_workers.
        first = resumed % num_workers
        role = (worker + (first if first < local else 0)) % local
        delivered = roles_consumed(resumed, num_workers)[role]
        task = RoleTask(role, num_workers, epoch, tuple(segments), delivered)
        memory = BatchMemory(self.ring, worker, shared=info is not None)
        yield from iter_role_batches(self.source, task, self.reader, memory, worker)
