"""`Source` and `Mixing`: the datasets of a mix and how each epoch shares them out.

A `Source` names one dataset and its share of the epoch (weight, samples or repeat);
`Mixing` sets the mix's epoch length and batch make-up. They check themselves where they
are made, like every group of `pipeline.config`, and import no torch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from shards.errors import UsageError
from shards.flags import check_choice, check_int_at_least, refuse
from shards.formats import FORMATS, is_format
from shards.redact import redact_url
from shards.storage import is_remote


@dataclass(frozen=True)
class Mixing:
    """How a mix of sources (`source=[Source(...), ...]`) shares out each epoch.

    Attributes:
        epoch_samples: samples an epoch over all ranks that the sources' weights share
            out; default: the sum of the sources' sizes. Only with weights (with
            `samples=` or `repeat=` the epoch is their sum).
        batches: `mixed` (default): every batch holds each source's share, rounded,
            the remainder rotated; `single`: sources take turns in runs of a batch, so a
            batch holds one source when its rank's share starts on a run (see
            docs/LOADER.md, "Mixing datasets").
    """

    epoch_samples: int | None = None
    batches: str = "mixed"

    def __post_init__(self) -> None:
        if self.epoch_samples is not None:
            check_int_at_least(self, "epoch_samples", 1)
        check_choice(self, "batches", ("mixed", "single"))


SOURCE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # keys become "{name}/{key}": no slash


@dataclass(frozen=True)
class Source:
    """One dataset of a mix and its share of each epoch.

    `Source("s3://big/manifest.json", weight=0.7)`. Give exactly one of:

    Attributes:
        source: anything `LoaderConfig.source` takes for one dataset: a manifest
            (file, directory or URL), shard URLs or a brace pattern, tar or Parquet.
        weight: its share of `Mixing.epoch_samples` (default: the sum of the sources'
            sizes); weights are relative, and every source of a mix then has one.
        samples: exactly this many samples an epoch.
        repeat: this many times its size an epoch (0.5: half of it, 2: twice).
        split: the manifest split to read.
        format: `tar` or `parquet`; default: the loader's `format`.
        name: what its keys (`"{name}/{key}"`), stats and logs call it; default: a
            short name from the source (`s3://big/manifest.json` -> `big`,
            `data/curated` -> `curated`), unique within the mix.
    """

    source: str | os.PathLike | Sequence[str]
    weight: float | None = field(default=None, kw_only=True)
    samples: int | None = field(default=None, kw_only=True)
    repeat: float | None = field(default=None, kw_only=True)
    split: str = field(default="train", kw_only=True)
    format: str | None = field(default=None, kw_only=True)
    name: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        single = isinstance(self.source, (str, os.PathLike))
        many = isinstance(self.source, Sequence) and not single and len(self.source) > 0
        if not (single and os.fspath(self.source)) and not many:
            raise refuse(self, "source", f" must name a manifest or shards, got {self.source!r}")
        given = [
            name for name in ("weight", "samples", "repeat") if getattr(self, name) is not None
        ]
        if len(given) != 1:
            raise refuse(
                self,
                "weight",
                f": give exactly one of weight, samples or repeat, got {given or 'none'}",
            )
        value = getattr(self, given[0])
        if given[0] == "samples":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise refuse(self, "samples", f" must be an integer of at least 1, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise refuse(self, given[0], f" must be a number above 0, got {value!r}")
        elif not math.isfinite(value):
            raise refuse(self, given[0], f" must be finite, got {value!r}")
        if not isinstance(self.split, str) or not self.split:
            raise refuse(self, "split", f" must be a split name, got {self.split!r}")
        if self.format is not None and not is_format(self.format):
            raise refuse(self, "format", f" {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.name is not None and not (
            isinstance(self.name, str) and SOURCE_NAME.match(self.name)
        ):
            raise refuse(
                self, "name", f" must be letters, digits, '_', '.' or '-', got {self.name!r}"
            )

    def __repr__(self) -> str:
        # URLs may carry credentials (`user:password@`, presigned signatures).
        shown = {"source": redact_source(self.source)}
        for name in ("weight", "samples", "repeat", "split", "format", "name"):
            value = getattr(self, name)
            if value is not None and not (name == "split" and value == "train"):
                shown[name] = value
        return f"Source({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def label(self) -> str:
        """Its name as given, else the one derived from the source."""
        return self.name or default_source_name(self.source)


def default_source_name(source: Any) -> str:
    """A short name for a source: its dataset directory, bucket or shard folder."""
    text = os.fspath(source if isinstance(source, (str, os.PathLike)) else source[0])
    parts = urlsplit(text) if is_remote(text) else None
    path = (parts.path if parts else text).rstrip("/")
    base = posixpath.basename(path)
    files = (".json", *(fmt.suffix for fmt in FORMATS.values()))
    if base.lower().endswith(files) or "{" in base:  # a manifest or shard files
        base = posixpath.basename(posixpath.dirname(path))
        if is_format(base):  # the build's format folders: name the dataset
            base = posixpath.basename(posixpath.dirname(posixpath.dirname(path)))
    if not base and parts:
        base = parts.netloc.rsplit("@", 1)[-1]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.")
    return name or "source"


def source_names(sources: Sequence[Source]) -> tuple[str, ...]:
    """Each source's name; two alike are refused (their keys would clash)."""
    names = tuple(source.label for source in sources)
    clashes = sorted({name for name in names if names.count(name) > 1})
    if clashes:
        raise UsageError(
            f"sources of a mix are named alike ({', '.join(clashes)}): give each a name, "
            "e.g. Source(..., name='web')"
        )
    return names


def redact_source(source: Any) -> Any:
    """A loader source with every URL in it redacted, for reprs and logs."""
    if isinstance(source, (str, os.PathLike)):
        return redact_url(os.fspath(source))
    if isinstance(source, Sequence):
        return [redact_source(item) for item in source]
    if hasattr(source, "source"):  # a `pipeline.Source`: its URLs redacted, the rest kept
        return dataclasses.replace(source, source=redact_source(source.source))
    return source
