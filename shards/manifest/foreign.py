"""Shards we did not build: the files a directory or glob names, and the one pass that indexes them.

img2dataset and webdataset's `ShardWriter` write shards without our manifest. The loader,
`preprocess verify`, `info` and `index` take such a directory (or a glob, a brace pattern,
one file), local or in any store (`find_shards`; listing where the store can list),
read each shard once with `survey_shard` (its samples, bytes, sha256 and the members its
samples hold) and, for `index`, make the surveys a `Manifest` with `foreign_manifest`,
saved beside the shards so exact epochs and resume work as on ours.
"""

from __future__ import annotations

import fnmatch
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from shards.errors import DEFAULT_LIMITS, ReadLimits, UsageError
from shards.formats import FORMATS, ShardFormat, format_of_url, get_format
from shards.manifest.fields import fields_entry
from shards.manifest.model import Manifest
from shards.manifest.names import LAYOUT_FLAT, MANIFEST_NAME
from shards.manifest.table import FileInfo, ShardInfo, ShardTable, SplitInfo
from shards.redact import redact_url
from shards.sample import ALLOWED_FIELDS, IMAGE_FIELDS, LABEL_FIELDS
from shards.storage import DEFAULT_RETRY, RetryPolicy, is_remote, transport_of, url_scheme
from shards.storage.patterns import GLOB_CHARACTERS, expand_glob, expand_urls, is_glob
from shards.storage.ranged import local_copy
from shards.storage.write import file_sha256

# What `foreign_manifest` records each member as (`fields.members`): the kind the loader
# reads it as by default. `labels` is left out: a multi-label entry needs per-class counts.
MEMBER_KINDS = {
    **{name: "image" for name in IMAGE_FIELDS},
    **{name: "label" for name in LABEL_FIELDS},
    "txt": "text",
    "json": "json",
    "weight": "weight",
}
INDEXED_BY = "preprocess index"


def list_shards(
    source: str,
    fmt: str | None = None,
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[str, list[str]]:
    """`(format, paths)` of the shards a directory without our manifest, or a glob, holds.

    A directory: its `.tar` or `.parquet` files directly under it. A glob: the files it
    matches with a shard suffix. One format only: `fmt` chooses when both are there. A
    remote directory (prefix) or glob is listed through its store's transport.

    Raises:
        UsageError: no shard, or both formats and no `fmt` (the message names both counts
            and the `format=` to choose), or `fmt` names a format that is not there, or
            the store cannot be listed (a web server: name the files instead).
    """
    if is_remote(source):
        where = f"no manifest in {redact_url(source)}, and it"
        candidates = remote_listing(source, retry, storage_options or {})
    elif os.path.isdir(source):
        where = f"no manifest at {os.path.join(source, MANIFEST_NAME)}, and {source}"
        candidates = sorted(
            entry.path for entry in os.scandir(os.path.abspath(source)) if entry.is_file()
        )
    else:
        where = repr(source)
        candidates = expand_glob(source)
    found: dict[str, list[str]] = {}
    for path in candidates:
        shard_format = shard_format_of(path)
        if shard_format is not None:
            found.setdefault(shard_format, []).append(path)
    if fmt is None:
        for name in img2dataset_status(found, candidates):
            found.pop(name)
    return pick_format(found, where, fmt)


def img2dataset_status(found: dict[str, list[str]], candidates: Sequence[str]) -> list[str]:
    """The formats of `found` whose files are img2dataset's download status, not shards:
    those of a format that holds it (`ShardFormat.download_status`) each beside another
    format's shard of the same stem and `STEM_stats.json` (`00000.parquet` by `00000.tar`,
    its `--output_format webdataset` layout). The other format is what the folder holds."""
    names = set(candidates)
    status = []
    for name, paths in found.items():
        shards = {stem for other in found if other != name for stem in stems(found[other])}
        if get_format(name).download_status and all(
            stem in shards and f"{stem}_stats.json" in names for stem in stems(paths)
        ):
            status.append(name)
    return status


def stems(paths: Sequence[str]) -> set[str]:
    """The paths without their suffixes."""
    return {os.path.splitext(path)[0] for path in paths}


def remote_listing(source: str, retry: RetryPolicy, options: Mapping[str, Any]) -> list[str]:
    """The URLs of the files directly under a remote prefix, or those a glob in its last
    part matches (`s3://b/out/*.tar`), listed through the store's transport."""
    transport = transport_of(url_scheme(source))
    path = urlsplit(source).path
    glob = any(char in GLOB_CHARACTERS for char in path.rsplit("/", 1)[-1])
    prefix = source.rsplit("/", 1)[0] if glob else source.rstrip("/")
    for _, _, files in transport.walk(prefix, retry, options):
        names = [
            name for name in files if not glob or fnmatch.fnmatchcase(name, path.rsplit("/", 1)[-1])
        ]
        return [f"{prefix}/{name}" for name in names]
    return []


def find_shards(
    source: str,
    fmt: str | None = None,
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[str, list[str]]:
    """`(format, paths)` of a directory without our manifest, a glob, a brace pattern or
    one shard file, local or in any store (paths are then URLs).

    What `preprocess verify`, `info` and `index` read when there is no manifest.

    Raises:
        UsageError: a brace pattern naming local files that are not there, or as
            `list_shards`.
        FileNotFoundError: the path names nothing.
    """
    if is_remote(source):
        if "{" in source and "}" in source:
            return pattern_shards(source, fmt)
        found = shard_format_of(urlsplit(source).path)
        if found is not None and not any(char in GLOB_CHARACTERS for char in source):
            return pick_format({found: [source]}, repr(redact_url(source)), fmt)
        return list_shards(source, fmt, retry=retry, storage_options=storage_options)
    if os.path.isdir(source) or is_glob(source):
        return list_shards(source, fmt)
    if os.path.isfile(source):
        found = shard_format_of(source)
        if found is None or (fmt is not None and fmt != found):
            wanted = " or ".join(shard_format.suffix for shard_format in FORMATS.values())
            raise UsageError(f"{source} is not a {fmt or wanted} shard file")
        return found, [os.path.abspath(source)]
    if "{" in source and "}" in source:
        return pattern_shards(source, fmt)
    raise FileNotFoundError(f"no such file or directory: {source}")


def pattern_shards(pattern: str, fmt: str | None) -> tuple[str, list[str]]:
    """`(format, paths)` of a brace pattern's shards (`shards.storage.patterns`), which
    must all exist: a half-synced range is refused naming how many are missing (remote
    ones are found missing when read, naming the URL)."""
    paths = expand_urls(pattern)
    missing = [path for path in paths if not is_remote(path) and not os.path.isfile(path)]
    if missing:
        raise UsageError(
            f"{len(missing)} of the {len(paths)} shards {pattern!r} names do not exist "
            f"(first: {missing[0]}); fix the pattern, or pass the shards' directory"
        )
    found: dict[str, list[str]] = {}
    for path in paths:
        shard_format = shard_format_of(path)
        if shard_format is None:
            raise UsageError(f"{path} ({pattern!r}) is not a shard file")
        found.setdefault(shard_format, []).append(path)
    return pick_format(found, repr(pattern), fmt)


def names_shards(source: str) -> bool:
    """True when `source` is a glob, brace pattern or shard file, or a directory holding
    shard files (any remote location but a `.json` one): what `find_shards` reads (or
    explains) rather than a manifest."""
    if is_remote(source):
        return not urlsplit(source).path.endswith(".json")
    if os.path.isdir(source):
        return any(
            entry.is_file() and shard_format_of(entry.name) is not None
            for entry in os.scandir(source)
        )
    if os.path.isfile(source):
        return shard_format_of(source) is not None
    return is_glob(source) or ("{" in source and "}" in source)


def shard_format_of(path: str) -> str | None:
    """The format a file's suffix names, None for other files (`_stats.json`, `.txt`)."""
    try:
        return format_of_url(path).name
    except ValueError:
        return None


def pick_format(found: dict[str, list[str]], where: str, fmt: str | None) -> tuple[str, list[str]]:
    """The one format of `found` (`{format: paths}`) to read, chosen by `fmt` when given."""
    held = ", ".join(f"{len(paths)} {name}" for name, paths in sorted(found.items()))
    if fmt is not None:
        get_format(fmt)
        if fmt not in found:
            raise UsageError(
                f"{where} holds no {fmt} shards ({held or 'no shard files'}); "
                "pick a format it holds"
            )
        return fmt, found[fmt]
    if not found:
        suffixes = " or ".join(f"*{shard_format.suffix}" for shard_format in FORMATS.values())
        raise UsageError(
            f"{where} holds no {suffixes} shard files either: a build-shards output without "
            "a manifest did not finish (rerun it); otherwise pass the shards' folder or files"
        )
    if len(found) > 1:
        choices = " or ".join(f"format={name!r}" for name in sorted(found))
        raise UsageError(
            f"{where} holds shards that mix formats ({held}); choose one with {choices} "
            "(`--format` on the command line)"
        )
    name = next(iter(found))
    return name, found[name]


@dataclass(frozen=True)
class ShardSurvey:
    """What one pass over one shard found.

    Attributes:
        path: the shard's local path.
        fmt: its format's registry name.
        samples: samples as the loader counts them (bad ones included).
        bytes: the file's size.
        sha256: the file's sha256 hex; None when not asked for.
        members: allowlisted member (or column) -> samples holding it.
        repeated_keys: Parquet rows read under a made key, their own repeating an
            earlier row's (`shards.parquet.iter_parquet_samples`).
    """

    path: str
    fmt: str
    samples: int
    bytes: int
    sha256: str | None
    members: Counter = field(default_factory=Counter)
    repeated_keys: int = 0


def survey_fields(
    shard_format: ShardFormat, stream: BinaryIO, path: str, limits: ReadLimits | None = None
) -> frozenset[str]:
    """What a survey asks a shard for: every allowlisted member, less the class columns a
    format with a schema lacks (its reader refuses a class column asked for and not
    there, and img2dataset's Parquet has none). A format without one (tar) is asked for
    every member as it is: its first sample's need not be every sample's. Rewinds
    `stream`."""
    if not shard_format.schema:
        return ALLOWED_FIELDS
    held = set(shard_format.list_members(stream, path, limits or DEFAULT_LIMITS))
    stream.seek(0)
    return ALLOWED_FIELDS - (set(LABEL_FIELDS) - held)


def survey_shard(
    path: str,
    fmt: str,
    *,
    checksum: bool = True,
    limits: ReadLimits | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
) -> ShardSurvey:
    """Read one shard once: its samples and the members they hold (and its sha256); a
    remote one is fetched once through its store (`local_copy`) and read from the copy.

    Raises:
        ShardError: the shard is malformed (the message names it).
        OSError: it cannot be read (`ShardReadError` for a store past its retries).
    """
    shard_format = get_format(fmt)
    members: Counter = Counter()
    samples = repeated = 0
    options = {} if limits is None else {"limits": limits}
    with local_copy(path, retry, storage_options=storage_options) as local:
        with open(local, "rb") as stream:
            fields = survey_fields(shard_format, stream, path, limits)
            for sample in shard_format.iter_samples(stream, path, fields=fields, **options):
                samples += 1
                repeated += "__repeated_key__" in sample
                members.update(name for name in sample if not name.startswith("__"))
        digest = file_sha256(local) if checksum else None
        size = os.path.getsize(local)
    return ShardSurvey(path, fmt, samples, size, digest, members, repeated)


def members_line(members: Counter, samples: int) -> str:
    """`jpg 35, txt 35, json 35 of 35 samples`: what the samples hold, most common first."""
    if not members:
        return f"no readable member in {samples} samples"
    ordered = sorted(members.items(), key=lambda item: (-item[1], item[0]))
    held = ", ".join(f"{name} {count}" for name, count in ordered)
    return f"{held} of {samples} samples"


def foreign_manifest(
    surveys: Sequence[ShardSurvey], split: str = "train", source: str = ""
) -> Manifest:
    """The manifest of shards we did not build, from one survey of each (in order).

    Label-free unless every sample holds a class member (`cls`, `label`); the classes are
    then unnamed, so `classes` stays empty. `config.indexed` records what was indexed
    and the members seen; `fields.members` the kind each is read as.

    Raises:
        UsageError: no survey, or surveys of two formats.
    """
    if not surveys:
        raise UsageError("no shards to index")
    formats = {survey.fmt for survey in surveys}
    if len(formats) != 1:
        raise UsageError(f"cannot index shards of two formats together ({sorted(formats)})")
    fmt = formats.pop()
    infos = [
        ShardInfo(index, s.samples, {fmt: FileInfo(os.path.basename(s.path), s.bytes, s.sha256)})
        for index, s in enumerate(surveys)
    ]
    table = ShardTable.from_infos(split, infos, LAYOUT_FLAT)
    members: Counter = sum((survey.members for survey in surveys), Counter())
    total = sum(survey.samples for survey in surveys)
    repeated = sum(survey.repeated_keys for survey in surveys)
    labelled = any(members[name] == total for name in LABEL_FIELDS) and total > 0
    kinds = {
        name: kind
        for name, kind in MEMBER_KINDS.items()
        if name in members and (kind != "label" or labelled)
    }
    images = [name for name in IMAGE_FIELDS if name in members]
    return Manifest(
        classes=[],
        image_field=max(images, key=members.__getitem__) if images else IMAGE_FIELDS[0],
        formats=[fmt],
        splits={split: SplitInfo(split, total, table, [])},
        config={
            "indexed": {
                "by": INDEXED_BY,
                "source": source,
                "members": dict(members.most_common()),
                **({"repeated_keys": repeated} if repeated else {}),
            }
        },
        inputs=total,
        skipped={},
        fields=fields_entry("single" if labelled else "none", kinds, {}) if kinds else None,
        layout=LAYOUT_FLAT,
    )


def is_indexed(manifest: Manifest) -> bool:
    """True for a manifest `preprocess index` wrote for shards we did not build."""
    indexed = manifest.config.get("indexed")
    return isinstance(indexed, dict) and indexed.get("by") == INDEXED_BY
