"""What a build commits after its shard tasks: `errors.jsonl`, the skip budget, the manifest.

Order of commits (`preprocess.job.run_build`): `_build/config.json` first
(`preprocess.output`), one marker per finished shard, then `errors.jsonl`, then
`manifest.json` (the commit point: a dataset without it is incomplete), then the
client index files (`shards.clients`: timm's `_info.json`, wids indexes, open_clip's `sizes.json`), which
`rewrite_client_files` can remake from the manifest alone. `index_shards` commits the
same two for shards another tool wrote, from one pass over them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from preprocess.build import ShardResult, image_field
from preprocess.config import BuildConfig
from preprocess.listing import Listing
from preprocess.output import ERRORS_NAME
from preprocess.plan import Plan, manifest_fields
from preprocess.ray_job import BuildError
from shards.clients import write_client_files
from shards.errors import UsageError
from shards.manifest import (
    LAYOUT_FLAT,
    MANIFEST_NAME,
    Manifest,
    ShardTable,
    SplitInfo,
    write_manifest,
)
from shards.manifest.files import manifest_base, manifest_url, read_manifest
from shards.manifest.foreign import foreign_manifest, survey_shard
from shards.redact import redact_url
from shards.storage import DEFAULT_RETRY, READ_SCHEMES, RetryPolicy, exists, is_remote
from shards.storage.write import OutputStore, open_output_store


def assemble_manifest(
    plan: Plan,
    config: BuildConfig,
    results: list[ShardResult],
    listing: Listing | None = None,
    layout: str = LAYOUT_FLAT,
) -> Manifest:
    """The manifest: every planned input and every input refused at listing, accounted for.

    Files refused at listing (a name that is not UTF-8) are inputs that were
    skipped; tree entries that are not inputs at all (other suffixes, loops, ...)
    are counted in `config.listing`, with the symlinks followed and the files left
    out for their suffix counted by suffix (`left_out_suffixes`).
    """
    listing = listing or Listing([])
    splits: dict[str, SplitInfo] = {}
    for name in sorted({r.split for r in results}):
        # Columns, not one ShardInfo per shard: ~90 bytes a shard rather than ~1.5 KB.
        infos = [r.info for r in results if r.split == name]
        table = ShardTable.from_infos(name, infos, layout)
        counts = table.class_counts.totals(len(plan.classes)).tolist()
        if not table.class_counts.counted.any():
            counts = []  # multi-label: counted in `fields.label_counts`, not summing to samples
        splits[name] = SplitInfo(name, table.total_samples(), table, counts)
    skipped = Counter(s.reason for r in results for s in r.skipped)
    skipped.update(entry.reason for entry in listing.refused)
    inputs = plan.inputs + len(listing.refused)
    listing_record = {
        "links_followed": listing.links_followed,
        "left_out": listing.left_out_counts(),
    }
    if listing.left_out_suffixes:  # absent when none, as in manifests written before it
        listing_record["left_out_suffixes"] = listing.suffix_counts()
    config_record = {
        **config.output_shaping(),
        "input": redact_url(config.input),
        "plan_digest": plan.digest,
        "shard_size": plan.shard_size,  # derived when --shard-bytes was given
        "listing": listing_record,
    }
    manifest = Manifest(
        classes=plan.classes,
        image_field=image_field(config.image),
        formats=list(config.formats),
        splits=splits,
        config=config_record,
        inputs=inputs,
        skipped=dict(skipped),
        fields=manifest_fields(
            config.input_columns(),
            image_field(config.image),
            plan,
            {(r.split, r.info.index): {s.path for s in r.skipped} for r in results},
        ),
        layout=layout,
    )
    if manifest.written + sum(skipped.values()) != inputs:
        raise BuildError(
            f"accounting error: {manifest.written} written + {sum(skipped.values())} skipped "
            f"!= {inputs} inputs; please report this as a bug"
        )
    return manifest


def write_errors(
    store: OutputStore, results: list[ShardResult], listing: Listing | None = None
) -> None:
    """`errors.jsonl`: every skipped input with its reason, in shard order.

    Entries left out at listing come first, with `"shard": null`: refused inputs
    and the named tree entries that are not inputs (loops, unreadable directories,
    directory links outside the root, ...).
    """
    lines = []
    for entry in listing.left_out if listing else ():
        record = {"path": entry.path, "reason": entry.reason, "detail": entry.detail}
        record["shard"] = None
        lines.append(json.dumps(record, ensure_ascii=False))
    for result in results:
        for skip in result.skipped:
            record = {"path": skip.path, "reason": skip.reason, "detail": skip.detail}
            record["shard"] = f"{result.split}-{result.info.index:06d}"
            lines.append(json.dumps(record, ensure_ascii=False))
    store.write_bytes_atomic(ERRORS_NAME, ("\n".join(lines) + "\n" if lines else "").encode())


def enforce_skip_budget(manifest: Manifest, config: BuildConfig, store: OutputStore) -> None:
    """Refuse to commit a manifest when more inputs were skipped than `--max-skip-fraction` allows."""
    skipped = sum(manifest.skipped.values())
    if manifest.inputs and skipped / manifest.inputs > config.max_skip_fraction:
        histogram = ", ".join(f"{reason}: {n}" for reason, n in sorted(manifest.skipped.items()))
        raise BuildError(
            f"{skipped} of {manifest.inputs} inputs were skipped ({skipped / manifest.inputs:.1%}), "
            f"over --max-skip-fraction {config.max_skip_fraction:.1%} ({histogram}). "
            f"See {store.location(ERRORS_NAME)}; fix the inputs or raise --max-skip-fraction and rerun "
            "(finished shards are kept)."
        )


def rewrite_client_files(source: str, output: str | None = None) -> list[str]:
    """(Re)write the client index files of a finished build from its manifest alone.

    For any output whose manifest this version reads (old flat layouts included), in any
    store (`read_manifest`); no shard is opened. They are written beside the manifest, or
    into `output` (a directory or store) when given: a web server cannot be written.
    Returns the names written (none for an output without tar shards).

    Raises:
        FileNotFoundError: the output has no manifest (the build did not finish).
        ManifestError: the manifest (or a side table it names) is not valid.
        UsageError: the store cannot be written (pass `output`).
    """
    manifest = read_manifest(source)
    target = output if output is not None else manifest_base(manifest_url(source))
    return write_client_files(open_output_store(target), manifest)


@dataclass(frozen=True)
class IndexSummary:
    """What `index_shards` wrote: the manifest, the client files and what it found."""

    manifest: Manifest
    manifest_path: str
    client_files: list[str]
    # Parquet rows read under a made key (their own repeats an earlier row's): file -> rows.
    repeated_keys: Counter
    # The shards' folder when the manifest went elsewhere (`--output` for remote shards):
    # the manifest is read beside them, so it is to be copied there.
    elsewhere: str | None = None


def index_shards(
    paths: list[str],
    fmt: str,
    output: str | None = None,
    split: str = "train",
    source: str = "",
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
) -> IndexSummary:
    """Read shards another tool wrote once and commit a manifest beside them, then the
    client files: the loader then reads them with exact counts, checksums and resume.

    Args:
        paths: the shard files (local paths or URLs of one store), in the order the
            manifest lists them; remote ones are read through the storage layer.
        fmt: their format.
        output: where to write (default: their folder, in the store they are in); a
            manifest names its shards relative to its own folder, so for local shards it
            must be theirs. Remote shards may have it written elsewhere (a web server
            cannot be written), to be copied beside them.
        split: the split they make.
        source: what the user named, recorded in the manifest's `config`.

    Raises:
        UsageError: the shards are not all in one folder, `output` is another folder of
            local shards, the store cannot be written, or a manifest is there already
            (ours: rerun its build; `index` refuses to replace it).
        ShardError: a shard is malformed (named).
    """
    folders = {manifest_base(path) for path in paths}
    if len(folders) != 1:
        shown = ", ".join(redact_url(folder) for folder in sorted(folders)[:3])
        raise UsageError(
            f"the shards are in {len(folders)} folders ({shown}); a "
            "manifest lists the shards of its own folder: index each folder"
        )
    folder = folders.pop()
    if output is not None and not is_remote(folder) and os.path.abspath(output) != folder:
        raise UsageError(
            f"--output {output}: a manifest names its shards relative to its own folder, so "
            f"it is written beside them, in {folder}; leave --output out or give that folder"
        )
    target = folder if output is None else output
    if exists(manifest_url(target), retry, storage_options=storage_options, schemes=READ_SCHEMES):
        shown = redact_url(target)
        raise UsageError(
            f"{shown} has a {MANIFEST_NAME} already; `preprocess index {shown}` rewrites "
            "its client files, and a dataset we built is rebuilt with build-shards"
        )
    store = open_output_store(target, storage_options)
    surveys = [
        survey_shard(path, fmt, retry=retry, storage_options=storage_options) for path in paths
    ]
    manifest = foreign_manifest(surveys, split, source)
    written = write_manifest(store, manifest)
    repeated = Counter({os.path.basename(s.path): s.repeated_keys for s in surveys})
    elsewhere = folder if manifest_base(manifest_url(target)) != folder else None
    client_files = write_client_files(store, manifest)
    return IndexSummary(manifest, redact_url(str(written)), client_files, repeated, elsewhere)
