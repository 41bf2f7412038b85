"""`BuildConfig`: every option of `preprocess build-shards`, and which of them shape the output.

The output-shaping part is stored in `_build/config.json` at the start of a
build and in the manifest; a rerun against the same output must match it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from preprocess.columns import LABEL_MODES, InputColumns
from preprocess.images import (
    BACKENDS,
    EXTENSIONS,
    RESAMPLE_CHOICES,
    RESIZE_POLICIES,
    RESTART_LAYOUTS,
    ImageConfig,
)
from shards.cluster import ray_address_option
from shards.flags import (
    about,
    check_bytes,
    check_choice,
    check_flag,
    check_fraction,
    check_int_at_least,
    option,
    refuse,
)
from shards.formats import FORMAT_NAMES, FORMATS, is_format
from shards.manifest import LAYOUTS
from shards.storage import READ_SCHEMES, credentials_problem, is_remote, validate_url
from shards.units import ByteSize

# Where shard tasks run (see `preprocess.pool.resolve_executor`); all write the same bytes.
EXECUTORS = ("auto", "ray", "local", "inline")
# Options that change how a build runs but not a byte of what it writes.
# `input` and `output` are left out too: moving a dataset must not invalidate a
# build; the plan digest (every path and label) guards the inputs instead.
RUNTIME_ONLY = (
    "input",
    "output",
    "input_root",
    "ray_address",
    "workers",
    "overwrite",
    "max_skip_fraction",
    "executor",
    "progress",
    "storage_options",
)


def older_restarts(layout: str, current: str) -> str:
    """The older of two `RESTART_LAYOUTS`: what an old `--no-jpeg-restart*` switch leaves."""
    return max(layout, current, key=RESTART_LAYOUTS.index)


def unchanged(current: Any) -> Any:
    """An old switch that named the default: accepted, and it changes nothing."""
    return current


# The switches of builds made before `--jpeg-restarts` took a layout; each one can only
# make the layout older, so they combine in any order as they did.
RESTART_SPELLINGS = {
    "--no-jpeg-restarts": functools.partial(older_restarts, "none"),
    "--no-jpeg-restart-columns": functools.partial(older_restarts, "rows"),
    "--no-jpeg-restart-narrow-rows": functools.partial(older_restarts, "columns-all"),
    "--jpeg-restart-columns": unchanged,
    "--jpeg-restart-narrow-rows": unchanged,
}


@dataclass(frozen=True)
class BuildConfig:
    """Options of one `build-shards` run.

    Attributes:
        input: ImageFolder root, or a CSV/JSONL/Parquet manifest of `path,label[,split]`.
        output: directory that receives shards, `manifest.json` and `errors.jsonl`.
        image: per-image decode/resize/encode options.
        shard_size: samples per shard (fewer when inputs are skipped).
        shard_bytes: instead of `shard_size`, aim for tar shards of about this many
            bytes (an int or a size text: `"512MB"`, `"1GiB"`; `shards.units`); the
            count is measured on a fixed probe of the inputs
            (`preprocess.sizing`) and recorded in the manifest.
        formats: shard formats to write; both hold the same samples and keys.
        layout: where a new build puts its shards (`shards.manifest.LAYOUTS`):
            `by_format` (`OUT/tar/`, `OUT/parquet/`) or `flat` (beside the manifest).
            None: a rerun keeps the layout its build started with, a new build gets
            `by_format`. Recorded apart from `output_shaping()`, so a flat build made
            before the option existed still resumes flat.
        val_fraction: share of inputs put in `val` by a hash of their path,
            unless the manifest has a `split` column.
        seed: seeds the order of samples inside each split.
        row_group_size: Parquet rows per row group, the loader's streaming unit.
        max_skip_fraction: fail the job when more inputs than this are skipped.
        ray_address: `auto` or `ray://host:port`: the Ray cluster the tasks run on. None
            (default): `RAY_ADDRESS` when set, else no cluster; `executor` `ray` (or `auto`
            for a large build) then starts a Ray of its own on this machine.
        executor: `auto` (default: Ray when a cluster is named by `ray_address` or
            `RAY_ADDRESS`, or when the build is large enough that Ray's start-up is a
            few percent of it, `preprocess.pool.RAY_MIN_INPUTS_PER_CPU`; else `local`),
            `ray`, `local` (a process pool on this machine, no start-up of seconds) or
            `inline` (this process; for debugging). Every executor writes the same bytes.
        workers: processes of the local pool, or CPUs of a local Ray (None: all).
        overwrite: rebuild everything, replacing an existing output.
        progress: show a progress bar.
        confine_to_input: read nothing outside the input root (the tree, or a list
            file's directory): a file or directory symlink resolving outside it is
            skipped as `outside_input`, checked again when each file is opened. By
            default symlinks are followed wherever they point, as torchvision's
            ImageFolder does.
        label: `single` (one class per input), `multi` (an input list's `label`
            holds a list of class names) or `none` (no classes: image-text pairs).
        fields: `COLUMN:MEMBER` entries: the input list's column becomes the sample
            member `txt` (a caption), `weight` (a number) or a key of `json`.
        storage_options: fsspec options of the object stores the build reads and writes
            (the input's listing and images, the output), e.g. `endpoint_url`; None takes
            each store's standard environment (`AWS_*`, ...), which is all the command
            line uses. Python only, never shown in a repr nor recorded: credentials go here.
    """

    input: str = option(
        text="ImageFolder root, or a CSV/JSONL/Parquet list of path,label[,split]; required",
        group="input and output",
    )
    output: str = option(
        text="directory (or s3://bucket/prefix) for the shards, manifest.json and errors.jsonl; "
        "required",
        group="input and output",
    )
    image: ImageConfig = option(
        default_factory=ImageConfig,
        text="per-image decode, resize and encode options",
        group="image",
        nested={
            "image_size": about("target side in pixels; what it measures depends on --resize"),
            "resize": about(
                "fit the shorter or longer side to --image-size, center-crop a square, or keep "
                "the size",
                RESIZE_POLICIES,
            ),
            "resample": about("resampling filter of the resize", RESAMPLE_CHOICES),
            "encode": about("encoding of the stored images", tuple(EXTENSIONS)),
            "quality": about("JPEG/WebP quality 1-100 (ignored for PNG)"),
            "max_pixels": about("skip images whose header declares more pixels, before decoding"),
            "backend": about(
                "auto: libjpeg-turbo + OpenCV when --resample is bilinear, Pillow "
                "otherwise and for inputs they cannot decode (counted); fast: require them; "
                "pillow: Pillow only",
                BACKENDS,
            ),
            "jpeg_restarts": about(
                "where JPEG restart markers start intervals, so the loader decodes only the "
                "rows and columns a crop needs: columns = intervals of about 64 px (files "
                "~1.5-3% larger), one per row in rows under 384 px, which decode faster so; "
                "columns-all = column intervals in those rows too; rows = one interval per "
                "MCU row (about 4 bytes a row); none = no markers. Each of the last three "
                "writes the files of builds made before the one above it, and is how such a "
                "build resumes (the older --no-jpeg-restarts, --no-jpeg-restart-columns and "
                "--no-jpeg-restart-narrow-rows still mean none, rows and columns-all)",
                RESTART_LAYOUTS,
                bare="columns",
                spellings=RESTART_SPELLINGS,
            ),
        },
    )
    shard_size: int = option(
        1000, "samples per shard (fewer when inputs are skipped)", "shard", exclusive="size"
    )
    shard_bytes: ByteSize | None = option(
        None,
        "aim for tar shards of about this size instead of --shard-size, e.g. 512MB or 1GiB "
        "(default: none)",
        "shard",
        exclusive="size",
    )
    formats: tuple[str, ...] = option(
        FORMAT_NAMES, "comma-separated shard formats to write", "shard", metavar="LIST"
    )
    layout: str | None = option(
        None,
        "where a new build puts the shards: by_format = a directory per format "
        "(OUTPUT/tar/, OUTPUT/parquet/) that pyarrow, polars, duckdb and HF datasets open "
        "by its path; flat = every shard beside manifest.json (default: by_format for a new "
        "build; a rerun keeps the layout its build started with)",
        "shard",
        LAYOUTS,
    )
    val_fraction: float = option(
        0.0,
        "share of inputs put in the val split (by a hash of their path), unless the input "
        "list has a split column",
        "shard",
    )
    seed: int = option(0, "seeds the order of the samples inside each split", "shard")
    row_group_size: int = option(
        128, "Parquet rows per row group (the loader's streaming unit)", "shard"
    )
    max_skip_fraction: float = option(
        0.01, "fail the build when more than this share of the inputs is skipped", "run"
    )
    ray_address: str | None = ray_address_option(
        "the shard tasks run on",
        "no cluster: --executor ray, or auto for a large build, starts a Ray on this machine",
        "run",
    )
    executor: str = option(
        "auto",
        "where shard tasks run: auto is Ray when --ray-address (or RAY_ADDRESS) names a "
        "cluster or the build is large enough that Ray's start-up is a few percent of it, "
        "else local, a process pool on this machine that needs no Ray start-up; "
        "inline runs them one after another in this process (for debugging)",
        "run",
        EXECUTORS,
    )
    workers: int | None = option(
        None,
        "processes of the local pool, or CPUs of a local Ray (default: all of this machine's)",
        "run",
    )
    overwrite: bool = option(False, "rebuild everything, replacing the build in --output", "run")
    progress: bool = option(
        True, "progress bar on a terminal, a progress line every 10 s otherwise", "run"
    )
    confine_to_input: bool = option(
        False,
        "read nothing outside the input root: a symlink resolving outside it is skipped as "
        "`outside_input`, and an input list naming a path outside its folder (or "
        "--input-root) or a URL is refused (by default symlinks are followed, as "
        "torchvision's ImageFolder does, and a list may name any path or URL)",
        "input and output",
    )
    input_root: str | None = option(
        None,
        "folder or URL prefix an input list's paths are keyed relative to; every listed "
        "path must lie under it (default: the list's folder, or the deepest common folder "
        "of the listed paths when some lie outside it)",
        "input and output",
    )

    label: str = option(
        "single",
        "what the input list's `label` column holds: one class name, a list of them "
        "(multi-label), or nothing read at all (label-free data such as image-text pairs)",
        "input and output",
        LABEL_MODES,
    )
    description: str | None = option(
        None,
        "one line describing the dataset, written into every Parquet shard's metadata "
        "(ours and HF datasets' `info.description`) (default: none)",
        "input and output",
    )
    fields: tuple[str, ...] = option(
        (),
        "comma-separated COLUMN:MEMBER of input-list columns written into each sample: "
        "MEMBER is txt (a caption), weight (a number) or json (a key of the metadata "
        "document), e.g. caption:txt,tags:json,w:weight (default: none)",
        "input and output",
        metavar="COLUMN:MEMBER,...",
    )
    # repr=False: credentials put here must not leak wherever a config is logged.
    storage_options: dict | None = field(
        default=None,
        repr=False,
        metadata={"help": "fsspec options of the build's object stores", "cli": False},
    )

    def __post_init__(self) -> None:
        for name in ("input", "output"):
            location = getattr(self, name)
            if not isinstance(location, str) or not location:
                raise refuse(self, name, f" must be a path or URL, got {location!r}")
            credentials = credentials_problem(location)
            if credentials is not None:
                raise refuse(self, name, f" {credentials}")
        self._check_input_location()
        if not isinstance(self.image, ImageConfig):
            raise refuse(self, "image", f" must be an ImageConfig, got {self.image!r}")
        check_int_at_least(self, "shard_size", 1)
        check_bytes(self, "shard_bytes", 1, optional=True)
        formats = self.formats
        if not isinstance(formats, tuple) or not formats or not all(is_format(f) for f in formats):
            raise refuse(
                self,
                "formats",
                f" takes a comma-separated subset of {','.join(FORMATS)}, got {formats!r}",
            )
        check_choice(self, "layout", LAYOUTS, optional=True)
        value = self.val_fraction
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
            raise refuse(self, "val_fraction", f" must be a number in [0, 1), got {value!r}")
        if type(self.seed) is not int:
            raise refuse(self, "seed", f" must be an integer, got {self.seed!r}")
        check_int_at_least(self, "row_group_size", 1)
        check_fraction(self, "max_skip_fraction")
        self._check_run_options()
        check_choice(self, "label", LABEL_MODES)
        if self.description is not None and not isinstance(self.description, str):
            raise refuse(self, "description", f" must be text or None, got {self.description!r}")
        if not isinstance(self.fields, tuple):
            raise refuse(self, "fields", f" must be a tuple of COLUMN:MEMBER, got {self.fields!r}")
        self.input_columns()  # a bad --fields entry is one error before any work
        if self.storage_options is not None and not isinstance(self.storage_options, Mapping):
            raise refuse(self, "storage_options", " must be a dict of fsspec options or None")

    def _check_input_location(self) -> None:
        """`input` and `input_root`, when URLs, checked as every read checks them (one line)."""
        for name in ("input", "input_root"):
            location = getattr(self, name)
            if name == "input_root" and location is None:
                continue
            if not isinstance(location, str) or not location:
                raise refuse(self, name, f" must be a path or URL, got {location!r}")
            if not is_remote(location):
                continue
            try:
                validate_url(location, schemes=READ_SCHEMES)
            except ValueError as error:
                raise refuse(self, name, f": {error}") from None

    def _check_run_options(self) -> None:
        """The options of where and how the tasks run (`RUNTIME_ONLY`)."""
        address = self.ray_address
        if address is not None and (not isinstance(address, str) or not address):
            raise refuse(
                self, "ray_address", f" must be `auto`, ray://host:port or None, got {address!r}"
            )
        check_choice(self, "executor", EXECUTORS)
        if self.ray_address and self.executor in ("local", "inline"):
            raise refuse(
                self,
                "executor",
                f" {self.executor} does not use Ray, and ray_address (--ray-address) names "
                "a Ray cluster; use executor ray (or auto), or leave ray_address out",
            )
        if self.workers is not None:
            check_int_at_least(self, "workers", 1)
        for name in ("overwrite", "progress", "confine_to_input"):
            check_flag(self, name)

    def input_columns(self) -> InputColumns:
        """What the input list's columns hold (`--label`, `--fields`), checked.

        Raises:
            ValueError: a malformed `--fields` entry or an unknown `--label`.
        """
        return InputColumns.parse(self.label, tuple(self.fields))

    def output_shaping(self) -> dict[str, Any]:
        """The options that determine the output bytes (compared on resume)."""
        # Field by field: `storage_options` may hold what `asdict` cannot copy (a session).
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in RUNTIME_ONLY}
        data["image"] = asdict(self.image)
        # The layout shapes the output too, but the build record keeps it apart
        # (`preprocess.output.build_record`): records of builds made before it existed
        # still match, and a rerun without --layout keeps the layout it started with.
        data.pop("layout")
        # One of the two sizes shapes the output; without a byte target the record is the
        # one builds made before `shard_bytes` existed, so they still resume.
        data.pop("shard_size" if self.shard_bytes is not None else "shard_bytes")
        # Confinement decides which inputs are read, so it shapes the output; left out
        # when off, so records of builds made before the option existed still resume.
        if not self.confine_to_input:
            data.pop("confine_to_input")
        # The same for the column options: left out at their defaults.
        if self.label == "single":
            data.pop("label")
        if self.description is None:
            data.pop("description")
        if self.fields:
            data["fields"] = list(self.fields)
        else:
            data.pop("fields")
        data["formats"] = list(self.formats)
        data["image"] = {
            k: list(v) if isinstance(v, tuple) else v for k, v in data["image"].items()
        }
        data["image"].pop("jpeg_restarts")
        data["image"].update(restart_record(self.image))
        return data


# How the build record and the manifest spell `ImageConfig.jpeg_restarts`: the switches of
# the versions before it took a layout, each recorded only when on, so the records (and
# the marker digests) of builds started by those versions still match. `none` records
# nothing, and neither do PNG and WebP builds, which no layout touches.
RESTART_RECORD = {
    "columns": ("jpeg_restarts", "jpeg_restart_columns", "jpeg_restart_narrow_rows"),
    "columns-all": ("jpeg_restarts", "jpeg_restart_columns"),
    "rows": ("jpeg_restarts",),
    "none": (),
}
RESTART_KEYS = RESTART_RECORD["columns"]


def restart_record(image: ImageConfig) -> dict[str, bool]:
    """The image record's entries for the restart layout (`RESTART_RECORD`), in order."""
    layout = image.jpeg_restarts if image.encode == "jpeg" else "none"
    return dict.fromkeys(RESTART_RECORD[layout], True)


def recorded_restarts(image: Mapping[str, Any]) -> str:
    """The restart layout an image record names (`RESTART_RECORD`, read back).

    Each switch counts only under the one before it, as the versions that wrote them
    read them: no `jpeg_restarts` is `none` whatever else is there.
    """
    on = [image.get(key) is True for key in RESTART_KEYS]
    if not on[0]:
        return "none"
    if not on[1]:
        return "rows"
    return "columns" if on[2] else "columns-all"


def comparable_record(config: Mapping[str, Any]) -> dict[str, Any]:
    """An output-shaping record with its restart switches read as one `jpeg_restarts` layout."""
    image = config.get("image")
    if not isinstance(image, Mapping):
        return dict(config)
    folded = {key: value for key, value in image.items() if key not in RESTART_KEYS}
    folded["jpeg_restarts"] = recorded_restarts(image)
    return {**config, "image": folded}


def diff_configs(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Human-readable differences between two output-shaping records, one line each.

    A build started with another restart layout gets the flag that resumes it; that
    line is left out when the encoding differs too (no layout touches PNG or WebP).
    """
    old, new = comparable_record(old), comparable_record(new)
    changes = dict(_diff(old, new, ""))
    if "image.encode" in changes:
        changes.pop("image.jpeg_restarts", None)
    elif "image.jpeg_restarts" in changes:
        flag = f"--jpeg-restarts {old['image']['jpeg_restarts']}"
        changes["image.jpeg_restarts"] += (
            f" (the build was started with {flag}; rerun with {flag} to resume it)"
        )
    return list(changes.values())


def _diff(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str) -> list[tuple[str, str]]:
    """`(path, line)` of every difference, nested records walked."""
    changes = []
    for name in sorted(set(old) | set(new)):
        path = f"{prefix}{name}"
        before, after = old.get(name), new.get(name)
        if isinstance(before, Mapping) and isinstance(after, Mapping):
            changes.extend(_diff(before, after, f"{path}."))
        elif before != after:
            changes.append((path, f"{path}: {before!r} -> {after!r}"))
    return changes
