"""Resolve a loader source (manifest, shard URLs, patterns) into shard specs with counts.

A manifest is the preferred source: it gives every shard's URL, sample count
and checksum without opening a shard. Plain URLs work too; their counts come
from a `manifest.json` beside them, else from the shards themselves (tar
headers or the Parquet footer), which is cheap for local files; a shard that
cannot even be counted is left out of the epoch and reported, not fatal.

The specs are `ShardSpecs`: columns (counts, sizes, digests) and a URL rule, so
a million shards cost ~50 MB in the process that resolves them, are inherited by
forked workers as they are, and pickle as arrays for spawned ones.
"""

from __future__ import annotations

import logging
import operator
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import urlsplit

import numpy as np
import pyarrow as pa

from pipeline.epoch import Mix
from pipeline.positions import compact_dtype
from shards.errors import DataError, ShardError, UsageError
from shards.formats import DEFAULT_FORMAT, ShardFormat, format_of_url, get_format, is_format
from shards.manifest import (
    MANIFEST_NAME,
    Manifest,
    manifest_base,
    read_manifest,
    shard_name,
)
from shards.manifest.foreign import list_shards, pick_format
from shards.redact import redact_url
from shards.storage import (
    DEFAULT_RETRY,
    ObjectNotFoundError,
    RetryPolicy,
    exists,
    is_remote,
    open_stream,
)
from shards.storage.patterns import expand_urls

log = logging.getLogger("pipeline")


class UnreadableSourceError(DataError, ValueError):
    """None of a source's shards could be read; the message names the first failure."""


@dataclass(frozen=True)
class ShardSpec:
    """One shard as the loader sees it.

    Attributes:
        url: where to read it; may hold credentials, so it is left out of the repr:
            print `display` instead.
        fmt: the format's registry name (`tar`, `parquet`).
        samples: how many samples it holds (the manifest's count, or counted).
        sha256: the manifest's checksum, when there is one.
        bytes: the manifest's byte count, when there is one: caps the read.
        counted: False for a remote shard read without counts (resampled mode, no
            manifest): `samples` is then 1, the shard's weight in the draws (webdataset
            draws shards uniformly), and the shard is read to its end.
    """

    url: str = field(repr=False)
    fmt: str
    samples: int
    sha256: str | None = None
    bytes: int | None = None
    counted: bool = True

    @property
    def format(self) -> ShardFormat:
        return get_format(self.fmt)

    @property
    def display(self) -> str:
        """The URL with credentials redacted: the one form that may be printed."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"ShardSpec({self.display!r}, {self.fmt!r}, {self.samples})"


_NO_SIZE = -1  # in `ShardSpecs.sizes`: no recorded byte count


class ShardSpecs(Sequence[ShardSpec]):
    """A compact, read-only sequence of `ShardSpec`, made one at a time on access.

    Holds the format, the counts, and (when a manifest gave them) the byte sizes
    and raw sha256 digests as numpy arrays. A URL is `prefix + name`, the name
    being `shard_name(split, index, fmt)` unless `names` lists them (a manifest
    with names of its own, or shards given as URLs, where `prefix` is empty).

    Attributes:
        fmt: the format's registry name, the same for every shard.
        samples: int64 samples per shard (read-only).
        sizes: byte counts, -1 where unknown (int32 when every count fits, else
            int64: `compact_sizes`); None when none is known.
        digests: uint8 [n, 32] sha256 digests; None when none is known or they
            were left unread (see `resolve_source`'s `checksums`).
        checked: which rows of `digests` are real; None when all are.
        table_sha256: the sha256 of the manifest's side table these shards came
            from, which covers their digests; None for inline lists and URLs.
        counted: False when the counts are not known (`ShardSpec.counted`).
    """

    def __init__(
        self,
        fmt: str,
        samples: np.ndarray,
        *,
        prefix: str = "",
        split: str = "",
        names: Sequence[str] | None = None,
        sizes: np.ndarray | None = None,
        digests: np.ndarray | None = None,
        checked: np.ndarray | None = None,
        table_sha256: str | None = None,
        counted: bool = True,
    ) -> None:
        self.fmt = fmt
        self.counted = counted
        self.samples = _read_only(np.asarray(samples, np.int64))
        self.prefix = prefix
        self.split = split
        self.names = None if names is None else tuple(names)
        self.sizes = None if sizes is None else _read_only(compact_sizes(sizes))
        self.digests = None if digests is None else _read_only(np.asarray(digests, np.uint8))
        self.checked = None if checked is None else _read_only(np.asarray(checked, bool))
        self.table_sha256 = table_sha256

    @classmethod
    def from_specs(cls, specs: Sequence[ShardSpec], counted: bool = True) -> ShardSpecs:
        """From a list of specs of one format (shards given as URLs).

        Raises:
            ValueError: the specs mix formats.
        """
        formats = {spec.fmt for spec in specs}
        if len(formats) > 1:
            raise UsageError(f"shard specs mix formats {sorted(formats)}; give one per loader")
        digests = np.zeros((len(specs), 32), np.uint8)
        checked = np.zeros(len(specs), bool)
        for i, spec in enumerate(specs):
            if spec.sha256 is not None:
                digests[i] = np.frombuffer(bytes.fromhex(spec.sha256), np.uint8)
                checked[i] = True
        sizes = [_NO_SIZE if spec.bytes is None else spec.bytes for spec in specs]
        return cls(
            formats.pop() if formats else DEFAULT_FORMAT,
            np.array([spec.samples for spec in specs], np.int64),
            names=[spec.url for spec in specs],
            sizes=np.array(sizes, np.int64),
            digests=digests,
            checked=checked,
            counted=counted and all(spec.counted for spec in specs),
        )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return ShardSpecs.from_specs([self[i] for i in range(*index.indices(len(self)))])
        index = operator.index(index)
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"shard {index} of {len(self)}")
        return ShardSpec(
            self.url(index),
            self.fmt,
            int(self.samples[index]),
            self.sha256(index),
            self.size(index),
            self.counted,
        )

    def __iter__(self) -> Iterator[ShardSpec]:
        for index in range(len(self)):
            yield self[index]

    def url(self, index: int) -> str:
        if self.names is not None:
            return self.prefix + self.names[index]
        return self.prefix + shard_name(self.split, index, self.fmt)

    def sha256(self, index: int) -> str | None:
        if self.digests is None or (self.checked is not None and not self.checked[index]):
            return None
        return self.digests[index].tobytes().hex()

    def size(self, index: int) -> int | None:
        if self.sizes is None or self.sizes[index] == _NO_SIZE:
            return None
        return int(self.sizes[index])

    def iter_file_names(self) -> Iterator[str]:
        """Each shard's file name as its redacted URL ends: `basename(spec.display)`."""
        for index in range(len(self)):
            name = self.names[index] if self.names is not None else None
            if self.prefix and (name is None or "?" not in name):
                # A manifest's base has no query, so redaction leaves the name alone.
                yield name if name is not None else shard_name(self.split, index, self.fmt)
            else:
                yield os.path.basename(redact_url(self.url(index)))

    def iter_sha256(self) -> Iterator[str | None]:
        """Each shard's sha256 as hex, None where there is none."""
        chunk = 65536
        for start in range(0, len(self), chunk):
            stop = min(start + chunk, len(self))
            if self.digests is None:
                yield from [None] * (stop - start)
                continue
            text = self.digests[start:stop].tobytes().hex()
            for i in range(stop - start):
                row = start + i
                known = self.checked is None or self.checked[row]
                yield text[64 * i : 64 * i + 64] if known else None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        shown = ", ".join(repr(self[i].display) for i in range(min(3, len(self))))
        more = ", ..." if len(self) > 3 else ""
        return f"ShardSpecs({len(self)} {self.fmt} shards: {shown}{more})"


def compact_sizes(sizes: Sequence[int] | np.ndarray) -> np.ndarray:
    """Byte counts as int32 when every one fits (shards under 2 GiB), else int64.

    The main process and, by fork, every worker hold a count per shard: 4 MB at 10^6
    shards instead of 8. Sample counts stay int64: epoch positions are summed from them.
    """
    sizes = np.asarray(sizes, np.int64)
    return sizes.astype(compact_dtype(int(sizes.max()) if len(sizes) else 0), copy=False)


def _read_only(array: np.ndarray) -> np.ndarray:
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


@dataclass(frozen=True)
class ResolvedSource:
    """What the loader needs to plan an epoch.

    Attributes:
        shards: the shards, in order; a list of `ShardSpec` is made a `ShardSpecs`.
        unreadable: `(redacted URL, reason)` of shards given as URLs that could not
            even be counted; they take no part in the epoch, and the loader logs them.
        label_mode: how the dataset was labelled, from its manifest's `fields`:
            `single` (a class id in `cls`; also when nothing is known), `multi` (a
            list of class ids in `labels`) or `none` (label-free, e.g. image-text).
        label_counts: multi-label only: the split's samples holding each class.
        members: the member (and Parquet column) names its samples hold, when the
            manifest records them (builds with `--fields`, `preprocess index`); None
            when unknown. A field none of them can give is refused before any read.
    """

    shards: ShardSpecs
    classes: list[str] | None = None
    class_counts: list[int] | None = None
    manifest_url: str | None = None
    unreadable: tuple[tuple[str, str], ...] = ()
    label_mode: str = "single"
    label_counts: list[int] | None = None
    members: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.shards, ShardSpecs):
            object.__setattr__(self, "shards", ShardSpecs.from_specs(list(self.shards)))

    @property
    def counts(self) -> np.ndarray:
        """Samples per shard, int64, read-only (no copy)."""
        return self.shards.samples

    @property
    def total_samples(self) -> int:
        return int(self.counts.sum())

    # One source is read as a mix of one, unnamed (`pipeline.epoch.Mix`), with what a
    # `pipeline.mixing.ResolvedMix` gives the loader: it plans, reads and checks every
    # source alike.
    names: ClassVar[tuple[str, ...]] = ("",)
    remaps: ClassVar[tuple[None, ...]] = (None,)

    @property
    def parts(self) -> tuple[ResolvedSource, ...]:
        return (self,)

    @property
    def quotas(self) -> tuple[int, ...]:
        return (self.total_samples,)

    def mix(self, unit: int = 1) -> Mix:
        return Mix.one(self.counts, unit)


def manifest_path(url: str) -> str:
    """The path part of a manifest URL: a presigned URL's query string is not part of it."""
    return urlsplit(url).path if is_remote(url) else url


def is_manifest_source(source: Any) -> bool:
    """A `.json` file or URL (presigned ones included), or a dataset directory: local, or
    a remote folder (`is_remote_directory`)."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    text = os.fspath(source)
    local = not is_remote(text)
    folder = os.path.isdir(text) if local else is_remote_directory(text)
    return manifest_path(text).endswith(".json") or folder


def resolve_source(
    source: str | os.PathLike | Sequence[str],
    split: str,
    fmt: str | None = None,
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
    checksums: bool = False,
    allow_missing: bool = False,
    remote_counts: str = "refuse",
) -> ResolvedSource:
    """Shard specs for `split` from a manifest (path, dir or URL) or from shards.

    Shards are a directory without our manifest (its `.tar` or `.parquet` files), a
    glob (`DIR/*.tar`), a brace pattern or a list of URLs. Their counts come from the
    manifest beside them, else from one counting pass, said once in one log line.

    `checksums` reads every shard's sha256 from a manifest's side table (for
    `verify_checksums`); without it they stay unread, 32 bytes a shard that every
    process holding the source (and every forked worker) would otherwise carry.
    Inline shard lists and the manifest beside shard URLs always give them.
    `allow_missing` reads the shards that exist when some named ones do not (a brace
    range that half exists); without it that is an error naming them.
    `remote_counts` says what to do about remote tar shards without a manifest, whose
    count means reading them whole (`REMOTE_COUNTS`): `refuse` (one line saying how
    else), `stream` (count them by reading each once, with progress in the log) or
    `skip` (resampled mode: leave them uncounted, `ShardSpec.counted`).

    Raises:
        ManifestError: the manifest is malformed (the message names it and the field),
            or has no such split (`SplitNotFoundError`) or format (`FormatNotBuiltError`).
        UsageError: mixed formats, a format the URLs are not, counts unavailable, or
            named shards missing.
        UnreadableSourceError: none of the shard URLs could be read.
    """
    counting = (retry, storage_options, allow_missing, remote_counts)
    if is_manifest_source(source):
        url = os.fspath(source)
        if is_remote_directory(url):
            url, fmt = remote_dataset_manifest(url, fmt, retry, storage_options)
            if url is None:  # shards we did not build
                options = {"retry": retry, "storage_options": storage_options}
                found, paths = list_shards(os.fspath(source), fmt, **options)
                return resolve_urls(paths, found, *counting)
        if not is_remote(url) and os.path.isdir(url):
            url, fmt = dataset_manifest(url, fmt)
            if not os.path.exists(url):  # shards we did not build
                found, paths = list_shards(os.fspath(source), fmt)
                return resolve_urls(paths, found, *counting)
        manifest = read_manifest_url(
            url, retry, storage_options, split=split, fmt=fmt, checksums=checksums
        )
        resolved = from_manifest(manifest, url, split, fmt)
        # The manifest's int64 byte counts, now held compact (`compact_sizes`), go back to
        # pyarrow's pool when it goes: hand them back, or every forked worker inherits them.
        del manifest
        pa.default_memory_pool().release_unused()
        return resolved
    urls = expand_urls(source)
    found, urls = one_format(urls, fmt)
    return resolve_urls(urls, found, *counting)


def one_format(urls: list[str], fmt: str | None) -> tuple[str, list[str]]:
    """The format of `urls`, and those of it: `fmt` chooses when they mix formats."""
    by_format: dict[str, list[str]] = {}
    for url in urls:
        by_format.setdefault(format_of_url(url).name, []).append(url)
    if fmt is not None and fmt not in by_format:
        held = ", ".join(sorted(by_format))
        raise UsageError(f"format={fmt!r} but the URLs are {held} shards")
    return pick_format(by_format, "the shard URLs", fmt)


def resolve_urls(
    urls: list[str],
    fmt: str,
    retry: RetryPolicy,
    storage_options,
    allow_missing: bool,
    remote_counts: str = "refuse",
) -> ResolvedSource:
    """Specs of shards given as URLs: the neighbour manifest's, else counted once (remote
    tar shards as `remote_counts` says: see `resolve_source`)."""
    urls = present_urls(urls, allow_missing)
    known = neighbour_manifest(urls, fmt, retry, storage_options)
    if known is None and needs_streaming(urls, fmt):
        if remote_counts == "skip":
            return ResolvedSource(
                ShardSpecs.from_specs([ShardSpec(u, fmt, 1, counted=False) for u in urls])
            )
        if remote_counts != "stream":
            raise UsageError(no_counts_hint(urls))
    specs, unreadable, missing, counted = [], [], [], 0
    started = progress = time.perf_counter()
    for url in urls:
        spec = known.spec(url) if known else None
        if spec is None:
            try:
                spec = ShardSpec(url, fmt, count_samples(url, fmt, retry, storage_options))
                counted += 1
                if time.perf_counter() - progress > COUNT_PROGRESS_S:
                    progress = time.perf_counter()
                    log.info("counting shards without a manifest: %d of %d", counted, len(urls))
            except ObjectNotFoundError:
                missing.append(url)
                continue
            except (ShardError, OSError) as error:
                # One corrupt shard among many given as URLs costs that shard, not the job;
                # the loader names them once (`ResolvedSource.unreadable`).
                unreadable.append((redact_url(url), str(error)))
                continue
        specs.append(spec)
    refuse_missing(missing, len(urls), allow_missing)
    if not specs:
        first = unreadable[0][1] if unreadable else "none exist"
        raise UnreadableSourceError(
            f"none of the {len(urls)} shards could be read; first: {first}. "
            "Check the shards with `preprocess verify` or the URLs"
        )
    if counted:
        log_counting_pass(urls, counted, time.perf_counter() - started)
    # Class names are the dataset's, whichever of its shards were named: a trainer
    # launched on shard URLs needs no --num-classes when the manifest sits beside them.
    classes = list(known.manifest.classes) if known else None
    # Label facts hold for any subset of the dataset's shards; per-split counts do not.
    mode = (known.manifest.fields or {}).get("label", "single") if known else "single"
    return ResolvedSource(
        ShardSpecs.from_specs(specs),
        classes=classes,
        unreadable=tuple(unreadable),
        label_mode=mode,
    )


MISSING_NAMED = 3  # missing shards a refusal names


def present_urls(urls: list[str], allow_missing: bool) -> list[str]:
    """`urls` without the local files that do not exist: refused unless `allow_missing`."""
    missing = [url for url in urls if not is_remote(url) and not os.path.exists(url)]
    refuse_missing(missing, len(urls), allow_missing)
    if not missing:
        return urls
    gone = set(missing)
    return [url for url in urls if url not in gone]


def refuse_missing(missing: list[str], named: int, allow_missing: bool) -> None:
    """One line naming how many of the `named` shards are missing and the first few."""
    if not missing:
        return
    shown = ", ".join(redact_url(url) for url in missing[:MISSING_NAMED])
    more = f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
    line = f"{len(missing)} of the {named} shards named do not exist: {shown}{more}"
    if len(missing) == named or not allow_missing:
        raise UsageError(
            f"{line}; fix the pattern or the list, or read the ones that exist with "
            "LoaderConfig(io=ReadOptions(allow_missing_shards=True)) "
            "(train: --allow-missing-shards)"
        )
    log.warning("%s; reading the %d that exist (allow_missing_shards)", line, named - len(missing))


# Sources whose counting pass was already told in this process: a trainer resolves its
# source twice (classes, then the loader), and the line says the same both times.
_COUNTING_TOLD: set[tuple[str, int]] = set()


def log_counting_pass(urls: list[str], counted: int, seconds: float) -> None:
    """The one line that says what a source without a manifest could not give: once a
    process for each source."""
    folders = {manifest_base(url) for url in urls}
    where = folders.pop() if len(folders) == 1 else "DIR"
    told = (urls[0], len(urls))
    if told in _COUNTING_TOLD:
        return
    _COUNTING_TOLD.add(told)
    log.warning(
        "%d shards without a manifest: counted by reading them (%.1f s), no checksums; "
        "run `preprocess index %s` to save the counts",
        counted,
        seconds,
        redact_url(where),
    )


def read_manifest_url(
    url: str,
    retry: RetryPolicy,
    storage_options,
    *,
    split: str | None = None,
    fmt: str | None = None,
    checksums: bool = True,
) -> Manifest:
    """The manifest and the side tables the loader needs (`shards.manifest.read_manifest`).

    With `split`, only that split's side table is read; with `fmt`, only that
    format's columns (without, the loader's default: tar, else the first format);
    without `checksums`, not the side tables' sha256 column. Per-shard class
    counts are never read. Any malformed content is one `ManifestError`.
    """
    return read_manifest(
        url,
        retry=retry,
        storage_options=storage_options,
        splits=None if split is None else (split,),
        formats=(fmt or DEFAULT_FORMAT,),
        shard_class_counts=False,
        shard_digests=checksums,
    )


def from_manifest(manifest: Manifest, url: str, split: str, fmt: str | None) -> ResolvedSource:
    fmt = fmt or (DEFAULT_FORMAT if DEFAULT_FORMAT in manifest.formats else manifest.formats[0])
    table = manifest.shard_table(split, fmt)
    files = table.file_columns(fmt)
    # The manifest's names are validated plain file names (or plain names in their
    # format's directory), so these stay in its directory.
    specs = ShardSpecs(
        fmt,
        table.samples,
        prefix=manifest_base(url).rstrip("/") + "/" + (table.derived_prefix(fmt) or ""),
        split=split,
        names=files.names,
        sizes=files.sizes,
        digests=files.digests,
        table_sha256=table.table_sha256,
    )
    return ResolvedSource(
        specs,
        manifest.classes,
        manifest.splits[split].class_counts,
        url,
        **label_facts(manifest, split),
    )


def label_facts(manifest: Manifest, split: str) -> dict[str, Any]:
    """`label_mode`, `label_counts` and `members` of a split, from the manifest's `fields`."""
    fields = manifest.fields or {}
    counts = (fields.get("label_counts") or {}).get(split)
    members = None
    # `preprocess index` records only the members it knows the kind of: not all there are.
    indexed = isinstance(manifest.config, dict) and "indexed" in manifest.config
    if fields.get("members") and not indexed:
        members = tuple(dict.fromkeys([*fields["members"], *fields.get("columns", {})]))
    return {"label_mode": fields.get("label", "single"), "label_counts": counts, "members": members}


def dataset_manifest(directory: str, fmt: str | None) -> tuple[str, str | None]:
    """The manifest of a local dataset directory, and the format to read.

    A format directory of a `by_format` output (`OUT/tar`) has no manifest of its
    own: the one above it is the dataset's, read for that format.

    Raises:
        ValueError: `fmt` names another format than the directory holds.
    """
    candidate = os.path.join(directory, MANIFEST_NAME)
    parent, leaf = os.path.split(os.path.abspath(directory))
    above = os.path.join(parent, MANIFEST_NAME)
    if os.path.exists(candidate) or not is_format(leaf) or not os.path.exists(above):
        return candidate, fmt
    if fmt is not None and fmt != leaf:
        raise UsageError(
            f"format={fmt!r} but {directory} holds the {leaf} shards of the dataset in "
            f"{parent}; pass {parent} to read its {fmt} shards"
        )
    return above, leaf


class NeighbourManifest:
    """Specs of shards given as URLs, from the manifest in their directory (or the one
    above their format directory, in a `by_format` output)."""

    def __init__(self, manifest: Manifest, base: str, fmt: str) -> None:
        self.manifest = manifest
        self.base = base
        self.fmt = fmt

    def spec(self, url: str) -> ShardSpec | None:
        """The manifest's spec for `url`, None when it does not list that file."""
        head, _, name = url.rpartition("/")
        if head == f"{self.base}/{self.fmt}":
            name = f"{self.fmt}/{name}"  # a by_format layout's name, relative to the manifest
        elif head != self.base:
            return None
        if self.fmt not in self.manifest.formats:
            return None
        found = self.manifest.locate(name, self.fmt)
        if found is None:
            return None
        split, index = found
        table = self.manifest.splits[split].shards
        files = table.file_columns(self.fmt)
        samples, size = int(table.samples[index]), int(files.sizes[index])
        return ShardSpec(url, self.fmt, samples, files.sha256(index), size)


def neighbour_manifest(
    urls: list[str], fmt: str, retry, storage_options
) -> NeighbourManifest | None:
    """The `manifest.json` in the shards' directory, read for format `fmt`, if any.

    Shards in a directory named after their format (`OUT/tar/`, a `by_format`
    layout) without a manifest of its own take the one above it. A neighbour that
    is missing is fine (the shards are counted instead); one that exists but is
    malformed is an error, since it would otherwise be silently ignored.
    """
    base = manifest_base(urls[0])
    parent, _, leaf = base.rpartition("/")
    for root in (base, parent) if leaf == fmt and parent else (base,):
        candidate = f"{root}/{MANIFEST_NAME}"
        if not is_remote(candidate) and not os.path.exists(candidate):
            continue
        try:
            manifest = read_manifest_url(candidate, retry, storage_options, fmt=fmt)
        except OSError:
            continue
        return NeighbourManifest(manifest, root, fmt)
    return None


REMOTE_COUNTS = ("refuse", "stream", "skip")
COUNT_PROGRESS_S = 5.0  # seconds between two progress lines of a counting pass


def needs_streaming(urls: list[str], fmt: str) -> bool:
    """Whether counting these shards means reading remote ones whole (a format that can
    count from a footer, as Parquet, reads only that)."""
    return not get_format(fmt).random_access and any(is_remote(url) for url in urls)


def no_counts_hint(urls: list[str]) -> str:
    """Why remote shards without a manifest have no counts, and the three ways on."""
    first = redact_url(next(url for url in urls if is_remote(url)))
    return (
        f"no sample counts for {len(urls)} remote shards without a manifest ({first}, ...): "
        "exact epochs need counts. Draw samples instead with "
        "LoaderConfig(sampling=Resampled(epoch_samples=N)), count them by reading each once "
        "with ReadOptions(count_remote_shards=True), or save a manifest beside them with "
        f"`preprocess index {redact_url(manifest_base(urls[0]))}`"
    )


def is_remote_directory(source: Any) -> bool:
    """A remote URL naming a folder (prefix), not shard files nor a `.json` manifest."""
    if not isinstance(source, (str, os.PathLike)) or not is_remote(os.fspath(source)):
        return False
    path = urlsplit(os.fspath(source)).path
    if path.endswith(".json") or "{" in path or any(char in "*?[" for char in path):
        return False
    try:
        format_of_url(path)
    except ValueError:
        return True
    return False


def remote_dataset_manifest(
    url: str, fmt: str | None, retry: RetryPolicy, storage_options
) -> tuple[str | None, str | None]:
    """The manifest of a remote dataset folder and the format to read, as
    `dataset_manifest` for a local one (a `by_format` folder takes the one above it);
    None when neither is there (shards we did not build)."""
    base = url.rstrip("/")
    candidate = f"{base}/{MANIFEST_NAME}"
    if exists(candidate, retry, storage_options=storage_options):
        return candidate, fmt
    parent, _, leaf = base.rpartition("/")
    above = f"{parent}/{MANIFEST_NAME}"
    if (
        is_format(leaf)
        and fmt in (None, leaf)
        and exists(above, retry, storage_options=storage_options)
    ):
        return above, leaf
    return None, fmt


def count_samples(url: str, fmt: str, retry: RetryPolicy, storage_options) -> int:
    """Samples in one shard without a manifest: tar headers (a remote tar streamed once)
    or the Parquet footer.

    Raises:
        ShardError: the shard is malformed (named in the message).
    """
    shard_format = get_format(fmt)
    with open_stream(
        url, retry, storage_options=storage_options, random_access=shard_format.random_access
    ) as stream:
        return shard_format.count_samples(stream, url)
