"""Resolve a loader source (manifest, shard URLs, patterns) into shard specs with counts.

A manifest is the preferred source: it gives every shard's URL, sample count
and checksum without opening a shard. Plain URLs work too; their counts come
from a `manifest.json` beside them, else from the shards themselves (tar
headers or the Parquet footer), which is cheap for local files.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pipeline.opener import DEFAULT_RETRY, RetryPolicy, open_stream
from pipeline.urls import expand_urls, url_scheme, url_suffix_format
from shards.manifest import MANIFEST_NAME, Manifest

MAX_MANIFEST_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ShardSpec:
    """One shard as the loader sees it."""

    url: str
    fmt: str  # tar | parquet
    samples: int
    sha256: str | None = None


@dataclass(frozen=True)
class ResolvedSource:
    """What the loader needs to plan an epoch."""

    shards: list[ShardSpec]
    classes: list[str] | None = None
    class_counts: list[int] | None = None
    manifest_url: str | None = None

    @property
    def total_samples(self) -> int:
        return sum(s.samples for s in self.shards)


def is_manifest_source(source: Any) -> bool:
    if not isinstance(source, (str, os.PathLike)):
        return False
    text = os.fspath(source)
    return text.endswith(".json") or (url_scheme(text) in ("", "file") and os.path.isdir(text))


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
        ValueError: unknown split or format, mixed formats, or counts unavailable.
    """
    if is_manifest_source(source):
        url = os.fspath(source)
        if url_scheme(url) in ("", "file") and os.path.isdir(url):
            url = os.path.join(url, MANIFEST_NAME)
        manifest = read_manifest_url(url, retry, storage_options)
        return from_manifest(manifest, url, split, fmt)
    urls = expand_urls(source)
    formats = {url_suffix_format(u) for u in urls}
    if len(formats) != 1:
        raise ValueError(f"shard URLs mix formats {sorted(formats)}; give one format per loader")
    found = formats.pop()
    if fmt and fmt != found:
        raise ValueError(f"format={fmt!r} but the URLs are {found} shards")
    counts = counts_from_neighbour_manifest(urls, retry, storage_options)
    specs = []
    for url in urls:
        samples = counts.get(url)
        if samples is None:
            samples = count_samples(url, found, retry, storage_options)
        specs.append(ShardSpec(url, found, samples))
    return ResolvedSource(specs)


def read_manifest_url(url: str, retry: RetryPolicy, storage_options) -> Manifest:
    with open_stream(url, retry, storage_options=storage_options) as stream:
        data = stream.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"{url} is larger than {MAX_MANIFEST_BYTES} bytes; not a manifest")
    return Manifest.from_json(data.decode("utf-8"), url)


def from_manifest(manifest: Manifest, url: str, split: str, fmt: str | None) -> ResolvedSource:
    fmt = fmt or ("tar" if "tar" in manifest.formats else manifest.formats[0])
    base = posixpath.dirname(url) if "://" in url else os.path.dirname(os.path.abspath(url))
    urls = manifest.shard_urls(split, fmt, base)
    info = manifest.splits[split]
    specs = [
        ShardSpec(u, fmt, s.samples, s.files[fmt].sha256)
        for u, s in zip(urls, info.shards, strict=True)
    ]
    return ResolvedSource(specs, manifest.classes, info.class_counts, url)


def counts_from_neighbour_manifest(urls: list[str], retry, storage_options) -> dict[str, int]:
    """Counts from a `manifest.json` in the shards' directory, when there is one."""
    base = posixpath.dirname(urls[0]) if "://" in urls[0] else os.path.dirname(urls[0])
    candidate = f"{base}/{MANIFEST_NAME}"
    if url_scheme(candidate) in ("", "file") and not os.path.exists(candidate):
        return {}
    try:
        manifest = read_manifest_url(candidate, retry, storage_options)
    except (OSError, ValueError):
        return {}
    counts = {}
    for split in manifest.splits.values():
        for shard in split.shards:
            for file in shard.files.values():
                counts[f"{base}/{file.name}"] = shard.samples
    return counts


def count_samples(url: str, fmt: str, retry: RetryPolicy, storage_options) -> int:
    """Samples in one shard without a manifest: tar headers or the Parquet footer."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with open_stream(url, retry, storage_options=storage_options, random_access=True) as stream:
            return pq.ParquetFile(stream).metadata.num_rows
    from shards.tar import count_tar_samples

    if url_scheme(url) not in ("", "file"):
        raise ValueError(
            f"no sample counts for remote shard {url}: pass the dataset's manifest.json as the "
            "source (exact epochs need counts), or use resampled=True with epoch_samples"
        )
    with open_stream(url, retry, storage_options=storage_options) as stream:
        return count_tar_samples(stream)
