"""What a run measures and where it goes: data wait vs compute, verdicts, JSONL/CSV, plot.

Data wait is the time the training loop is blocked asking for the next batch.
The loop reads the loss once per optimizer step (a device sync), so on a GPU
the wait is time the GPU sat idle for lack of input, and the rest of the step
is compute.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("trainers")

METRICS_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"
PLOT_NAME = "metrics.png"
CSV_COLUMNS = (
    "kind",
    "step",
    "epoch",
    "loss",
    "lr",
    "images_per_s",
    "data_wait_frac",
    "val_loss",
    "val_accuracy",
    "val_samples",
    "evals",
    "time_s",
)


@dataclass
class Window:
    """Totals over a stretch of training steps on this rank."""

    steps: int = 0
    samples: int = 0
    wait_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def wait_frac(self) -> float:
        return self.wait_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def add(self, other: Window) -> None:
        self.steps += other.steps
        self.samples += other.samples
        self.wait_s += other.wait_s
        self.elapsed_s += other.elapsed_s


class StepTimer:
    """Splits wall time into data wait and the rest, per optimizer step.

    `mark()` restarts the clock (after an evaluation or a checkpoint, which are
    not training time); `record_wait` adds time blocked on the loader;
    `end_step` closes a step. `take()` returns the window since the last take.
    """

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.pending_wait = 0.0
        self.window = Window()
        self.total = Window()

    def mark(self) -> None:
        self.last = time.perf_counter()
        self.pending_wait = 0.0

    def record_wait(self, seconds: float) -> None:
        self.pending_wait += seconds

    def end_step(self, samples: int) -> None:
        now = time.perf_counter()
        step = Window(1, samples, self.pending_wait, now - self.last)
        self.window.add(step)
        self.total.add(step)
        self.last, self.pending_wait = now, 0.0

    def take(self) -> Window:
        window, self.window = self.window, Window()
        return window


def iter_timed(batches: Iterable, timer: StepTimer) -> Iterator:
    """Yield from `batches`, charging the time spent in `next()` to data wait.

    Closing this generator closes the inner iterator at once, so a prefetcher
    stopped mid-epoch hands its read-ahead batch back to the loader.
    """
    iterator = iter(batches)
    try:
        while True:
            started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            timer.record_wait(time.perf_counter() - started)
            yield batch
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


def bottleneck_verdict(wait_frac: float, threshold: float, device: str, workers: int) -> str:
    """One line saying whether the input pipeline or the model limits the run."""
    who = "GPU" if device == "cuda" else "CPU"
    if wait_frac >= threshold:
        return (
            f"input-bound: the {who} waited {wait_frac:.0%} of the time for data; raise "
            f"--workers (now {workers}) or shrink --image-size"
        )
    return f"compute-bound: data wait is {wait_frac:.0%} of step time; the input pipeline keeps up"


class MetricsLog:
    """Rows to `metrics.jsonl` and `metrics.csv` (and TensorBoard when installed); rank 0 only."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / METRICS_NAME
        self.csv_path = self.run_dir / CSV_NAME
        self.writer = open_tensorboard(self.run_dir) if enabled and tensorboard else None

    def write(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
            if new:
                writer.writeheader()
            writer.writerow(row)
        if self.writer is not None:
            for name, value in row.items():
                if isinstance(value, (int, float)) and name not in ("step", "epoch"):
                    self.writer.add_scalar(f"{row['kind']}/{name}", value, row["step"])

    def truncate(self, keep: Callable[[dict], bool]) -> int:
        """Rewrite both files with only the rows `keep` accepts (resume drops replayed rows)."""
        if not self.enabled or not self.path.exists():
            return 0
        rows = read_jsonl(self.path)
        kept = [row for row in rows if keep(row)]
        rewrite_jsonl(self.path, kept)
        with open(self.csv_path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        return len(rows) - len(kept)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def open_tensorboard(run_dir: Path):
    """A SummaryWriter, or None when tensorboard is not installed (silently optional)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (killed mid-write) is dropped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def rewrite_jsonl(path: Path, rows: list[dict]) -> None:
    tmp = path.with_name(f".{path.name}.rewrite")
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


class Trace:
    """Debug trace per rank: the keys of every micro-batch and a parameter digest per step."""

    def __init__(self, run_dir: str | Path, rank: int, enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "trace" / f"rank{rank}.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def truncate(self, keep: Callable[[dict], bool]) -> None:
        if self.enabled and self.path.exists():
            rewrite_jsonl(self.path, [row for row in read_jsonl(self.path) if keep(row)])


def plot_metrics(metrics_path: str | Path, png_path: str | Path) -> bool:
    """Loss, learning rate, images/s and data wait against step, as one PNG.

    Returns:
        False when matplotlib is not installed (the `bench` extra): no plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = read_jsonl(metrics_path)
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    steps = [r["step"] for r in train]
    panels = [
        (axes[0][0], "loss", "train loss"),
        (axes[0][1], "lr", "learning rate"),
        (axes[1][0], "images_per_s", "images/s (all ranks)"),
        (axes[1][1], "data_wait_frac", "data wait / step time"),
    ]
    for axis, name, title in panels:
        axis.plot(steps, [r[name] for r in train], lw=1.2)
        axis.set_title(title)
        axis.grid(alpha=0.3)
    if evals:
        twin = axes[0][0].twinx()
        twin.plot([r["step"] for r in evals], [r["val_accuracy"] for r in evals], "o-", color="C1")
        twin.set_ylabel("val accuracy", color="C1")
    axes[1][1].set_ylim(0, 1)
    for axis in axes[1]:
        axis.set_xlabel("optimizer step")
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return True
