"""`preprocess build-shards --dry-run`: list and plan as the driver does, say what a build would do.

Writes nothing but the plan files: inputs, sizes and the output are checked before a long build.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from preprocess.build import BUILD_DIR
from preprocess.config import BuildConfig
from preprocess.job import plan_build
from preprocess.listing import Listing
from preprocess.output import (
    PLAN_NAME,
    build_record,
    check_output,
    read_build_record,
    record_changes,
    record_layout,
)
from preprocess.plan import Plan
from preprocess.sizing import Probe, probe_inputs
from shards.formats import get_format
from shards.storage import is_remote
from shards.storage.write import OutputStore, open_output_store


@dataclass
class DryRun:
    """What `build-shards --dry-run` found: the plan and what building it would do.

    Attributes:
        plan: the plan, its files kept under `plan_location`.
        listing: the listing's account of entries that are not inputs.
        output: the output's directory or URL.
        plan_location: where the plan files are; None for an object-store output,
            whose plan lived in a temporary directory.
        probe: sizes of the probe's inputs in each format, for the estimate.
        existing: what the output holds: `new`, `resume`, `replace` (--overwrite),
            or the refusal a build would meet.
        committed: shards of an existing build with a marker (checked when built).
    """

    plan: Plan
    listing: Listing
    output: str
    plan_location: str | None
    probe: Probe
    existing: str
    committed: int = 0

    def estimated_bytes(self) -> dict[str, int | None]:
        """Per format, the probe's mean sample size times the inputs (None: nothing readable)."""
        estimate: dict[str, int | None] = {}
        for fmt in self.probe.sizes:
            mean = self.probe.mean_bytes(fmt)
            ends = get_format(fmt).file_overhead_bytes * len(self.plan.shards)
            estimate[fmt] = None if mean is None else round(mean * self.plan.inputs) + ends
        return estimate


def run_dry_run(config: BuildConfig) -> DryRun:
    """List and plan as `run_build` does, and write nothing but the plan files.

    Raises:
        BuildError: the output holds something other than a build.
        InputError: the input list cannot be trusted (nothing is left behind).
    """
    store = open_output_store(config.output, config.storage_options)
    check_output(store, config)
    with contextlib.ExitStack() as stack:
        listing, plan = plan_build(config, store, stack)
    probe = probe_inputs(plan.probe, config.image, config.formats, config.storage_options)
    location = None if is_remote(store.url) else store.location(PLAN_NAME)
    existing, committed = describe_existing(store, config, plan)
    return DryRun(plan, listing, store.url, location, probe, existing, committed)


def describe_existing(store: OutputStore, config: BuildConfig, plan: Plan) -> tuple[str, int]:
    """What a build would do with the output: (`new`/`resume`/`replace`/refusal, markers)."""
    previous = read_build_record(store)
    if previous is None:
        return "new", 0
    if config.overwrite:
        return "replace", 0
    changes = record_changes(previous, build_record(config, plan))
    if config.layout is not None and config.layout != record_layout(previous):
        changes.append(f"layout: {record_layout(previous)!r} -> {config.layout!r}")
    if changes:
        return "refused, the output holds a build with other options: " + "; ".join(changes), 0
    markers = [
        name
        for name in store.list()
        if name.startswith(f"{BUILD_DIR}/") and name.count("/") == 1 and "-" in name
    ]
    return "resume", len(markers)
