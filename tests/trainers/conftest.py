"""Trainer fixtures: one sample dataset built into shards once per session, and run helpers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.sample import make_sample
from trainers.train import main

REPO = Path(__file__).resolve().parents[2]
TRAIN_IMAGES = 600
TRAIN_CLASSES = 4


@pytest.fixture(autouse=True)
def one_torch_thread():
    """On a small shared CPU, several intra-op threads thrash; one is several times faster here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def train_shards(tmp_path_factory) -> Path:
    """600 sample images, 4 classes, stored at 48 px in shards of 50 (tar + Parquet), 20% val."""
    root = tmp_path_factory.mktemp("trainer-data")
    make_sample(root / "images", TRAIN_IMAGES, classes=TRAIN_CLASSES, seed=5, workers=2)
    config = BuildConfig(
        input=str(root / "images"),
        output=str(root / "shards"),
        image=ImageConfig(image_size=48),
        shard_size=50,
        val_fraction=0.2,
        seed=1,
        row_group_size=25,
        executor="inline",
        progress=False,
    )
    run_build(config)
    return root / "shards"


def base_args(shards: Path, run_dir: Path, **overrides) -> list[str]:
    """A small, fast CPU run; `overrides` replace flags (`batch_size=8` -> `--batch-size 8`)."""
    options = {
        "train_shards": str(shards),
        "model": "cnn",
        "image_size": 24,
        "batch_size": 16,
        "epochs": 2,
        "workers": 0,
        "device": "cpu",
        "run_dir": str(run_dir),
        "lr": 0.4,
        "log_every": 1,
        "checkpoint_every": 0,
        "shuffle_buffer": 256,
        "shuffle_initial": 64,
    }
    options.update(overrides)
    args = ["--no-progress", "--no-tensorboard"]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + name.replace("_", "-"))
        elif value is not None:
            args += [flag, str(value)]
    return args


def train_main(shards: Path, run_dir: Path, **overrides) -> int:
    return main(base_args(shards, run_dir, **overrides))


def split_samples(shards: Path, split: str) -> int:
    manifest = json.loads((Path(shards) / "manifest.json").read_text())
    return manifest["splits"][split]["samples"]


def read_rows(run_dir: Path, kind: str | None = None) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def read_trace(run_dir: Path, rank: int = 0, kind: str | None = None) -> list[dict]:
    path = Path(run_dir) / "trace" / f"rank{rank}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def train_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "trainers.train", *args]


def torchrun_command(args: list[str], processes: int = 2) -> list[str]:
    """`train` under torchrun, `processes` ranks on this machine."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        "-m",
        "trainers.train",
        *args,
    ]


def run_subprocess(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(args),
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
