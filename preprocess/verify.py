"""`preprocess verify` and `preprocess info`: check a shard directory against its manifest.

Verify recomputes every file's size and sha256, reads every sample of every
shard, opens each image's header, and checks that the formats hold the same
keys and labels. It reports the first bad shard by name.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from shards.io import file_sha256
from shards.manifest import Manifest, ShardInfo, read_manifest
from shards.parquet import iter_parquet_samples
from shards.sample import SampleError
from shards.tar import iter_tar_samples


class VerifyError(Exception):
    """A shard does not match the manifest; the message names it."""


@dataclass(frozen=True)
class VerifyReport:
    shards: int
    files: int
    samples: int


def verify_directory(directory: str | Path, check_images: bool = True) -> VerifyReport:
    """Check every shard listed in the manifest; raise `VerifyError` at the first bad one."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    shards = files = samples = 0
    for split in manifest.splits.values():
        for shard in split.shards:
            samples += verify_shard(directory, manifest, shard, check_images)
            shards += 1
            files += len(shard.files)
    return VerifyReport(shards, files, samples)


def verify_shard(directory: Path, manifest: Manifest, shard: ShardInfo, check_images: bool) -> int:
    contents = {}
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
        contents[fmt] = read_shard_index(path, fmt, manifest.image_field, check_images)
        if len(contents[fmt]) != shard.samples:
            raise VerifyError(
                f"{file.name}: {len(contents[fmt])} samples, manifest says {shard.samples}"
            )
    first, *others = contents.values()
    for fmt_contents in others:
        if fmt_contents != first:
            raise VerifyError(f"shard {shard.index}: formats disagree on keys or labels")
    return shard.samples


def read_shard_index(
    path: Path, fmt: str, image_field: str, check_images: bool
) -> list[tuple[str, bytes]]:
    """(key, label) of every sample, opening each image's header when asked."""
    entries = []
    try:
        with open(path, "rb") as stream:
            reader = iter_tar_samples if fmt == "tar" else iter_parquet_samples
            for sample in reader(stream, str(path)):
                if image_field not in sample or "cls" not in sample or "__error__" in sample:
                    raise VerifyError(f"{path.name}: sample {sample['__key__']} is incomplete")
                if check_images:
                    with Image.open(io.BytesIO(sample[image_field])) as image:
                        image.size  # noqa: B018 - header parse only
                entries.append((sample["__key__"], sample["cls"]))
    except VerifyError:
        raise
    except (OSError, ValueError, SampleError, EOFError, tarfile.TarError) as error:
        raise VerifyError(f"{path.name}: unreadable ({error})") from error
    return entries


def describe(manifest: Manifest) -> str:
    """The manifest summary printed by `preprocess info`."""
    lines = [
        f"classes: {len(manifest.classes)} ({', '.join(manifest.classes[:8])}{', ...' if len(manifest.classes) > 8 else ''})",
        f"image field: {manifest.image_field}    formats: {', '.join(manifest.formats)}",
        f"inputs: {manifest.inputs}    written: {manifest.written}    skipped: {sum(manifest.skipped.values())}",
    ]
    for reason, count in sorted(manifest.skipped.items()):
        lines.append(f"  skipped {reason}: {count}")
    for name, split in manifest.splits.items():
        sizes = {fmt: sum(s.files[fmt].bytes for s in split.shards) for fmt in manifest.formats}
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
