"""Resolve a loader source (manifest, shard URLs, patterns) into shard specs with counts.

A manifest is the preferred source: it gives every shard's URL, sample count
and checksum without opening a shard. Plain URLs work too; their counts come
from a `manifest.json` beside them, else from the shards themselves (tar
headers or the Parquet footer), which is cheap for local files; a shard that
cannot even be counted is left out of the epoch and reported, not fatal.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pipeline.opener import DEFAULT_RETRY, RetryPolicy, open_stream
from pipeline.urls import expand_urls, url_scheme
from shards.errors import ShardError
from shards.formats import ShardFormat, format_of_url, get_format
from shards.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, ManifestError
from shards.redact import redact_url

log = logging.getLogger("pipeline")


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
    """

    url: str = field(repr=False)
    fmt: str
    samples: int
    sha256: str | None = None
    bytes: int | None = None

    @property
    def format(self) -> ShardFormat:
        return get_format(self.fmt)

    @property
    def display(self) -> str:
        """The URL with credentials redacted: the one form that may be printed."""
        return redact_url(self.url)

    def __repr__(self) -> str:
        return f"ShardSpec({self.display!r}, {self.fmt!r}, {self.samples})"


@dataclass(frozen=True)
class ResolvedSource:
    """What the loader needs to plan an epoch.

    Attributes:
        unreadable: `(redacted URL, reason)` of shards given as URLs that could not
            even be counted; they take no part in the epoch, and the loader logs them.
    """

    shards: list[ShardSpec]
    classes: list[str] | None = None
    class_counts: list[int] | None = None
    manifest_url: str | None = None
    unreadable: tuple[tuple[str, str], ...] = ()

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)


def manifest_path(url: str) -> str:
    """The path part of a manifest URL: a presigned URL's query string is not part of it."""
    return urlsplit(url).path if url_scheme(url) not in ("", "file") else url


def is_manifest_source(source: Any) -> bool:
    """A `.json` file or URL (presigned ones included), or a local dataset directory."""
    if not isinstance(source, (str, os.PathLike)):
        return False
    text = os.fspath(source)
    local = url_scheme(text) in ("", "file")
    return manifest_path(text).endswith(".json") or (local and os.path.isdir(text))


def resolve_source(
    source: str | os.PathLike | Sequence[str],
    split: str,
    fmt: str | None = None,
    *,
    retry: RetryPolicy = DEFAULT_RETRY,
    storage_options: Mapping[str, Any] | None = None,
) -> ResolvedSource:
    """Shard specs for `split` from a manifest (path, dir or URL) or from shard URLs.

    Raises:
        ManifestError: the manifest is malformed (the message names it and the field).
        ValueError: unknown split or format, mixed formats, or counts unavailable.
    """
    if is_manifest_source(source):
        url = os.fspath(source)
        if url_scheme(url) in ("", "file") and os.path.isdir(url):
            url = os.path.join(url, MANIFEST_NAME)
        manifest = read_manifest_url(url, retry, storage_options)
        return from_manifest(manifest, url, split, fmt)
    urls = expand_urls(source)
    formats = {format_of_url(u).name for u in urls}
    if len(formats) != 1:
        raise ValueError(f"shard URLs mix formats {sorted(formats)}; give one format per loader")
    found = formats.pop()
    if fmt and fmt != found:
        raise ValueError(f"format={fmt!r} but the URLs are {found} shards")
    known = specs_from_neighbour_manifest(urls, retry, storage_options)
    specs, unreadable = [], []
    for url in urls:
        spec = known.get(url)
        if spec is None:
            try:
                spec = ShardSpec(url, found, count_samples(url, found, retry, storage_options))
            except (ShardError, OSError) as error:
                # One corrupt shard among many given as URLs costs that shard, not the job.
                log.warning(
                    "shard %s cannot be counted, left out of the epoch: %s", redact_url(url), error
                )
                unreadable.append((redact_url(url), str(error)))
                continue
        specs.append(spec)
    if not specs:
        raise ValueError(
            f"none of the {len(urls)} shards could be read; first: {unreadable[0][1]}. "
            "Check the shards with `preprocess verify` or the URLs"
        )
    return ResolvedSource(specs, unreadable=tuple(unreadable))


def read_manifest_url(url: str, retry: RetryPolicy, storage_options) -> Manifest:
    """Fetch and validate a manifest; any malformed content is one `ManifestError`."""
    with open_stream(url, retry, storage_options=storage_options) as stream:
        data = stream.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ManifestError(
            url, "(file)", f"larger than {MAX_MANIFEST_BYTES} bytes; not a manifest"
        )
    return Manifest.from_json(data, url)


def manifest_base(url: str) -> str:
    """The directory shard names in a manifest are relative to (no query string)."""
    if url_scheme(url) in ("", "file"):
        return os.path.dirname(os.path.abspath(url))
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, posixpath.dirname(parts.path), "", ""))


def from_manifest(manifest: Manifest, url: str, split: str, fmt: str | None) -> ResolvedSource:
    fmt = fmt or ("tar" if "tar" in manifest.formats else manifest.formats[0])
    # The manifest's names are validated plain file names, so these stay in its directory.
    urls = manifest.shard_urls(split, fmt, manifest_base(url))
    info = manifest.splits[split]
    specs = [
        ShardSpec(u, fmt, s.samples, s.files[fmt].sha256, s.files[fmt].bytes)
        for u, s in zip(urls, info.shards, strict=True)
    ]
    return ResolvedSource(specs, manifest.classes, info.class_counts, url)


def specs_from_neighbour_manifest(urls: list[str], retry, storage_options) -> dict[str, ShardSpec]:
    """Specs (counts, checksums, sizes) from a `manifest.json` in the shards' directory.

    A neighbour that is missing is fine (the shards are counted instead); one that
    exists but is malformed is an error, since it would otherwise be silently ignored.
    """
    base = manifest_base(urls[0])
    candidate = f"{base}/{MANIFEST_NAME}"
    if url_scheme(candidate) in ("", "file") and not os.path.exists(candidate):
        return {}
    try:
        manifest = read_manifest_url(candidate, retry, storage_options)
    except OSError:
        return {}
    specs = {}
    for split in manifest.splits.values():
        for shard in split.shards:
            for name, file in shard.files.items():
                url = f"{base}/{file.name}"
                specs[url] = ShardSpec(url, name, shard.samples, file.sha256, file.bytes)
    return specs


def count_samples(url: str, fmt: str, retry: RetryPolicy, storage_options) -> int:
    """Samples in one shard without a manifest: tar headers or the Parquet footer.

    Raises:
        ShardError: the shard is malformed (named in the message).
        ValueError: a remote tar shard: counting it would download it whole.
    """
    shard_format = get_format(fmt)
    if not shard_format.random_access and url_scheme(url) not in ("", "file"):
        raise ValueError(
            f"no sample counts for remote shard {redact_url(url)}: pass the dataset's "
            "manifest.json as the source (exact epochs need counts), or use resampled=True "
            "with epoch_samples"
        )
    with open_stream(
        url, retry, storage_options=storage_options, random_access=shard_format.random_access
    ) as stream:
        return shard_format.count_samples(stream, url)
