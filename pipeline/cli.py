"""`pipeline` command line: inspect-shuffle.

`main()` reads as a table of contents; each subcommand is one entry of
`COMMANDS`: its options dataclass (the flags are generated from it, see
`shards.flags`) and the function that turns them into a `LoaderConfig` and runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields

from pipeline.config import Batching, Shuffle, Workers
from shards.flags import (
    Command,
    build_command_parser,
    check_at_least,
    check_int_at_least,
    option,
    run_command,
    settings_group,
)
from shards.formats import DEFAULT_FORMAT, FORMAT_NAMES
from shards.sample import LabelField

DESCRIPTION = """\
Look at what the streaming loader will deliver before training on it."""

EPILOG = "`pipeline COMMAND --help` lists every option."


@dataclass(frozen=True)
class InspectShuffleOptions:
    """Options of `inspect-shuffle`; the loader's own defaults where they are loader options."""

    source: str = option(
        text="manifest.json, dataset directory, or shard URLs/pattern",
        group="data",
        positional=True,
    )
    split: str = option("train", "split of the manifest to read", "data")
    format: str | None = option(
        None,
        f"shard format to read labels from; default: {DEFAULT_FORMAT} when built",
        "data",
        FORMAT_NAMES,
    )
    label_field: str = option(
        "cls",
        "member the labels are read from: cls or label (one class id), labels (a JSON list "
        "of class ids: each sample is measured as its rarest label) or json:KEY",
        "data",
    )
    # The loader's own groups, so their defaults and checks are the loader's.
    batch: Batching = settings_group(
        Batching, "batches, as the loader is run", only=("size", "drop_last", "epoch_rule")
    )
    shuffle: Shuffle = settings_group(Shuffle, "each worker's shuffle buffer")
    workers: Workers = settings_group(Workers, "DataLoader workers", prefix="", only=("count",))
    world_size: int = option(1, "ranks; every rank's stream is measured", "loader")
    epochs: int = option(1, "epochs to replay (each has its own shard order)", "loader")
    seed: int = option(0, "the loader's seed (shard order and buffers: seed + epoch)", "loader")
    trials: int = option(16, "ideal shuffles simulated per epoch", "report")
    tolerance: float = option(0.10, "relative excess over ideal still called ideal", "report")
    search: bool = option(
        True, "search for a shuffle buffer that mixes as well as an ideal shuffle", "report"
    )
    json: bool = option(False, "print a JSON summary instead of the table", "report")

    def __post_init__(self) -> None:
        check_int_at_least(self, "world_size", 1)
        check_int_at_least(self, "epochs", 1)
        check_int_at_least(self, "trials", 2)  # an ideal shuffle's spread needs two
        check_at_least(self, "tolerance", 0)
        LabelField.parse(self.label_field)


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), argv)


def build_parser() -> argparse.ArgumentParser:
    return build_command_parser("pipeline", DESCRIPTION, EPILOG, COMMANDS)


def run_inspect_shuffle(options: InspectShuffleOptions, args: argparse.Namespace) -> int:
    from pipeline.loader import LoaderConfig
    from pipeline.shuffle_quality import format_report, inspect_shuffle

    # Our own errors (a source it cannot serve as asked) are printed by `run_command`.
    # The options named as the loader's settings are them (source, split, format, batch,
    # shuffle, workers, world size, seed): one added to the options reaches the loader.
    own = {f.name for f in fields(LoaderConfig)}
    settings = {f.name: getattr(options, f.name) for f in fields(options) if f.name in own}
    loader = LoaderConfig(**settings, rank=0)
    report = inspect_shuffle(
        loader,
        epochs=options.epochs,
        trials=options.trials,
        tolerance=options.tolerance,
        search_buffer=options.search,
        label_field=options.label_field,
    )
    print(json.dumps(report.to_dict(), indent=2) if options.json else format_report(report))
    return 0


# The subcommands in the order `--help` lists them; a new one is a dataclass, a run
# function and a line here.
COMMANDS = (
    Command(
        "inspect-shuffle",
        "measure how well the loader's stream mixes classes, against an ideal shuffle "
        "(reads labels only, decodes no image)",
        InspectShuffleOptions,
        run_inspect_shuffle,
    ),
)


if __name__ == "__main__":
    sys.exit(main())
