"""torchrun with two CPU processes (gloo): disjoint samples, equal steps, identical parameters."""

from __future__ import annotations

import json
import subprocess

import pytest

from pipeline.sources import ShardSpec
from tests.trainers.conftest import (
    REPO,
    base_args,
    read_rows,
    read_trace,
    split_samples,
    subprocess_env,
    torchrun_command,
)
from trainers.data import iter_shard_keys
from trainers.schedule import lr_at
from trainers.train import main

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def torchrun(args: list[str], processes: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(
        torchrun_command(args, processes),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_two_cpu_ranks_train_in_step(train_shards, tmp_path):
    run_dir = tmp_path / "run"
    args = base_args(
        train_shards, run_dir, epochs=1, batch_size=16, accum_steps=2, debug_trace=True, log_every=1
    )
    result = torchrun(args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world size 2" in result.stderr

    train_total = split_samples(train_shards, "train")
    batches = [read_trace(run_dir, rank, "batch") for rank in (0, 1)]
    per_rank = train_total // 2 // 16
    assert len(batches[0]) == len(batches[1]) == per_rank  # equal batch counts per rank
    keys = [{k for row in rows for k in row["keys"]} for rows in batches]
    padded = -train_total % 2  # the `pad` rule may repeat at most world-1 samples
    assert len(keys[0] & keys[1]) <= padded  # ranks see disjoint samples

    digests = [[r["digest"] for r in read_trace(run_dir, rank, "params")] for rank in (0, 1)]
    assert len(digests[0]) == -(-per_rank // 2)  # equal optimizer steps (accumulation of 2)
    assert digests[0] == digests[1]  # identical parameters after every step

    val_keys = [[k for r in read_trace(run_dir, rank, "val") for k in r["keys"]] for rank in (0, 1)]
    every_val_key = []
    manifest = json.loads((train_shards / "manifest.json").read_text())
    for shard in manifest["splits"]["val"]["shards"]:
        url = str(train_shards / shard["files"]["tar"]["name"])
        every_val_key += list(iter_shard_keys(ShardSpec(url, "tar", shard["samples"])))
    assert sorted(val_keys[0] + val_keys[1]) == sorted(every_val_key)  # each val sample once
    evaluation = read_rows(run_dir, "eval")[0]
    assert evaluation["val_samples"] == split_samples(train_shards, "val")

    figures = json.loads((run_dir / "config.json").read_text())
    assert figures["effective_batch"] == 64 and figures["world_size"] == 2
    steps = figures["total_steps"]
    for row in read_rows(run_dir, "train"):
        expected = lr_at(row["step"] - 1, steps, figures["warmup_steps"], 0.4 * 64 / 256, 0.0)
        assert row["lr"] == pytest.approx(expected)


def test_two_ranks_resume_on_one_with_the_same_global_batch(train_shards, tmp_path):
    """4 steps on 2 ranks x 16, then the rest of the epoch on 1 rank x 32: no sample twice."""
    run_dir = tmp_path / "run"
    two = base_args(train_shards, run_dir, epochs=1, batch_size=16, debug_trace=True, max_steps=4)
    result = torchrun(two)
    assert result.returncode == 0, result.stderr[-3000:]
    one = base_args(train_shards, run_dir, epochs=1, batch_size=32, debug_trace=True, resume="auto")
    assert main(one) == 0
    before = [
        k
        for rank in (0, 1)
        for r in read_trace(run_dir, rank, "batch")
        if r["step"] < 4
        for k in r["keys"]
    ]
    after = [k for r in read_trace(run_dir, 0, "batch") if r["step"] >= 4 for k in r["keys"]]
    assert len(before) == 4 * 2 * 16
    seen = before + after
    assert len(seen) == len(set(seen))  # nothing doubled within the epoch
    assert (
        len(seen) >= split_samples(train_shards, "train") - 32
    )  # at most a batch left by drop_last
