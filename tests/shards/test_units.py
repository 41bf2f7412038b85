"""Byte sizes: one rule for every size flag and setting (`shards.units`).

A letter is its SI prefix (powers of 1000) and an `i` makes it binary (powers of 1024),
whether the size comes from a flag, a config file or a Python keyword.
"""

from __future__ import annotations

import json

import pytest

from pipeline.config import LoaderConfig, ReadOptions
from preprocess.cli import build_parser as preprocess_parser
from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from shards.errors import UsageError
from shards.flags import SettingError, flag_specs
from shards.units import ByteSize, ByteSizeError, parse_bytes
from trainers.config import TrainConfig, coerce_values, parse_command_line

SIZES = [
    ("0", 0),
    ("200000", 200_000),
    ("512B", 512),
    ("512K", 512_000),
    ("512kb", 512_000),
    ("512KiB", 512 * 2**10),
    ("512Ki", 512 * 2**10),
    ("512M", 512_000_000),
    ("512MB", 512_000_000),
    ("512 MB", 512_000_000),
    ("512MiB", 512 * 2**20),
    ("512mib", 512 * 2**20),
    ("0.5G", 500_000_000),
    ("0.5GB", 500_000_000),
    (".5GiB", 2**29),
    ("6G", 6 * 10**9),
    ("200GiB", 200 * 2**30),
    ("1.5TiB", 3 * 2**39),
    ("1.5TB", 1_500_000_000_000),
    ("2P", 2 * 10**15),
    ("1.1KiB", 1126),  # 1126.4: a fraction of a byte is rounded down
    ("0.7K", 700),  # exact: no float rounding to 699
    (" 64MiB ", 64 * 2**20),
]
BAD = ["", "MB", "-5MB", "12 parsecs", "1e9", "1.5", "1.5B", "5 M B", "iB", "5iB", "0x10", "5MBB"]


@pytest.mark.parametrize(("text", "expected"), SIZES)
def test_a_size_means_one_thing(text, expected):
    assert parse_bytes(text) == expected
    assert ByteSize(text) == expected and type(ByteSize(text)) is ByteSize


@pytest.mark.parametrize("text", BAD)
def test_a_bad_size_is_one_line_saying_how_to_write_one(text):
    with pytest.raises(ByteSizeError, match=r"is not a (byte size|whole number of bytes)") as info:
        parse_bytes(text)
    assert "512MiB" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("value", [-1, True, 1.5, None, [5], b"5MB"])
def test_a_byte_size_is_a_count_of_bytes(value):
    with pytest.raises(ByteSizeError):
        ByteSize(value)


def test_a_byte_size_is_an_int_everywhere_else():
    size = ByteSize("2KiB")
    assert repr(size) == "2048" and json.dumps({"bytes": size}) == '{"bytes": 2048}'
    assert ByteSize(6e9) == 6 * 10**9 and ByteSize(size) == 2048


# Every size setting takes an int or a size text, and stores the bytes it names.
SETTINGS = [
    (
        lambda v: LoaderConfig(source="data", io=ReadOptions(cache_limit=v)).io.cache_limit,
        "6G",
        6 * 10**9,
    ),
    (lambda v: ReadOptions(prefetch_bytes=v).prefetch_bytes, "512MiB", 512 * 2**20),
    (lambda v: ReadOptions(cache_limit=v).cache_limit, 2**30, 2**30),
    (lambda v: ImageConfig(max_file_bytes=v).max_file_bytes, "64MiB", 64 * 2**20),
    (lambda v: BuildConfig(input="i", output="o", shard_bytes=v).shard_bytes, "1GiB", 2**30),
]


@pytest.mark.parametrize(("make", "value", "expected"), SETTINGS)
def test_every_size_setting_takes_an_int_or_a_size(make, value, expected):
    made = make(value)
    assert made == expected and isinstance(made, ByteSize)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: LoaderConfig(source="data", io=ReadOptions(cache_limit="lots")), "cache_limit"),
        (lambda: ReadOptions(prefetch_bytes="-1MB"), "prefetch_bytes"),
        (lambda: BuildConfig(input="i", output="o", shard_bytes="0"), "shard_bytes"),
        (lambda: ImageConfig(max_file_bytes="1.5"), "max_file_bytes"),
    ],
)
def test_a_bad_size_setting_names_the_setting(make, name):
    with pytest.raises(SettingError, match=name) as info:
        make()
    assert "\n" not in str(info.value)


def size_flags(cls: type) -> list[str]:
    """The flags of `cls` whose field is a byte size."""
    return [
        spec.dest.replace("_", "-")
        for spec in flag_specs(cls)
        if ByteSize in (spec.kind, *getattr(spec.kind, "__args__", ()))
    ]


def test_the_size_flags_are_the_byte_size_fields():
    assert size_flags(TrainConfig) == ["prefetch-bytes", "cache-limit"]
    assert size_flags(BuildConfig) == ["shard-bytes"]


@pytest.mark.parametrize(
    ("flag", "text", "path", "expected"),
    [
        ("--cache-limit", "6G", ("loader", "io", "cache_limit"), 6 * 10**9),
        ("--cache-limit", "200GiB", ("loader", "io", "cache_limit"), 200 * 2**30),
        ("--prefetch-bytes", "0", ("loader", "io", "prefetch_bytes"), 0),
        ("--prefetch-bytes", "512MB", ("loader", "io", "prefetch_bytes"), 512 * 10**6),
    ],
)
def test_train_size_flags_read_sizes(flag, text, path, expected):
    _, config = parse_command_line(["--train-shards", "data", flag, text])
    value = config
    for name in path:
        value = getattr(value, name)
    assert value == expected


@pytest.mark.parametrize("flag", ["--cache-limit", "--prefetch-bytes"])
def test_a_bad_train_size_flag_is_one_line_naming_the_flag(flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_command_line(["--train-shards", "data", flag, "lots"])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"argument {flag}: 'lots' is not a byte size" in lines[0]


def test_build_size_flag_reads_sizes_and_refuses_bad_ones_in_one_line(capsys):
    parser = preprocess_parser()
    base = ["build-shards", "--input", "i", "--output", "o", "--shard-bytes"]
    assert parser.parse_args([*base, "0.5G"]).shard_bytes == 500_000_000
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "5 parsecs"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "argument --shard-bytes: '5 parsecs' is not a byte size" in lines[0]


@pytest.mark.parametrize(
    ("show_help", "flags"),
    [
        (lambda: preprocess_parser().parse_args(["build-shards", "--help"]), ["--shard-bytes"]),
        (lambda: parse_command_line(["--help"]), ["--prefetch-bytes", "--cache-limit"]),
    ],
)
def test_every_size_flag_states_the_rule_in_its_help(show_help, flags, capsys):
    with pytest.raises(SystemExit):
        show_help()
    text = " ".join(capsys.readouterr().out.split())
    for flag in flags:
        assert f"{flag} SIZE" in text
    assert text.count("SIZE is 512MB or 0.5G (powers of 1000), 512MiB or 1.5TiB") == len(flags)


def test_a_config_file_takes_sizes_as_the_flags_do():
    values = coerce_values({"cache-limit": "200GB", "prefetch-bytes": 1000}, "run.toml")
    assert values == {"cache_limit": 200 * 10**9, "prefetch_bytes": 1000}
    with pytest.raises(UsageError, match="run.toml: cache-limit: 'lots' is not a byte size"):
        coerce_values({"cache-limit": "lots"}, "run.toml")
