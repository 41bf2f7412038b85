"""Open any location for reading: the one entry point, which validates and asks the registry.

`open_stream` is what the loader, `verify`, the trainer and a build's remote inputs
read through; `read_bytes` reads a whole small object (an input image, a side table)
under a size cap; `exists` asks whether anything is there.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any, BinaryIO

from shards.storage.registry import SHARD_SCHEMES, TRANSPORTS
from shards.storage.retry import DEFAULT_RETRY, ObjectNotFoundError, RetryPolicy
from shards.storage.urls import url_scheme, validate_url


def open_stream(
    url: str,
    retry: RetryPolicy = DEFAULT_RETRY,
    *,
    storage_options: Mapping[str, Any] | None = None,
    random_access: bool = False,
    expected_size: int | None = None,
    schemes: Collection[str] = SHARD_SCHEMES,
) -> BinaryIO:
    """Open `url` for streaming reads; the body is never downloaded whole first.

    Args:
        url: a local path, `file://`, `http(s)://`, `s3://` or `gs://` URL. It is
            validated again here, so a `pipe:` URL can never slip through.
        retry: retry, backoff, stall limit and deadline for remote URLs.
        storage_options: keyword arguments for `fsspec.open` on object-store URLs,
            such as `{"endpoint_url": ...}` for an S3-compatible store.
        random_access: return a seekable file for http(s) too (Range requests
            per position), as Parquet readers need; for object stores, pick a
            block cache suited to random rather than sequential reads.
        expected_size: the shard's byte count when the caller knows it (the
            manifest's): the most that is read. A file, server or store reporting
            a larger size (`os.fstat`, `Content-Length`, `Content-Range` total,
            object size) fails at open, since that is not the shard the manifest
            describes; a smaller one is read to its end, where the shard reader
            reports the truncation, so a cut shard costs only its missing rest. A
            body sent without a size ends at `expected_size`, and one that keeps
            going past it fails instead of being read on.
        schemes: the schemes accepted (`validate_url`): by default what the loader
            reads shards from; a build's inputs pass `READ_SCHEMES`, which adds the
            other object stores (`az://`, `gcs://`, `memory://`).

    Returns:
        A readable binary file object; close it when done. Local and object-store
        files can seek; http(s) ones cannot: they are an `io.BufferedReader`
        whose `.raw` is the `RetryingStream`
        (with `retries` and `resumes` counters). Object-store files are an
        `io.BufferedReader` over a `RetryingFsspecFile` (`retries`, `reopens`).
        Read tars from it with `tarfile.open(fileobj=stream, mode="r|")`.
        Remote reads past `retry.deadline` raise `ShardReadError`.

    Raises:
        ValueError: the URL is not allowed, or `expected_size` is negative.
        ObjectNotFoundError: nothing is there (no file, HTTP 404 or 410, no object);
            a `ShardReadError`.
        ShardReadError: the shard could not be opened, after retries where useful,
            or it is larger than `expected_size`. Every message holds the URL
            redacted, never its credentials.
        ImportError: the fsspec backend for the scheme (s3fs, gcsfs) is missing.
    """
    url = validate_url(url, schemes=schemes)
    if expected_size is not None and not (isinstance(expected_size, int) and expected_size >= 0):
        raise ValueError(f"expected_size must be a byte count >= 0, got {expected_size!r}")
    # `validate_url` made a `file://` URL its path; one lookup picks the store.
    return TRANSPORTS[url_scheme(url)].open(
        url,
        retry,
        storage_options=storage_options or {},
        random_access=random_access,
        expected_size=expected_size,
    )


def read_bytes(
    url: str,
    max_bytes: int,
    retry: RetryPolicy = DEFAULT_RETRY,
    *,
    storage_options: Mapping[str, Any] | None = None,
    schemes: Collection[str] = SHARD_SCHEMES,
) -> bytes:
    """The bytes at `url`, at most `max_bytes + 1` of them (so a caller sees "too large").

    Through `open_stream`: the same validation, retries, deadline and redaction.

    Raises:
        ValueError: the URL is not allowed.
        ObjectNotFoundError: nothing is there.
        ShardReadError: it could not be read, after retries where useful.
    """
    with open_stream(url, retry, storage_options=storage_options, schemes=schemes) as stream:
        return stream.read(max_bytes + 1)


def exists(
    url: str,
    retry: RetryPolicy = DEFAULT_RETRY,
    *,
    storage_options: Mapping[str, Any] | None = None,
    schemes: Collection[str] = SHARD_SCHEMES,
) -> bool:
    """Whether something can be read at `url`: opened (no body read) through its transport.

    Raises:
        ShardReadError: the store failed past `retry`'s budget (not "nothing there").
    """
    try:
        open_stream(url, retry, storage_options=storage_options, schemes=schemes).close()
    except ObjectNotFoundError:
        return False
    return True
