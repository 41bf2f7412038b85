"""`preprocess` command line: make-sample, build-shards, verify, info, index.

`main()` reads as a table of contents; each subcommand is one entry of
`COMMANDS`: its options dataclass (the flags are generated from it, see
`shards.flags`) and the function that runs it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from preprocess.config import BuildConfig
from shards.errors import ShardError, ShardpipeError, UsageError
from shards.flags import (
    Command,
    StderrHandler,
    build_command_parser,
    config_from_args,
    option,
    run_command,
)
from shards.formats import FORMAT_NAMES

DESCRIPTION = """\
Turn an image dataset (an ImageFolder tree, or a CSV/JSONL/Parquet list of
path,label) into tar and Parquet shards with a manifest, ready for
`train` and the streaming loader; then check and describe them."""

EPILOG = """\
Try it: `preprocess make-sample --output images`, then
`preprocess build-shards --input images --output shards`, then
`train --train-shards shards`. `preprocess COMMAND --help` lists every option."""


@dataclass(frozen=True)
class SampleOptions:
    """Options of `make-sample`."""

    output: str = option(
        text="directory to write the sample into (empty or absent); required", group="sample"
    )
    count: int = option(1000, "images to write", "sample")
    classes: int = option(10, "classes, one directory each (1 to 1000)", "sample")
    seed: int = option(0, "seeds every image (the same seed writes the same bytes)", "sample")
    workers: int | None = option(
        None, "processes drawing images (default: one per CPU; 1: this process)", "sample"
    )
    overwrite: bool = option(
        False,
        "replace an earlier sample in --output (nothing else is ever deleted); one that is "
        "this sample already is kept as it is",
        "sample",
    )
    progress: bool = option(True, "a bar on a terminal, a line every 10 s in a log file", "sample")

    def __post_init__(self) -> None:
        if self.count < 1:
            raise UsageError("--count must be at least 1")
        if not 1 <= self.classes <= 1000:
            raise UsageError("--classes must be in 1..1000")
        if self.seed < 0:
            raise UsageError("--seed must be 0 or more")
        if self.workers is not None and self.workers < 1:
            raise UsageError("--workers must be at least 1")


SOURCE_TEXT = (
    "a shard directory (a build-shards --output, or shards another tool wrote, without a "
    "manifest.json), a manifest.json, a quoted glob ('DIR/*.tar') or brace pattern, or one "
    "shard file; local or a URL (s3://, gs://, http(s)://: listed where the store can list)"
)
FORMAT_TEXT = (
    "the shard format to read where both tar and Parquet files are there (default: the one "
    "format there)"
)


@dataclass(frozen=True)
class VerifyOptions:
    """Options of `verify`."""

    source: str = option(text=SOURCE_TEXT, group="verify", positional=True)
    images: bool = option(
        True,
        "decode every image as the loader does (--no-images: checksums, counts, keys and "
        "labels only)",
        "verify",
    )
    format: str | None = option(None, FORMAT_TEXT, "verify", FORMAT_NAMES)
    accept_failed_rows: bool = option(
        False,
        "accept rows with a null cell, as img2dataset writes each failed download (a null "
        "jpg): counted and named in the summary, not failures (the loader skips them)",
        "verify",
    )


@dataclass(frozen=True)
class InfoOptions:
    """Options of `info`."""

    source: str = option(text=SOURCE_TEXT, group="info", positional=True)
    format: str | None = option(None, FORMAT_TEXT, "info", FORMAT_NAMES)


@dataclass(frozen=True)
class IndexOptions:
    """Options of `index`."""

    source: str = option(
        text="a build-shards --output (its client files are rewritten), or shards another "
        "tool wrote: their directory, a quoted glob or brace pattern, or one file; local or "
        "a URL (s3://, gs://, http(s)://: listed where the store can list)",
        group="index",
        positional=True,
    )
    output: str | None = option(
        None,
        "where the manifest (or the client files) go (default: beside the shards, in the "
        "store they are in; for local shards the only choice: a manifest names its shards "
        "relative to itself; for a web server, which cannot be written, a folder to copy "
        "them from)",
        "index",
    )
    format: str | None = option(None, FORMAT_TEXT, "index", FORMAT_NAMES)
    split: str = option("train", "the split the indexed shards make", "index")


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(
        build_parser(), argv, "interrupted; rerun the same command to resume", setup_logging
    )


def build_parser() -> argparse.ArgumentParser:
    return build_command_parser("preprocess", DESCRIPTION, EPILOG, COMMANDS)


def setup_logging() -> None:
    """`preprocess` log lines (progress of make-sample, starting Ray) to stderr, once."""
    logger = logging.getLogger("preprocess")
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, StderrHandler) for h in logger.handlers):
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def fail(command: str, error: BaseException | str, label: str = "error") -> int:
    """A user's mistake, or a problem of the data or the machine: one line on stderr, exit 1.

    Our own errors (`ShardpipeError`) that a command does not label itself are printed
    the same way by `run_command`; any other exception is a bug and keeps its traceback.
    """
    print(f"preprocess {command}: {label}: {error}", file=sys.stderr)
    return 1


def run_make_sample(options: SampleOptions, args: argparse.Namespace) -> int:
    from preprocess.sample import make_sample

    try:
        summary = make_sample(
            options.output,
            options.count,
            classes=options.classes,
            seed=options.seed,
            workers=options.workers,
            overwrite=options.overwrite,
            progress=options.progress,
        )
    except OSError as error:
        return fail("make-sample", error)
    print(summary.describe())
    return 0


def build_config_from_args(args: argparse.Namespace) -> BuildConfig:
    """The `BuildConfig` of parsed `build-shards` flags."""
    return config_from_args(BuildConfig, args)


def run_build_shards(config: BuildConfig, args: argparse.Namespace) -> int:
    from preprocess.dry_run import run_dry_run
    from preprocess.job import run_build

    try:
        if args.dry_run:
            print(format_dry_run(run_dry_run(config)))
            return 0
        summary = run_build(config)
    except FileNotFoundError as error:
        return fail("build-shards", error)
    except OSError as error:  # a shard read that ran out of retries too (`ShardReadError`)
        return fail(
            "build-shards",
            f"{error}. Nothing partial was left under a final name; fix the cause and rerun "
            "the same command to resume.",
            "environment error",
        )
    print(format_summary(summary))
    return 0


def format_summary(summary) -> str:
    from preprocess.verify import human_bytes
    from preprocess.worker_shards import few_shards_line

    m = summary.manifest
    rows = [("split", "images", "shards")]
    rows += [(name, str(s.samples), str(len(s.shards))) for name, s in m.splits.items()]
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(cell.rjust(width[i]) for i, cell in enumerate(row)) for row in rows]
    lines.append(f"inputs {m.inputs}, written {m.written}, skipped {sum(m.skipped.values())}")
    few = few_shards_line({name: (s.samples, len(s.shards)) for name, s in m.splits.items()})
    lines += [few] if few else []
    lines += [f"  skipped {reason}: {n}" for reason, n in sorted(m.skipped.items())]
    if summary.left_out:
        lines.append(
            "not inputs: "
            + ", ".join(f"{reason} {n}" for reason, n in sorted(summary.left_out.items()))
            + " (named ones in errors.jsonl)"
        )
    if summary.left_out_suffixes_line:
        lines.append(f"files left out by extension: {summary.left_out_suffixes_line}")
    if summary.pillow_fallbacks:
        share = summary.pillow_fallbacks / max(1, m.written)
        lines.append(
            f"inputs decoded by Pillow (not plain JPEG: PNG, CMYK, ...): "
            f"{summary.pillow_fallbacks} ({share:.1%})"
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
    if summary.shards_built == 0:
        # No image was read: a rate would read "0 images/s", as if the build had stalled.
        lines.append(
            f"nothing to do: {summary.shards_reused} shards reused; wall {summary.seconds:.1f} s"
        )
    else:
        lines.append(
            f"shards built {summary.shards_built}, reused {summary.shards_reused}; "
            f"wall {summary.seconds:.1f} s, {summary.images_per_s:.0f} images/s"
        )
        if summary.phases:
            lines.append(_phases_line(summary))
    if summary.executor_reason:
        lines.append(f"executor: {summary.executor} ({summary.executor_reason})")
    lines.append(f"manifest: {summary.output / 'manifest.json'}")
    if summary.client_files:
        lines.append(f"for timm, wids and open_clip: {', '.join(summary.client_files)}")
    return "\n".join(lines)


def _phases_line(summary) -> str:
    """`phases: plan 0.2 s, local start 0.0 s (0.0 s waited), encode 3.1 s, commit 0.0 s; ...`.

    The executor's start runs beside planning: only its `waited` part adds to the wall time.
    """
    phases = summary.phases
    start = f"{summary.executor} start {phases['start']:.2f} s ({phases['wait']:.2f} s waited)"
    idle = f"workers idle at the end {summary.tail_idle_s:.2f} s"
    return (
        f"phases: plan {phases['plan']:.2f} s, {start}, encode {phases['encode']:.2f} s, "
        f"commit {phases['commit']:.2f} s; {idle}"
    )


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


def run_verify(options: VerifyOptions, args: argparse.Namespace) -> int:
    from preprocess.verify import verify_source

    try:
        report = verify_source(
            options.source,
            check_images=options.images,
            fmt=options.format,
            accept_failed=options.accept_failed_rows,
        )
    except (ShardpipeError, FileNotFoundError) as error:
        return fail("verify", error, "FAILED")
    print(f"verify: OK: {report.summary()}")
    return 0


def run_info(options: InfoOptions, args: argparse.Namespace) -> int:
    from preprocess.verify import describe, describe_foreign, manifest_directory
    from shards.manifest import read_manifest
    from shards.manifest.foreign import find_shards, names_shards

    source = options.source
    try:
        if manifest_directory(source) is None and names_shards(source):
            fmt, paths = find_shards(source, options.format)
            print(describe_foreign(paths, fmt))
        else:
            print(describe(read_manifest(source)))
    except FileNotFoundError as error:
        return fail("info", error)
    return 0


def run_index(options: IndexOptions, args: argparse.Namespace) -> int:
    from preprocess.verify import manifest_directory

    source = options.source
    try:
        if manifest_directory(source) is not None:
            return rewrite_index(source, options.output)
        return index_foreign(options)
    except FileNotFoundError as error:
        return fail("index", error)
    except ShardError as error:
        return fail("index", f"{error}; the shard cannot be indexed: replace or remove it")
    except OSError as error:
        return fail("index", f"{error}; fix the cause and rerun", "environment error")


def rewrite_index(source: str, output: str | None = None) -> int:
    """`index` of one of our builds: its client files, from the manifest alone."""
    from preprocess.commit import rewrite_client_files
    from shards.redact import redact_url

    names = rewrite_client_files(source, output)
    if not names:
        print(f"index: nothing written: {redact_url(source)} has no tar shards")
        return 0
    print(f"index: wrote {', '.join(names)} in {redact_url(output or source)}")
    return 0


def index_foreign(options: IndexOptions) -> int:
    """`index` of shards another tool wrote: one pass, then a manifest and client files."""
    from preprocess.commit import index_shards
    from preprocess.verify import repeated_keys_note
    from shards.manifest.foreign import find_shards
    from shards.redact import redact_url

    fmt, paths = find_shards(options.source, options.format)
    summary = index_shards(paths, fmt, options.output, options.split, options.source)
    split = summary.manifest.splits[options.split]
    print(
        f"index: {len(split.shards)} {fmt} shards, {split.samples} samples; wrote "
        f"{summary.manifest_path}"
        + (f" and {', '.join(summary.client_files)}" if summary.client_files else "")
        + repeated_keys_note(summary.repeated_keys)
        + (
            f"; the loader reads a manifest beside its shards: copy it (and the files beside "
            f"it) to {redact_url(summary.elsewhere)}"
            if summary.elsewhere
            else ""
        )
    )
    return 0


# The subcommands in the order `--help` lists them; a new one is a dataclass, a run
# function and a line here.
COMMANDS = (
    Command(
        "make-sample",
        "write a sample ImageFolder dataset of photo-like images (to try everything)",
        SampleOptions,
        run_make_sample,
    ),
    Command(
        "build-shards",
        "turn an image dataset into tar and Parquet shards and a manifest (resumable)",
        BuildConfig,
        run_build_shards,
        (
            (
                "--dry-run",
                "list and plan only: print the inputs per split and class, the shards, an "
                "estimate of the bytes (from 64 probe inputs) and what is left out; writes "
                "nothing but the plan under OUTPUT/_build/plan",
            ),
        ),
    ),
    Command(
        "verify",
        "recompute checksums and counts, and judge every sample as the loader does",
        VerifyOptions,
        run_verify,
    ),
    Command(
        "info",
        "print the manifest summary of a shard directory, or what shards without one hold",
        InfoOptions,
        run_info,
    ),
    Command(
        "index",
        "(re)write the client files (timm's _info.json, wids indexes, open_clip's sizes.json) of a finished build "
        "from its manifest; for shards another tool wrote, read them once and save a "
        "manifest beside them too",
        IndexOptions,
        run_index,
    ),
)


if __name__ == "__main__":
    sys.exit(main())
