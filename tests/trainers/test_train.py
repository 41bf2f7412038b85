"""End-to-end CPU training through `main([...])` on shards built by build-shards."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import base_args, read_rows, read_trace, split_samples, train_main
from trainers.checkpoint import latest_checkpoint, load_checkpoint
from trainers.models import build_model
from trainers.run import seed_generators
from trainers.schedule import lr_at
from trainers.train import main

pytestmark = pytest.mark.slow


def test_loss_falls_and_val_accuracy_beats_chance(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_main(train_shards, run_dir, epochs=3, log_every=3) == 0
    train = read_rows(run_dir, "train")
    evals = read_rows(run_dir, "eval")
    for row in train + evals:
        assert {"step", "epoch", "loss", "lr", "images_per_s", "data_wait_frac"} <= set(row)
    first, last = train[0]["loss"], sum(r["loss"] for r in train[-3:]) / 3
    assert last < 0.6 * first
    assert len(evals) == 3 and evals[-1]["val_accuracy"] > 0.6  # 4 classes: chance is 0.25
    assert evals[-1]["val_samples"] == split_samples(train_shards, "val")  # all of val, once
    end = read_rows(run_dir, "end")[0]
    assert end["verdict"].startswith(("input-bound", "compute-bound"))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["config"]["schedule"]["batch_size"] == 16 and config["effective_batch"] == 16
    assert (run_dir / "metrics.csv").read_text().startswith("kind,step,epoch,loss,lr")
    if _has_matplotlib():
        assert (run_dir / "metrics.png").stat().st_size > 0
    err = capsys.readouterr().err
    for figure in (
        "effective batch 16",
        "optimizer steps; drop_last leaves out",
        "warmup",
        "peak 0.4 x 16/256",
        "workers",
    ):
        assert figure in err


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


@pytest.mark.parametrize(("batch", "accum", "epochs"), [(32, 1, 1), (8, 4, 2)])
def test_lr_per_optimizer_step_follows_the_formula(train_shards, tmp_path, batch, accum, epochs):
    run_dir = tmp_path / "run"
    code = train_main(
        train_shards,
        run_dir,
        batch_size=batch,
        accum_steps=accum,
        warmup_steps=3,
        min_lr=0.001,
        lr_scaling="sqrt",
        epochs=epochs,
    )
    assert code == 0
    figures = json.loads((run_dir / "config.json").read_text())
    batches = figures["batches_per_epoch"]
    assert batches == split_samples(train_shards, "train") // batch  # drop_last on train
    steps = figures["total_steps"]
    assert steps == epochs * math.ceil(batches / accum)  # the last partial window is stepped
    peak = 0.4 * math.sqrt(batch * accum / 256)
    assert figures["peak_lr"] == pytest.approx(peak)
    train = read_rows(run_dir, "train")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for row in train:
        assert row["lr"] == pytest.approx(lr_at(row["step"] - 1, steps, 3, peak, 0.001))
        assert row["scheduler_steps"] == row["step"]  # the scheduler steps once per optimizer step
    final = load_checkpoint(latest_checkpoint(run_dir))
    assert final["scheduler"]["steps"] == steps and final["state"]["step"] == steps


def test_accumulation_matches_one_big_batch(train_shards, tmp_path):
    """K micro-batches of B give the gradient of one batch of K x B (no BatchNorm)."""
    common = dict(model="cnn-nobn", max_steps=1, momentum=0.0, weight_decay=0.0, warmup_steps=0)
    common.update(lr=0.5, lr_scaling="none", debug_trace=True, epochs=1, log_every=1)
    big, small = tmp_path / "big", tmp_path / "small"
    assert train_main(train_shards, big, batch_size=32, accum_steps=1, **common) == 0
    assert train_main(train_shards, small, batch_size=8, accum_steps=4, **common) == 0
    big_keys = [k for r in read_trace(big, kind="batch") for k in r["keys"]]
    small_keys = [k for r in read_trace(small, kind="batch") for k in r["keys"]]
    assert big_keys == small_keys and len(small_keys) == 32  # the same samples, in the same order
    seed_generators(0)
    initial = build_model("cnn-nobn", 4).state_dict()
    after_big = load_checkpoint(latest_checkpoint(big))["model"]
    after_small = load_checkpoint(latest_checkpoint(small))["model"]
    for name, start in initial.items():
        step_big = after_big[name] - start  # = -lr x gradient
        step_small = after_small[name] - start
        assert step_big.abs().max() > 0
        torch.testing.assert_close(step_small, step_big, rtol=1e-3, atol=1e-6)


def test_resume_with_a_changed_global_batch_is_refused_with_a_diff(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_main(train_shards, run_dir, epochs=1, max_steps=3) == 0
    code = train_main(train_shards, run_dir, epochs=1, batch_size=32, resume="auto")
    assert code == 1
    err = capsys.readouterr().err
    assert "global_batch: 16 -> 32" in err and "--allow-data-change" in err
    # Told that the change is intended, it continues from the checkpoint's step.
    assert (
        train_main(
            train_shards, run_dir, epochs=1, batch_size=32, resume="auto", allow_data_change=True
        )
        == 0
    )
    steps = [r["step"] for r in read_rows(run_dir, "train")]
    assert steps[:3] == [1, 2, 3] and steps[3] == 4


def test_fresh_run_refuses_a_used_run_dir(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_main(train_shards, run_dir, epochs=1, max_steps=1) == 0
    assert train_main(train_shards, run_dir, epochs=1, max_steps=1) == 1
    assert "already holds a run" in capsys.readouterr().err


def test_corrupt_latest_checkpoint_stops_the_resume(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert train_main(train_shards, run_dir, epochs=1, max_steps=2) == 0
    path = latest_checkpoint(run_dir)
    path.write_bytes(path.read_bytes()[:1000])
    assert train_main(train_shards, run_dir, epochs=1, resume="auto") == 1
    err = capsys.readouterr().err
    assert str(path) in err and "truncated or corrupt" in err


def test_non_finite_loss_stops_with_step_and_shards(train_shards, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = train_main(train_shards, run_dir, epochs=1, lr=1e30, lr_scaling="none", warmup_steps=0)
    assert code == 1
    err = capsys.readouterr().err
    assert "non-finite loss at optimizer step" in err
    assert ".tar (" in err  # names the shard(s) the failing batch came from


def test_overlapping_train_and_val_are_refused(train_shards, tmp_path, capsys):
    # The train split's own samples, read from its Parquet twins: other URLs, the same keys.
    manifest = json.loads((train_shards / "manifest.json").read_text())
    pattern = manifest["splits"]["train"]["patterns"]["parquet"]
    code = train_main(
        train_shards, tmp_path / "run", val_shards=str(train_shards / pattern), max_steps=1
    )
    assert code == 1
    assert "samples are in both train and val" in capsys.readouterr().err


def test_fp16_on_cpu_is_refused_and_bf16_trains(train_shards, tmp_path, capsys):
    assert train_main(train_shards, tmp_path / "fp16", amp="fp16", max_steps=1) == 1
    assert "--amp fp16 needs CUDA" in capsys.readouterr().err
    assert train_main(train_shards, tmp_path / "bf16", amp="bf16", max_steps=2, epochs=1) == 0
    assert all(math.isfinite(r["loss"]) for r in read_rows(tmp_path / "bf16", "train"))


def test_console_script_help_lists_flag_groups(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in ("batch options", "--accum-steps", "--lr-scaling", "--resume", "--amp"):
        assert text in out


def test_base_args_are_valid_flags(tmp_path):
    args = base_args(tmp_path, tmp_path / "run", debug_trace=True)
    assert "--debug-trace" in args and "--no-progress" in args


def test_installed_console_script():
    script = Path(sys.executable).with_name("train")
    if not script.exists():
        pytest.skip("the `train` console script is not installed (pip install -e .)")
    result = subprocess.run(
        [str(script), "scan-throughput", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "--scan-batch-sizes" in result.stdout


def test_training_on_shard_urls_takes_classes_from_the_manifest_beside_them(train_shards, tmp_path):
    """Launching on a brace pattern, the way peers are launched, needs no --num-classes."""
    manifest = json.loads((train_shards / "manifest.json").read_text())
    pattern = str(train_shards / manifest["splits"]["train"]["patterns"]["tar"])
    assert train_main(train_shards, tmp_path / "run", train_shards=pattern, epochs=1) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert any(row.get("kind") == "train" for row in rows)
