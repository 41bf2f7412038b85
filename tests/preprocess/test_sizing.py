"""`--shard-bytes`: a byte target turned into samples per shard, measured before the plan."""

import json

import pytest

from preprocess.cli import main
from preprocess.config import BuildConfig
from preprocess.job import run_build
from preprocess.listing import InputError, SourceItem
from preprocess.ray_job import BuildError
from preprocess.sizing import shard_size_for_bytes
from preprocess.sources import list_sources
from shards.manifest import read_manifest
from tests.conftest import small_build_config


def test_shards_land_near_the_byte_target_and_the_count_is_recorded(sample_dir, tmp_path):
    target = 150_000  # ~30 of the 64-px test images
    config = small_build_config(sample_dir, tmp_path / "out", shard_bytes=target)
    summary = run_build(config)
    manifest = read_manifest(summary.output)
    derived = manifest.config["shard_size"]
    assert derived == shard_size_for_bytes(list_sources(str(sample_dir)), target, config.image)
    assert 5 < derived < 200
    full = [s for s in manifest.splits["train"].shards if s.samples == derived]
    assert len(full) >= 3
    for shard in full:
        assert 0.7 * target < shard.files["tar"].bytes < 1.3 * target
    # A rerun of the same command finds the same plan and reuses every shard.
    again = run_build(config)
    every = sum(len(split.shards) for split in manifest.splits.values())
    assert again.shards_built == 0 and again.shards_reused == every


def test_byte_target_is_part_of_the_build_record(sample_dir, tmp_path):
    by_count = small_build_config(sample_dir, tmp_path / "a")
    by_bytes = small_build_config(sample_dir, tmp_path / "a", shard_bytes=150_000)
    assert "shard_bytes" not in by_count.output_shaping()  # older builds still resume
    assert "shard_size" not in by_bytes.output_shaping()
    run_build(by_count)
    with pytest.raises(BuildError, match="shard_bytes: None -> 150000"):
        run_build(by_bytes)


def test_cli_takes_one_of_the_two_sizes(sample_dir, tmp_path, capsys):
    args = ["build-shards", "--input", str(sample_dir), "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        main([*args, "--shard-size", "10", "--shard-bytes", "1MB"])
    assert "not allowed with" in capsys.readouterr().err
    code = main([*args, "--shard-bytes", "2MB", "--executor", "inline", "--no-progress"])
    assert code == 0
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert manifest["config"]["shard_bytes"] == 2_000_000


def test_a_probe_of_only_bad_inputs_is_an_error(tmp_path):
    bad = tmp_path / "c" / "bad.jpg"
    bad.parent.mkdir()
    bad.write_bytes(b"not an image")
    items = [SourceItem(str(bad), "c/bad.jpg", "c")]
    with pytest.raises(InputError, match="--shard-size"):
        shard_size_for_bytes(items, 10**6, BuildConfig(input="x", output="y").image)
