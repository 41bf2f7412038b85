"""`preprocess verify` and `preprocess info`: check a shard directory against its manifest.

Verify recomputes every file's size and sha256, reads every sample of every shard
through the same readers the loader uses, and judges each sample as the loader
would (`shards.imagedata.check_image`: the format allowlist, the pixel cap, a full
decode), so a dataset it passes is read without a skip, and one it fails lists
exactly what the loader will skip. It also checks that the formats hold the same
keys and labels. Shard-level problems name the first bad shard.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shards.errors import DataError, ShardError
from shards.formats import get_format
from shards.imagedata import check_image
from shards.io import file_sha256
from shards.manifest import LAYOUT_FLAT, Manifest, ShardInfo, format_dir, read_manifest
from shards.sample import (
    DEFAULT_FIELDS,
    Field,
    SampleError,
    check_class_range,
    class_ranged_fields,
    field_value,
    read_fields,
)

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

    def record_skip(self, file_name: str, key: str, error: SampleError) -> None:
        self.skipped[error.reason] += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{file_name} sample {key}: {error}")


def verify_directory(directory: str | Path, check_images: bool = True) -> VerifyReport:
    """Check every shard listed in the manifest.

    Raises:
        VerifyError: at the first shard that does not match the manifest, or, after
            reading everything, when some samples would be skipped by the loader
            (the message counts them by reason and names the first few).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    report = VerifyReport()
    for split in manifest.splits.values():
        for shard in split.shards:
            report.samples += verify_shard(directory, manifest, shard, check_images, report)
            report.shards += 1
            report.files += len(shard.files)
    if report.skipped:
        total = sum(report.skipped.values())
        reasons = ", ".join(f"{r}: {n}" for r, n in sorted(report.skipped.items()))
        raise VerifyError(
            f"{total} of {report.samples} samples would be skipped by the loader ({reasons}); "
            f"e.g. {'; '.join(report.examples)}. Rebuild those shards from good inputs"
        )
    return report


def verify_shard(
    directory: Path,
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
        path = directory / file.name
        if not path.exists():
            raise VerifyError(f"{file.name}: missing")
        size = path.stat().st_size
        if size != file.bytes:
            raise VerifyError(
                f"{file.name}: {size} bytes, manifest says {file.bytes} (truncated or replaced)"
            )
        if file_sha256(path) != file.sha256:
            raise VerifyError(f"{file.name}: checksum mismatch")
        contents[fmt] = read_shard_index(
            path, fmt, shard.samples, check_images, report, fields, len(manifest.classes) or None
        )
    first, *others = contents.values()
    for fmt_contents in others:
        if fmt_contents != first:
            raise VerifyError(f"shard {shard.index}: formats disagree on keys or labels")
    return shard.samples


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


def describe(manifest: Manifest) -> str:
    """The manifest summary printed by `preprocess info`."""
    lines = [
        f"classes: {len(manifest.classes)} ({', '.join(manifest.classes[:8])}{', ...' if len(manifest.classes) > 8 else ''})",
        f"image field: {manifest.image_field}    formats: {', '.join(manifest.formats)}",
        f"inputs: {manifest.inputs}    written: {manifest.written}    skipped: {sum(manifest.skipped.values())}",
    ]
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
    return "\n".join(lines)


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"
