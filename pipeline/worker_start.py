"""How a loader's DataLoader workers start: `Workers.start_method` resolved for this moment.

`auto` forks, as PyTorch's DataLoader does on Linux, unless forking here could hang a
worker as it starts (`shards.processes.fork_hazard` without Python threads: the native
threads of torch.distributed, Ray or CUDA). A DDP trainer is such a process: its workers
are spawned instead, each a fresh interpreter that imports the loader (about 1.5 s, once
per run with persistent workers). Spawned, not forked from a forkserver: a spawned
worker is still this process's child, so PyTorch hears of its death by SIGCHLD even
when it dies halfway through sending a batch, where a forkserver's child would leave the
loader blocked on the half-sent batch for good.

The batch ring and the epoch state reach spawned workers as shared memory
(`pipeline.sharedbytes`). The dataset itself is pickled to them: one that does not
pickle (a lambda as transform) is forked anyway under `auto`, with one warning saying
why and what to change; an explicit `spawn` refuses it in one line.
"""

from __future__ import annotations

import logging
import pickle

from shards.errors import UsageError
from shards.processes import fork_hazard, start_context

log = logging.getLogger("pipeline")

START_METHODS = ("auto", "fork", "spawn")
_warned: set[str] = set()  # problems warned of, once each
_said: set[str] = set()  # hazards that made workers spawn, said once each


def worker_context(asked: str, dataset: object):
    """The multiprocessing context the DataLoader's workers start in (`asked`: a
    `Workers.start_method`), checked that `dataset` can get there."""
    hazard = fork_hazard(count_threads=False) if asked == "auto" else None
    method = asked if asked != "auto" else ("spawn" if hazard else "fork")
    if method == "fork":
        return start_context(method)
    problem = pickle_problem(dataset)
    if problem is None:
        if hazard and hazard not in _said:
            _said.add(hazard)
            log.info("loader workers are spawned, not forked: %s", hazard)
        return start_context(method)
    if asked != "auto":
        raise UsageError(
            f"start_method={asked!r} sends the dataset to each worker pickled, and it does "
            f"not pickle: {problem}. Define transforms and augmentation ops at module level "
            f"(not as lambdas or closures), or use start_method='fork'"
        )
    if problem not in _warned:
        _warned.add(problem)
        log.warning(
            "loader workers fork although %s, which can hang a worker as it starts; they "
            "cannot be spawned clean because the dataset does not pickle: %s. Define "
            "transforms and augmentation ops at module level (not as lambdas or closures)",
            hazard,
            problem,
        )
    return start_context("fork")


def pickle_problem(dataset: object) -> str | None:
    """Why `dataset` does not pickle, in one line; None when it does."""
    try:
        pickle.dumps(dataset, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # pickle raises PicklingError, TypeError, AttributeError
        return f"{type(error).__name__}: {error}"
    return None
