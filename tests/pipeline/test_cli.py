"""`pipeline` as a user meets it: one-line mistakes, `--version`, defaults that are the loader's."""

from __future__ import annotations

import importlib.metadata

import pytest

from pipeline.cli import build_parser, main
from pipeline.loader import LoaderConfig


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"shardpipe {importlib.metadata.version('shardpipe')}"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ([], "required: COMMAND"),
        (["inspect-shuffle"], "source"),
        (["inspect-shuffle", "d", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["inspect-shuffle", "d", "--format", "zip"], "--format"),
    ],
)
def test_usage_mistakes_exit_2_with_one_line(args, fragment, capsys):
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "--help" in lines[0], lines


def test_a_missing_source_is_one_line_exit_1(tmp_path, capsys):
    assert main(["inspect-shuffle", str(tmp_path / "nope")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("pipeline inspect-shuffle: error: "), lines


def test_loader_options_default_to_the_loaders_defaults():
    """The shown defaults are the loader's: a change to LoaderConfig must show in --help."""
    loader = LoaderConfig(source="d")
    args = build_parser().parse_args(["inspect-shuffle", "d"])
    assert (args.split, args.format, args.seed) == (loader.split, loader.format, loader.seed)
    assert (args.batch_size, args.drop_last, args.epoch_rule) == (
        loader.batch.size,
        loader.batch.drop_last,
        loader.batch.epoch_rule,
    )
    assert (args.shuffle_buffer, args.shuffle_initial) == (
        loader.shuffle.buffer,
        loader.shuffle.initial,
    )
    assert args.workers == loader.workers.count
