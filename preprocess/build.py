"""Write one shard: read, process and encode its planned inputs into tar and Parquet files.

This is the body of one Ray task. It holds at most one Parquet row group of
encoded images in memory, writes each format under a temporary name, commits
both when complete (rename, or upload to an object store), then writes the
shard's marker in `_build/`: the commit point that lets a rerun skip this shard
after checking its checksums.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, BinaryIO

from preprocess.images import EXTENSIONS, ImageConfig, process_image, read_source
from preprocess.plan import PlannedSample, ShardTask
from shards.formats import get_format
from shards.manifest import LAYOUT_FLAT, FileInfo, ShardInfo, shard_name
from shards.redact import redact_text
from shards.sample import MAX_FIELD_BYTES, Sample, SampleError
from shards.storage.write import OutputStore, file_sha256, open_output_store

BUILD_DIR = "_build"
# Skip reasons that say nothing about the input's bytes, only about the machine or the
# tree at the time: a plain rerun tries these inputs again (`retry_skips`). Every other
# reason is a data error, tried again only once the file's size or mtime changed.
ENVIRONMENT_REASONS = frozenset({"missing", "unreadable", "io_error", "loop", "outside_input"})
# OSErrors confined to one input: `(reason, what it means; what to do)`. Any other
# OSError (no memory, no file descriptors, a full disk, a network down) is the worker's
# or the output's and propagates: only those end a build.
_INPUT_ERRNOS = {
    errno.ELOOP: ("loop", "a symlink that resolves to itself; fix the link"),
    errno.ENAMETOOLONG: ("bad_path", "shorten the name in the list (or rename the file)"),
    errno.EILSEQ: ("bad_path", "its file system cannot hold this name; rename the file"),
    errno.EISDIR: ("missing", "a directory, not a file; fix the path in the list"),
    errno.EIO: ("io_error", "check the disk and rerun (it is retried)"),
    errno.ESTALE: ("io_error", "check the disk and rerun (it is retried)"),
    errno.ENXIO: ("io_error", "check the disk and rerun (it is retried)"),
}


@dataclass(frozen=True)
class Skip:
    """One input that was not written, and why.

    Attributes:
        size, mtime_ns: the file's stat when it was skipped (None when it could not be
            stat'ed, or in markers written before they were recorded); a rerun tries a
            data error again only when these changed.
    """

    path: str
    reason: str
    detail: str
    size: int | None = None
    mtime_ns: int | None = None

    def __post_init__(self) -> None:
        # Written to errors.jsonl and the shard's marker: any URL a reason quotes (a
        # remote input's, a list row's) is recorded redacted, whoever wrote the reason.
        object.__setattr__(self, "detail", redact_text(self.detail))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Skip:
        """A marker's skip entry; fields unknown to this version are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def environmental(self) -> bool:
        return self.reason in ENVIRONMENT_REASONS


@dataclass(frozen=True)
class ShardResult:
    """What a task reports back: the shard's manifest entry and its skipped inputs.

    Attributes:
        retried: inputs skipped by an earlier run that this run tried again.
        recovered: of those, the inputs now written (their shard was rebuilt).
        pillow_fallbacks: inputs the fast backend handed to Pillow (not plain JPEG:
            PNG, CMYK, ...), kept in the shard's marker so a rerun reports them too.
    """

    split: str
    info: ShardInfo
    skipped: list[Skip]
    reused: bool  # True when a complete shard from an earlier run was kept
    retried: int = 0
    recovered: int = 0
    pillow_fallbacks: int = 0


@dataclass(frozen=True)
class ShardJob:
    """What every shard task of one build needs besides its own `ShardTask`.

    Made once by the driver (`preprocess.job.shard_job`) and sent to every task as it
    is (Ray puts it in its object store once; the local pool pickles it): plain values
    only, no handles.

    Attributes:
        output: the output directory (absolute) or object-store URL.
        shaping: `BuildConfig.output_shaping()`; each marker's digest covers it, so a
            marker of a build with other options is stale.
        image: how every input becomes the stored image.
        formats: the shard formats written, each file holding the same samples.
        class_names: the dataset's classes (their count sizes the class counts), written
            into the metadata of files that carry it (Parquet).
        row_group_size: Parquet rows per row group.
        description: the dataset's one-line description, or None.
        confine_root: the resolved input root under `--confine-to-input`, else None.
        layout: where the files go (`shards.manifest.LAYOUTS`).
        members: the members besides the image of a build with extra columns, else None
            (`preprocess.job.shard_members`).
        storage_options: fsspec options of the output and of remote inputs; never shown.
    """

    output: str
    shaping: dict[str, Any]
    image: ImageConfig
    formats: tuple[str, ...]
    class_names: tuple[str, ...]
    row_group_size: int
    description: str | None = None
    confine_root: str | None = None
    layout: str = LAYOUT_FLAT
    members: tuple[str, ...] | None = None
    storage_options: Mapping[str, Any] | None = dataclasses.field(default=None, repr=False)

    def open_store(self) -> OutputStore:
        """The output's store."""
        return open_output_store(self.output, self.storage_options)


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


def build_shard(task: ShardTask, job: ShardJob) -> ShardResult:
    """Build one shard, or reuse it if an earlier run completed it and it checks out.

    A reused shard's skipped inputs are tried again first (`retry_skips`): when one
    of them reads now, the shard is rebuilt and gains it, byte-identical to a shard
    built with the input there from the start.

    Data errors of single inputs are skipped and reported, and so are inputs that
    cannot be read (missing, permission denied, an I/O error); errors of the machine
    or the output (disk full, an upload that failed) propagate and leave no file
    under a final name.
    """
    store = job.open_store()
    digest = task_digest(task, job.shaping)
    reused = reusable_result(store, task, digest, job)
    if reused is not None and reused.reused:
        return reused
    retried = reused.retried if reused is not None else 0
    names = {fmt: shard_name(task.split, task.index, fmt, job.layout) for fmt in job.formats}
    with contextlib.ExitStack() as stack:
        # Leaving the stack commits the staged files one by one (last format first);
        # an exception discards those not yet committed. A committed file without
        # its marker is not part of the build: a rerun rewrites it.
        staged = {fmt: stack.enter_context(store.staged(names[fmt])) for fmt in job.formats}
        skipped, class_counts, fallbacks = write_formats(task, staged, job)
        # Hashed before the commit: an upload is then never read back to hash it.
        files = {
            fmt: FileInfo(names[fmt], staged[fmt].stat().st_size, file_sha256(staged[fmt]))
            for fmt in job.formats
        }
    info = ShardInfo(task.index, len(task.samples) - len(skipped), files, class_counts)
    recovered = 0
    if reused is not None:
        still_skipped = {skip.path for skip in skipped}
        recovered = sum(skip.path not in still_skipped for skip in reused.skipped)
    result = ShardResult(task.split, info, skipped, False, retried, recovered, fallbacks)
    etags = committed_etags(store, files)
    store.write_bytes_atomic(marker_name(task), _marker_json(result, digest, etags))
    return result


def reusable_result(
    store: OutputStore, task: ShardTask, digest: str, job: ShardJob
) -> ShardResult | None:
    """The shard an earlier run committed, as `build_shard` would report it, or None.

    `reused` is True when it is kept as it is; False when one of its skipped inputs
    changed (`retry_skips`), so it is rebuilt (`retried` counts the inputs tried).
    None when no committed shard checks out against `digest` (`task_digest`).
    """
    committed = load_complete_shard(store, task, digest)
    if committed is None:
        return None
    retried, changed = retry_skips(task, committed.skipped, job)
    return dataclasses.replace(committed, reused=not changed, retried=retried)


def retry_skips(task: ShardTask, skipped: list[Skip], job: ShardJob) -> tuple[int, bool]:
    """Try a reused shard's skipped inputs again: (how many were tried, whether any changed).

    An environmental skip is tried by reading the input again: it changed when it
    reads now or fails for another reason. A data error is not read again unless
    the file's size or mtime differ from those recorded with the skip (so a corrupt
    file costs one `stat` per rerun, not a decode); a marker that recorded neither
    (written before they were) has nothing to compare, so its data errors stay.
    """
    by_rel = {planned.rel: planned for planned in task.samples}
    tried = 0
    changed = False
    for skip in skipped:
        planned = by_rel.get(skip.path)
        if planned is None:
            continue
        if skip.environmental:
            tried += 1
            try:
                read_input(planned, job.image, job.confine_root, job.storage_options)
            except SampleError as error:
                changed = changed or error.reason != skip.reason
            else:
                changed = True
        elif skip.size is not None and _stat_of(planned.path) != (skip.size, skip.mtime_ns):
            tried += 1
            changed = True
    return tried, changed


def _stat_of(path: str) -> tuple[int | None, int | None]:
    """(size, mtime_ns) of a local input, (None, None) when it has none to give."""
    if "://" in path:
        return None, None
    try:
        info = os.stat(path)
    except OSError:
        return None, None
    return info.st_size, info.st_mtime_ns


def write_formats(
    task: ShardTask, paths: dict[str, Path], job: ShardJob
) -> tuple[list[Skip], list[int], int]:
    """Write the task's samples to one file per format: skips, class counts, Pillow fallbacks.

    Class counts are per single label; a multi-label or label-free shard records none
    (`[]`): the manifest's counts sum to the samples, and the driver counts the
    multi-label classes from the plan (`preprocess.plan.written_label_counts`).
    """
    skipped: list[Skip] = []
    fallbacks: dict[str, int] = {"pillow": 0}
    class_counts = [0] * len(job.class_names)
    single = all(type(planned.label) is int for planned in task.samples)
    field = image_field(job.image)
    dataset = {
        "class_names": job.class_names,
        "description": job.description,
        "split": task.split,
        "members": job.members,  # the build's columns, also for a shard whose inputs all fail
    }
    with contextlib.ExitStack() as stack:
        writers = []
        for fmt, path in paths.items():
            fileobj: BinaryIO = stack.enter_context(open(path, "wb"))
            writer = get_format(fmt).open_writer(fileobj, field, job.row_group_size, **dataset)
            writers.append(writer)
        try:
            for planned in task.samples:
                try:
                    sample = build_shard_sample(
                        planned,
                        task.split,
                        job.image,
                        field,
                        job.confine_root,
                        fallbacks=fallbacks,
                        storage_options=job.storage_options,
                    )
                except SampleError as error:
                    size, mtime_ns = _stat_of(planned.path)
                    skipped.append(Skip(planned.rel, error.reason, error.detail, size, mtime_ns))
                    continue
                if single:
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
    return skipped, class_counts if single else [], fallbacks["pillow"]


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


def read_input(
    planned: PlannedSample,
    image: ImageConfig,
    confine_root: str | None,
    storage_options: Mapping[str, Any] | None = None,
) -> bytes:
    """One input's bytes; a file that cannot be read is a skip, not the build's end.

    A remote input is read through `shards.storage` with the shards' retries and a
    deadline (`preprocess.images.INPUT_RETRY`) and the build's `storage_options`; one
    still failing after them is its `missing` or `io_error` skip naming the redacted
    URL, retried by a plain rerun.

    Raises:
        SampleError: `read_source`'s reasons, `unreadable` (permission denied),
            `io_error` (EIO and kin, or a remote read failing past its retries),
            `loop` (a symlink that resolves to itself), `bad_path` (a name the file
            system refuses: ENAMETOOLONG, EILSEQ), `missing` (EISDIR).
        OSError: an error of the machine rather than the file; it propagates.
    """
    try:
        return read_source(
            planned.path,
            image.max_file_bytes,
            confine_to=confine_root,
            storage_options=storage_options,
        )
    except PermissionError as error:
        raise SampleError(
            "unreadable",
            f"{planned.path}: {error.strerror}; fix its permissions and rerun (it is retried)",
        ) from error
    except OSError as error:
        if error.errno not in _INPUT_ERRNOS:
            raise
        reason, advice = _INPUT_ERRNOS[error.errno]
        raise SampleError(reason, f"{planned.path}: {error.strerror}; {advice}") from error


def build_shard_sample(
    planned: PlannedSample,
    split: str,
    image: ImageConfig,
    field: str,
    confine_root: str | None = None,
    *,
    fallbacks: dict[str, int] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> Sample:
    """Read and process one input into the sample dict written to every format.

    `fallbacks["pillow"]` counts the inputs the fast backend handed to Pillow; a remote
    input is read with `storage_options`.

    Members: the image, `json` (our metadata, plus the input list's `json` columns),
    then by the label `cls` (single), `labels` (multi-label: a JSON list of class ids)
    or nothing (label-free), and the `txt` and `weight` columns when the list has them.

    Raises:
        SampleError: the image's reasons, or `bad_json` when the metadata document
            with the list's `json` columns is over `MAX_FIELD_BYTES` (what the loader reads).
    """
    data = read_input(planned, image, confine_root, storage_options)
    processed = process_image(data, image)
    if fallbacks is not None and processed.pillow_fallback:
        fallbacks["pillow"] += 1
    meta = {
        "source": planned.rel,
        "split": split,
        "width": processed.width,
        "height": processed.height,
        "orig_width": processed.orig_width,
        "orig_height": processed.orig_height,
        "orig_format": processed.orig_format,
        "orig_mode": processed.orig_mode,
    }
    values = planned.fields or {}
    meta.update(values.get("json", {}))  # the list's columns never take our keys (sources)
    sample: Sample = {"__key__": planned.key, field: processed.data}
    if type(planned.label) is int:
        meta["label"] = planned.label
        sample["cls"] = str(planned.label).encode("ascii")
    elif planned.label is not None:
        meta["labels"] = planned.label
        sample["labels"] = json.dumps(planned.label).encode("ascii")
    document = json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")
    if len(document) > MAX_FIELD_BYTES:
        raise SampleError(
            "bad_json",
            f"{planned.path}: its metadata document with the list's json columns is "
            f"{len(document)} bytes, over the {MAX_FIELD_BYTES} a loader reads; shorten them",
        )
    sample["json"] = document
    if "txt" in values:
        sample["txt"] = values["txt"].encode("utf-8")
    if "weight" in values:
        sample["weight"] = json.dumps(float(values["weight"])).encode("ascii")
    return sample


def _marker_json(result: ShardResult, digest: str, etags: dict[str, str]) -> bytes:
    document = {
        "digest": digest,
        "split": result.split,
        "info": asdict(result.info),
        "skipped": [asdict(s) for s in result.skipped],
    }
    if result.pillow_fallbacks:
        document["pillow_fallbacks"] = result.pillow_fallbacks
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
    if not isinstance(document, dict) or document.get("digest") != digest:
        return None
    try:
        # Markers are ours, but a disk can damage one: a marker of another shape is no
        # marker, and the shard is simply rebuilt.
        info = ShardInfo.from_dict(document["info"])
        skipped = [Skip.from_dict(s) for s in document["skipped"]]
        split = str(document["split"])
        etags = dict(document.get("etags", {}))
        fallbacks = int(document.get("pillow_fallbacks", 0))
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    for fmt, file in info.files.items():
        stored = store.info(file.name)
        if stored is None or stored.size != file.bytes:
            return None
        if stored.etag and stored.etag == etags.get(fmt):
            continue
        if store.sha256(file.name) != file.sha256:
            return None
    return ShardResult(split, info, skipped, reused=True, pillow_fallbacks=fallbacks)
