"""What a run measures and where it goes: data wait vs compute, verdicts, JSONL/CSV, plot.

Data wait is the time the training loop is blocked asking for the next batch.
The loop reads the loss once per optimizer step (a device sync), so on a GPU
the wait is time the GPU sat idle for lack of input, and the rest of the step
is compute.
"""

from __future__ import annotations

import csv
import datetime
import importlib.util
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shards.storage.write import atomic_write_bytes

log = logging.getLogger("trainers")

METRICS_NAME = "metrics.jsonl"
CSV_NAME = "metrics.csv"
PLOT_NAME = "metrics.png"
# Every field any row has (a row with another field is a bug: `MetricsLog.write` raises).
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
    "val_map",
    "val_f1_micro",
    "val_f1_macro",
    "val_f1_tuned",
    "evals",
    "time_s",
    "wall_time",
    "rate_steps",
    "scheduler_steps",
    "first_batch_s",
    "peak_mem_gb",
    "verdict",
)
# TensorBoard gets the curves worth watching, under one tag each; counters, clocks and
# the eval row's copies of training figures stay in the JSONL/CSV.
TENSORBOARD_TAGS = {
    "train": {
        "loss": "train/loss",
        "lr": "train/lr",
        "images_per_s": "train/images_per_s",
        "data_wait_frac": "train/data_wait_frac",
        "first_batch_s": "train/first_batch_s",
        "peak_mem_gb": "train/peak_mem_gb",
    },
    "eval": {
        "val_loss": "val/loss",
        "val_accuracy": "val/accuracy",
        "val_map": "val/map",
        "val_f1_micro": "val/f1_micro",
        "val_f1_macro": "val/f1_macro",
    },
}
MARKER_POINTS = 40  # plot each point as a marker up to this many rows


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

    @property
    def images_per_s(self) -> float:
        return self.samples / self.elapsed_s if self.elapsed_s > 0 else 0.0

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


def rate_window(current: Window, previous: Window | None, min_steps: int) -> Window:
    """The steps a metrics row's images/s and data wait are measured over.

    A row forced early (an epoch's end, `--max-steps`) may cover one or two steps,
    often steps whose batches the loader had read ahead while the model was slower:
    alone, their images/s looked like a 10-20x spike. Such a short window, fewer
    than `min_steps`, is measured together with the window before it.
    """
    if previous is None or current.steps >= min_steps:
        return current
    merged = Window()
    merged.add(previous)
    merged.add(current)
    return merged


def bottleneck_verdict(
    wait_frac: float, threshold: float, device: str, workers: int, flag: str = "--workers"
) -> str:
    """One line saying whether the input pipeline or the model limits the run; `flag` is
    what adds worker roles (`--remote-workers` under Ray placement), `workers` its value."""
    who = "GPU" if device == "cuda" else "CPU"
    if wait_frac >= threshold:
        return (
            f"input-bound: the {who} waited {wait_frac:.0%} of the time for data; raise "
            f"{flag} (now {workers}) or shrink --image-size"
        )
    return f"compute-bound: data wait is {wait_frac:.0%} of step time; the input pipeline keeps up"


class MetricsLog:
    """Rows to `metrics.jsonl` and `metrics.csv` (and TensorBoard when installed); rank 0 only.

    Every row gets `time_s`, seconds since the run started (a resumed run goes on
    from its last kept row), and `wall_time`, the local time in ISO 8601.
    """

    def __init__(
        self, run_dir: str | Path, enabled: bool, tensorboard: bool, started: float | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.path = self.run_dir / METRICS_NAME
        self.csv_path = self.run_dir / CSV_NAME
        self.writer = open_tensorboard(self.run_dir) if enabled and tensorboard else None
        self.started = time.perf_counter() if started is None else started
        self.offset_s = 0.0  # time_s of the earlier segments of a resumed run
        self.last: dict[str, dict[str, Any]] = {}  # the latest row of each kind

    def elapsed_s(self) -> float:
        return self.offset_s + time.perf_counter() - self.started

    def write(self, row: dict[str, Any]) -> dict[str, Any]:
        """Stamp `row` with the time, keep it as the latest of its kind, write it; returns it."""
        row = {**row, "time_s": round(self.elapsed_s(), 3), "wall_time": wall_clock()}
        self.last[row["kind"]] = row
        if not self.enabled:
            return row
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        new = not self.csv_path.exists()
        with open(self.csv_path, "a", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="raise")
            if new:
                writer.writeheader()
            writer.writerow(row)
        if self.writer is not None:
            for tag, value in tensorboard_scalars(row):
                self.writer.add_scalar(tag, value, row["step"])
        return row

    def truncate(self, keep: Callable[[dict], bool]) -> int:
        """Rewrite both files with only the rows `keep` accepts (resume drops replayed rows)."""
        if not self.enabled or not self.path.exists():
            return 0
        rows = read_jsonl(self.path)
        kept = [row for row in rows if keep(row)]
        rewrite_jsonl(self.path, kept)
        with open(self.csv_path, "w", encoding="utf-8", newline="") as f:
            # "ignore": rows written by an older version may hold fields we no longer write.
            writer = csv.DictWriter(f, CSV_COLUMNS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
        self.offset_s = max((row.get("time_s") or 0.0 for row in kept), default=0.0)
        self.last = {row["kind"]: row for row in kept if "kind" in row}
        return len(rows) - len(kept)

    def close(self) -> None:
        if self.writer is not None:
            end = self.last.get("end")
            if end is not None and "verdict" in end:
                self.writer.add_text("summary", end["verdict"], end["step"])
            self.writer.close()


def wall_clock() -> str:
    """Now, local time with its UTC offset, to the second: `2026-12-01T09:50:23+01:00`."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def tensorboard_scalars(row: dict[str, Any]) -> list[tuple[str, float]]:
    """`(tag, value)` pairs of a metrics row that TensorBoard shows (see TENSORBOARD_TAGS)."""
    tags = TENSORBOARD_TAGS.get(row.get("kind", ""), {})
    return [(tag, row[name]) for name, tag in tags.items() if row.get(name) is not None]


def summary_line(end: dict[str, Any], steps_per_epoch: int) -> str:
    """The run in one line: wall time, final loss, val accuracy, images/s and the verdict."""
    epochs = end["step"] / steps_per_epoch if steps_per_epoch else 0.0
    unit = "epoch" if epochs == 1 else "epochs"
    parts = [f"{end['step']} optimizer steps ({epochs:.3g} {unit}) in {end['time_s']:.1f} s"]
    if end.get("loss") is not None:
        parts.append(f"final train loss {end['loss']:.4f}")
    if end.get("val_accuracy") is not None:
        parts.append(
            f"val accuracy {end['val_accuracy']:.4f} (val loss {end['val_loss']:.4f}, "
            f"{end['val_samples']} samples)"
        )
    elif end.get("val_map") is not None:
        parts.append(
            f"val mAP {end['val_map']:.4f}, F1 micro {end['val_f1_micro']:.4f} / macro "
            f"{end['val_f1_macro']:.4f} (val loss {end['val_loss']:.4f}, "
            f"{end['val_samples']} samples)"
        )
    else:
        parts.append("no validation")
    parts.append(f"{end['images_per_s']:.0f} images/s")
    parts.append(end["verdict"])
    return "summary: " + "; ".join(parts)


@dataclass(frozen=True)
class MultiLabelReport:
    """Validation figures of a multi-label model, overall and per class.

    Attributes:
        mean_ap: mean over classes with a positive of the average precision.
        f1_micro, f1_macro: F1 at the fixed threshold 0.5 (micro: pooled over classes;
            macro: the mean over classes that have a positive or a prediction).
        f1_tuned: macro F1 at `thresholds`; optimistic, since they were chosen on the
            same samples.
        ap, thresholds, f1, positives: per class; `thresholds[c]` is the score (a
            sigmoid) at or above which class c is predicted, chosen for the best F1 on
            this split (0.5 and NaN AP/F1 for a class without a positive).
    """

    samples: int
    mean_ap: float
    f1_micro: float
    f1_macro: float
    f1_tuned: float
    ap: np.ndarray
    thresholds: np.ndarray
    f1: np.ndarray
    positives: np.ndarray


def multi_label_report(scores: np.ndarray, targets: np.ndarray) -> MultiLabelReport:
    """mAP, F1 and per-class thresholds of `scores` `[N, C]` (probabilities) against 0/1 targets.

    One sort per class serves AP and the threshold search. Tied scores count as one
    cut: a threshold never splits samples of equal score.
    """
    scores = np.asarray(scores, dtype=np.float64)
    targets = np.asarray(targets, dtype=bool)
    samples, classes = scores.shape
    order = np.argsort(-scores, axis=0, kind="stable")
    ranked = np.take_along_axis(scores, order, axis=0)
    hits = np.take_along_axis(targets, order, axis=0)
    true_pos = np.cumsum(hits, axis=0, dtype=np.float64)
    cut = np.arange(1, samples + 1, dtype=np.float64)[:, None]  # samples predicted positive
    positives = hits.sum(axis=0)
    has_pos = positives > 0
    ap = np.full(classes, np.nan)
    ap[has_pos] = (true_pos / cut * hits).sum(axis=0)[has_pos] / positives[has_pos]
    # F1 of predicting the top k: 2 tp / (k + positives); only at the end of a run of ties.
    f1_at = 2 * true_pos / (cut + positives)
    last_of_tie = np.ones_like(hits)
    last_of_tie[:-1] = ranked[:-1] > ranked[1:]
    best = np.where(last_of_tie, f1_at, -1.0).argmax(axis=0) if samples else np.zeros(classes, int)
    columns = np.arange(classes)
    thresholds = np.where(has_pos, ranked[best, columns] if samples else 0.5, 0.5)
    best_f1 = np.where(has_pos, f1_at[best, columns] if samples else np.nan, np.nan)
    micro, macro = f1_scores(scores >= 0.5, targets)
    _, tuned = f1_scores(scores >= thresholds, targets)
    return MultiLabelReport(
        samples=samples,
        mean_ap=float(ap[has_pos].mean()) if has_pos.any() else 0.0,
        f1_micro=micro,
        f1_macro=macro,
        f1_tuned=tuned,
        ap=ap,
        thresholds=thresholds,
        f1=best_f1,
        positives=positives,
    )


def f1_scores(predicted: np.ndarray, targets: np.ndarray) -> tuple[float, float]:
    """Micro and macro F1 of boolean predictions `[N, C]`.

    Macro averages the classes that have a positive or a prediction (F1 is undefined
    for the others); 0.0 when there is none.
    """
    true_pos = (predicted & targets).sum(axis=0)
    wrong = (predicted ^ targets).sum(axis=0)  # false positives + false negatives
    denominator = 2 * true_pos + wrong
    micro = 2 * true_pos.sum() / denominator.sum() if denominator.sum() else 0.0
    defined = denominator > 0
    macro = (2 * true_pos[defined] / denominator[defined]).mean() if defined.any() else 0.0
    return float(micro), float(macro)


def write_thresholds(
    run_dir: str | Path, report: MultiLabelReport, classes: list[str] | None, step: int
) -> Path:
    """`RUN_DIR/thresholds.json`: per class the threshold chosen on val, its F1, AP, positives."""
    names = classes if classes and len(classes) == len(report.ap) else None
    rows = []
    for index in range(len(report.ap)):
        rows.append(
            {
                "class": names[index] if names else index,
                "threshold": float(report.thresholds[index]),
                "f1": None if np.isnan(report.f1[index]) else float(report.f1[index]),
                "ap": None if np.isnan(report.ap[index]) else float(report.ap[index]),
                "positives": int(report.positives[index]),
            }
        )
    document = {
        "step": step,
        "val_samples": report.samples,
        "val_map": report.mean_ap,
        "val_f1_tuned": report.f1_tuned,
        "classes": rows,
    }
    path = Path(run_dir) / "thresholds.json"
    atomic_write_bytes(path, (json.dumps(document, indent=1) + "\n").encode())
    return path


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
    """Replace a JSONL file with `rows`, atomically (a resumed run trims rows past its step)."""
    atomic_write_bytes(path, "".join(json.dumps(row) + "\n" for row in rows).encode())


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


def plot_metrics(
    metrics_path: str | Path, png_path: str | Path, threshold: float | None = None
) -> bool:
    """Loss (and val accuracy), learning rate, images/s and data wait against step, as one PNG.

    Args:
        threshold: the data-wait share above which the run is input-bound; drawn
            as a line on the data-wait panel.

    Returns:
        False when matplotlib is not installed (a dependency of shardpipe; a
        stripped-down environment may lack it): no plot. A matplotlib that is
        there but fails to import is a broken install and raises its `ImportError`.
    """
    plt = load_pyplot()
    if plt is None:
        return False
    figure = build_figure(read_jsonl(metrics_path), threshold)
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return True


def load_pyplot() -> Any:
    """`matplotlib.pyplot` on the Agg backend (plots are only ever saved), or None when
    matplotlib is not installed; a broken install raises its `ImportError`."""
    if importlib.util.find_spec("matplotlib") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def build_figure(rows: list[dict], threshold: float | None = None):
    """The figure `plot_metrics` saves; readable from a 1-epoch run of a few rows up.

    Few rows are drawn as markers (a line through two points hides them), the
    step axis has integer ticks only, epoch ends are dotted lines, and the
    data-wait panel shows the input-bound threshold and the run's verdict.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    end = next((r for r in reversed(rows) if r.get("kind") == "end"), None)
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    steps = [r["step"] for r in train]
    style = {"lw": 1.2, "marker": "o" if len(train) <= MARKER_POINTS else None, "ms": 4}
    panels = [
        (axes[0][0], "loss", "train loss"),
        (axes[0][1], "lr", "learning rate"),
        (axes[1][0], "images_per_s", "images/s (all ranks)"),
        (axes[1][1], "data_wait_frac", "data wait / step time"),
    ]
    epoch_ends = [a["step"] for a, b in itertools.pairwise(train) if b["epoch"] != a["epoch"]]
    for axis, name, title in panels:
        axis.plot(steps, [r[name] for r in train], **style)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        for step in epoch_ends:
            axis.axvline(step, color="0.6", ls=":", lw=1)
    if evals:
        name = "val_accuracy" if "val_accuracy" in evals[0] else "val_map"
        twin = axes[0][0].twinx()
        twin.plot([r["step"] for r in evals], [r.get(name) for r in evals], "o-", color="C1")
        twin.set_ylabel(name.replace("_", " ").replace("map", "mAP"), color="C1")
        twin.set_ylim(0, 1.02)
    mark_verdict(axes[1][1], threshold, end)
    for axis in axes[1]:
        axis.set_xlabel("optimizer step")
    figure.tight_layout()
    return figure


def mark_verdict(axis, threshold: float | None, end: dict | None) -> None:
    """The input-bound threshold as a dashed line, the run's verdict as the legend's title."""
    axis.set_ylim(0, 1)
    verdict = end["verdict"].split(";")[0] if end and end.get("verdict") else None
    color = "C3" if verdict and verdict.startswith("input-bound") else "C2"
    if threshold is None:
        if verdict:
            axis.text(0.02, 0.95, verdict, transform=axis.transAxes, va="top", color=color)
        return
    axis.axhline(threshold, color="C3", ls="--", lw=1, label=f"input-bound above {threshold:.0%}")
    legend = axis.legend(loc="best", fontsize=8, title=verdict, title_fontsize=8)
    legend.get_title().set_color(color)
