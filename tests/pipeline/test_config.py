"""`LoaderConfig` and its groups: every bad value refused where it is made, the flat keywords
kept for one release (each warning once), credentials kept out of reprs, and the flag
generator walking the groups."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest

import preprocess.cli
from pipeline import cli
from pipeline.config import (
    FLAT_NAMES,
    SAMPLING_NAMES,
    Batching,
    Crop,
    Exact,
    LoaderConfig,
    LoaderOptions,
    ReadOptions,
    Resampled,
    Shuffle,
    Workers,
)
from shards.flags import OldSpellingWarning, SettingError, flag_specs
from shards.storage import RetryPolicy
from trainers.config import Data, TrainConfig, parse_command_line, read_config_file


@pytest.mark.parametrize(
    ("group", "options", "named"),
    [
        (Batching, dict(size=0), "Batching.size must be at least 1, got 0"),
        (Batching, dict(size=2.0), "Batching.size must be an integer"),
        (Batching, dict(size=True), "Batching.size must be an integer"),
        (Batching, dict(drop_last="yes"), "Batching.drop_last must be True, False or None"),
        (Batching, dict(epoch_rule="even"), "'even' is not one of pad, drop, uneven"),
        (Batching, dict(channels_last=None), "Batching.channels_last must be True or False"),
        (Resampled, dict(epoch_samples=0), "Resampled.epoch_samples must be at least 1"),
        (Resampled, dict(balance=1), "Resampled.balance must be True or False"),
        (Shuffle, dict(buffer=0), "Shuffle.buffer must be at least 1"),
        (Shuffle, dict(initial=0), "Shuffle.initial must be at least 1"),
        (Crop, dict(image_size=0), "Crop.image_size must be at least 1"),
        (Crop, dict(scale=(0.5, 0.1)), "Crop.scale must be (min, max) with 0 < min <= max <= 1"),
        (Crop, dict(scale=(0.0, 1.0)), "Crop.scale must be (min, max)"),
        (Crop, dict(scale=(0.5, 1.5)), "Crop.scale must be (min, max)"),
        (Crop, dict(scale=0.5), "Crop.scale must be (min, max)"),
        (Crop, dict(ratio=(2.0, 1.0)), "Crop.ratio must be (min, max) with 0 < min <= max"),
        (Crop, dict(hflip=1.5), "Crop.hflip must be a number in [0, 1]"),
        (Crop, dict(crop_fraction=0.0), "Crop.crop_fraction must be a number in (0, 1]"),
        (Crop, dict(backend="turbo"), "Crop.backend 'turbo' is not one of auto, fast, pillow"),
        (Crop, dict(transform="resize"), "Crop.transform must be callable or None"),
        (Workers, dict(count=-1), "Workers.count must be at least 0"),
        (Workers, dict(prefetch_factor=0), "Workers.prefetch_factor must be at least 1"),
        (Workers, dict(persistent=None), "Workers.persistent must be True or False"),
        (Workers, dict(pin_memory="auto"), "Workers.pin_memory must be True, False or None"),
        (Workers, dict(reuse_buffers=0), "Workers.reuse_buffers must be True or False"),
        (ReadOptions, dict(retry=None), "ReadOptions.retry must be a RetryPolicy"),
        (ReadOptions, dict(storage_options="key=1"), "ReadOptions.storage_options must be a dict"),
        (ReadOptions, dict(limits={}), "ReadOptions.limits must be a ReadLimits"),
        (ReadOptions, dict(checksums="sha256"), "ReadOptions.checksums must be True or False"),
        (ReadOptions, dict(timeout=-1), "ReadOptions.timeout must be at least 0"),
        (LoaderOptions, dict(format="zip"), "'zip' is not one of tar, parquet"),
        (LoaderOptions, dict(shuffle=2000), "LoaderOptions.shuffle must be a Shuffle"),
        (LoaderOptions, dict(crop=Batching()), "LoaderOptions.crop must be a Crop"),
        (LoaderOptions, dict(workers=4), "LoaderOptions.workers must be a Workers"),
        (LoaderOptions, dict(io=None), "LoaderOptions.io must be a ReadOptions"),
        (LoaderOptions, dict(max_skip_fraction=2), "max_skip_fraction must be a number in [0, 1]"),
    ],
)
def test_every_group_refuses_a_bad_value_naming_the_field_and_what_it_allows(group, options, named):
    with pytest.raises(SettingError) as refused:
        group(**options)
    assert named in str(refused.value)
    assert isinstance(refused.value, ValueError)  # what callers catching ValueError expect


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(source=""), "LoaderConfig.source must name a manifest or shards"),
        (dict(source=3), "LoaderConfig.source must name a manifest or shards"),
        (dict(split=""), "LoaderConfig.split must be a split name"),
        (dict(train="yes"), "LoaderConfig.train must be True, False or None"),
        (dict(batch=256), "LoaderConfig.batch must be a Batching"),
        (dict(sampling="resampled"), "LoaderConfig.sampling must be Exact() or Resampled"),
        (dict(with_keys=None), "LoaderConfig.with_keys must be True or False"),
        (dict(seed=-1), "LoaderConfig.seed must be at least 0"),
        (dict(rank=-1), "LoaderConfig.rank must be at least 0"),
        (dict(world_size=0), "LoaderConfig.world_size must be at least 1"),
        (dict(rank=2, world_size=2), "LoaderConfig.rank must be below world_size 2, got 2"),
        (dict(fields=("image", "caption")), "unknown field 'caption'"),
        (dict(sampling=Resampled(balance=True), fields=("image",)), "fields must hold 'label'"),
    ],
)
def test_loader_config_refuses_bad_top_level_values(options, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        LoaderConfig(**{"source": "shards/", **options})


def test_valid_edge_values_pass():
    Batching(size=1, drop_last=False, epoch_rule="uneven", channels_last=False)
    Resampled(epoch_samples=1, balance=True)
    Shuffle(buffer=1, initial=1)
    Shuffle(buffer=10, initial=50)  # more than the buffer: the buffer fills first
    Crop(image_size=1, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0, crop_fraction=1.0)
    Crop(scale=(1e-6, 1), hflip=1, transform=print)
    Workers(count=0, prefetch_factor=1, persistent=False, pin_memory=False, reuse_buffers=False)
    ReadOptions(retry=RetryPolicy(deadline=math.inf), storage_options={}, timeout=0)
    config = LoaderConfig(
        source=["a.tar", "b.tar"],
        rank=0,
        world_size=1,
        seed=0,
        train=False,
        max_skip_fraction=0.0,
        format="parquet",
    )
    assert config.rank == 0 and LoaderConfig("x", max_skip_fraction=1).max_skip_fraction == 1


def test_a_zero_batch_size_is_one_clear_error_at_construction():
    """It used to reach `samples // part.batch_size` as a ZeroDivisionError."""
    with pytest.raises(SettingError, match=r"^Batching.size must be at least 1, got 0$"):
        LoaderConfig(source="shards/", batch=Batching(size=0))


# The flat keywords of earlier versions, kept for one release: the only tests that use them
# (pyproject.toml turns an OldSpellingWarning anywhere else into an error).
flat_keywords = pytest.mark.filterwarnings("ignore::shards.flags.OldSpellingWarning")


def test_each_flat_keyword_warns_once_naming_its_grouped_spelling():
    grouped = {
        "batch_size": "LoaderConfig(batch=Batching(size=...))",
        "num_workers": "LoaderConfig(workers=Workers(count=...))",
        "read_limits": "LoaderConfig(io=ReadOptions(limits=...))",
        "resampled": "LoaderConfig(sampling=Resampled())",
        "class_balance": "LoaderConfig(sampling=Resampled(balance=...))",
    }
    for name in [*FLAT_NAMES, *SAMPLING_NAMES]:
        options = SAMPLING_OPTIONS.get(name) or {name: flat_value(name)}
        with pytest.warns(OldSpellingWarning) as caught:
            LoaderConfig(source="x", **options)
        messages = [str(w.message) for w in caught if f"({name}=...)" in str(w.message)]
        assert len(messages) == 1, (name, messages)
        assert messages[0].startswith(f"LoaderConfig({name}=...) is now LoaderConfig(")
        assert grouped.get(name, "") in messages[0]
        assert {w.filename for w in caught} == {__file__}  # the caller's line, not ours
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second use is silent
            LoaderConfig(source="x", **options)


SAMPLING_OPTIONS = {
    "resampled": dict(resampled=True),
    "epoch_samples": dict(resampled=True, epoch_samples=4),
    "class_balance": dict(class_balance=True),
}


def flat_value(name: str):
    """A valid value of the flat keyword `name` that is not its group field's default."""
    group, inner = FLAT_NAMES[name]
    return changed_value(inner, getattr(getattr(LoaderConfig("x"), group), inner))


def test_the_grouped_spelling_never_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LoaderConfig(
            source="x",
            batch=Batching(size=8),
            sampling=Resampled(epoch_samples=4),
            workers=Workers(count=0),
            io=ReadOptions(cache_limit="1GB"),
        )


@flat_keywords
@pytest.mark.parametrize("flat", sorted(FLAT_NAMES))
def test_every_flat_keyword_sets_its_group_field(flat):
    group, inner = FLAT_NAMES[flat]
    value = flat_value(flat)
    config = LoaderConfig(source="x", **{flat: value})
    assert getattr(getattr(config, group), inner) == value
    # Only that field changed: the rest of the group keeps its defaults.
    expected = dataclasses.replace(getattr(LoaderConfig("x"), group), **{inner: value})
    assert getattr(config, group) == expected


def changed_value(name: str, default):
    """A valid value of the group field `name` that is not its default."""
    special = {
        "epoch_rule": "drop",
        "scale": (0.2, 0.9),
        "ratio": (0.5, 2.0),
        "backend": "pillow",
        "transform": print,
        "retry": RetryPolicy(attempts=2),
        "storage_options": {"anon": True},
        "limits": dataclasses.replace(ReadOptions().limits, members=10),
        "hflip": 0.25,
        "crop_fraction": 0.5,
        "timeout": 5.0,
        "cache_dir": "/tmp/shard-cache",
        "cache_limit": 2**30,
    }
    if name in special:
        return special[name]
    if isinstance(default, bool) or default is None:
        return not default
    return default + 1


@flat_keywords
def test_flat_keywords_combine_into_one_group():
    config = LoaderConfig("x", batch_size=8, drop_last=False, num_workers=0, prefetch_factor=4)
    assert config.batch == Batching(size=8, drop_last=False)
    assert config.workers.count == 0 and config.workers.prefetch_factor == 4


@flat_keywords
@pytest.mark.parametrize(
    ("flat", "sampling"),
    [
        (dict(), Exact()),
        (dict(resampled=False), Exact()),
        (dict(resampled=True), Resampled()),
        (dict(resampled=True, epoch_samples=100), Resampled(epoch_samples=100)),
        (dict(class_balance=True), Resampled(balance=True)),
        (dict(class_balance=True, epoch_samples=5), Resampled(epoch_samples=5, balance=True)),
    ],
)
def test_three_sampling_keywords_are_one_sampling_choice(flat, sampling):
    config = LoaderConfig(source="x", **flat)
    assert config.sampling == sampling
    assert config.resampling is isinstance(sampling, Resampled)


@flat_keywords
@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(batch=Batching(), batch_size=8), "LoaderConfig.batch and batch_size were both"),
        (dict(crop=Crop(), image_size=64, backend="fast"), "backend, image_size were both given"),
        (dict(sampling=Exact(), resampled=True), "sampling and resampled were both given"),
        (dict(epoch_samples=10), "epoch_samples needs resampled=True"),
        (dict(resampled=True, epoch_samples=0), "epoch_samples must be at least 1"),
        (dict(num_workers=-2), "num_workers must be at least 0, got -2"),
        (dict(read_limits=None), "read_limits must be a ReadLimits"),
    ],
)
def test_flat_keyword_mistakes_name_what_the_user_wrote(options, named):
    with pytest.raises(SettingError, match=named):
        LoaderConfig(source="x", **options)


@flat_keywords
def test_dataclasses_replace_keeps_working_with_groups():
    config = LoaderConfig("x", batch=Batching(size=8))
    moved = dataclasses.replace(config, rank=1, world_size=2, shuffle=Shuffle(buffer=4))
    assert (moved.rank, moved.batch.size, moved.shuffle.buffer) == (1, 8, 4)
    with pytest.raises(SettingError, match=r"replace\(config.shuffle"):
        dataclasses.replace(config, shuffle_buffer=4)


def test_configs_are_frozen():
    config = LoaderConfig("x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch.size = 3  # type: ignore[misc]


def test_repr_redacts_credentials():
    config = LoaderConfig(
        source=["https://user:hunter2@host/a.tar", "s3://bucket/b.tar"],
        io=ReadOptions(storage_options={"secret": "hunter3"}),
    )
    text = repr(config)
    assert "hunter2" not in text and "hunter3" not in text
    assert text.startswith("LoaderConfig(source=[") and "batch=Batching(size=256" in text
    assert config.io.storage_options == {"secret": "hunter3"}
    assert "hunter3" not in repr(config.io)


def test_options_are_a_loader_configs_shared_part():
    """`TrainConfig.loader` reaches `LoaderConfig` whole: nothing is copied field by field."""
    options = LoaderOptions(format="tar", shuffle=Shuffle(buffer=7), workers=Workers(count=0))
    config = LoaderConfig(source="x", **options.options)
    assert config.options == options.options
    assert config.shuffle.buffer == 7 and config.workers.count == 0


# The flag generator walks the groups.


def test_train_flags_keep_their_names_and_reach_the_loader_group():
    _, config = parse_command_line(
        [
            "--train-shards",
            "d",
            "--workers",
            "3",
            "--image-size",
            "64",
            "--shuffle-buffer",
            "100",
            "--shuffle-initial",
            "10",
            "--format",
            "parquet",
            "--backend",
            "pillow",
            "--scale",
            "0.25,1",
            "--no-persistent-workers",
            "--verify-checksums",
            "--batch-timeout",
            "30",
        ]
    )
    loader = config.loader
    assert loader.workers == Workers(count=3, persistent=False)
    assert loader.crop == Crop(image_size=64, backend="pillow", scale=(0.25, 1.0))
    assert loader.shuffle == Shuffle(buffer=100, initial=10) and loader.format == "parquet"
    assert loader.io.checksums is True and loader.io.timeout == 30.0


def test_train_help_lists_the_loader_groups_as_sections():
    from shards.flags import default_values
    from trainers.config import build_parser

    text = build_parser("train", default_values(TrainConfig)).format_help()
    for section in ("shuffle options:", "crop options:", "workers options:", "reading options:"):
        assert section in text
    dests = [spec.dest for spec in flag_specs(TrainConfig)]
    assert len(dests) == len(set(dests))
    assert {"workers", "image_size", "shuffle_buffer", "shuffle_initial", "format"} <= set(dests)


def test_a_group_refusal_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_command_line(["--train-shards", "d", "--workers", "-1"])
    assert "--workers must be at least 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["inspect-shuffle", "d", "--shuffle-buffer", "0"])
    assert "--shuffle-buffer must be at least 1, got 0" in capsys.readouterr().err


def test_config_files_use_flag_names_for_group_options(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("workers = 1\nimage-size = 32\nshuffle_buffer = 64\nscale = [0.5, 1]\n")
    assert read_config_file(path) == {
        "workers": 1,
        "image_size": 32,
        "shuffle_buffer": 64,
        "scale": (0.5, 1.0),
    }
    _, config = parse_command_line(["--config", str(path), "--train-shards", "d"])
    assert config.loader.workers.count == 1 and config.loader.crop.image_size == 32
    assert config.loader.shuffle.buffer == 64 and config.loader.crop.scale == (0.5, 1.0)


def test_a_stored_train_config_round_trips_with_its_loader_group():
    loader = LoaderOptions(workers=Workers(count=1), crop=Crop(scale=(0.3, 1.0)))
    config = TrainConfig(data=Data(train_shards="x"), loader=loader)
    assert TrainConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("main", "argv", "suggested"),
    [
        (parse_command_line, ["--train-shards", "d", "--epoch", "1"], "--epochs"),
        (parse_command_line, ["--train-shards", "d", "--shuffle-buf", "9"], "--shuffle-buffer"),
        (cli.main, ["inspect-shuffle", "d", "--batch", "8"], "--batch-size"),
        (
            preprocess.cli.main,
            ["build-shards", "--input", "i", "--output", "o", "--overwrit"],
            "--overwrite",
        ),
    ],
)
def test_flags_are_never_abbreviated_and_an_unknown_one_gets_a_suggestion(
    main, argv, suggested, capsys
):
    """argparse's `allow_abbrev` read `--epoch 1` as `--epochs 1`; now it is refused."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "unrecognized arguments: " in lines[0], lines
    if suggested:
        assert f"(did you mean {suggested}?)" in lines[0]


def test_a_mix_takes_sources_only_and_reads_them_exactly():
    from pipeline import Mixing, Source

    mix = [Source("data/web", weight=0.7), Source("data/curated", weight=0.3)]
    assert LoaderConfig(source=mix).is_mix and not LoaderConfig(source="data/web").is_mix
    assert LoaderConfig(source=Source("data/web", repeat=1)).source == (
        Source("data/web", repeat=1),
    )
    with pytest.raises(SettingError, match="mixes Source"):
        LoaderConfig(source=[mix[0], "data/other"])
    with pytest.raises(SettingError, match="must be Exact"):
        LoaderConfig(source=mix, sampling=Resampled())
    with pytest.raises(SettingError, match="Mixing.batches 'one' is not one of mixed, single"):
        LoaderConfig(source=mix, mixing=Mixing(batches="one"))
    shown = repr(LoaderConfig(source=[Source("https://u:secret@h/d/manifest.json", weight=1)]))
    assert "secret" not in shown and "Source(source='https://" in shown
