"""Write one shard: read, process and encode its planned inputs into tar and Parquet files.

This is the body of one Ray task. It holds at most one Parquet row group of
encoded images in memory, writes each format under a temporary name, renames
both when complete, then writes the shard's marker in `_build/`: the commit
point that lets a rerun skip this shard after checking its checksums.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from preprocess.images import EXTENSIONS, ImageConfig, process_image, read_source
from preprocess.plan import ShardTask
from shards.io import atomic_path, atomic_write_bytes, file_sha256
from shards.manifest import FileInfo, ShardInfo, shard_name
from shards.parquet import ParquetShardWriter
from shards.sample import Sample, SampleError
from shards.tar import TarShardWriter

BUILD_DIR = "_build"


@dataclass(frozen=True)
class Skip:
    """One input that was not written, and why."""

    path: str
    reason: str
    detail: str


@dataclass(frozen=True)
class ShardResult:
    """What a task reports back: the shard's manifest entry and its skipped inputs."""

    split: str
    info: ShardInfo
    skipped: list[Skip]
    reused: bool  # True when a complete shard from an earlier run was kept


def image_field(config: ImageConfig) -> str:
    """The tar suffix and Parquet column of the encoded images."""
    return EXTENSIONS[config.encode]


def task_digest(task: ShardTask, shaping: dict) -> str:
    """Identifies what a shard must contain; a marker with another digest is stale."""
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode())
    digest.update(f"{task.split}/{task.index}".encode())
    for sample in task.samples:
        digest.update(f"\n{sample.key}\t{sample.rel}\t{sample.label}".encode())
    return digest.hexdigest()


def marker_path(output: Path, task: ShardTask) -> Path:
    return output / BUILD_DIR / f"{task.split}-{task.index:06d}.json"


def build_shard(
    task: ShardTask,
    output: str,
    shaping: dict,
    image: ImageConfig,
    formats: tuple[str, ...],
    num_classes: int,
    row_group_size: int,
) -> ShardResult:
    """Build one shard, or reuse it if an earlier run completed it and it checks out.

    Data errors of single inputs are skipped and reported; environment errors
    (disk full, permissions) propagate and leave no file under a final name.
    """
    out = Path(output)
    digest = task_digest(task, shaping)
    reused = load_complete_shard(out, task, digest)
    if reused is not None:
        return reused
    field = image_field(image)
    names = {fmt: shard_name(task.split, task.index, fmt) for fmt in formats}
    skipped: list[Skip] = []
    class_counts = [0] * num_classes
    with contextlib.ExitStack() as stack:
        writers = []
        for fmt in formats:
            tmp = stack.enter_context(atomic_path(out / names[fmt]))
            fileobj = stack.enter_context(open(tmp, "wb"))
            if fmt == "tar":
                writers.append(TarShardWriter(fileobj))
            else:
                writers.append(ParquetShardWriter(fileobj, field, row_group_size))
        try:
            for planned in task.samples:
                try:
                    sample = make_sample(planned, task.split, image, field)
                except SampleError as error:
                    skipped.append(Skip(planned.rel, error.reason, error.detail))
                    continue
                class_counts[planned.label] += 1
                for writer in writers:
                    writer.write(sample)
        except BaseException:
            # Release the writers while their temp files are still open; the
            # temp files themselves are removed by atomic_path.
            for writer in writers:
                with contextlib.suppress(Exception):
                    writer.close()
            raise
        for writer in writers:
            writer.close()
    files = {
        fmt: FileInfo(names[fmt], (out / names[fmt]).stat().st_size, file_sha256(out / names[fmt]))
        for fmt in formats
    }
    info = ShardInfo(task.index, len(task.samples) - len(skipped), files, class_counts)
    result = ShardResult(task.split, info, skipped, reused=False)
    atomic_write_bytes(marker_path(out, task), _marker_json(result, digest))
    return result


def make_sample(planned, split: str, image: ImageConfig, field: str) -> Sample:
    """Read and process one input into the sample dict written to every format."""
    processed = process_image(read_source(planned.path, image.max_file_bytes), image)
    meta = {
        "source": planned.rel,
        "split": split,
        "label": planned.label,
        "width": processed.width,
        "height": processed.height,
        "orig_width": processed.orig_width,
        "orig_height": processed.orig_height,
        "orig_format": processed.orig_format,
        "orig_mode": processed.orig_mode,
    }
    return {
        "__key__": planned.key,
        field: processed.data,
        "cls": str(planned.label).encode("ascii"),
        "json": json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8"),
    }


def _marker_json(result: ShardResult, digest: str) -> bytes:
    document = {
        "digest": digest,
        "split": result.split,
        "info": asdict(result.info),
        "skipped": [asdict(s) for s in result.skipped],
    }
    return json.dumps(document, indent=1).encode("utf-8")


def load_complete_shard(out: Path, task: ShardTask, digest: str) -> ShardResult | None:
    """The marker's result if it matches `digest` and every file matches its checksum."""
    marker = marker_path(out, task)
    try:
        document = json.loads(marker.read_text("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if document.get("digest") != digest:
        return None
    info = ShardInfo.from_dict(document["info"])
    for file in info.files.values():
        path = out / file.name
        if (
            not path.exists()
            or path.stat().st_size != file.bytes
            or file_sha256(path) != file.sha256
        ):
            return None
    skipped = [Skip(**s) for s in document["skipped"]]
    return ShardResult(document["split"], info, skipped, reused=True)
