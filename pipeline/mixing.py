"""Weighted sources: several datasets read as one epoch (`LoaderConfig(source=[Source(...)])`).

A `Source` declares its share of the epoch (a weight, a sample count or a repeat
factor); `source_quotas` turns the shares into exact per-source sample counts and
`resolve_mix` resolves the sources and unifies their classes. The epoch plan lays the
quotas out (`pipeline.epoch`: one plan for a mix and for one plain source, which is a
mix of one). No torch here: `pipeline.config` checks a config's `Source`s with it.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property
from typing import Any

import numpy as np

from pipeline.config import Source, source_names
from pipeline.epoch import Mix
from pipeline.sources import ResolvedSource, resolve_source
from shards.errors import DataError, ShardpipeError, UsageError

# The most samples a mix's epoch may hold: stream positions are int64 and a share's
# float arithmetic (shuffle buffers) is exact below 2**53, which at 10^5 samples/s is
# ~2,800 years of reading: far past any epoch, and refused in one line beyond.
MAX_EPOCH_SAMPLES = 2**53


def source_quotas(
    sources: Sequence[Source], sizes: Sequence[int], epoch_samples: int | None
) -> tuple[int, ...]:
    """Samples each source gives an epoch: exact, summing to the epoch.

    Weights share `epoch_samples` (default: the sum of `sizes`), rounded down, the
    samples left over given one each to the largest remainders (ties: the first
    source); a repeat factor is rounded to the nearest sample (halves up).

    Raises:
        UsageError: weights given for some sources only, `epoch_samples` without
            weights, an empty source, a source whose share rounds to no sample, or an
            epoch past `MAX_EPOCH_SAMPLES` (named by the source and its field).
    """
    names = source_names(sources)
    for name, size in zip(names, sizes, strict=True):
        if size < 1:
            raise UsageError(f"source {name!r} holds no samples; leave it out of the mix")
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise UsageError(
            "give every source of a mix a weight, or none (then samples= or repeat=): "
            f"{', '.join(n for n, w in zip(names, weighted, strict=True) if not w)} have none"
        )
    if all(weighted):
        total = sum(sizes) if epoch_samples is None else epoch_samples
        if total > MAX_EPOCH_SAMPLES:
            raise UsageError(
                f"Mixing.epoch_samples={total} is past the 2**53 samples an epoch a mix can "
                "plan exactly; lower it (one epoch need not be the whole run)"
            )
        shares = [
            Fraction(s.weight) * total / sum(Fraction(x.weight) for x in sources) for s in sources
        ]
        quotas = [int(share) for share in shares]
        by_remainder = sorted(range(len(sources)), key=lambda i: (-(shares[i] - quotas[i]), i))
        for i in by_remainder[: total - sum(quotas)]:
            quotas[i] += 1
    elif epoch_samples is not None:
        raise UsageError(
            "Mixing(epoch_samples=...) is shared out by weights; with samples= or repeat= "
            "the epoch is their sum: leave epoch_samples out, or give weights"
        )
    else:
        quotas = [
            s.samples if s.samples is not None else int(Fraction(s.repeat) * size + Fraction(1, 2))
            for s, size in zip(sources, sizes, strict=True)
        ]
    for name, source, quota in zip(names, sources, quotas, strict=True):
        asked = "samples" if source.samples is not None else "repeat"
        if source.weight is None and quota > MAX_EPOCH_SAMPLES:
            raise UsageError(
                f"source {name!r}: {asked}={getattr(source, asked)!r} asks {quota} samples an "
                "epoch, past the 2**53 a mix can plan exactly; lower it"
            )
    if sum(quotas) > MAX_EPOCH_SAMPLES:
        raise UsageError(
            f"the quotas of sources {', '.join(names)} sum to {sum(quotas)} samples an epoch, "
            "past the 2**53 a mix can plan exactly; lower their samples= or repeat="
        )
    empty = [name for name, quota in zip(names, quotas, strict=True) if quota < 1]
    if empty:
        raise UsageError(
            f"sources {', '.join(empty)} get no sample an epoch at these shares; raise "
            "their share or Mixing(epoch_samples=...)"
        )
    return tuple(quotas)


@dataclass(frozen=True)
class ResolvedMix:
    """A mix's sources resolved: what the loader plans, reads and reports by.

    Attributes:
        parts: each source's shards, as one source's (`pipeline.sources.ResolvedSource`).
        names, quotas: each source's name and samples an epoch.
        classes: the class names of all sources by name (one list when they agree, else
            their sorted union); None when no source names its classes.
        remaps: per source, its class ids to `classes`' (None: the same ids).
    """

    parts: tuple[ResolvedSource, ...]
    names: tuple[str, ...]
    quotas: tuple[int, ...]
    classes: list[str] | None
    remaps: tuple[tuple[int, ...] | None, ...]

    manifest_url = None
    class_counts = None  # per-source counts do not add up to the epoch's
    label_counts = None

    @cached_property
    def shards(self) -> ChainedShards:
        """Every source's shards, one after another (what a run's data identity lists)."""
        return ChainedShards(self.names, tuple(part.shards for part in self.parts))

    @property
    def label_mode(self) -> str:
        """`none` when no source has labels, `multi` when one has multi-label targets."""
        modes = {part.label_mode for part in self.parts}
        return "multi" if "multi" in modes else "none" if modes == {"none"} else "single"

    @property
    def unreadable(self) -> tuple[tuple[str, str], ...]:
        return tuple(item for part in self.parts for item in part.unreadable)

    @property
    def total_samples(self) -> int:
        """Samples an epoch: the quotas' sum."""
        return sum(self.quotas)

    def mix(self, unit: int = 1) -> Mix:
        return Mix(self.names, tuple(p.counts for p in self.parts), self.quotas, unit)


def resolve_mix(
    sources: Sequence[Source], epoch_samples: int | None, fmt: str | None, **read: Any
) -> ResolvedMix:
    """Each source resolved (`pipeline.sources.resolve_source`), its quota, the classes unified.

    Args:
        fmt: the loader's format, for sources that name none.
        read: `retry`, `storage_options`, `checksums`, `allow_missing`, as for one source.

    Raises:
        UsageError: names clash, the shares do not work out (`source_quotas`), or
            multi-label sources name their classes differently.
        What `resolve_source` raises, the message prefixed with the source's name.
    """
    names = source_names(sources)
    parts = []
    for name, source in zip(names, sources, strict=True):
        try:
            parts.append(resolve_source(source.source, source.split, source.format or fmt, **read))
        except ShardpipeError as error:
            kind = UsageError if isinstance(error, UsageError) else DataError
            raise kind(f"source {name!r}: {error}") from error
    quotas = source_quotas(sources, [p.total_samples for p in parts], epoch_samples)
    classes, remaps = unify_classes(parts)
    multi = any(p.label_mode == "multi" for p in parts)
    if multi and any(r is not None for r in remaps):
        raise UsageError(
            "multi-label sources of a mix must name the same classes in the same order "
            f"({', '.join(names)} do not); rebuild them with one class list"
        )
    return ResolvedMix(tuple(parts), names, quotas, classes, remaps)


def unify_classes(
    parts: Sequence[ResolvedSource],
) -> tuple[list[str] | None, tuple[tuple[int, ...] | None, ...]]:
    """One class list for all sources, by name, and each source's ids mapped into it."""
    named = [p.classes for p in parts if p.classes]
    if not named:
        return None, tuple(None for _ in parts)
    if all(c == named[0] for c in named):
        return list(named[0]), tuple(None for _ in parts)
    classes = sorted(set().union(*named))
    position = {name: i for i, name in enumerate(classes)}
    remaps = tuple(None if not p.classes else tuple(position[c] for c in p.classes) for p in parts)
    return classes, remaps


class ChainedShards(Sequence):
    """The shards of a mix's sources as one read-only sequence, in source order.

    Speaks the `pipeline.sources.ShardSpecs` columns a trainer reads (`samples`,
    `iter_file_names`, `iter_sha256`), file names prefixed with the source's name.
    """

    table_sha256 = None  # several manifests: each shard's own digest stands for it

    def __init__(self, names: tuple[str, ...], parts: tuple[Sequence, ...]) -> None:
        self.names, self.parts = names, parts
        self.ends = np.cumsum([len(part) for part in parts])
        self.samples = np.concatenate([np.asarray(p.samples, np.int64) for p in parts])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index: int):  # type: ignore[override]
        index = operator.index(index) % len(self) if len(self) else operator.index(index)
        part = int(np.searchsorted(self.ends, index, side="right"))
        return self.parts[part][index - (int(self.ends[part - 1]) if part else 0)]

    def __iter__(self) -> Iterator:
        return itertools.chain.from_iterable(self.parts)

    def iter_file_names(self) -> Iterator[str]:
        for name, part in zip(self.names, self.parts, strict=True):
            yield from (f"{name}/{file}" for file in part.iter_file_names())

    def iter_sha256(self) -> Iterator[str | None]:
        return itertools.chain.from_iterable(part.iter_sha256() for part in self.parts)
