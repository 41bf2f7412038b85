"""`SharedBytes`: memory the main process shares with its loader workers, however they start.

Forked workers inherit the mapping. Workers started by a forkserver or spawn
(`Workers.start_method`, `shards.processes`) receive it with the pickled dataset as a
file descriptor of the same pages (a Linux memfd, passed the way multiprocessing passes
descriptors to a starting process) and map it again, so the batch ring and the epoch
state work alike under every start method. Pickled for anything else (a Ray actor,
possibly on another node) it arrives detached: `mapping` is None.
"""

from __future__ import annotations

import mmap
import os
import weakref
from multiprocessing import context, reduction


class SharedBytes:
    """`size` zeroed bytes shared with the worker processes this process starts."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("shared memory needs at least one byte")
        self.size = size
        self.fd = -1
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("shardpipe-loader", os.MFD_CLOEXEC)
            weakref.finalize(self, os.close, self.fd)
            os.ftruncate(self.fd, size)
            self.mapping: mmap.mmap | None = mmap.mmap(self.fd, size)
        else:  # reaches forked workers only
            self.mapping = mmap.mmap(-1, size)

    def __reduce__(self):
        starting = context.get_spawning_popen()
        if starting is None or self.fd < 0 or self.mapping is None:
            return _detached, (self.size,)
        return _attached, (reduction.DupFd(self.fd), self.size)


def _detached(size: int) -> SharedBytes:
    shared = SharedBytes.__new__(SharedBytes)
    shared.size, shared.fd, shared.mapping = size, -1, None
    return shared


def _attached(descriptor, size: int) -> SharedBytes:
    """In a worker started by a forkserver or spawn: the parent's pages, mapped here."""
    shared = SharedBytes.__new__(SharedBytes)
    shared.size, shared.fd = size, descriptor.detach()
    weakref.finalize(shared, os.close, shared.fd)
    shared.mapping = mmap.mmap(shared.fd, size)
    return shared
