"""`preprocess verify` and `preprocess info`: check shards against their manifest, or as found.

Verify recomputes every file's size and sha256, reads every sample of every shard
through the same readers the loader uses, and judges each sample as the loader
would (`shards.image.policy.check_image`: the format allowlist, the pixel cap, a full
decode), so a dataset it passes is read without a skip, and one it fails lists
exactly what the loader will skip. It also checks that the formats hold the same
keys and labels. Shard-level problems name the first bad shard. Shards we did not
build (no manifest.json: img2dataset, webdataset's `ShardWriter`) are read the same way
and reported as found: shards, samples, the members each holds, decode failures.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shlex
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from preprocess.worker_shards import few_shards_line
from shards.errors import DataError, ShardError, UsageError
from shards.formats import get_format, is_format
from shards.image.policy import check_image
from shards.manifest import (
    LAYOUT_FLAT,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    format_dir,
    read_manifest,
)
from shards.manifest.files import manifest_base, manifest_url
from shards.manifest.foreign import (
    MEMBER_KINDS,
    find_shards,
    is_indexed,
    list_shards,
    members_line,
    shard_format_of,
    survey_fields,
    survey_shard,
)
from shards.redact import redact_url
from shards.sample import (
    DEFAULT_FIELDS,
    IMAGE_FIELDS,
    Field,
    SampleError,
    check_class_range,
    class_ranged_fields,
    field_value,
    read_fields,
)
from shards.storage import (
    DEFAULT_RETRY,
    READ_SCHEMES,
    ObjectNotFoundError,
    exists,
    is_remote,
    transport_of,
    url_scheme,
)
from shards.storage.ranged import local_copy
from shards.storage.write import file_sha256

# The skip reason of a row whose cell the writer left null: img2dataset keeps each failed
# download as a row with a null `jpg`.
FAILED_ROW_REASON = "null_cell"
MAX_EXAMPLES = 5


class VerifyError(DataError):
    """A shard does not match the manifest, or holds samples the loader would skip."""


@dataclass
class VerifyReport:
    shards: int = 0
    files: int = 0
    samples: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> samples the loader skips
    examples: list[str] = field(default_factory=list)
    # Shards without our manifest only: their format, folder and the members seen.
    foreign: str | None = None
    folder: str = ""
    members: Counter = field(default_factory=Counter)
    # Parquet rows read under a made key (`{key}-{row:09d}`): file name -> rows.
    repeated_keys: Counter = field(default_factory=Counter)
    accepted: int = 0  # null-cell rows accepted by `--accept-failed-rows`

    def summary(self) -> str:
        """The one line `preprocess verify` prints when nothing would be skipped."""
        repeats = repeated_keys_note(self.repeated_keys) + self.accepted_note()
        if self.foreign is None:
            return f"{self.shards} shards, {self.files} files, {self.samples} samples{repeats}"
        return (
            f"{self.shards} {self.foreign} shards without a manifest, {self.samples} samples; "
            f"members: {members_line(self.members, self.samples)}; decode failures: "
            f"{sum(self.skipped.values()) or 'none'}{repeats}; run "
            f"`{index_command(self.folder, self.foreign)}` to save the counts"
        )

    def accept_failed_rows(self, accept: bool) -> None:
        """With `accept` (`verify --accept-failed-rows`), rows with a null cell leave the
        skips for `accepted`: a writer's failed rows (img2dataset's failed downloads)."""
        if accept:
            self.accepted = self.skipped.pop(FAILED_ROW_REASON, 0)

    def failed_rows_hint(self) -> str:
        """How to accept the null-cell rows among the skips, or "" when there are none."""
        if not self.skipped.get(FAILED_ROW_REASON):
            return ""
        return (
            f"; rows with a null cell are how img2dataset keeps its failed downloads (a "
            f"null jpg): if that is what these are, rerun with --accept-failed-rows (the "
            f"loader skips them, counted as {FAILED_ROW_REASON})"
        )

    def accepted_note(self) -> str:
        if not self.accepted:
            return ""
        return (
            f"; accepted {self.accepted} rows with a null cell (--accept-failed-rows: the "
            f"writer's failed rows, which the loader skips as {FAILED_ROW_REASON})"
        )

    def record_skip(self, file_name: str, key: str, error: SampleError) -> None:
        self.skipped[error.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{file_name} sample {key}: {error}")


def repeated_keys_note(repeated: Counter) -> str:
    """`; 3 rows repeat the key of an earlier row (a.parquet 3): ...`, or "" when none do.

    `repeated`: file name -> its Parquet rows read under a made key.
    """
    total = sum(repeated.values())
    if not total:
        return ""
    files = ", ".join(f"{name} {n}" for name, n in repeated.most_common(MAX_EXAMPLES) if n)
    return (
        f"; {total} rows repeat the key of an earlier row ({files}): each is read as its own "
        "sample under the key KEY-ROW (its row index, 9 digits)"
    )


def manifest_directory(source: str) -> str | Path | None:
    """The directory of the manifest `source` names or holds (a `by_format` output's
    format folder names the output's), None when there is none (shards we did not build).
    A remote source's is its URL's folder, asked of its store (`shards.storage.exists`)."""
    if is_remote(source):
        path = urlsplit(source).path
        if "{" in path or shard_format_of(path) is not None:
            return None  # shard files: one, a glob or a brace pattern
        url = manifest_url(source)
        return manifest_base(url) if exists(url, schemes=READ_SCHEMES) else None
    path = Path(source)
    if path.suffix == ".json" and path.is_file():
        return path.parent
    if not path.is_dir():
        return None
    if (path / MANIFEST_NAME).exists():
        return path
    if is_format(path.resolve().name) and (path.resolve().parent / MANIFEST_NAME).exists():
        return path.resolve().parent
    return None


def verify_source(
    source: str, check_images: bool = True, fmt: str | None = None, accept_failed: bool = False
) -> VerifyReport:
    """`verify_directory` for a dataset with a manifest, else `verify_foreign` of its shards.

    `accept_failed`: rows with a null cell (img2dataset keeps each failed download as a
    row with a null `jpg`) are counted as accepted, not as samples that fail.

    Raises:
        VerifyError: as `verify_directory` (for shards without a manifest: a malformed
            shard, or samples the loader would skip).
        UsageError, FileNotFoundError: `source` names no shards (`find_shards`).
    """
    directory = manifest_directory(source)
    if directory is not None:
        return verify_directory(directory, check_images, accept_failed)
    found, paths = find_shards(source, fmt)
    return verify_foreign(paths, found, check_images, accept_failed)


def verify_foreign(
    paths: list[str], fmt: str, check_images: bool = True, accept_failed: bool = False
) -> VerifyReport:
    """Read every sample of shards we did not build and judge each member it holds as the
    loader reads it (images decoded, text, JSON, class ids); a skip is a decode failure.

    Raises:
        VerifyError: a shard is malformed (named), or some samples would be skipped (the
            message counts them by reason, names the first few and the members seen).
    """
    report = VerifyReport(foreign=fmt, folder=common_folder(paths))
    for path in paths:
        report.samples += verify_foreign_shard(path, fmt, check_images, report)
        report.shards += 1
        report.files += 1
    report.accept_failed_rows(accept_failed)
    if report.skipped:
        total = sum(report.skipped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.skipped.items()))
        raise VerifyError(
            f"{total} of {report.samples} samples in {report.shards} {fmt} shards would be "
            f"skipped by the loader ({reasons}); e.g. {'; '.join(report.examples)}. Members: "
            f"{members_line(report.members, report.samples)}{report.failed_rows_hint()}"
        )
    return report


def verify_foreign_shard(path: str, fmt: str, check_images: bool, report: VerifyReport) -> int:
    """One shard without a manifest, judged sample by sample; returns its sample count."""
    name, samples, fields = os.path.basename(path), 0, {}
    try:
        with local_copy(path, DEFAULT_RETRY) as local, open(local, "rb") as stream:
            shard_format = get_format(fmt)
            wanted = survey_fields(shard_format, stream, path)
            for sample in shard_format.iter_samples(stream, path, fields=wanted):
                samples += 1
                report.repeated_keys[name] += "__repeated_key__" in sample
                held = frozenset(key for key in sample if not key.startswith("__"))
                report.members.update(held)
                if held not in fields:
                    fields[held] = member_fields(held)
                judged = judge_sample(sample, check_images, fields[held])
                if isinstance(judged, SampleError):
                    report.record_skip(name, sample["__key__"], judged)
    except ShardError as error:
        raise VerifyError(f"{name}: {error.reason}: {error.detail}") from error
    return samples


def member_fields(members: frozenset[str]) -> tuple[Field, ...]:
    """The fields that read each member a sample holds, as the kind the loader reads it."""
    fields = []
    image = next((name for name in IMAGE_FIELDS if name in members), None)
    if image is not None:
        fields.append(Field("image", "image", image))
    for member in sorted(members):
        kind = MEMBER_KINDS.get(member)
        if kind is not None and kind != "image":
            fields.append(Field(member, kind, member))
    return tuple(fields)


def common_folder(paths: list[str]) -> str:
    """The folder holding every path (what `preprocess index` takes); URLs' own folder
    when they share one (a store's paths are not this machine's)."""
    if paths and is_remote(paths[0]):
        folders = {manifest_base(path) for path in paths}
        if len(folders) != 1:
            return redact_url(paths[0])
        folder = folders.pop()
        if transport_of(url_scheme(folder)).listable:
            return folder
        # A web server cannot be listed: what `index` takes is the files, as a pattern.
        names = ",".join(posixpath.basename(urlsplit(path).path) for path in paths)
        return f"{folder}/{{{names}}}" if len(paths) > 1 else paths[0]
    return os.path.commonpath([os.path.dirname(path) for path in paths]) if paths else ""


def verify_directory(
    directory: str | Path, check_images: bool = True, accept_failed: bool = False
) -> VerifyReport:
    """Check every shard listed in the manifest.

    Raises:
        VerifyError: at the first shard that does not match the manifest, or, after
            reading everything, when some samples would be skipped by the loader
            (the message counts them by reason and names the first few).
    """
    directory = directory if is_remote(str(directory)) else Path(directory)
    manifest = read_manifest(directory)
    report = VerifyReport()
    for split in manifest.splits.values():
        for shard in split.shards:
            report.samples += verify_shard(directory, manifest, shard, check_images, report)
            report.shards += 1
            report.files += len(shard.files)
    report.accept_failed_rows(accept_failed)
    if report.skipped:
        total = sum(report.skipped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.skipped.items()))
        raise VerifyError(
            f"{total} of {report.samples} samples would be skipped by the loader ({reasons}); "
            f"e.g. {'; '.join(report.examples)}. Rebuild those shards from good inputs"
            f"{report.failed_rows_hint()}"
        )
    return report


def verify_shard(
    directory: str | Path,
    manifest: Manifest,
    shard: ShardInfo,
    check_images: bool,
    report: VerifyReport | None = None,
) -> int:
    """Check one shard's files; returns its sample count. Skips go into `report`."""
    report = report if report is not None else VerifyReport()
    contents = {}
    fields = verify_fields(manifest)
    for fmt, file in shard.files.items():
        with shard_copy(directory, file.name) as path:
            size = path.stat().st_size
            if size != file.bytes:
                raise VerifyError(
                    f"{file.name}: {size} bytes, manifest says {file.bytes} (truncated or replaced)"
                )
            if file_sha256(path) != file.sha256:
                raise VerifyError(f"{file.name}: checksum mismatch")
            classes = len(manifest.classes) or None
            contents[fmt] = read_shard_index(
                path, fmt, shard.samples, check_images, report, fields, classes
            )
    first, *others = contents.values()
    for fmt_contents in others:
        if fmt_contents != first:
            raise VerifyError(f"shard {shard.index}: formats disagree on keys or labels")
    return shard.samples


@contextlib.contextmanager
def shard_copy(directory: str | Path, name: str) -> Iterator[Path]:
    """The local path of the shard `name` in `directory`: itself when local, a copy fetched
    through the storage layer when remote (`local_copy`).

    Raises:
        VerifyError: the shard is missing.
    """
    try:
        with local_copy(f"{directory}/{name}", DEFAULT_RETRY) as local:
            if not os.path.exists(local):
                raise VerifyError(f"{name}: missing")
            yield Path(local)
    except ObjectNotFoundError:
        raise VerifyError(f"{name}: missing") from None


def verify_fields(manifest: Manifest) -> tuple[Field, ...]:
    """What verify decodes of each sample: the fields the manifest says the build wrote.

    A plain build: image and class, the loader's default. A build with a `fields`
    entry: its image, its label (none, one class id, or a list of them) and every
    extra member (text, JSON, weight), each checked as the loader checks it.
    """
    members = (manifest.fields or {}).get("members")
    if members is None:
        return DEFAULT_FIELDS
    fields = []
    for member, kind in sorted(members.items()):
        if kind == "image":
            fields.append(Field("image", "image"))
        elif kind == "multi_label":
            fields.append(Field(member, kind, member, num_classes=len(manifest.classes)))
        else:
            fields.append(Field(member, kind, member))
    return tuple(fields)


def read_shard_index(
    path: Path,
    fmt: str,
    declared: int,
    check_images: bool,
    report: VerifyReport,
    fields: tuple[Field, ...] = DEFAULT_FIELDS,
    num_classes: int | None = None,
) -> list[tuple[str, tuple | None]]:
    """(key, decoded non-image values) of every sample, judging each as the loader would,
    labels against the manifest's `num_classes` included.

    Raises:
        VerifyError: the shard is malformed, or holds another number of samples
            than the manifest says (the loader reports those as `shard_short`/`shard_long`).
    """
    entries = []
    try:
        with open(path, "rb") as stream:
            reader = get_format(fmt).iter_samples
            members = read_fields(fields)
            ranged = class_ranged_fields(fields, num_classes)
            for sample in reader(stream, str(path), fields=members, declared=declared):
                report.repeated_keys[path.name] += "__repeated_key__" in sample
                judged = judge_sample(sample, check_images, fields, ranged, num_classes)
                entries.append((sample["__key__"], judged))
    except ShardError as error:
        raise VerifyError(f"{path.name}: {error.reason}: {error.detail}") from error
    for key, label in entries:
        if isinstance(label, SampleError):
            report.record_skip(path.name, key, label)
    return [(key, None if isinstance(label, SampleError) else label) for key, label in entries]


def judge_sample(
    sample: dict,
    check_images: bool,
    fields: tuple[Field, ...] = DEFAULT_FIELDS,
    ranged: frozenset[int] = frozenset(),
    num_classes: int | None = None,
) -> tuple | SampleError:
    """The sample's decoded values (label, text, ...), or the `SampleError` the loader would
    skip it for (`ranged`: indices of the fields checked against `num_classes`, as the
    loader's `class_ranged_fields`)."""
    try:
        if "__error__" in sample:
            raise sample["__error__"]
        values, parsed = [], {}
        for index, spec in enumerate(fields):
            value = field_value(sample, spec, parsed)
            if index in ranged:
                check_class_range(spec, value, num_classes, sample["__key__"])
            if spec.kind != "image":
                values.append(value)
            elif check_images:
                check_image(value)
    except SampleError as error:
        return error
    return tuple(values)


def describe_foreign(paths: list[str], fmt: str) -> str:
    """Shards we did not build, as one reading pass finds them (no decode, no checksum)."""
    surveys = [survey_shard(path, fmt, checksum=False) for path in paths]
    members = sum((survey.members for survey in surveys), Counter())
    samples = [survey.samples for survey in surveys]
    total = sum(samples)
    folder = common_folder(paths)
    lines = [
        f"shards without a manifest: {len(paths)} {fmt} shards in {folder} (not built by "
        "preprocess build-shards; counted by reading them)",
        f"samples: {total} ({min(samples)} to {max(samples)} a shard)",
        f"members: {members_line(members, total)}",
        class_line([], "single" if any(members[n] == total for n in ("cls", "label")) else "none"),
        f"bytes: {fmt} {human_bytes(sum(survey.bytes for survey in surveys))}",
        f"run `{index_command(folder, fmt)}` to save the counts as a manifest (exact epochs, "
        "equal batches, resume)",
    ]
    return "\n".join(lines)


def class_line(classes: list[str], label: str) -> str:
    """`classes: 4 (cat, dog, ...)`, or `no classes (label-free)`."""
    if not classes:
        return "no classes (label-free)" if label == "none" else "classes: unnamed (class ids)"
    more = ", ..." if len(classes) > 8 else ""
    return f"classes: {len(classes)} ({', '.join(classes[:8])}{more})"


def describe(manifest: Manifest) -> str:
    """The manifest summary printed by `preprocess info`."""
    label = (manifest.fields or {}).get("label", "single")
    lines = [
        class_line(manifest.classes, label),
        f"image field: {manifest.image_field}    formats: {', '.join(manifest.formats)}",
    ]
    if is_indexed(manifest):
        members = Counter(manifest.config["indexed"].get("members", {}))
        lines.append(
            "indexed by `preprocess index` (shards not built here): members: "
            f"{members_line(members, manifest.written)}"
        )
    else:
        lines.append(
            f"inputs: {manifest.inputs}    written: {manifest.written}    "
            f"skipped: {sum(manifest.skipped.values())}"
        )
    for reason, count in sorted(manifest.skipped.items()):
        lines.append(f"  skipped {reason}: {count}")
    suffixes = manifest.left_out_suffixes
    if suffixes:
        counts = ", ".join(f"{suffix}: {n}" for suffix, n in suffixes.items())
        lines.append(f"files left out by extension at listing: {counts}")
    if manifest.layout != LAYOUT_FLAT:
        folders = ", ".join(format_dir(fmt, manifest.layout) for fmt in manifest.formats)
        lines.append(f"layout: {manifest.layout} ({folders}: one directory per format)")
    for name, split in manifest.splits.items():
        sizes = {fmt: split.shards.total_bytes(fmt) for fmt in manifest.formats}
        size_text = ", ".join(f"{fmt} {human_bytes(b)}" for fmt, b in sizes.items())
        lines.append(
            f"split {name}: {split.samples} samples in {len(split.shards)} shards ({size_text})"
        )
        for fmt, pattern in split.patterns().items():
            lines.append(f"  {fmt}: {pattern}")
    few = few_shards_line({name: (s.samples, len(s.shards)) for name, s in manifest.splits.items()})
    return "\n".join([*lines, few] if few else lines)


def index_command(folder: str, fmt: str) -> str:
    """The `preprocess index` command that indexes `folder`'s `fmt` shards as pasted:
    with `--format` when the folder holds shards of another format too."""
    shown = shlex.quote(folder)  # a brace pattern must reach `index` as one argument
    transport = transport_of(url_scheme(folder))
    if transport is not None and not transport.writable:  # a web server: write it here
        name = posixpath.basename(manifest_base(folder)) or "shards"
        shown += f" --output ./{name}-index"
    try:
        list_shards(folder)
    except UsageError:  # both formats (or none to pick from): name the one read here
        return f"preprocess index {shown} --format {fmt}"
    return f"preprocess index {shown}"


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"
