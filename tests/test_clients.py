"""The documents about other tools stay true: MIGRATION.md's `ours` snippets run on a
real build, CLIENTS.md names tests that exist, and (on request) timm reads a build.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preprocess.job import run_build
from preprocess.sample import make_sample
from tests.conftest import small_build_config

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def ours_snippets(text: str) -> list[str]:
    """The code of every ```` ```python ours ```` block, in order."""
    return re.findall(r"^```python ours\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture
def in_built(tmp_path, monkeypatch):
    """A working directory holding `shards/`, built as MIGRATION.md says (the default layout)."""
    make_sample(tmp_path / "images", 48, classes=3, seed=2, workers=1)
    run_build(small_build_config(tmp_path / "images", tmp_path / "shards", shard_size=16))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.timeout(120)
def test_migration_snippets_run(in_built):
    pytest.importorskip("datasets")
    snippets = ours_snippets((DOCS / "MIGRATION.md").read_text())
    assert len(snippets) == 4
    namespace: dict = {}
    for code in snippets:
        exec(compile(code, "docs/MIGRATION.md", "exec"), namespace)
    assert namespace["seen"] == namespace["val"].source.total_samples > 0
    assert namespace["classes"] == ["class_000", "class_001", "class_002"]


def test_every_test_the_clients_table_names_exists():
    text = (DOCS / "CLIENTS.md").read_text()
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", text)
    assert len(named) >= 10
    for path, name in named:
        tree = ast.parse((REPO / path).read_text())
        functions = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert name in functions, f"docs/CLIENTS.md names {path}::{name}, which does not exist"


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("SHARDPIPE_TIMM_CHECK") != "1",
    reason="installs torch 2.14.1 + torchvision + timm (GBs, minutes): SHARDPIPE_TIMM_CHECK=1",
)
@pytest.mark.timeout(3600)
def test_timm_reads_a_build_through_its_info_file():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "timm_check.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert '"split": "validation"' in run.stdout
