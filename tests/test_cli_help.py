"""Every flag of every command (`preprocess`, `pipeline`, `train`) says what it does.

Walks the real parsers, subcommands included; the flag generator refuses a
config field without help, and this catches a flag added by hand without it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

import pipeline.cli
import preprocess.cli
from shards.flags import default_values
from trainers.config import COMMANDS, TrainConfig, build_parser


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
