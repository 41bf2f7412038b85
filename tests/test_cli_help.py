"""Every flag of every command (`preprocess`, `pipeline`, `train`) says what it does, is
never abbreviated, and a near miss of a flag or a command gets a suggestion.

Walks the real parsers, subcommands included; the flag generator refuses a
config field without help, and this catches a flag added by hand without it.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Iterator

import pytest

import pipeline.cli
import preprocess.cli
from shards.flags import default_values
from trainers.config import COMMANDS, TrainConfig, build_parser
from trainers.train import main as train_main


def all_parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield "preprocess", preprocess.cli.build_parser()
    yield "pipeline", pipeline.cli.build_parser()
    for command in COMMANDS:
        yield f"train {command}", build_parser(command, default_values(TrainConfig))


def walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.Action]]:
    """`(command, action)` of every argument, descending into subcommands."""
    for action in parser._actions:  # argparse keeps no public list of its actions
        if isinstance(action.choices, dict) and not action.option_strings:
            for sub_name, sub in action.choices.items():
                yield from walk(f"{name} {sub_name}", sub)
        else:
            yield name, action


def every_flag() -> list[tuple[str, argparse.Action]]:
    return [item for name, parser in all_parsers() for item in walk(name, parser)]


def test_no_flag_lacks_help():
    flags = every_flag()
    missing = [
        f"{name} {action.option_strings or action.dest}"
        for name, action in flags
        if not action.help
    ]
    assert len(flags) > 200  # the walk reached every command's flags
    assert missing == []


@pytest.mark.parametrize("name", ["preprocess", "pipeline", *(f"train {c}" for c in COMMANDS)])
def test_every_valued_flag_shows_its_default(name):
    parser = dict(all_parsers())[name]
    for command, action in walk(name, parser):
        if action.option_strings and action.nargs != 0 and not action.required:
            assert "default" in action.help, f"{command} {action.option_strings}: {action.help!r}"
            assert "(default: None)" not in action.help, f"{command}: say what None means"


@pytest.mark.parametrize("name", ["preprocess", "pipeline", *(f"train {c}" for c in COMMANDS)])
def test_every_help_text_renders_as_written(name):
    # argparse %-formats help: an unescaped "0.6% of a file" would raise, "3% larger" would
    # print garbage. Each flag's help is expanded as `--help` expands it.
    parser = dict(all_parsers())[name]
    formatter = parser._get_formatter()  # argparse keeps no public way to expand one help
    for command, action in walk(name, parser):
        if action.help and action.help is not argparse.SUPPRESS:
            text = formatter._expand_help(action)
            assert text.replace("%", "") == action.help.replace("%", ""), command


# Flags are never abbreviated, and a near miss gets a suggestion


def every_parser() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """`(command, parser)` of every CLI and every subcommand."""

    def descend(name: str, parser: argparse.ArgumentParser):
        yield name, parser
        for action in parser._actions:
            if isinstance(action.choices, dict) and not action.option_strings:
                for sub_name, sub in action.choices.items():
                    yield from descend(f"{name} {sub_name}", sub)

    for name, parser in all_parsers():
        yield from descend(name, parser)


def test_no_parser_abbreviates_flags():
    names = [name for name, parser in every_parser() if parser.allow_abbrev]
    assert len(list(every_parser())) == 2 + 5 + 1 + len(COMMANDS)  # every subcommand reached
    assert names == []


@functools.cache
def top_parser(command: str) -> argparse.ArgumentParser:
    """The parser a command line starts in: `preprocess`, `pipeline`, `train COMMAND`."""
    return dict(all_parsers())[command]


def near_misses() -> Iterator[tuple[str, list[str], str]]:
    """`(top parser, argv, flag)`: each long flag of each command less its last letter, with
    the command's required arguments given, so the near miss is all that is wrong."""
    for name, parser in every_parser():
        if name in ("preprocess", "pipeline"):
            continue  # no flags of their own but --help and --version
        top, *words = name.split()
        if top == "train":
            top, words = name, []  # `train COMMAND` has a parser of its own
        required = []
        for action in parser._actions:
            if not action.option_strings and action.required:
                required.append("x")  # a positional
            elif action.required:
                required += [action.option_strings[0], "x"]
        for action in parser._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--version") and len(flag) > 5:
                    yield top, [*words, *required, flag[:-1], "1"], flag


def test_every_shortened_flag_is_refused_with_a_suggestion(capsys):
    """argparse's `allow_abbrev` read `--epoch 1` as `--epochs 1`: every flag of every CLI.

    One parser per command line, built once (tests/pipeline/test_config.py runs the same
    refusal through each CLI's `main`).
    """
    cases = list(near_misses())
    assert len(cases) > 250
    for top, argv, flag in cases:
        with pytest.raises(SystemExit) as stop:
            top_parser(top).parse_args(argv)
        assert stop.value.code == 2, (top, argv)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and f"unrecognized arguments: {flag[:-1]} 1" in lines[0], lines
        assert "(did you mean --" in lines[0], lines


@pytest.mark.parametrize(
    ("main", "argv", "suggested"),
    [
        (preprocess.cli.main, ["verfy", "shards"], "verify"),
        (preprocess.cli.main, ["build-shard", "--input", "i"], "build-shards"),
        (preprocess.cli.main, ["indx"], "index"),
        (pipeline.cli.main, ["inspect-shufle", "shards"], "inspect-shuffle"),
        (train_main, ["find-batchsize"], "find-batch-size"),
        (train_main, ["scan-troughput", "--device", "cpu"], "scan-throughput"),
        (train_main, ["trian", "--train-shards", "x"], "train"),
    ],
)
def test_a_mistyped_command_gets_a_suggestion(main, argv, suggested, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert f"unknown command {argv[0]!r} (did you mean {suggested}?)" in lines[0]
    assert "; the commands are " in lines[0]


def test_a_word_like_no_command_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as stop:
        preprocess.cli.main(["zzz"])
    assert stop.value.code == 2
    line = capsys.readouterr().err.strip()
    assert "did you mean" not in line
    assert line.endswith(
        "unknown command 'zzz'; the commands are make-sample, build-shards, verify, info, "
        "index; see `preprocess --help`"
    )


def test_the_train_console_script_reads_its_command_from_sys_argv(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["train", "find-batch-sise"])
    with pytest.raises(SystemExit) as stop:
        train_main()
    assert stop.value.code == 2
    assert "(did you mean find-batch-size?)" in capsys.readouterr().err
