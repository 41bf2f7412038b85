"""`ManifestError`, the one error a manifest that cannot be trusted raises, and its advice."""

from __future__ import annotations

import os
from typing import Any

from shards.errors import DataError
from shards.redact import redact_url

FIX = "rebuild the dataset with `preprocess build-shards`, or fix the file"
TABLE_FIX = (
    "copy the manifest's side tables (`_shards-*.parquet`) with it: they are part of the "
    "dataset; or rebuild it with `preprocess build-shards`"
)


class ManifestError(DataError, ValueError):
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


class ManifestNotFoundError(DataError, FileNotFoundError):
    """No manifest where one was asked for; the message says why one may be missing and
    what to do (`shards.manifest.files.missing_manifest`).

    Also a `FileNotFoundError`, which a missing manifest always was, so code catching that
    still does; a `DataError`, so a command line prints it as one line.
    """

    __str__ = Exception.__str__  # the message, not OSError's errno form


class SplitNotFoundError(ManifestError, KeyError):
    """A split the manifest does not have; the message names the file and the splits it has.

    Also a `KeyError`, which a missing split always was.
    """

    __str__ = Exception.__str__  # the message, not KeyError's quoted repr of it


class FormatNotBuiltError(ManifestError, KeyError):
    """A shard format the dataset was not built in; the message names the file and its formats.

    Also a `KeyError`, which a missing format always was.
    """

    __str__ = Exception.__str__
