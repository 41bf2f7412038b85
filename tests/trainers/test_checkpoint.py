"""Checkpoint files: atomic with a `latest` pointer, safe loading, RNG round trip, resume checks."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from trainers.checkpoint import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainers.run import resume_problems


def payload(step: int) -> dict:
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "step": step,
        "w": torch.ones(3) * step,
    }


class Marker:
    """Unpickling this would create a marker file: the payload of a malicious checkpoint."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_latest_points_at_the_newest_and_old_ones_are_pruned(tmp_path):
    for step in (5, 10, 15, 20):
        save_checkpoint(tmp_path, payload(step), step, keep=2)
    names = sorted(p.name for p in checkpoint_dir(tmp_path).glob("step-*.pt"))
    assert names == ["step-000000015.pt", "step-000000020.pt"]
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step-000000020.pt"
    assert load_checkpoint(latest)["step"] == 20


def test_a_half_written_file_is_never_picked(tmp_path):
    save_checkpoint(tmp_path, payload(5), 5, keep=3)
    directory = checkpoint_dir(tmp_path)
    # What a kill during torch.save leaves: a temporary name, never the final one.
    (directory / ".step-000000010.pt.tmp-123-abcd").write_bytes(b"PK\x03\x04half")
    assert latest_checkpoint(tmp_path).name == "step-000000005.pt"
    # Killed after the rename but before the pointer moved: the pointer still wins.
    save_checkpoint(tmp_path, payload(10), 10, keep=3)
    (directory / "latest").write_text("step-000000005.pt\n")
    assert latest_checkpoint(tmp_path).name == "step-000000005.pt"


def test_truncated_checkpoint_is_refused_naming_the_file(tmp_path):
    path = save_checkpoint(tmp_path, payload(5), 5, keep=3)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(path)


def test_malicious_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "PWNED"
    path = tmp_path / "evil.pt"
    torch.save(
        {"format": FORMAT_NAME, "version": FORMAT_VERSION, "model": Marker(str(marker))}, path
    )
    assert not marker.exists()
    with pytest.raises(CheckpointError, match="refused"):
        load_checkpoint(path)
    assert not marker.exists()


def test_foreign_file_is_refused(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"state_dict": torch.ones(1)}, path)
    with pytest.raises(CheckpointError, match="not a shardpipe-checkpoint"):
        load_checkpoint(path)


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    save_checkpoint(
        tmp_path, {"format": FORMAT_NAME, "version": FORMAT_VERSION, "rng": state}, 1, 1
    )
    loaded = load_checkpoint(latest_checkpoint(tmp_path))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(loaded["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_resume_problems_list_changed_fields():
    saved = {"train_data": "a", "global_batch": 64, "seed": 0, "model": "cnn", "num_classes": 4}
    same = dict(saved)
    assert resume_problems(saved, same, allow_data_change=False) == []
    changed = dict(saved, global_batch=128, seed=1)
    problems = resume_problems(saved, changed, allow_data_change=False)
    assert problems == ["  global_batch: 64 -> 128", "  seed: 0 -> 1"]
    assert resume_problems(saved, changed, allow_data_change=True) == []
    other_model = dict(saved, model="resnet-tiny")
    assert resume_problems(saved, other_model, allow_data_change=True) == [
        "  model: 'cnn' -> 'resnet-tiny'"
    ]


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda loader: loader["segments"][0].update(consumed=-1), "segments[0].consumed"),
        (lambda loader: loader["segments"][0].update(world_size=10**5), "segments[0].world_size"),
        (lambda loader: loader.update(epoch=True), "epoch"),
        (lambda loader: loader.pop("segments"), "missing key segments"),
    ],
    ids=["negative-consumed", "huge-world", "bool-epoch", "no-segments"],
)
def test_resume_from_a_tampered_loader_state_is_one_line(
    train_shards, tmp_path, capsys, edit, field
):
    """`train --resume` checks the checkpoint's loader position as the loader does: one
    line naming the checkpoint and the field, exit 1, no traceback, no step trained."""
    from tests.trainers.conftest import read_rows, train_main

    run_dir = tmp_path / "run"
    assert train_main(train_shards, run_dir, epochs=1, max_steps=2) == 0
    path = latest_checkpoint(run_dir)
    checkpoint = torch.load(path, weights_only=True)
    edit(checkpoint["loader"])
    torch.save(checkpoint, path)
    capsys.readouterr()
    assert train_main(train_shards, run_dir, epochs=1, resume="auto") == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in errors[0]
    assert str(path) in errors[0] and f"loader state: {field}" in errors[0]
    assert [row["step"] for row in read_rows(run_dir, "train")] == [1, 2]


def test_a_checkpoint_stored_before_the_config_groups_resumes(train_shards, tmp_path):
    """Checkpoints of earlier versions store the config flat (`batch_size` at the top). A
    resume checks the stored data identity, whose keys did not change, so they resume; the
    stored config still reads as this version's (`TrainConfig.from_dict`)."""
    from tests.trainers.conftest import read_rows, train_main
    from trainers.config import TrainConfig

    run_dir = tmp_path / "run"
    assert train_main(train_shards, run_dir, epochs=1, max_steps=2) == 0
    path = latest_checkpoint(run_dir)
    checkpoint = torch.load(path, weights_only=True)
    grouped = checkpoint["config"]
    flat = {"loader": grouped["loader"], "recipe": dict(grouped["recipe"])}
    for name, group in grouped.items():
        if name not in flat:
            flat.update(group)
    flat["label_smoothing"] = flat["recipe"].pop("label_smoothing")
    checkpoint["config"] = flat  # the layout of before the groups
    torch.save(checkpoint, path)
    assert TrainConfig.from_dict(flat) == TrainConfig.from_dict(grouped)
    assert train_main(train_shards, run_dir, epochs=1, max_steps=4, resume="auto") == 0
    assert [row["step"] for row in read_rows(run_dir, "train")] == [1, 2, 3, 4]
