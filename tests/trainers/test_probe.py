"""find-batch-size and scan-throughput on CPU, and their pure parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from trainers.probe import ScanPoint, fit_line, knee_index, max_batch_for
from trainers.train import main


def test_memory_line_fit_and_extrapolation():
    points = [(2, 1000 + 2 * 50), (4, 1000 + 4 * 50), (8, 1000 + 8 * 50)]
    fixed, per_sample = fit_line(points)
    assert fixed == pytest.approx(1000) and per_sample == pytest.approx(50)
    assert max_batch_for(fixed, per_sample, budget=1000 + 50 * 45.5) == 40  # 45 -> a multiple of 8
    assert max_batch_for(fixed, per_sample, budget=1000 + 50 * 9) == 9
    assert max_batch_for(fixed, per_sample, budget=900) < 1
    with pytest.raises(ValueError):
        fit_line([(4, 10), (4, 12)])


def test_knee_is_the_smallest_batch_near_the_best_rate():
    rates = [(8, 100.0), (16, 180.0), (32, 290.0), (64, 300.0), (128, 305.0)]
    points = [ScanPoint(b, r, 1.0, None, None) for b, r in rates]
    assert points[knee_index(points)].batch_size == 32
    points.append(ScanPoint(256, 0.0, 0.0, None, None, oom=True))
    assert points[knee_index(points)].batch_size == 32
    assert knee_index([ScanPoint(8, 0.0, 0.0, None, None, oom=True)]) is None


@pytest.mark.slow
def test_find_batch_size_on_cpu(tmp_path):
    # A fresh process: in a long pytest session the RSS baseline drifts with
    # whatever earlier tests allocated, which made an in-process budget flaky.
    args = ["find-batch-size", "--model", "cnn", "--image-size", "64", "--device", "cpu"]
    args += ["--probe-batches", "8,32,64", "--memory-budget-mb", "1500", "--memory-fraction", "0.8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "trainers.train", *args, "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "find-batch-size.json").read_text())
    assert result["per_sample_bytes"] > 0
    assert result["batch_size"] >= 8
    assert result["confirmed_peak_bytes"] <= result["budget_bytes"]
    assert "--batch-size" in done.stdout


@pytest.mark.slow
def test_scan_throughput_synthetic_and_loader(train_shards, tmp_path, capsys):
    common = [
        "--model",
        "cnn",
        "--image-size",
        "24",
        "--device",
        "cpu",
        "--scan-steps",
        "2",
        "--scan-warmup",
        "1",
    ]
    synthetic = tmp_path / "synthetic"
    assert (
        main(
            [
                "scan-throughput",
                *common,
                "--scan-batch-sizes",
                "4,8,16",
                "--run-dir",
                str(synthetic),
            ]
        )
        == 0
    )
    document = json.loads((synthetic / "scan-throughput.json").read_text())
    assert [p["batch_size"] for p in document["points"]] == [4, 8, 16]
    assert all(p["images_per_s"] > 0 for p in document["points"])
    assert document["knee"] in (0, 1, 2)
    assert "<- knee" in (synthetic / "scan-throughput.md").read_text()
    loader = tmp_path / "loader"
    args = ["scan-throughput", *common, "--scan-batch-sizes", "8,16", "--scan-source", "loader"]
    args += ["--train-shards", str(train_shards), "--workers", "0", "--run-dir", str(loader)]
    assert main(args) == 0
    points = json.loads((loader / "scan-throughput.json").read_text())["points"]
    assert all(0.0 <= p["data_wait_frac"] <= 1.0 for p in points)
    assert "| batch | images/s |" in capsys.readouterr().out


def test_scanning_the_loader_under_ray_placement_joins_the_cluster_as_train_does(
    train_shards, monkeypatch, capsys
):
    """`--scan-source loader --worker-placement ray` goes through `train`'s cluster join,
    so a cluster that cannot hold the roles is one line in flags, before any model runs."""
    monkeypatch.setattr("ray.cluster_resources", lambda: {"CPU": 1.0}, raising=False)
    monkeypatch.setattr("trainers.placement.start_ray", lambda *args: None)
    args = ["scan-throughput", "--scan-source", "loader", "--train-shards", str(train_shards)]
    args += ["--model", "cnn", "--image-size", "24", "--device", "cpu", "--workers", "0"]
    args += ["--worker-placement", "ray", "--remote-workers", "4"]
    assert main(args) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train: error: the Ray cluster has CPU 1 but "), err[-3:]
    assert err[-1].endswith("ask for fewer --remote-workers, or pass --ray-fallback local")
