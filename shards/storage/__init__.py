"""Where bytes live and how they are read and written: the one storage layer, torch-free.

Sits under everything that touches a location: the loader's shards and side tables,
`preprocess verify`, the trainer's shard listing, and a build's inputs (trees, list
files, images) all read through `open_stream`, so a remote input gets the shards'
retries, deadline and redaction. Every location's scheme names its `Transport` in one
registry (`registry`; the shipped entries in `transports`): `urls` (`is_remote`,
validation), `retry` (`RetryPolicy`, the deadline clock, the retrying read loop),
`local`, `http`, `objectstore` (fsspec), `ranged` (parallel ranged fetches), `cache`
(the node-local shard cache); writing (atomic files, output stores) is `write`.
"""

from shards.storage.http import HttpRangeFile, RetryingStream
from shards.storage.local import NotRegularFileError, open_regular_file, read_regular_file
from shards.storage.objectstore import RetryingFsspecFile, object_store_filesystem, walk
from shards.storage.read import exists, open_stream, read_bytes
from shards.storage.registry import (
    READ_SCHEMES,
    SHARD_SCHEMES,
    Transport,
    register,
    transport_of,
    unregister,
)
from shards.storage.retry import (
    DEFAULT_RETRY,
    ObjectChangedError,
    ObjectNotFoundError,
    RetryPolicy,
    ShardReadError,
)
from shards.storage.urls import (
    check_characters,
    check_scheme,
    credentials_problem,
    file_url_path,
    is_remote,
    local_path,
    url_scheme,
    validate_url,
)

__all__ = [
    "DEFAULT_RETRY",
    "READ_SCHEMES",
    "SHARD_SCHEMES",
    "HttpRangeFile",
    "NotRegularFileError",
    "ObjectChangedError",
    "ObjectNotFoundError",
    "RetryPolicy",
    "RetryingFsspecFile",
    "RetryingStream",
    "ShardReadError",
    "Transport",
    "check_characters",
    "check_scheme",
    "exists",
    "credentials_problem",
    "file_url_path",
    "is_remote",
    "local_path",
    "object_store_filesystem",
    "open_regular_file",
    "open_stream",
    "read_bytes",
    "read_regular_file",
    "register",
    "transport_of",
    "unregister",
    "url_scheme",
    "validate_url",
    "walk",
]

# The stores this project ships register themselves (after the names above exist:
# `write` imports them from this package).
from shards.storage import transports  # noqa: E402, F401
