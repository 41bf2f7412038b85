"""`BuildConfig` and `ImageConfig` refuse every bad value when they are made, naming the
field and what it allows, before any work; `storage_options` is never shown or recorded."""

from __future__ import annotations

import dataclasses

import pytest

from preprocess.cli import main
from preprocess.config import BuildConfig, diff_configs, recorded_restarts
from preprocess.images import RESTART_LAYOUTS, ImageConfig
from shards.flags import SettingError

BUILD_REFUSALS = [
    ("input", "", "must be a path or URL"),
    ("output", None, "must be a path or URL"),
    ("output", "s3://key:secret@bucket/out", "holds credentials"),
    ("image", {"image_size": 64}, "must be an ImageConfig"),
    ("shard_size", 0, "must be at least 1, got 0"),
    ("shard_size", 2.5, "must be an integer of at least 1"),
    ("shard_bytes", 0, "must be at least 1"),
    ("formats", ("tar", "zip"), "subset of tar,parquet"),
    ("formats", (), "subset of tar,parquet"),
    ("formats", "tar", "subset of tar,parquet"),
    ("layout", "nested", "is not one of flat, by_format (or None"),
    ("val_fraction", 1.0, "in [0, 1), got 1.0"),
    ("val_fraction", -0.1, "in [0, 1)"),
    ("seed", "7", "must be an integer"),
    ("row_group_size", 0, "must be at least 1"),
    ("max_skip_fraction", 1.5, "in [0, 1]"),
    ("ray_address", "", "must be `auto`, ray://host:port or None"),
    ("executor", "dask", "'dask' is not one of auto, ray, local, inline"),
    ("workers", 0, "must be at least 1"),
    ("overwrite", "yes", "must be True or False"),
    ("progress", 1, "must be True or False"),
    ("confine_to_input", None, "must be True or False"),
    ("label", "many", "'many' is not one of single, multi, none"),
    ("description", 42, "must be text or None"),
    ("fields", "caption:txt", "must be a tuple of COLUMN:MEMBER"),
    ("storage_options", ["endpoint_url"], "must be a dict of fsspec options or None"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), BUILD_REFUSALS)
def test_every_build_option_refuses_a_bad_value_naming_it(name, value, allowed):
    options = {"input": "images", "output": "shards", name: value}
    with pytest.raises(SettingError) as refused:
        BuildConfig(**options)
    assert str(refused.value).startswith(f"BuildConfig.{name}")
    assert allowed in str(refused.value)


def test_ray_address_with_an_executor_without_ray_is_refused_naming_both():
    with pytest.raises(SettingError, match=r"BuildConfig\.executor local does not use Ray"):
        BuildConfig(input="i", output="o", executor="local", ray_address="auto")


IMAGE_REFUSALS = [
    ("image_size", 0, "must be at least 1, got 0"),
    ("image_size", 256.0, "must be an integer"),
    ("resize", "stretch", "'stretch' is not one of shorter, longer, center-crop, none"),
    ("encode", "gif", "'gif' is not one of jpeg, webp, png"),
    ("quality", 0, "must be at least 1"),
    ("quality", 101, "must be in 1..100, got 101"),
    ("max_pixels", 0, "must be at least 1"),
    ("max_pixels", 10**12, "MAX_IMAGE_PIXELS"),
    ("max_file_bytes", 0, "must be at least 1"),
    ("max_aspect", 0.5, "must be at least 1"),
    ("min_side", 0, "must be at least 1"),
    ("resample", "nearest", "'nearest' is not one of bilinear, bicubic, lanczos"),
    ("background", (255, 255), "three integers in 0..255"),
    ("background", (0, 0, 256), "three integers in 0..255"),
    ("backend", "gpu", "'gpu' is not one of auto, fast, pillow"),
    ("jpeg_restarts", False, "False is not one of columns, columns-all, rows, none"),
    ("jpeg_restarts", "diagonal", "is not one of columns, columns-all, rows, none"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), IMAGE_REFUSALS)
def test_every_image_option_refuses_a_bad_value_naming_it(name, value, allowed):
    with pytest.raises(SettingError) as refused:
        ImageConfig(**{name: value})
    assert str(refused.value).startswith(f"ImageConfig.{name}")
    assert allowed in str(refused.value)


def test_the_fast_backend_with_another_filter_is_refused_naming_the_backend():
    with pytest.raises(SettingError, match=r"ImageConfig\.backend 'fast' resizes with OpenCV"):
        ImageConfig(backend="fast", resample="lanczos")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--shard-size", "0"], "--shard-size must be at least 1, got 0"),
        (["--quality", "101"], "--quality must be in 1..100, got 101"),
        (["--val-fraction", "1"], "--val-fraction must be a number in [0, 1), got 1.0"),
    ],
)
def test_the_command_line_refuses_a_bad_value_in_one_line_naming_the_flag(
    tmp_path, capsys, flags, line
):
    argv = ["build-shards", "--input", str(tmp_path), "--output", str(tmp_path / "out"), *flags]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and line in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_storage_options_are_never_shown_nor_recorded():
    secret = {"key": "AKIAEXAMPLE", "secret": "s3cr3t-value", "endpoint_url": "http://x"}
    config = BuildConfig(input="s3://in/images", output="s3://out/shards", storage_options=secret)
    assert "s3cr3t" not in repr(config) and "storage_options" not in repr(config)
    assert "storage_options" not in config.output_shaping()
    assert "s3cr3t" not in repr(config.output_shaping())
    # Whether a build has options or not, its record is the same: it still resumes.
    plain = dataclasses.replace(config, storage_options=None)
    assert config.output_shaping() == plain.output_shaping()


@pytest.mark.parametrize("layout", RESTART_LAYOUTS)
def test_a_restart_layout_reads_back_from_its_record(layout):
    image = BuildConfig(input="i", output="o", image=ImageConfig(jpeg_restarts=layout))
    record = image.output_shaping()
    assert recorded_restarts(record["image"]) == layout
    other = next(name for name in RESTART_LAYOUTS if name != layout)
    changed = BuildConfig(input="i", output="o", image=ImageConfig(jpeg_restarts=other))
    (line,) = diff_configs(record, changed.output_shaping())
    assert line.startswith(f"image.jpeg_restarts: {layout!r} -> {other!r}")
    assert f"rerun with --jpeg-restarts {layout} to resume it" in line


def test_a_new_encoding_is_one_line_not_two():
    jpeg = BuildConfig(input="i", output="o")
    png = BuildConfig(input="i", output="o", image=ImageConfig(encode="png"))
    assert diff_configs(jpeg.output_shaping(), png.output_shaping()) == [
        "image.encode: 'jpeg' -> 'png'"
    ]
