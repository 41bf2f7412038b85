"""`BuildConfig`: every option of `preprocess build-shards`, and which of them shape the output.

The output-shaping part is stored in `_build/config.json` at the start of a
build and in the manifest; a rerun against the same output must match it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from preprocess.images import BACKENDS, EXTENSIONS, RESAMPLING, RESIZE_POLICIES, ImageConfig
from preprocess.sizing import parse_bytes
from preprocess.sources import LABEL_MODES, InputColumns
from shards.flags import about, option
from shards.manifest import LAYOUTS, SHARD_FORMATS
from shards.redact import url_credentials_problem

# Where shard tasks run (see `preprocess.pool.resolve_executor`); all write the same bytes.
EXECUTORS = ("auto", "ray", "local", "inline")
# Options that change how a build runs but not a byte of what it writes.
# `input` and `output` are left out too: moving a dataset must not invalidate a
# build; the plan digest (every path and label) guards the inputs instead.
RUNTIME_ONLY = (
    "input",
    "output",
    "ray_address",
    "workers",
    "overwrite",
    "max_skip_fraction",
    "executor",
    "progress",
)


@dataclass(frozen=True)
class BuildConfig:
    """Options of one `build-shards` run.

    Attributes:
        input: ImageFolder root, or a CSV/JSONL/Parquet manifest of `path,label[,split]`.
        output: directory that receives shards, `manifest.json` and `errors.jsonl`.
        image: per-image decode/resize/encode options.
        shard_size: samples per shard (fewer when inputs are skipped).
        shard_bytes: instead of `shard_size`, aim for tar shards of about this many
            bytes; the count is measured on a fixed probe of the inputs
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
        ray_address: None for a local Ray sized to this machine, `auto` or
            `ray://host:port` for a cluster.
        executor: `auto` (default: Ray when a cluster is named by `ray_address` or
            `RAY_ADDRESS`, else `local`), `ray`, `local` (a process pool on this
            machine, no start-up of seconds) or `inline` (this process; for
            debugging). Every executor writes the same bytes.
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
            "resample": about("resampling filter of the resize", tuple(RESAMPLING)),
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
                "JPEG output gets a restart marker at every MCU row, so the loader can decode "
                "only the rows a crop needs (about 4 bytes a row); "
                "--no-jpeg-restarts writes files without them, as builds made before the "
                "option did, and is how such a build resumes"
            ),
            "jpeg_restart_columns": about(
                "with --jpeg-restarts, a restart interval is about 64 px of a row (a divisor "
                "of its MCUs; the whole row when none fits), so the loader can decode only "
                "the columns a crop needs too (files ~1.5-3% larger); "
                "--no-jpeg-restart-columns writes one interval per MCU row, as builds made "
                "before the option did, and is how such a build resumes"
            ),
            "jpeg_restart_narrow_rows": about(
                "with column intervals, rows under 384 px (24 MCUs) keep one interval per row, "
                "which the loader decodes faster there; --no-jpeg-restart-narrow-rows cuts "
                "them into columns too, as builds made before the option did, and is how "
                "such a build resumes"
            ),
        },
    )
    shard_size: int = option(
        1000, "samples per shard (fewer when inputs are skipped)", "shard", exclusive="size"
    )
    shard_bytes: int | None = option(
        None,
        "aim for tar shards of about this size instead of --shard-size, e.g. 512MB or 1GiB "
        "(default: none)",
        "shard",
        parse=parse_bytes,
        metavar="SIZE",
        exclusive="size",
    )
    formats: tuple[str, ...] = option(
        SHARD_FORMATS, "comma-separated shard formats to write", "shard", metavar="LIST"
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
    ray_address: str | None = option(
        None, "`auto` or ray://host:port for a Ray cluster (default: a local Ray)", "run"
    )
    executor: str = option(
        "auto",
        "where shard tasks run: auto is Ray when --ray-address (or RAY_ADDRESS) names a "
        "cluster, else local, a process pool on this machine that needs no Ray start-up; "
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
        "`outside_input` (by default symlinks are followed, as torchvision's ImageFolder does)",
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

    def __post_init__(self) -> None:
        self.input_columns()  # a bad --label or --fields is one error before any work
        for flag, location in (("--input", self.input), ("--output", self.output)):
            credentials = url_credentials_problem(str(location))
            if credentials is not None:
                raise ValueError(f"{flag} {credentials}")
        if self.shard_size < 1:
            raise ValueError("--shard-size must be at least 1")
        if self.shard_bytes is not None and self.shard_bytes < 1:
            raise ValueError("--shard-bytes must be at least 1")
        if not self.formats or any(f not in SHARD_FORMATS for f in self.formats):
            raise ValueError(
                f"--formats takes a comma-separated subset of {','.join(SHARD_FORMATS)}"
            )
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"--layout must be one of {', '.join(LAYOUTS)}, or left out")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError("--val-fraction must be in [0, 1)")
        if not 0.0 <= self.max_skip_fraction <= 1.0:
            raise ValueError("--max-skip-fraction must be in [0, 1]")
        if self.executor not in EXECUTORS:
            raise ValueError(f"--executor must be one of {', '.join(EXECUTORS)}")
        if self.ray_address and self.executor in ("local", "inline"):
            raise ValueError(
                f"--ray-address names a Ray cluster, and --executor {self.executor} does not "
                "use Ray; pass --executor ray (or auto), or leave --ray-address out"
            )
        if self.workers is not None and self.workers < 1:
            raise ValueError("--workers must be at least 1")
        if self.row_group_size < 1:
            raise ValueError("--row-group-size must be at least 1")

    def input_columns(self) -> InputColumns:
        """What the input list's columns hold (`--label`, `--fields`), checked.

        Raises:
            ValueError: a malformed `--fields` entry or an unknown `--label`.
        """
        return InputColumns.parse(self.label, tuple(self.fields))

    def output_shaping(self) -> dict[str, Any]:
        """The options that determine the output bytes (compared on resume)."""
        data = asdict(self)
        for name in RUNTIME_ONLY:
            data.pop(name)
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
        # Restart markers: recorded only when they are written, so the records of builds
        # made before the option (no markers) match --no-jpeg-restarts, and PNG or WebP
        # builds, which they do not touch, still resume.
        markers = self.image.jpeg_restarts and self.image.encode == "jpeg"
        if not markers:
            data["image"].pop("jpeg_restarts")
        # Column intervals: the same, and only where there are markers, so the records of
        # builds made before them (row intervals) match --no-jpeg-restart-columns, and the
        # record of a --no-jpeg-restarts build is what it was.
        columns = markers and self.image.jpeg_restart_columns
        if not columns:
            data["image"].pop("jpeg_restart_columns")
        # Narrow rows kept whole: the same again, only with column intervals.
        if not (columns and self.image.jpeg_restart_narrow_rows):
            data["image"].pop("jpeg_restart_narrow_rows")
        return data


# Output-shaping switches that `output_shaping` records only when on, so the records of
# builds made before them (off) still match: for each, the hint for a rerun that meets a
# build started with it off, and one started with it on.
RECORDED_WHEN_ON = {
    "image.jpeg_restarts": (
        "the build was started without JPEG restart markers; rerun with --no-jpeg-restarts "
        "to resume it",
        "the build was started with JPEG restart markers; rerun without --no-jpeg-restarts "
        "to resume it",
    ),
    "image.jpeg_restart_columns": (
        "the build was started without restart intervals shorter than an MCU row; rerun "
        "with --no-jpeg-restart-columns to resume it",
        "the build was started with restart intervals shorter than an MCU row; rerun "
        "without --no-jpeg-restart-columns to resume it",
    ),
    "image.jpeg_restart_narrow_rows": (
        "the build was started with column intervals in rows under 384 px too; rerun with "
        "--no-jpeg-restart-narrow-rows to resume it",
        "the build was started with one interval per row under 384 px; rerun without "
        "--no-jpeg-restart-narrow-rows to resume it",
    ),
}


# Switches recorded only while another one is on: when that one differs too, its line alone
# says what to rerun with (`--no-jpeg-restarts` already writes no restart intervals at all,
# `--no-jpeg-restart-columns` no column intervals).
RECORDED_UNDER = {
    "image.jpeg_restart_columns": "image.jpeg_restarts",
    "image.jpeg_restart_narrow_rows": "image.jpeg_restart_columns",
}


def diff_configs(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two output-shaping configs, one line each."""
    changes = {}
    for name in sorted(set(old) | set(new)):
        path = f"{prefix}{name}"
        before, after = old.get(name), new.get(name)
        if isinstance(before, dict) and isinstance(after, dict):
            changes.update((line, line) for line in diff_configs(before, after, f"{path}."))
        elif before != after:
            changes[path] = _change_line(path, name in old, before, name in new, after)
    return [line for path, line in changes.items() if RECORDED_UNDER.get(path) not in changes]


def _change_line(path: str, had: bool, before: Any, has: bool, after: Any) -> str:
    """`path: before -> after`; a switch recorded only when on shows its absence as False."""
    if path not in RECORDED_WHEN_ON:
        return f"{path}: {before!r} -> {after!r}"
    was_off, was_on = RECORDED_WHEN_ON[path]
    before, after = (before if had else False), (after if has else False)
    return f"{path}: {before!r} -> {after!r} ({was_on if had else was_off})"
