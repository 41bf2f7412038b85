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
(`pipeline.sharedbytes`). The dataset itself is pickled to them, and each imports the
main script again: a dataset that does not pickle (a lambda as transform), or a script
that starts the workers from its top level (which each worker would run again), is
forked anyway under `auto`, with one warning saying why and what to change; an explicit
`spawn` refuses it in one line.
"""

from __future__ import annotations

import ast
import inspect
import logging
import pickle
import sys
from pathlib import Path

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
    problem = unguarded_main() or pickle_problem(dataset)
    if problem is None:
        if hazard and hazard not in _said:
            _said.add(hazard)
            log.info("loader workers are spawned, not forked: %s", hazard)
        return start_context(method)
    if asked != "auto":
        raise UsageError(
            f"start_method={asked!r} cannot start the workers: {problem}; or use "
            f"start_method='fork'"
        )
    if problem not in _warned:
        _warned.add(problem)
        log.warning(
            "loader workers fork although %s, which can hang a worker as it starts; they "
            "cannot be spawned clean: %s",
            hazard,
            problem,
        )
    return start_context("fork")


def pickle_problem(dataset: object) -> str | None:
    """Why `dataset` cannot go to a spawned worker, with what to change; None when it can."""
    try:
        pickle.dumps(dataset, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # pickle raises PicklingError, TypeError, AttributeError
        return (
            f"the dataset goes to each worker pickled, and it does not pickle "
            f"({type(error).__name__}: {error}). Define transforms and augmentation ops at "
            f"module level (not as lambdas or closures)"
        )
    return None


def unguarded_main() -> str | None:
    """Where the main script starts workers from its top level, outside
    `if __name__ == "__main__":`, so that a spawned worker, which imports the script
    again, would run that code again (start a loader, join a process group); None when
    it does not (a guarded script, `python -c`, a notebook, a thread of its own).
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    frame = inspect.currentframe()
    while frame is not None and not (
        frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"
    ):
        frame = frame.f_back
    if frame is None or path is None or frame.f_code.co_filename != path:
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for statement in tree.body:
        if statement.lineno <= line <= (statement.end_lineno or statement.lineno):
            if isinstance(statement, ast.If) and "__name__" in ast.unparse(statement.test):
                return None
            return (
                f"{path}, line {line}, starts them from its top level, which each spawned "
                f"worker runs again as it imports the script. Move that code under "
                f'`if __name__ == "__main__":`'
            )
    return None
