"""`preprocess` command line: make-sample, build-shards, verify, info.

`main()` reads as a table of contents; each subcommand turns its flags into a
config and calls one library function.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from preprocess.config import BuildConfig
from preprocess.images import ImageConfig
from preprocess.sizing import parse_bytes
from shards.manifest import SHARD_FORMATS


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="preprocess", description=__doc__)
    commands = parser.add_subparsers(required=True, metavar="COMMAND")
    add_make_sample(commands)
    add_build_shards(commands)
    add_verify(commands)
    add_info(commands)
    return parser


def add_make_sample(commands) -> None:
    p = commands.add_parser(
        "make-sample", help="write a sample ImageFolder dataset of photo-like images"
    )
    p.add_argument("--output", required=True)
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(handler=run_make_sample)


def run_make_sample(args) -> int:
    from preprocess.sample import make_sample

    try:
        summary = make_sample(
            args.output,
            args.count,
            classes=args.classes,
            seed=args.seed,
            workers=args.workers,
            overwrite=args.overwrite,
        )
    except ValueError as error:
        print(f"make-sample: error: {error}", file=sys.stderr)
        return 1
    print(summary.describe())
    return 0


def add_build_shards(commands) -> None:
    defaults = ImageConfig()
    p = commands.add_parser(
        "build-shards", help="turn an image dataset into tar and Parquet shards"
    )
    p.add_argument(
        "--input",
        required=True,
        help="ImageFolder root or CSV/JSONL/Parquet manifest (path,label[,split])",
    )
    p.add_argument(
        "--output", required=True, help="directory for shards, manifest.json and errors.jsonl"
    )
    p.add_argument("--image-size", type=int, default=defaults.image_size)
    p.add_argument(
        "--resize", choices=("shorter", "longer", "center-crop", "none"), default=defaults.resize
    )
    p.add_argument(
        "--resample", choices=("bilinear", "bicubic", "lanczos"), default=defaults.resample
    )
    p.add_argument("--encode", choices=("jpeg", "webp", "png"), default=defaults.encode)
    p.add_argument(
        "--backend",
        choices=("pillow", "fast"),
        default=defaults.backend,
        help="`fast`: libjpeg-turbo + OpenCV for plain JPEGs (pip install 'shardpipe[fast]')",
    )
    p.add_argument("--quality", type=int, default=defaults.quality)
    p.add_argument(
        "--max-pixels",
        type=int,
        default=defaults.max_pixels,
        help="skip images whose header declares more pixels",
    )
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--shard-size", type=int, default=None, help="samples per shard (1000)")
    sizes.add_argument(
        "--shard-bytes",
        type=parse_bytes,
        default=None,
        help="aim for tar shards of about this size instead, e.g. 512MB or 1GiB",
    )
    p.add_argument(
        "--formats", default=",".join(SHARD_FORMATS), help="comma-separated: tar,parquet"
    )
    p.add_argument("--val-fraction", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-group-size", type=int, default=128)
    p.add_argument("--max-skip-fraction", type=float, default=0.01)
    p.add_argument(
        "--ray-address",
        default=None,
        help="`auto` or ray://host:port for a cluster; default: local Ray",
    )
    p.add_argument("--executor", choices=("ray", "inline"), default="ray")
    p.add_argument("--workers", type=int, default=None, help="CPUs for a local Ray (default: all)")
    p.add_argument("--overwrite", action="store_true", help="rebuild everything")
    p.add_argument(
        "--confine-to-input",
        action="store_true",
        help="read nothing outside the input root: a file or directory symlink resolving "
        "outside it is skipped as `outside_input` (checked again when each file is "
        "opened); by default symlinks are followed, as torchvision's ImageFolder does",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="list and plan only: print the inputs per split and class, the shards, an "
        "estimate of the bytes (from 64 probe inputs) and what is left out; writes "
        "nothing but the plan under OUTPUT/_build/plan",
    )
    p.set_defaults(handler=run_build_shards)


def build_config_from_args(args) -> BuildConfig:
    image = ImageConfig(
        image_size=args.image_size,
        resize=args.resize,
        encode=args.encode,
        quality=args.quality,
        max_pixels=args.max_pixels,
        resample=args.resample,
        backend=args.backend,
    )
    return BuildConfig(
        input=args.input,
        output=args.output,
        image=image,
        shard_size=args.shard_size or 1000,
        shard_bytes=args.shard_bytes,
        formats=tuple(f.strip() for f in args.formats.split(",") if f.strip()),
        val_fraction=args.val_fraction,
        seed=args.seed,
        row_group_size=args.row_group_size,
        max_skip_fraction=args.max_skip_fraction,
        ray_address=args.ray_address,
        executor=args.executor,
        workers=args.workers,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        confine_to_input=args.confine_to_input,
    )


def run_build_shards(args) -> int:
    from preprocess.job import run_build, run_dry_run
    from preprocess.ray_job import BuildError
    from preprocess.sources import InputError

    try:
        config = build_config_from_args(args)
        if args.dry_run:
            print(format_dry_run(run_dry_run(config)))
            return 0
        summary = run_build(config)
    except (BuildError, InputError, ValueError, FileNotFoundError) as error:
        print(f"build-shards: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(
            f"build-shards: environment error: {error}. Nothing partial was left under a final name; "
            "fix the cause and rerun the same command to resume.",
            file=sys.stderr,
        )
        return 1
    print(format_summary(summary))
    return 0


def format_summary(summary) -> str:
    from preprocess.verify import human_bytes

    m = summary.manifest
    rows = [("split", "images", "shards")]
    rows += [(name, str(s.samples), str(len(s.shards))) for name, s in m.splits.items()]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.rjust(width[i]) for i, cell in enumerate(row)) for row in rows]
    lines.append(f"inputs {m.inputs}, written {m.written}, skipped {sum(m.skipped.values())}")
    lines += [f"  skipped {reason}: {n}" for reason, n in sorted(m.skipped.items())]
    if summary.left_out:
        lines.append(
            "not inputs: "
            + ", ".join(f"{reason} {n}" for reason, n in sorted(summary.left_out.items()))
            + " (named ones in errors.jsonl)"
        )
    if summary.links_followed:
        lines.append(f"symlinks followed: {summary.links_followed}")
    if summary.shards_reused or summary.retried:
        lines.append(
            f"rerun: retried {summary.retried} skipped inputs, recovered {summary.recovered}"
        )
    lines.append(
        "bytes: "
        + ", ".join(f"{fmt} {human_bytes(b)}" for fmt, b in summary.bytes_by_format.items())
    )
    lines.append(
        f"shards built {summary.shards_built}, reused {summary.shards_reused}; "
        f"wall {summary.seconds:.1f} s, {summary.images_per_s:.0f} images/s"
    )
    lines.append(f"manifest: {summary.output / 'manifest.json'}")
    return "\n".join(lines)


# A dry run names the classes one by one up to this many; beyond, it summarises them.
_CLASSES_LISTED = 50
_LEFT_OUT_NAMED = 20


def format_dry_run(report) -> str:
    """The `--dry-run` report: what would be built, and what is left out and why."""
    plan = report.plan
    lines = [f"dry run: nothing built; {plan.inputs} inputs, {len(plan.classes)} classes"]
    rows = [("split", "inputs", "shards", "samples per shard")]
    for split, count in plan.split_counts.items():
        sizes = [piece.size for piece in plan.shards if piece.split == split]
        shape = f"{sizes[0]}" + (f" (last {sizes[-1]})" if sizes[-1] != sizes[0] else "")
        rows.append((split, str(count), str(len(sizes)), shape))
    lines += _table(rows)
    lines += _class_lines(plan)
    lines.append(_estimate_line(report))
    lines += _left_out_lines(report.listing)
    lines.append(_existing_line(report))
    where = report.plan_location or "nowhere (an object-store output keeps no plan files)"
    lines.append(f"plan: {where}")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    width = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(width[i]) for i, cell in enumerate(row)) for row in rows]


def _class_lines(plan) -> list[str]:
    splits = list(plan.class_counts)
    totals = [
        sum(plan.class_counts[s][label] for s in splits) for label in range(len(plan.classes))
    ]
    if len(plan.classes) <= _CLASSES_LISTED:
        rows = [("class", *splits)]
        rows += [
            (name, *(str(plan.class_counts[s][label]) for s in splits))
            for label, name in enumerate(plan.classes)
        ]
        return _table(rows)
    ordered = sorted(range(len(totals)), key=totals.__getitem__)
    smallest = ", ".join(f"{plan.classes[i]} {totals[i]}" for i in ordered[:5])
    middle = totals[ordered[len(ordered) // 2]]
    return [
        f"inputs per class: min {totals[ordered[0]]}, median {middle}, "
        f"max {totals[ordered[-1]]}; smallest: {smallest}"
    ]


def _estimate_line(report) -> str:
    from preprocess.verify import human_bytes

    probe = report.probe
    failed = ", ".join(f"{reason} {n}" for reason, n in sorted(probe.failed.items()))
    readable = probe.tried - sum(probe.failed.values())
    estimate = report.estimated_bytes()
    if readable == 0:
        return f"estimated bytes: unknown (none of the {probe.tried} probe inputs read: {failed})"
    sizes = ", ".join(f"{fmt} ~{human_bytes(b)}" for fmt, b in estimate.items() if b is not None)
    note = f"; unreadable: {failed}" if failed else ""
    return f"estimated bytes: {sizes} (from {readable} of {probe.tried} probe inputs{note})"


def _left_out_lines(listing) -> list[str]:
    counts = listing.left_out_counts()
    refused = listing.refused
    lines = []
    if refused:
        lines.append(f"inputs refused at listing (skipped in the manifest): {len(refused)}")
    if counts:
        lines.append("not inputs: " + ", ".join(f"{r} {n}" for r, n in counts.items()))
    for entry in listing.left_out[:_LEFT_OUT_NAMED]:
        lines.append(f"  {entry.path}: {entry.reason}: {entry.detail}")
    if len(listing.left_out) > _LEFT_OUT_NAMED:
        lines.append(f"  ... {len(listing.left_out) - _LEFT_OUT_NAMED} more named entries")
    if listing.links_followed:
        lines.append(f"symlinks followed: {listing.links_followed}")
    return lines


def _existing_line(report) -> str:
    if report.existing == "new":
        return f"output: {report.output}: a new build"
    if report.existing == "replace":
        return f"output: {report.output}: its build would be replaced (--overwrite)"
    if report.existing == "resume":
        return (
            f"output: {report.output}: resumes the build there ({report.committed} of "
            f"{len(report.plan.shards)} shards have a marker, checked when built)"
        )
    return f"output: {report.output}: would be {report.existing}"


def add_verify(commands) -> None:
    p = commands.add_parser(
        "verify",
        help="recompute checksums and counts; judge every sample as the loader does",
    )
    p.add_argument("directory")
    p.add_argument(
        "--no-images",
        action="store_true",
        help="do not decode the images (checksums, counts, keys and labels only)",
    )
    p.set_defaults(handler=run_verify)


def run_verify(args) -> int:
    from preprocess.verify import VerifyError, verify_directory

    try:
        report = verify_directory(args.directory, check_images=not args.no_images)
    except (VerifyError, FileNotFoundError, ValueError) as error:
        print(f"verify: FAILED: {error}", file=sys.stderr)
        return 1
    print(f"verify: OK: {report.shards} shards, {report.files} files, {report.samples} samples")
    return 0


def add_info(commands) -> None:
    p = commands.add_parser("info", help="print the manifest summary of a shard directory")
    p.add_argument("directory")
    p.set_defaults(handler=run_info)


def run_info(args) -> int:
    from preprocess.verify import describe
    from shards.manifest import read_manifest

    try:
        print(describe(read_manifest(args.directory)))
    except (FileNotFoundError, ValueError) as error:
        print(f"info: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
