"""What a run leaves to read: CSV = JSONL fields with times, steady images/s, tags, plot, summary."""

from __future__ import annotations

import csv
import datetime
import importlib.util
import json
from pathlib import Path

import pytest

from tests.trainers.conftest import base_args, read_rows, split_samples
from trainers.metrics import (
    CSV_NAME,
    MetricsLog,
    Window,
    build_figure,
    plot_metrics,
    rate_window,
    summary_line,
    tensorboard_scalars,
)
from trainers.train import main

VERDICT = "compute-bound: data wait is 4% of step time; the input pipeline keeps up"


def read_csv(run_dir: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(Path(run_dir) / CSV_NAME, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def sample_rows() -> list[dict]:
    train = {"kind": "train", "step": 1, "epoch": 0, "loss": 1.5, "lr": 0.1}
    train |= {"images_per_s": 90.0, "data_wait_frac": 0.1, "rate_steps": 1}
    train |= {"scheduler_steps": 1, "first_batch_s": 0.4}
    evaluation = {"kind": "eval", "step": 2, "epoch": 1, "evals": 1, "loss": 1.2, "lr": 0.05}
    evaluation |= {"images_per_s": 80.0, "data_wait_frac": 0.1}
    evaluation |= {"val_loss": 1.2, "val_accuracy": 0.5, "val_samples": 40}
    end = {"kind": "end", "step": 2, "epoch": 1, "loss": 1.4, "images_per_s": 80.0}
    end |= {"data_wait_frac": 0.1, "val_loss": 1.2, "val_accuracy": 0.5, "val_samples": 40}
    end |= {"verdict": VERDICT}
    return [train, evaluation, end]


def test_csv_holds_every_jsonl_field_and_every_row_is_timed(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, tensorboard=False)
    for row in sample_rows():
        log.write(row)
    header, rows = read_csv(tmp_path)
    jsonl = read_rows(tmp_path)
    for row in jsonl:
        assert set(row) <= set(header)
    assert {"first_batch_s", "verdict", "scheduler_steps", "time_s", "wall_time"} <= set(header)
    assert rows[0]["first_batch_s"] == "0.4" and rows[2]["verdict"] == VERDICT
    times = [float(row["time_s"]) for row in rows]  # filled in every row, never empty
    assert times == sorted(times) and all(t >= 0 for t in times)
    for row in rows:
        stamp = datetime.datetime.fromisoformat(row["wall_time"])
        assert stamp.tzinfo is not None  # an unambiguous wall-clock time


def test_a_row_field_missing_from_the_csv_is_a_bug(tmp_path):
    log = MetricsLog(tmp_path, enabled=True, tensorboard=False)
    with pytest.raises(ValueError, match="bogus"):
        log.write({"kind": "train", "step": 1, "bogus": 1.0})


def test_a_resumed_log_goes_on_from_its_last_kept_time(tmp_path):
    first = MetricsLog(tmp_path, enabled=True, tensorboard=False)
    for row in sample_rows():
        first.write({**row, "time_s": 0})  # write() stamps its own time
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    stamped = [json.loads(line) for line in lines]
    stamped[0]["time_s"] = 100.0  # as if the first segment had run 100 s
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in stamped))
    second = MetricsLog(tmp_path, enabled=True, tensorboard=False)
    assert second.truncate(lambda row: row["kind"] == "train") == 2
    assert second.last == {"train": stamped[0]}
    row = second.write(sample_rows()[1])
    assert row["time_s"] >= 100.0
    _, rows = read_csv(tmp_path)
    assert [r["kind"] for r in rows] == ["train", "eval"]


def test_a_short_last_window_is_measured_with_the_one_before():
    previous = Window(steps=10, samples=160, wait_s=0.1, elapsed_s=1.0)
    short = Window(steps=1, samples=16, wait_s=0.0, elapsed_s=0.01)  # read-ahead batch: 1600/s
    merged = rate_window(short, previous, min_steps=5)
    assert merged.steps == 11 and merged.samples == 176
    assert merged.images_per_s == pytest.approx(176 / 1.01)
    assert rate_window(previous, short, min_steps=5) is previous  # a full window stands alone
    assert rate_window(short, None, min_steps=5) is short  # nothing to merge with
    assert rate_window(short, previous, min_steps=1) is short  # --log-every 1: every step


def test_tensorboard_gets_clean_tags():
    train, evaluation, end = sample_rows()
    assert dict(tensorboard_scalars(train)) == {
        "train/loss": 1.5,
        "train/lr": 0.1,
        "train/images_per_s": 90.0,
        "train/data_wait_frac": 0.1,
        "train/first_batch_s": 0.4,
    }
    assert dict(tensorboard_scalars(evaluation)) == {"val/loss": 1.2, "val/accuracy": 0.5}
    assert tensorboard_scalars(end) == []


def test_summary_line_names_time_loss_accuracy_rate_and_verdict():
    end = {**sample_rows()[2], "time_s": 12.34}
    line = summary_line(end, steps_per_epoch=2)
    assert line.startswith("summary: 2 optimizer steps (1 epoch) in 12.3 s")
    for part in ("final train loss 1.4000", "val accuracy 0.5000", "80 images/s", VERDICT):
        assert part in line
    no_val = {k: v for k, v in end.items() if not k.startswith("val_")}
    assert "no validation" in summary_line(no_val, steps_per_epoch=4)


def test_plot_of_a_two_row_run_has_markers_integer_steps_and_the_verdict(tmp_path):
    pytest.importorskip("matplotlib")
    rows = sample_rows()
    rows.insert(1, {**rows[0], "step": 2, "loss": 1.3})  # a 1-epoch run: two train rows
    figure = build_figure(rows, threshold=0.1)
    loss_axis, wait_axis = figure.axes[0], figure.axes[3]
    assert loss_axis.lines[0].get_marker() == "o"  # two points show as points
    for axis in figure.axes[:4]:
        ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert any(line.get_ydata()[0] == 0.1 for line in wait_axis.lines)  # the threshold line
    verdict = wait_axis.get_legend().get_title().get_text()
    assert verdict == "compute-bound: data wait is 4% of step time"
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert plot_metrics(metrics, tmp_path / "metrics.png", threshold=0.1)
    assert (tmp_path / "metrics.png").stat().st_size > 0


def short_last_window(batches: int) -> int:
    """A --log-every that leaves the epoch a last window shorter than half of it."""
    for log_every in range(4, 16):
        if 0 < batches % log_every < (log_every + 1) // 2:
            return log_every
    raise AssertionError(f"no --log-every leaves a short last window of {batches} batches")


@pytest.mark.timeout(120)
def test_one_epoch_run_metrics_and_summary(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    batches = split_samples(train_shards, "train") // 16
    log_every = short_last_window(batches)
    args = base_args(train_shards, run_dir, epochs=1, log_every=log_every, batch_size=16)
    assert main(args) == 0
    header, csv_rows = read_csv(run_dir)
    jsonl = read_rows(run_dir)
    assert set().union(*jsonl) <= set(header)
    assert {"first_batch_s", "verdict", "scheduler_steps"} <= set(header)
    assert all(row["time_s"] and row["wall_time"] for row in csv_rows)
    times = [row["time_s"] for row in jsonl]
    assert times == sorted(times)
    train = [row for row in jsonl if row["kind"] == "train"]
    assert [row["rate_steps"] for row in train[:-1]] == [log_every] * (len(train) - 1)
    # The short last window (batches % log_every steps) is measured with the one before it.
    assert train[-1]["step"] == batches
    assert train[-1]["rate_steps"] == log_every + batches % log_every
    end = read_rows(run_dir, "end")[0]
    assert end["loss"] == train[-1]["loss"] and end["val_accuracy"] > 0
    last = capsys.readouterr().err.splitlines()[-1]
    assert "summary:" in last and f"{batches} optimizer steps (1 epoch)" in last
    for part in ("final train loss", "val accuracy", "images/s", "-bound"):
        assert part in last


def test_unknown_split_is_one_line_before_the_run_dir_is_made(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(base_args(train_shards, run_dir, train_split="nope")) == 1
    lines = capsys.readouterr().err.splitlines()
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and "Traceback" not in "".join(lines)
    assert "split 'nope' not in manifest" in errors[0] and "'train', 'val'" in errors[0]
    assert not run_dir.exists()


def test_plot_is_drawn_when_matplotlib_is_installed(train_shards, tmp_path):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (the bench extra)")
    run_dir = tmp_path / "run"
    assert main(base_args(train_shards, run_dir, epochs=1, max_steps=3, plot=True)) == 0
    assert (run_dir / "metrics.png").stat().st_size > 0


@pytest.mark.slow
def test_evaluation_scores_each_good_val_sample_once_when_some_are_bad(train_shards, tmp_path):
    """Bad val samples are skipped, never stood in for by repeats of good ones: the eval row
    counts the good samples, and the trace names each of them exactly once."""
    import shutil
    from collections import Counter

    from tests.conftest import shard_files
    from tests.pipeline.test_faults import rewrite_tar
    from tests.trainers.conftest import read_trace, train_main

    shards = tmp_path / "shards"
    shutil.copytree(train_shards, shards)
    garbled = set()

    def garble(index, sample):
        if index in (3, 7):
            garbled.add(sample["__key__"])
            sample["jpg"] = b"\xff\xd8\xff\xe0 not a jpeg at all"
        return sample

    rewrite_tar(shard_files(shards, "tar", "val")[0], garble)
    run_dir = tmp_path / "run"
    assert train_main(shards, run_dir, epochs=1, max_steps=1, debug_trace=True) == 0
    (evaluation,) = read_rows(run_dir, "eval")
    assert evaluation["val_samples"] == split_samples(shards, "val") - 2
    seen = Counter(k for row in read_trace(run_dir, 0, "val") for k in row["keys"])
    assert max(seen.values()) == 1 and not set(seen) & garbled
    assert len(seen) == split_samples(shards, "val") - 2
