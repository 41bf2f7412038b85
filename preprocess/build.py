"""Write one shard: read, process and encode its planned inputs into tar and Parquet files.

This is the body of one Ray task. It holds at most one Parquet row group of
encoded images in memory, writes each format under a temporary name, commits
both when complete (rename, or upload to an object store), then writes the
shard's marker in `_build/`: the commit point that lets a rerun skip this shard
after checking its checksums.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

from preprocess.images import EXTENSIONS, ImageConfig, process_image, read_source
from preprocess.plan import ShardTask
from shards.io import OutputStore, file_sha256, open_output_store
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


def marker_name(task: ShardTask) -> str:
    """The shard's commit marker, relative to the output."""
    return f"{BUILD_DIR}/{task.split}-{task.index:06d}.json"


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

    Args:
        output: the output directory or object-store URL (see `open_output_store`).

    Data errors of single inputs are skipped and reported; environment errors
    (disk full, permissions, an upload that failed) propagate and leave no file
    under a final name.
    """
    store = open_output_store(output)
    digest = task_digest(task, shaping)
    reused = load_complete_shard(store, task, digest)
    if reused is not None:
        return reused
    field = image_field(image)
    names = {fmt: shard_name(task.split, task.index, fmt) for fmt in formats}
    with contextlib.ExitStack() as stack:
        # Leaving the stack commits the staged files one by one (last format first);
        # an exception discards those not yet committed. A committed file without
        # its marker is not part of the build: a rerun rewrites it.
        staged = {fmt: stack.enter_context(store.staged(names[fmt])) for fmt in formats}
        skipped, class_counts = write_formats(
            task, staged, image, field, num_classes, row_group_size
        )
        # Hashed before the commit: an upload is then never read back to hash it.
        files = {
            fmt: FileInfo(names[fmt], staged[fmt].stat().st_size, file_sha256(staged[fmt]))
            for fmt in formats
        }
    info = ShardInfo(task.index, len(task.samples) - len(skipped), files, class_counts)
    result = ShardResult(task.split, info, skipped, reused=False)
    etags = committed_etags(store, files)
    store.write_bytes_atomic(marker_name(task), _marker_json(result, digest, etags))
    return result


def write_formats(
    task: ShardTask,
    paths: dict[str, Path],
    image: ImageConfig,
    field: str,
    num_classes: int,
    row_group_size: int,
) -> tuple[list[Skip], list[int]]:
    """Write the task's samples to one file per format; returns skips and class counts."""
    skipped: list[Skip] = []
    class_counts = [0] * num_classes
    with contextlib.ExitStack() as stack:
        writers = []
        for fmt, path in paths.items():
            fileobj: BinaryIO = stack.enter_context(open(path, "wb"))
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
            # temp files themselves are removed by the store.
            for writer in writers:
                with contextlib.suppress(Exception):
                    writer.close()
            raise
        for writer in writers:
            writer.close()
    return skipped, class_counts


def committed_etags(store: OutputStore, files: dict[str, FileInfo]) -> dict[str, str]:
    """Version tags of just-committed files (object stores only), checking their sizes.

    The tag lets a resumed build trust the sha256 computed before the upload
    without downloading the object again: an object rewritten since gets a new tag.
    """
    etags = {}
    for fmt, file in files.items():
        stored = store.info(file.name)
        if stored is None or stored.size != file.bytes:
            found = "nothing" if stored is None else f"{stored.size} bytes"
            raise OSError(
                f"{store.location(file.name)}: uploaded {file.bytes} bytes but the store "
                f"holds {found}; check the store and rerun to resume"
            )
        if stored.etag:
            etags[fmt] = stored.etag
    return etags


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


def _marker_json(result: ShardResult, digest: str, etags: dict[str, str]) -> bytes:
    document = {
        "digest": digest,
        "split": result.split,
        "info": asdict(result.info),
        "skipped": [asdict(s) for s in result.skipped],
    }
    if etags:  # object stores only, so local markers stay byte-identical across builds
        document["etags"] = etags
    return json.dumps(document, indent=1).encode("utf-8")


def load_complete_shard(store: OutputStore, task: ShardTask, digest: str) -> ShardResult | None:
    """The marker's result if it matches `digest` and every file matches its checksum.

    Each file must have the recorded size. A local file is hashed again. An
    object whose version tag equals the one recorded right after its upload is
    the object that was hashed, so it is trusted without a download; without a
    recorded tag, or with another one, it is downloaded and hashed.
    """
    try:
        document = json.loads(store.read_bytes(marker_name(task)).decode("utf-8"))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if document.get("digest") != digest:
        return None
    info = ShardInfo.from_dict(document["info"])
    etags = document.get("etags", {})
    for fmt, file in info.files.items():
        stored = store.info(file.name)
        if stored is None or stored.size != file.bytes:
            return None
        if stored.etag and stored.etag == etags.get(fmt):
            continue
        if store.sha256(file.name) != file.sha256:
            return None
    skipped = [Skip(**s) for s in document["skipped"]]
    return ShardResult(document["split"], info, skipped, reused=True)
