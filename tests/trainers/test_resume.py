"""Checkpoint, SIGKILL, `--resume auto`: the same losses and sample order as without the kill."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from tests.trainers.conftest import (
    REPO,
    base_args,
    read_rows,
    read_trace,
    subprocess_env,
    train_command,
    train_main,
)
from trainers.checkpoint import checkpoint_dir
from trainers.train import main

pytestmark = pytest.mark.slow

RUN = dict(epochs=2, batch_size=16, accum_steps=2, workers=2, debug_trace=True)
STEPS_PER_EPOCH = 15  # 29 batches of 16 per epoch in windows of 2: the last, short one is stepped


def kill_after_first_checkpoint(args: list[str], run_dir, timeout: float = 180) -> int:
    """Start a run, SIGKILL it as soon as a checkpoint is committed; return the checkpoint step."""
    latest = checkpoint_dir(run_dir) / "latest"
    process = subprocess.Popen(
        train_command(args),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + timeout
    try:
        while not latest.exists():
            if process.poll() is not None:
                raise AssertionError(
                    f"run ended before its first checkpoint: {process.stderr.read()!r}"
                )
            if time.monotonic() > deadline:
                raise AssertionError("no checkpoint in time")
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()
    assert process.returncode == -signal.SIGKILL
    return int(latest.read_text().strip()[5:14])


def assert_resumed_alike(straight, killed) -> None:
    """The resumed run repeats the uninterrupted one: steps, losses, evaluations, the
    samples of every batch and the parameters after every step."""
    expected, resumed = read_rows(straight, "train"), read_rows(killed, "train")
    assert [r["step"] for r in resumed] == [r["step"] for r in expected] == list(range(1, 31))
    for want, got in zip(expected, resumed, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-7)
        assert got["lr"] == want["lr"]
    assert [r["val_accuracy"] for r in read_rows(killed, "eval")] == [
        r["val_accuracy"] for r in read_rows(straight, "eval")
    ]
    order = [(r["step"], r["batch"], r["keys"]) for r in read_trace(straight, kind="batch")]
    assert [(r["step"], r["batch"], r["keys"]) for r in read_trace(killed, kind="batch")] == order
    digests = [r["digest"] for r in read_trace(straight, kind="params")]
    assert [r["digest"] for r in read_trace(killed, kind="params")] == digests


def kill_mid_epoch_and_resume(args, tmp_path):
    """Run `args(run_dir)` straight, and again SIGKILLed after a mid-epoch checkpoint and
    resumed; check the two alike. Returns the straight run's directory."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(args(straight)) == 0
    step = kill_after_first_checkpoint(args(killed), killed)
    assert step % STEPS_PER_EPOCH != 0  # killed mid-epoch
    assert main(args(killed, resume="auto")) == 0
    assert_resumed_alike(straight, killed)
    return straight


@pytest.mark.parametrize("checkpoint_every", [4, 0], ids=["mid-epoch", "epoch-end"])
def test_killed_run_resumes_exactly(train_shards, tmp_path, checkpoint_every):
    run = dict(RUN, checkpoint_every=checkpoint_every)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert train_main(train_shards, straight, **run) == 0
    step = kill_after_first_checkpoint(base_args(train_shards, killed, **run), killed)
    assert (step % STEPS_PER_EPOCH == 0) == (checkpoint_every == 0)
    assert train_main(train_shards, killed, resume="auto", **run) == 0
    assert_resumed_alike(straight, killed)


def test_a_killed_run_on_a_mix_of_sources_resumes_exactly(train_shards, tmp_path):
    """Two weighted sources: the checkpoint holds each source's place in the epoch."""
    mix = ["--train-weights", "3,1", "--train-epoch-samples", "470"]  # 29 batches of 16

    def args(run_dir, **extra):
        command = base_args(train_shards, run_dir, **RUN, checkpoint_every=4, **extra)
        at = command.index("--train-shards")
        command[at + 1] = f"{train_shards}::{train_shards}"
        return command + mix

    straight = kill_mid_epoch_and_resume(args, tmp_path)
    keys = {k for r in read_trace(straight, kind="batch") for k in r["keys"]}
    assert {k.split("/", 1)[0] for k in keys} == {"shards1", "shards2"}


# DeiT's flags, with repeated augmentation, pairs mixed, and the image growing at epoch 1.
RECIPE = [
    "--aa", "rand-m9-mstd0.5-inc1", "--reprob", "0.25", "--mixup", "0.8", "--cutmix", "1.0",
    "--smoothing", "0.1", "--mixup-mode", "pair", "--aug-repeats", "2",
    "--progressive-start", "16", "--progressive-end", "24", "--progressive-step", "8",
]  # fmt: skip


def test_a_killed_run_with_a_training_recipe_resumes_exactly(train_shards, tmp_path):
    """Augmentation in the workers, repeats, mixup/cutmix on the batch and progressive
    resizing all draw from the seed and the position: the resumed run repeats every loss."""

    def args(run_dir, **extra):
        return base_args(train_shards, run_dir, **RUN, checkpoint_every=4, **extra) + RECIPE

    kill_mid_epoch_and_resume(args, tmp_path)
