"""`pipeline` command line: inspect-shuffle.

`main()` reads as a table of contents; each subcommand turns its flags into a
`LoaderConfig` and calls one library function.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipeline", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    add_inspect_shuffle(commands)
    return parser


def add_inspect_shuffle(commands) -> None:
    p = commands.add_parser(
        "inspect-shuffle",
        help="measure how well the loader's stream mixes classes vs an ideal shuffle",
        description=(
            "Replays the loader's exact delivery order for these settings, reading only "
            "labels (no image is decoded), and compares class mixing with ideal shuffles."
        ),
    )
    p.add_argument("source", help="manifest.json, dataset directory, or shard URLs/pattern")
    p.add_argument("--split", default="train")
    p.add_argument("--format", choices=("tar", "parquet"), default=None)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--shuffle-buffer", type=int, default=2000)
    p.add_argument("--shuffle-initial", type=int, default=500)
    p.add_argument(
        "--workers", type=int, default=None, help="DataLoader workers per rank (loader default)"
    )
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trials", type=int, default=16, help="ideal shuffles simulated per epoch")
    p.add_argument(
        "--tolerance", type=float, default=0.10, help="relative excess still called ideal"
    )
    p.add_argument(
        "--no-search", action="store_true", help="do not search for a buffer size that mixes"
    )
    p.add_argument("--json", action="store_true", help="print a JSON summary instead")
    p.set_defaults(handler=run_inspect_shuffle)


def run_inspect_shuffle(args) -> int:
    from pipeline.loader import LoaderConfig
    from pipeline.shuffle_quality import LabelReadError, format_report, inspect_shuffle

    options = dict(
        source=args.source,
        split=args.split,
        format=args.format,
        batch_size=args.batch_size,
        shuffle_buffer=args.shuffle_buffer,
        shuffle_initial=args.shuffle_initial,
        world_size=args.world_size,
        rank=0,
        seed=args.seed,
    )
    if args.workers is not None:
        options["num_workers"] = args.workers
    try:
        report = inspect_shuffle(
            LoaderConfig(**options),
            epochs=args.epochs,
            trials=args.trials,
            tolerance=args.tolerance,
            search_buffer=not args.no_search,
        )
    except (LabelReadError, ValueError, KeyError, OSError) as error:
        print(f"inspect-shuffle: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report.to_dict(), indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
