"""Where bytes live and how they are read and written: the one storage layer, torch-free.

Sits under everything that touches a location: the loader's shards and side tables,
`preprocess verify`, the trainer's shard listing, and a build's inputs (trees, list
files, images) all read through `open_stream`, so a remote input gets the shards'
retries, deadline and redaction. Split by transport: `urls` (schemes, `is_remote`,
validation), `retry` (`RetryPolicy`, the deadline clock, the retrying read loop),
`local`, `http`, `objectstore` (fsspec), `ranged` (parallel ranged fetches), `cache`
(the node-local shard cache); writing (atomic files, output stores) is `write`.
"""

from shards.storage.http import HttpRangeFile, RetryingStream
from shards.storage.local import NotRegularFileError, open_regular_file, read_regular_file
from shards.storage.objectstore import RetryingFsspecFile, object_store_filesystem, walk
from shards.storage.read import open_stream, read_bytes
from shards.storage.retry import (
    DEFAULT_RETRY,
    ObjectChangedError,
    ObjectNotFoundError,
    RetryPolicy,
    ShardReadError,
)
from shards.storage.urls import (
    HTTP_SCHEMES,
    LOCAL_SCHEMES,
    OBJECT_STORE_SCHEMES,
    READ_SCHEMES,
    SHARD_SCHEMES,
    check_characters,
    check_scheme,
    file_url_path,
    is_remote,
    local_path,
    url_scheme,
    validate_url,
)

__all__ = [
    "DEFAULT_RETRY",
    "HTTP_SCHEMES",
    "LOCAL_SCHEMES",
    "OBJECT_STORE_SCHEMES",
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
    "check_characters",
    "check_scheme",
    "file_url_path",
    "is_remote",
    "local_path",
    "object_store_filesystem",
    "open_regular_file",
    "open_stream",
    "read_bytes",
    "read_regular_file",
    "url_scheme",
    "validate_url",
    "walk",
]
