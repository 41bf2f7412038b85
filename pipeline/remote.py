"""Worker roles as Ray actors (`Workers(placement="ray")`): each runs `iter_role_batches`
for its role's slice of the same epoch plan on the cluster's CPU nodes, and streams its
uint8 batches to the training process, which only receives, pins and prefetches them.

Back-pressure: the trainer keeps at most `Workers.prefetch_factor` `next_batch` calls
outstanding per role; a synchronous actor runs one caller's calls in order, one batch each.

The wire: a batch's pixels (its contiguous NHWC uint8 buffer, H * W * 3 bytes an image)
go over the role's TCP channel (`pipeline.channel`, `Workers.ray_wire="channel"`) straight
into a reused ring slot or pinned memory here; Ray carries the rest (keys, counters, the
pixels' shape) and the actor's life. With `ray_wire="object_store"` the pixels go through
Ray's object store as numpy too (its raylets copy every byte on both nodes), and the one
copy here is out of it. Either way it is the one copy the DataLoader path makes out of
shared memory.

Exactly once: the trainer counts the batches it received from each role; an actor lost
with its node is started again on another node and resumes its role from that count
(`RoleTask.delivered`), so no batch is lost or delivered twice.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.batchring import BatchRing
from pipeline.channel import (
    ChannelError,
    ChannelImages,
    ChannelReceiver,
    ChannelSender,
    new_token,
)
from pipeline.config import Workers
from pipeline.plan import Segment, roles_consumed
from pipeline.roles import RoleTask, StreamSource, iter_role_batches
from shards.cluster import ClusterError, start_ray
from shards.redact import redact_url

log = logging.getLogger("pipeline")

RESTART_POLL_S = 1.0  # a lost role's new actor: how often room for it is checked while it waits
CHANNEL_TRIES = 3  # a role's channel failing this often in a row, its actor new each time: an error


@dataclass(frozen=True)
class WireImages:
    """An image batch on the wire: its `[B, H, W, 3]` buffer (the batch is channels-last)."""

    nhwc: np.ndarray


class RoleActor:
    """One role's stage chain in a Ray actor process (`ray.remote` makes it an actor).

    With a `channel_token` its image batches go over `pipeline.channel` (the trainer
    connects to `channel_address()`), and the batch Ray returns carries their shape.
    """

    def __init__(self, source: StreamSource, channel_token: bytes | None, depth: int) -> None:
        self.source = source
        self.reader = source.build_reader()  # this process's fetcher, kept across epochs
        self.batches: Iterator[tuple] = iter(())
        self.token, self.depth = channel_token, depth
        self.sender: ChannelSender | None = None

    def channel_address(self) -> tuple[str, int] | None:
        """Where this start's channel listens (asked after `start`: calls run in order)."""
        return None if self.sender is None else self.sender.address

    def start(self, task: RoleTask) -> None:
        self.batches = iter_role_batches(self.source, task, self.reader)
        if self.token is not None:  # a channel of its own for each start: no stale frames
            import ray

            if self.sender is not None:
                self.sender.close()
            self.sender = ChannelSender(self.token, ray.util.get_node_ip_address(), self.depth)

    def next_batch(self) -> tuple | None:
        """The role's next batch as numpy buffers, or None once the role is done."""
        batch = next(self.batches, None)
        if batch is None:
            return None
        values, size, keys, stats = batch
        return tuple(self.wire(value) for value in values), size, keys, stats

    def wire(self, value: object) -> object:
        value = to_wire(value)
        if self.sender is not None and isinstance(value, WireImages):
            return self.sender.send(value.nhwc)  # the pixels go over the channel
        return value


def to_wire(value: object) -> object:
    """A batch entry as the object store holds it without a copy: numpy, not torch."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 4 and value.permute(0, 2, 3, 1).is_contiguous():
        return WireImages(value.permute(0, 2, 3, 1).numpy())
    return np.ascontiguousarray(value.numpy())


def from_wire(
    value: object,
    pin: bool,
    ring: BatchRing | None = None,
    channel: ChannelReceiver | None = None,
) -> object:
    """A batch entry as the loader yields it: a tensor in pinned memory (`pin`), in a free
    slot of `ring`, or in the trainer's own memory; the one copy out of the read-only
    object store, or the one read from the role's `channel`.

    Why the ring: a fresh 38 MB batch (256 x 224 x 224 x 3) is past glibc's largest mmap
    threshold, so every copy into new memory faults in ~9,400 pages (~20 ms a batch on a
    2-core VM, ~80 us an image); a slot is reused once no tensor over it is left
    (`pipeline.batchring`), and a batch finding none free is copied into new memory.

    Raises:
        ChannelError: the channel broke or carried another frame than announced.
    """
    if isinstance(value, ChannelImages):
        if channel is None:
            raise ChannelError("a batch came by channel to a trainer without one")
        array, finish = image_buffer(value.shape, pin, ring)
        channel.receive_into(value, array)
        return finish()
    images = isinstance(value, WireImages)
    array = value.nhwc if images else value
    if not isinstance(array, np.ndarray):
        return value
    if images:
        out, finish = image_buffer(array.shape, pin, ring)
        np.copyto(out, array)
        return finish()
    with warnings.catch_warnings():
        # The tensor over the read-only buffer lives only until the copy below.
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        tensor = torch.from_numpy(array)
    return tensor.pin_memory() if pin else tensor.clone()


def image_buffer(shape: tuple[int, ...], pin: bool, ring: BatchRing | None) -> tuple:
    """Where an NHWC uint8 batch of `shape` is received: (a writable array over it, a
    function giving the NCHW-shaped tensor once it is filled). Pinned memory, else a free
    ring slot, else new memory; a slot left unfinished (a failed read) is freed."""
    if not pin and ring is not None:
        slot = ring.acquire(0, shape)
        if slot is not None:
            slot.channels_last = True  # the slot holds NHWC: the tensor is its NCHW view
            return slot.writable(), slot.tensor
    tensor = torch.empty(shape, dtype=torch.uint8, pin_memory=pin)
    return tensor.numpy(), lambda: tensor.permute(0, 3, 1, 2)


def start_remote_roles(
    source: StreamSource, workers: Workers, pin: bool, slot_bytes: int
) -> RemoteRoles | None:
    """The loader's remote roles on the cluster (Ray started or joined first); or, when
    the cluster has no room for them and `workers.fallback == "local"`, None after one
    warning line naming the cluster and what it lacks: the caller then runs the same
    roles as local DataLoader workers (`Workers.as_local`). `slot_bytes`: the largest
    image batch, for the slots unpinned batches are received into.

    Raises:
        ClusterError: no cluster answers; or it cannot hold `remote` actors of `ray_cpus`
            CPUs and `ray_resources` and `fallback="error"` (one line saying what is
            missing).
    """
    import ray

    ours = not ray.is_initialized()
    start_ray(workers.ray_address, None, "Workers.ray_address", log)
    if workers.fallback == "error":
        check_capacity(workers, ray.cluster_resources())
    else:
        short = capacity_shortfall(workers, ray.cluster_resources())
        if short is not None:
            cluster = redact_url(ray.get_runtime_context().gcs_address)
            log.warning(
                "the Ray cluster at %s has %s: the %d remote roles run as local DataLoader "
                "workers instead (Workers.fallback='local'), the same epoch",
                cluster,
                short,
                workers.remote,
            )
            if ours:  # joined (or started) for these roles only: nothing runs there now
                ray.shutdown()
                log.info(
                    "left the Ray cluster at %s: none of this loader's roles run there", cluster
                )
            return None
    return RemoteRoles(source, workers, pin, slot_bytes)


class RemoteRoles:
    """The loader's worker roles as Ray actors, made once and kept across epochs, on a
    cluster that has room for them (`start_remote_roles` checks)."""

    def __init__(self, source: StreamSource, workers: Workers, pin: bool, slot_bytes: int) -> None:
        import ray

        self.source_ref = ray.put(source)
        self.workers, self.pin = workers, pin
        # Unpinned batches are copied into reused slots: the batch the consumer holds, the
        # one it takes next and spares for a prefetcher (pinned ones go to torch's cache).
        self.ring = None if pin else BatchRing(1, workers.prefetch_factor + 2, slot_bytes)
        self.token = new_token() if workers.ray_wire == "channel" else None
        self.actors = [self.spawn() for _ in range(workers.remote)]

    def spawn(self):
        import ray

        options = dict(num_cpus=self.workers.ray_cpus, max_restarts=0)
        if self.workers.ray_resources:
            options["resources"] = dict(self.workers.ray_resources)
        depth = self.workers.prefetch_factor
        return ray.remote(RoleActor).options(**options).remote(self.source_ref, self.token, depth)

    def iter_epoch(
        self,
        epoch: int,
        segments: tuple[Segment, ...],
        consumed: int,
        batches: list[int],
        local: Iterator[tuple] | None = None,
    ) -> Iterator[tuple]:
        """The batches of `epoch` after `consumed` of this partition, in the DataLoader's
        order: batch `j` from role `j % roles`, a role that is done passed over.

        Args:
            batches: each role's planned batches (`len(batches)` roles in all); the last
                `remote` are this object's actors, the first the DataLoader's workers.
            local: the DataLoader's batches (its round robin over the local roles).
        """
        count, first_remote = len(batches), len(batches) - len(self.actors)
        delivered = roles_consumed(consumed, count)
        streams = {
            role: RoleStream(self, RoleTask(role, count, epoch, segments, delivered[role]), index)
            for index, role in enumerate(range(first_remote, count))
        }
        left = [planned - done for planned, done in zip(batches, delivered, strict=True)]
        live = deque(r for r in ((consumed + o) % count for o in range(count)) if left[r] > 0)
        while live:
            role = live.popleft()
            batch = next(local, None) if role < first_remote else streams[role].next_batch()
            if batch is None:
                continue  # the role is done
            values, size, keys, stats = batch
            left[role] -= 1
            if size and left[role] > 0:  # no size: an exactly-once role that ended short
                live.append(role)
            yield values, size, keys, stats

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []


def check_capacity(
    workers: Workers,
    resources: dict,
    context: str = "",
    advice: str = "ask for fewer remote roles or Workers(fallback='local')",
) -> None:
    """One clear line when the cluster cannot hold the roles at all (`context`: what
    happened first, said before it; `advice`: what to do besides adding nodes)."""
    short = capacity_shortfall(workers, resources)
    if short:
        raise ClusterError(
            f"{context}the Ray cluster has {short}: add nodes with them, or {advice}"
        )


def capacity_shortfall(workers: Workers, resources: dict) -> str | None:
    """What the cluster's `resources` (in all) lack for `workers.remote` roles, said as
    `has CPU 3 but Workers(...) needs CPU 8`, or None when they fit."""
    needs = {"CPU": workers.remote * workers.ray_cpus}
    for name, amount in (workers.ray_resources or {}).items():
        needs[name] = workers.remote * amount
    short = {name: amount for name, amount in needs.items() if resources.get(name, 0) < amount}
    if not short:
        return None
    has = ", ".join(f"{name} {resources.get(name, 0):g}" for name in short)
    wants = ", ".join(f"{name} {amount:g}" for name, amount in short.items())
    return (
        f"{has} but Workers(remote={workers.remote}, ray_cpus={workers.ray_cpus:g}, "
        f"ray_resources={workers.ray_resources}) needs {wants}"
    )


class RoleStream:
    """One role's batches as the training process receives them: its actor's outstanding
    `next_batch` calls (`Workers.prefetch_factor`) and the count received, which is where
    an actor started again after its node was lost resumes the role."""

    def __init__(self, roles: RemoteRoles, task: RoleTask, index: int) -> None:
        self.roles, self.task, self.index = roles, task, index  # index: of the role's actor
        self.received = 0
        self.before: dict = {}  # the counters of the role's lost actors, summed
        self.latest: dict = {}  # the current actor's latest counters
        self.pending: deque = deque()
        self.channel: ChannelReceiver | None = None  # connected on the actor's first batch
        self.channel_address = None  # the reference to the actor's channel address
        self.begin()

    @property
    def actor(self):
        return self.roles.actors[self.index]

    def begin(self):
        """Start the role on its actor from the first batch not received, `prefetch_factor`
        batches asked for; returns the start call's reference."""
        delivered = self.task.delivered + self.received
        started = self.actor.start.remote(dataclasses.replace(self.task, delivered=delivered))
        if self.channel is not None:
            self.channel.close()
        self.channel = None
        if self.roles.token is not None:
            self.channel_address = self.actor.channel_address.remote()
        ahead = self.roles.workers.prefetch_factor
        self.pending = deque(self.actor.next_batch.remote() for _ in range(ahead))
        return started

    def next_batch(self) -> tuple | None:
        """The role's next batch, or None when it is done. An actor lost with its node (its
        batches in that node's object store lost with it) is started again where the
        cluster has room and resumes from what was received; the stall, bounded by Ray's
        node failure detection, is logged."""
        import ray

        began, lost, broken = time.perf_counter(), False, 0
        while True:
            try:
                batch = ray.get(self.pending.popleft())
                if batch is not None:
                    values = tuple(self.receive(value) for value in batch[0])
            except (
                ray.exceptions.RayActorError,
                ray.exceptions.ObjectLostError,
                ChannelError,
            ) as error:
                broken = broken + 1 if isinstance(error, ChannelError) else 0
                if broken >= CHANNEL_TRIES:  # not a lost node: the channel cannot work here
                    raise ChannelError(
                        f"worker role {self.task.role}: its batch channel failed "
                        f"{broken} times in a row ({str(error).splitlines()[0][:200]}); if the "
                        "cluster's nodes cannot connect to each other on free ports, use "
                        "Workers(ray_wire='object_store') (train --ray-wire object_store)"
                    ) from error
                log.warning(
                    "worker role %d was lost (%s: %s); starting it again on the cluster from "
                    "its batch %d",
                    self.task.role,
                    type(error).__name__,
                    str(error).splitlines()[0][:200] if str(error) else "",
                    self.task.delivered + self.received,
                )
                self.restart()
                lost = True
                continue
            if lost:
                stall = time.perf_counter() - began
                log.warning(
                    "worker role %d delivers again after a stall of %.1f s", self.task.role, stall
                )
            if batch is None:
                return None
            self.received += 1
            self.pending.append(self.actor.next_batch.remote())
            _, size, keys, self.latest = batch
            return values, size, keys, add_counts(self.before, self.latest)

    def receive(self, value: object) -> object:
        """One entry of a batch as the loader yields it (`from_wire`), its pixels read
        from the role's channel when they came that way (connected on first use)."""
        if isinstance(value, ChannelImages) and self.channel is None:
            import ray

            address = ray.get(self.channel_address)
            self.channel = ChannelReceiver(tuple(address), self.roles.token)
        return from_wire(value, self.roles.pin, self.roles.ring, self.channel)

    def restart(self) -> None:
        """A new actor for the role, started from what was received. It waits for room
        while the cluster has it; once Ray has declared the lost node dead and the rest
        cannot hold the roles, one `ClusterError` line rather than a wait forever."""
        import ray

        ray.kill(self.actor)  # one that was only unreachable must not come back beside it
        self.before, self.latest = add_counts(self.before, self.latest), {}
        self.roles.actors[self.index] = self.roles.spawn()
        started = self.begin()
        context = f"worker role {self.task.role} was lost with its node, and "
        # Mid-epoch there is no local worker to hand the role to (a DataLoader's workers
        # are fixed while it iterates): the saved state resumes exactly, locally if need be.
        advice = (
            "resume from the last state_dict() (Workers(fallback='local'): on local workers "
            "if the cluster stays short)"
        )
        while not ray.wait([started], timeout=RESTART_POLL_S)[0]:
            check_capacity(self.roles.workers, ray.cluster_resources(), context, advice)


def add_counts(before: dict, latest: dict) -> dict:
    """A role's counters (`WorkerStats.snapshot`) over its actors: numbers and per-reason
    counts added, examples joined, the rest (its id, the fetcher's read-ahead) the latest."""
    total = dict(latest)
    for name, value in before.items():
        now = latest.get(name)
        if isinstance(value, dict) and name != "fetch":
            total[name] = {
                k: value.get(k, 0) + (now or {}).get(k, 0) for k in {*value, *(now or {})}
            }
        elif isinstance(value, list):
            total[name] = value + (now or [])
        elif isinstance(value, (int, float)) and name not in ("worker", "budget"):
            total[name] = value + (now or 0)
    return total
