"""The root of our errors (`ShardpipeError`: `DataError`, `UsageError`), the one error type
for bad shard bytes, and the read limits every shard reader obeys.

Every error class of the project derives from `ShardpipeError`, through one of two kinds:
`DataError` (the input data cannot be used: shards, manifests, samples, build inputs,
checkpoints) and `UsageError` (a setting or request that cannot be honoured). A command
line prints one line for these and exits 1 (2 for a refused command line); any other
exception (`TypeError`, a bare `KeyError`, ...) is a bug in our code and keeps its
traceback. Each class keeps the builtin base it had (`ManifestError` is a `ValueError`,
`ShardReadError` an `OSError`), so code catching those still catches them.

A reader that meets a shard it cannot trust raises `ShardError`: the loader and
`preprocess verify` catch exactly that (plus transient I/O errors), count it and move
on; any other exception from a reader is a bug and propagates. Problems confined to
one sample (an oversized member, a null cell, a name that is not UTF-8) are not
shard errors: the reader yields that sample with `__error__` set to a `SampleError`,
so it costs one counted skip and the rest of the shard survives.
"""

from __future__ import annotations

from dataclasses import dataclass

from shards.redact import redact_url


class ShardpipeError(Exception):
    """The root of every error this project raises on purpose; anything else is a bug."""


class DataError(ShardpipeError):
    """The input data cannot be used as asked: a shard, manifest, sample, build input or
    checkpoint that is missing, malformed or inconsistent. The message names it."""


class UsageError(ShardpipeError, ValueError):
    """A setting outside what it allows, or a request that cannot be honoured here (an
    unknown model, a device that is not there). A `ValueError`, as bad arguments are."""


class ShardError(DataError):
    """A shard's bytes break the format or the manifest's promises; the shard is skipped.

    Attributes:
        reason: a short stable slug (`bad_header`, `truncated`, `shard_short`,
            `shard_long`, `schema`, `checksum`, `too_large`, ...), the key of the
            loader's shard-error counts.
        url: the shard URL, redacted: safe to log.
        key: the sample key being read when the problem showed, if known.
        detail: what exactly is wrong, and what to do about it.
    """

    def __init__(self, reason: str, url: str, detail: str = "", key: str | None = None) -> None:
        self.reason = reason
        self.url = redact_url(url)
        self.key = key
        self.detail = detail
        where = f"shard {self.url}" + (f" (sample {key})" if key is not None else "")
        super().__init__(f"{where}: {reason}" + (f": {detail}" if detail else ""))

    def __reduce__(self) -> tuple[type, tuple]:
        # Keeps the attributes when the error crosses a DataLoader worker's pipe.
        return (type(self), (self.reason, self.url, self.detail, self.key))


# Why these defaults: a member (or Parquet cell) holds one encoded image; 64 MiB is
# ~30x the largest photo a training set stores and keeps one worker's peak memory
# bounded. Extended headers (pax records, GNU long names) are a few hundred bytes in
# practice. A shard of 10k samples has ~30k members; a million allows 30x that and
# still stops a server that streams headers forever. 64 GiB bounds a shard whose
# manifest gives no byte count (a manifest's count is used instead when it has one).
# A Parquet row group's image column is one page in our files, read whole, so a
# reader's peak is about 1.3-1.5x the group (measured: 257 MiB for one row of a
# 200 MiB group). Ours are 128 rows, ~15 MiB for 256-px JPEGs; 128 MiB leaves 8x for
# larger images or groups, holds a 64 MiB cell with its neighbours, and keeps a
# worker's open shard under ~200 MiB.
MAX_MEMBER_BYTES = 64 * 2**20
MAX_HEADER_BYTES = 1 * 2**20
MAX_MEMBERS = 1_000_000
MAX_SHARD_BYTES = 64 * 2**30
MAX_ROW_GROUP_BYTES = 128 * 2**20


@dataclass(frozen=True)
class MemberCap:
    """A cap on one member (a tar member, a Parquet column's cells) tighter than
    `ReadLimits.member_bytes`, set by the field that reads it.

    A reader checks a member's size against its cap before reading it (a tar header
    gives the size first): one over it is passed over unread and its sample carries
    `__error__ = SampleError(reason, ...)` (`shards.sample.oversized_member`), the
    reason its field's decode would have given, so it costs what any other bad value
    costs: one counted skip, and no bytes held in the shuffle buffer.

    Attributes:
        member: the member (tar field, Parquet column): `txt`, `json`, `cls`, ...
        max_bytes: the most bytes it may hold.
        reason: the skip reason: `bad_text`, `bad_json`, `bad_label`, `bad_labels`,
            `bad_weight` (`shards.sample.BAD_VALUE_REASONS`), or `member_too_large`.
        field: the loader field that set the cap, for the message (empty: none).
    """

    member: str
    max_bytes: int
    reason: str
    field: str = ""


@dataclass(frozen=True)
class ReadLimits:
    """Caps one shard read obeys; past any of them the shard is bad (`ShardError`).

    Attributes:
        member_bytes: one tar member's data or one Parquet cell; larger ones make
            their sample a counted skip (`member_too_large`), read past unread.
        header_bytes: one tar extended header (pax records, GNU long name).
        members: tar members in one shard (every kind, skipped ones too).
        shard_bytes: bytes of one shard; the manifest's byte count when known.
        row_group_bytes: one Parquet row group's uncompressed size, which is what
            reading it costs in memory; rebuild with a smaller `--row-group-size`.
        member_caps: tighter caps on named members (the loader sets one per member
            its text, JSON, label, multi-label and weight fields read, from their
            `Field.max_bytes`: `shards.sample.member_caps`); see `cap_for`.
    """

    member_bytes: int = MAX_MEMBER_BYTES
    header_bytes: int = MAX_HEADER_BYTES
    members: int = MAX_MEMBERS
    shard_bytes: int = MAX_SHARD_BYTES
    row_group_bytes: int = MAX_ROW_GROUP_BYTES
    member_caps: tuple[MemberCap, ...] = ()

    def __post_init__(self) -> None:
        for name in ("member_bytes", "header_bytes", "members", "shard_bytes", "row_group_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ReadLimits.{name} must be a positive integer, got {value!r}")
        caps = self.member_caps
        if not isinstance(caps, tuple) or not all(isinstance(cap, MemberCap) for cap in caps):
            raise ValueError(f"ReadLimits.member_caps must be a tuple of MemberCap, got {caps!r}")

    def cap_for(self, member: str) -> MemberCap:
        """The cap a reader applies to `member` before reading it: the smallest of its
        `member_caps` when under `member_bytes`, else `member_bytes` (`member_too_large`).

        Readers call it once per member name per shard, never per sample.
        """
        cap = MemberCap(member, self.member_bytes, "member_too_large")
        for candidate in self.member_caps:
            if candidate.member == member and candidate.max_bytes < cap.max_bytes:
                cap = candidate
        return cap


DEFAULT_LIMITS = ReadLimits()
