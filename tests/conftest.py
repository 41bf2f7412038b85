"""Shared fixtures: a small real sample dataset and shards built from it once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.job import run_build
from preprocess.output import DEFAULT_LAYOUT
from preprocess.sample import make_sample
from shards.manifest import format_dir, shard_name

SAMPLE_COUNT = 240
SAMPLE_CLASSES = 4


@pytest.fixture(autouse=True)
def flat_keywords_warn_in_every_test(monkeypatch):
    """Each flat `LoaderConfig` keyword warns once a process; each test gets a fresh "once",
    so pyproject's error filter catches a flat keyword in any test, whatever ran before."""
    from pipeline import config

    monkeypatch.setattr(config, "WARNED_FLAT_NAMES", set())


@pytest.fixture(autouse=True)
def logging_as_in_a_new_process():
    """A command's `main` sets up its loggers (`train`: handlers on `trainers` and `pipeline`,
    which stop propagating); each test starts from the loggers as found, as each command
    line starts in a new process, so one test's `train` does not print another's lines."""
    import logging

    loggers = [logging.getLogger(name) for name in ("pipeline", "preprocess", "shards", "trainers")]
    saved = [(lg.handlers[:], lg.level, lg.propagate) for lg in loggers]
    yield
    for logger, (handlers, level, propagate) in zip(loggers, saved, strict=True):
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate


def pytest_collection_modifyitems(config, items):
    """The tests on the shared CPU Ray cluster (`cpu_ray_cluster`) run last, one after
    another, so its nodes live only while they are used; the one that kills its nodes
    (`kills_nodes`) runs after the rest of them."""

    def place(item) -> int:
        if "cpu_ray_cluster" not in getattr(item, "fixturenames", ()):
            return 0
        return 2 if item.get_closest_marker("kills_nodes") else 1

    items[:] = sorted(items, key=place)  # stable: each group keeps its order


@pytest.fixture(scope="session")
def cpu_ray_cluster(tmp_path_factory):
    """A Ray head with no CPU and three 1-CPU worker nodes that are declared dead ~3 s
    after they go: the loader's remote roles and the trainer on them share it (a start
    costs ~14 s)."""
    from tests.cluster.raycluster import FAST_NODE_DEATH, LocalRayCluster

    root = tmp_path_factory.mktemp("cpu-ray") / "ray"
    with LocalRayCluster(root, workers=3, head_cpus=0, env=FAST_NODE_DEATH) as started:
        yield started


@pytest.fixture(scope="session")
def sample_dir(tmp_path_factory):
    """An ImageFolder tree of real, photo-like images in several formats."""
    root = tmp_path_factory.mktemp("sample") / "images"
    make_sample(root, SAMPLE_COUNT, classes=SAMPLE_CLASSES, seed=7, workers=1)
    return root


def small_build_config(input_dir, output_dir, **overrides) -> BuildConfig:
    """Small shards and images so tests stay fast; inline unless a test asks for Ray."""
    options = dict(
        input=str(input_dir),
        output=str(output_dir),
        image=ImageConfig(image_size=64),
        shard_size=32,
        val_fraction=0.2,
        seed=3,
        row_group_size=16,
        executor="inline",
        progress=False,
    )
    options.update(overrides)
    return BuildConfig(**options)


# Tests name the shard files of a build through these (or the manifest), never by a
# literal path, so they follow the default layout; a test of the flat layout of older
# builds passes `layout` itself.


def shard_key(split: str, index: int, fmt: str = "tar", layout=DEFAULT_LAYOUT) -> str:
    """A shard's name relative to its output, as the manifest names it: `tar/train-000001.tar`."""
    return shard_name(split, index, fmt, layout)


def shard_path(output, split: str, index: int, fmt: str = "tar", layout=DEFAULT_LAYOUT) -> Path:
    """The file of one shard of a build in the directory `output`."""
    return Path(output) / shard_key(split, index, fmt, layout)


def shard_url(base: str, split: str, index: int, fmt: str = "tar", layout=DEFAULT_LAYOUT) -> str:
    """`shard_path` for a URL (`s3://b/out`, `http://host:port`; `""` gives a server path)."""
    return f"{base.rstrip('/')}/{shard_key(split, index, fmt, layout)}"


def shard_files(output, fmt: str = "tar", split: str = "*", layout=DEFAULT_LAYOUT) -> list[Path]:
    """The shard files of format `fmt` (of one split, or all) in the directory `output`, sorted."""
    return sorted((Path(output) / format_dir(fmt, layout)).glob(f"{split}-*.{fmt}"))


@pytest.fixture(scope="session")
def built_shards(sample_dir, tmp_path_factory):
    """Shards (tar + Parquet) built inline from `sample_dir`: read-only for tests."""
    output = tmp_path_factory.mktemp("shards") / "out"
    summary = run_build(small_build_config(sample_dir, output))
    return summary
