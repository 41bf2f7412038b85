"""How this process starts worker processes: fork where that is safe, else a clean start.

A fork copies the process with its imports done, in milliseconds, and shares its memory
without pickling. It is unsafe where another thread may hold a lock at the moment of the
fork: the child inherits the lock held by a thread it does not have and can wait for it
forever before running a line of Python. Python threads (logging, a progress bar, a
pin-memory thread), Ray's gRPC threads and torch.distributed's communication threads are
such threads. The last hangs loader workers in practice: on Python up to 3.11, a gloo or
NCCL thread that enters Python at the moment of a fork leaves the child blocked on the
interpreter's thread-list lock (python/cpython#112275); a `DistributedDataParallel` step
followed by a fork hung 1 child in 3,000 here (`benchmarks/worker_start.py hazard`), and
PyTorch's own issue #130610 is the same with a pin-memory thread. A clean start avoids
it: a forkserver (a process started clean, by fork and exec, that forks the children
instead; Python 3.14's default on Linux) or spawn (fork and exec of a fresh
interpreter). The build's pool uses a forkserver; the loader spawns
(`pipeline.worker_start` says why).

The native pools a process holds without threads of their own running (OpenBLAS,
OpenMP, Arrow, OpenCV) reset themselves in a forked child, as PyTorch's forked loader
workers rely on, so they do not count.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from collections.abc import Sequence

# What a process that must not fork uses: a forkserver where the platform has one.
CLEAN_START = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def fork_hazard(count_threads: bool = True) -> str | None:
    """Why forking this process now could hang the child, in words; None where it is safe.

    `count_threads`: any other Python thread counts (the build's pool, whose clean start
    costs milliseconds, takes no chance). Without it only the native threads known to
    enter Python or libc locks at any moment count: torch.distributed's, Ray's and
    CUDA's (a loader's pin-memory thread among them), as PyTorch's DataLoader forks
    beside Python threads of its users every day.
    """
    if sys.platform != "linux":
        return f"fork is not safe on {sys.platform}"
    others = threading.active_count() - 1
    if count_threads and others:
        current = threading.current_thread()
        names = sorted({t.name for t in threading.enumerate() if t is not current})
        return f"{others} other Python thread{'s' * (others > 1)} run ({', '.join(names)})"
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return "Ray is initialized (its gRPC threads)"
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return "torch.distributed is initialized (its communication threads)"
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and cuda.is_initialized():
        return "CUDA is initialized (its driver's threads, a pin-memory thread)"
    return None


def start_method() -> str:
    """`fork` without a `fork_hazard`, else `CLEAN_START` (the build's local pool)."""
    return "fork" if fork_hazard() is None else CLEAN_START


def start_context(method: str, preload: Sequence[str] = ()) -> multiprocessing.context.BaseContext:
    """The multiprocessing context of `method`; a forkserver imports `preload` once, so its
    children start with them imported (only the first caller's list counts: the server is
    one per process, started on first use; a module that does not import is skipped)."""
    context = multiprocessing.get_context(method)
    if method == "forkserver" and preload:
        context.set_forkserver_preload(list(preload))
    return context
