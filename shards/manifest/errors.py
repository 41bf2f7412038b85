"""`ManifestError`, the one error a manifest that cannot be trusted raises, and its advice."""

from __future__ import annotations

import os
from typing import Any

from shards.redact import redact_url

FIX = "rebuild the dataset with `preprocess build-shards`, or fix the file"
TABLE_FIX = (
    "copy the manifest's side tables (`_shards-*.parquet`) with it: they are part of the "
    "dataset; or rebuild it with `preprocess build-shards`"
)


class ManifestError(ValueError):
    """A manifest that cannot be trusted: malformed, inconsistent, or naming files elsewhere.

    Attributes:
        source: where the manifest came from, redacted: safe to log.
        field: the offending field as a path (`splits.train.shards[3].samples`), or
            `(file)` for the file as a whole.
        problem: what is wrong.
        action: what to do about it.
    """

    def __init__(self, source: Any, field: str, problem: str, action: str = FIX) -> None:
        self.source = redact_url(os.fspath(source) if isinstance(source, os.PathLike) else source)
        self.field = field
        self.problem = problem
        self.action = action
        super().__init__(f"{self.source}: {field}: {problem}; {action}")

    def __reduce__(self) -> tuple[type, tuple]:
        # Keeps the attributes when the error crosses a DataLoader worker's pipe.
        return (type(self), (self.source, self.field, self.problem, self.action))
