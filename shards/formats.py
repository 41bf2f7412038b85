"""The shard-format registry: the one place that knows which formats exist and how each is read.

Every caller (build, verify, loader, shuffle inspection, trainer) goes through a
`ShardFormat` and never dispatches on a format's name itself. Both readers share one
signature and one contract:

* `iter_samples(stream, url, start=0, stop=None, *, fields, limits, declared)` yields
  the samples with index in `[start, stop)` as `Sample` dicts holding `__key__`,
  `__url__` (redacted) and the requested `fields` that the sample has; other fields
  are passed over unread. A sample is a tar key group with at least one allowlisted
  member, or a Parquet row. `fields` may name members beyond the allowlist (a
  `shards.sample.Field` mapping `caption`, say): they are read when present, decoded
  by the loader only as their field's kind, and never change what counts as a sample. `stop=None` reads to `declared` (when given) or the end.
* A problem confined to one sample makes it a sample with `__error__` (a `SampleError`):
  one counted skip. A problem with the shard raises `ShardError`, after every good
  sample before it was yielded. A shard that ends before `stop` raises `shard_short`;
  one holding more than `declared` samples raises `shard_long` once the declared ones
  are out (its extra samples are never read).
* `count_samples(stream, url, limits)` counts samples the same way, reading headers
  or the footer only.
* `list_members(stream, url, limits)` names what the samples hold, for messages: the
  first sample's members (tar) or the file's columns (Parquet), headers or footer only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol
from urllib.parse import urlsplit

from shards import parquet, tar
from shards.errors import ReadLimits, UsageError
from shards.redact import redact_url
from shards.sample import Sample


class ShardWriter(Protocol):
    """What build-shards writes through: one sample at a time, then `close`."""

    count: int

    def write(self, sample: Sample) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ShardFormat:
    """One on-disk shard format.

    Attributes:
        name: the name used in manifests and options (`tar`, `parquet`).
        suffix: the file suffix that identifies it in a URL (`.tar`).
        random_access: readers seek (Parquet's footer, then row groups), so remote
            streams must be opened seekable.
        columnar: reading a few fields reads only their bytes, not the samples' whole
            (Parquet's column chunks): where labels alone are cheap to read.
        schema: the file declares its members once for every sample (a schema):
            `list_members` names what every sample holds, and the reader refuses a
            label field asked for that the file lacks rather than yield samples without.
        min_sample_bytes: the fewest bytes one sample can take in a file of this
            format; a manifest claiming more samples than `bytes // this` lies.
        open_writer: `(fileobj, image_field, row_group_size, *, class_names=None,
            description=None, split=None, members=None) -> ShardWriter`; the keywords
            describe the dataset for formats whose files carry metadata or a schema
            (Parquet: `members` fixes the columns even of a shard whose every input was
            skipped), others ignore them.
        iter_samples: the reader; see the module docstring for its contract.
        count_samples: `(stream, url, limits) -> int`, headers or footer only.
        list_members: `(stream, url, limits) -> tuple[str, ...]`: the member names of
            the first sample (tar) or the columns (Parquet), headers or footer only;
            what a message names when a field reads a member the samples lack.
        sample_bytes: `(sample) -> int`, the bytes one sample adds to a file of this
            format (exact for tar; the payload for Parquet), for sizing shards.
        file_overhead_bytes: the least a file of this format adds beyond its samples
            (a tar's two end blocks), for estimates.
        download_status: img2dataset writes each shard's download status as a file of
            this format beside it (`00000.parquet` by `00000.tar` and
            `00000_stats.json`): in a folder without a manifest, such files beside
            another format's shards are that status, not shards.
    """

    name: str
    suffix: str
    random_access: bool
    columnar: bool
    schema: bool
    min_sample_bytes: int
    open_writer: Callable[..., ShardWriter]
    iter_samples: Callable[..., Iterator[Sample]]
    count_samples: Callable[[Any, str, ReadLimits], int]
    list_members: Callable[[Any, str, ReadLimits], tuple[str, ...]]
    sample_bytes: Callable[[Sample], int]
    file_overhead_bytes: int = 0
    download_status: bool = False


def _tar_writer(
    fileobj: BinaryIO,
    image_field: str,
    row_group_size: int,
    *,
    class_names: Sequence[str] | None = None,
    description: str | None = None,
    split: str | None = None,
    members: Sequence[str] | None = None,
) -> ShardWriter:
    # Tar members carry no dataset metadata: the manifest beside the shards does.
    return tar.TarShardWriter(fileobj)


def _parquet_writer(
    fileobj: BinaryIO,
    image_field: str,
    row_group_size: int,
    *,
    class_names: Sequence[str] | None = None,
    description: str | None = None,
    split: str | None = None,
    members: Sequence[str] | None = None,
) -> ShardWriter:
    return parquet.ParquetShardWriter(
        fileobj,
        image_field,
        row_group_size,
        class_names=class_names,
        description=description,
        split=split,
        members=members,
    )


def _tar_sample_bytes(sample: Sample) -> int:
    key = sample["__key__"]
    return sum(
        len(tar.member_header(f"{key}.{name}", len(data))) + len(data) + (-len(data) % tar.BLOCK)
        for name, data in sample.items()
        if not name.startswith("__")
    )


def _payload_bytes(sample: Sample) -> int:
    return sum(len(data) for name, data in sample.items() if not name.startswith("__"))


TAR = ShardFormat(
    name="tar",
    suffix=".tar",
    random_access=False,
    columnar=False,
    schema=False,
    # A sample's smallest form: one header block for an empty member.
    min_sample_bytes=tar.BLOCK,
    open_writer=_tar_writer,
    iter_samples=tar.iter_tar_samples,
    count_samples=tar.count_tar_samples,
    list_members=tar.first_sample_members,
    sample_bytes=_tar_sample_bytes,
    file_overhead_bytes=2 * tar.BLOCK,
)
PARQUET = ShardFormat(
    name="parquet",
    suffix=".parquet",
    random_access=True,
    columnar=True,
    schema=True,
    min_sample_bytes=1,
    open_writer=_parquet_writer,
    iter_samples=parquet.iter_parquet_samples,
    count_samples=parquet.count_parquet_samples,
    list_members=parquet.column_names,
    sample_bytes=_payload_bytes,
    download_status=True,
)
# The registry: a format is its module's reader and writer plus one entry here. Code
# looks formats up here when it runs (`FORMATS`, `get_format`, `is_format`), so a
# format registered later (a test's) is known everywhere; `FORMAT_NAMES` is the list
# at import, what a build writes by default and the choices `--help` shows.
FORMATS: dict[str, ShardFormat] = {fmt.name: fmt for fmt in (TAR, PARQUET)}
FORMAT_NAMES = tuple(FORMATS)
# What is read when a manifest holds several formats and none is asked for, and what
# `--shard-bytes` measures: tar, the format every webdataset-style reader streams.
DEFAULT_FORMAT = TAR.name


def is_format(name: object) -> bool:
    """Whether `name` is a registered format's name."""
    return isinstance(name, str) and name in FORMATS


def get_format(name: str) -> ShardFormat:
    """The format called `name`.

    Raises:
        UsageError: no such format; the message lists the known ones.
    """
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise UsageError(
            f"unknown shard format {name!r}; known formats: {', '.join(FORMATS)}"
        ) from None


def format_of_url(url: str) -> ShardFormat:
    """The format a shard URL's path suffix names; query strings and fragments are ignored.

    Raises:
        UsageError: the suffix names no format (compressed `.tar.gz` shards are not
            supported: we never inflate data).
    """
    path = urlsplit(url).path if "://" in url else url
    for fmt in FORMATS.values():
        if path.lower().endswith(fmt.suffix):
            return fmt
    suffixes = ", ".join(fmt.suffix for fmt in FORMATS.values())
    raise UsageError(
        f"cannot tell the shard format of {redact_url(url)!r}: its path must end in one of "
        f"{suffixes}; pass a manifest.json or its directory to read a dataset"
    )
