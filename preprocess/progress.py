"""Progress of the shard tasks while the driver (`preprocess.job.run_tasks`) waits for them.

A tqdm bar on a terminal, a plain line every few seconds in a log file, nothing for `--no-progress`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time

# Without a terminal (a log file, CI) a plain line this often instead of a bar.
PROGRESS_EVERY_S = 10.0


class ProgressLine:
    """Progress for a log file: `build-shards: N of M images (P%), R images/s` every few seconds.

    Never a `\r` frame: each report is a line of its own.
    """

    def __init__(
        self,
        total: int,
        initial: int = 0,
        every_s: float = PROGRESS_EVERY_S,
        label: str = "build-shards",
    ) -> None:
        self.label = label
        self.total = total
        self.done = initial
        self.every_s = every_s
        self.started = self.last = time.monotonic()
        self.counted = 0  # images of this run, for the rate

    def update(self, count: int) -> None:
        self.done += count
        self.counted += count
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            rate = self.counted / max(now - self.started, 1e-9)
            share = self.done / self.total if self.total else 1.0
            print(
                f"{self.label}: {self.done} of {self.total} images ({share:.0%}), "
                f"{rate:.0f} images/s",
                file=sys.stderr,
                flush=True,
            )


class NoProgress:
    """`--no-progress`: nothing at all."""

    def update(self, count: int) -> None:
        pass


@contextlib.contextmanager
def progress_bar(
    total: int,
    enabled: bool,
    initial: int = 0,
    every_s: float | None = None,
    label: str = "build-shards",
):
    """A tqdm bar on a terminal (log lines written above it), a `ProgressLine` otherwise
    (a line every `every_s`, default `PROGRESS_EVERY_S`); `label` names the command."""
    if not enabled:
        yield NoProgress()
        return
    if not sys.stderr.isatty():
        yield ProgressLine(total, initial, PROGRESS_EVERY_S if every_s is None else every_s, label)
        return
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    loggers = [logging.getLogger("preprocess"), logging.getLogger("ray"), logging.getLogger()]
    with (
        tqdm(total=total, initial=initial, unit="img", smoothing=0.1, desc=label) as bar,
        logging_redirect_tqdm(loggers=loggers),
    ):
        yield bar
