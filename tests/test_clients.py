"""The documents about other tools stay true: MIGRATION.md's `ours` snippets run on a
real build, CLIENTS.md names tests that exist, open_clip's `sizes.json` holds the
manifest's counts, and (on request) timm and open_clip's own trainer read a build.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from preprocess.job import run_build
from preprocess.sample import make_sample
from shards.clients import SIZES_NAME
from shards.manifest import LAYOUT_BY_FORMAT, LAYOUT_FLAT
from tests.conftest import small_build_config

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"


def ours_snippets(text: str) -> list[str]:
    """The code of every ```` ```python ours ```` block, in order."""
    return re.findall(r"^```python ours\n(.*?)^```", text, flags=re.S | re.M)


@pytest.fixture
def in_built(tmp_path, monkeypatch):
    """A working directory holding `data/shards/`, built as MIGRATION.md says (the default
    layout)."""
    make_sample(tmp_path / "images", 48, classes=3, seed=2, workers=1)
    run_build(small_build_config(tmp_path / "images", tmp_path / "data" / "shards", shard_size=16))
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


# --- open_clip's sizes.json -------------------------------------------------------------------


@pytest.fixture(scope="module")
def sizes_images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sizes") / "images"
    make_sample(root, 40, classes=2, seed=5, workers=1)
    return root


def open_clip_dataset_size(urls: list[str]) -> int:
    """open_clip 3.3's `get_dataset_size`: `sizes.json` beside the first shard, by base name."""
    sizes = json.loads((Path(urls[0]).parent / SIZES_NAME).read_text())
    return sum(int(sizes[os.path.basename(url)]) for url in urls)


@pytest.mark.parametrize("layout", [LAYOUT_BY_FORMAT, LAYOUT_FLAT])
def test_sizes_json_holds_the_manifest_counts_of_every_split(sizes_images, tmp_path, layout):
    out = tmp_path / "out"
    # Uneven shards (40 images, 7 a shard, a quarter to val) so a wrong count shows.
    config = small_build_config(sizes_images, out, shard_size=7, val_fraction=0.25, layout=layout)
    manifest = run_build(config).manifest
    assert sorted(manifest.splits) == ["train", "val"]
    tar_dir = out / "tar" if layout == LAYOUT_BY_FORMAT else out
    sizes = json.loads((tar_dir / SIZES_NAME).read_text())
    expected = {}
    for split, part in manifest.splits.items():
        urls = manifest.shard_urls(split, "tar", str(out))
        counts = part.shards.samples.tolist()
        expected.update({os.path.basename(u): n for u, n in zip(urls, counts, strict=True)})
        assert open_clip_dataset_size(urls) == part.samples
    assert sizes == expected  # every tar shard of every split, nothing else
    assert len(set(sizes.values())) > 1  # a last, short shard: counts are not all one number
    assert sum(sizes.values()) == sum(part.samples for part in manifest.splits.values())
    # pyarrow and polars open `parquet/` by its path: no foreign file may sit there.
    assert not (out / "parquet" / SIZES_NAME).exists()


def test_index_writes_sizes_json_into_the_tar_directory_from_the_manifest_alone(
    sizes_images, tmp_path
):
    from preprocess.cli import main as preprocess_main

    out = tmp_path / "out"
    run_build(small_build_config(sizes_images, out, shard_size=7, layout=LAYOUT_BY_FORMAT))
    built = (out / "tar" / SIZES_NAME).read_bytes()
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "manifest.json").write_bytes((out / "manifest.json").read_bytes())
    assert preprocess_main(["index", str(copy)]) == 0
    assert (copy / "tar" / SIZES_NAME).read_bytes() == built


def test_a_parquet_only_build_writes_no_sizes_json(sizes_images, tmp_path):
    out = tmp_path / "out"
    run_build(small_build_config(sizes_images, out, formats=("parquet",)))
    assert not list(out.rglob(SIZES_NAME))


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("SHARDPIPE_OPENCLIP_CHECK") != "1",
    reason="installs torch 2.14.1 + torchvision + open_clip (GBs, minutes): "
    "SHARDPIPE_OPENCLIP_CHECK=1",
)
@pytest.mark.timeout(3600)
def test_open_clip_trains_on_a_build_without_train_num_samples():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "openclip_check.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert '"samples_trained"' in run.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("SHARDPIPE_IMG2DATASET_CHECK") != "1",
    reason="installs img2dataset 1.47.0 in its own environment (a minute): "
    "SHARDPIPE_IMG2DATASET_CHECK=1",
)
@pytest.mark.timeout(1800)
def test_real_img2dataset_output_is_read_with_no_glue_beyond_a_field():
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "img2dataset_check.py")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "60/60 successes once" in run.stdout
    assert "counted skips `null_cell: 3`" in run.stdout
