"""The transport registry: one `Transport` class a store, one registry entry a scheme.

Every read, listing and write of a location asks here which transport serves its
scheme (`transport_for`), so a new store is one class and one `register` call: the
schemes the loader and a build accept (`SHARD_SCHEMES`, `READ_SCHEMES`) are views of
this registry, read when asked, never tables of their own. The entries this project
ships (local files, http(s), the fsspec object stores) are in `shards.storage.transports`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any, BinaryIO

from shards.errors import UsageError

# The credential shapes a URL's authority may have (`Transport.credentials`): none (any
# `userinfo@` is a secret, refused), `basic` (`user:password@` is the store's own auth,
# http Basic) or `account` (`container@account`: only a `user:password@` is a secret).
CREDENTIAL_SHAPES = ("none", "basic", "account")


class Transport:
    """How one kind of store is read, listed and written: subclass it and `register` it.

    Only `open` is required; a store that can list a prefix overrides `walk`, one that
    can be written overrides `write_bytes` (or `output_store`), one that serves byte
    ranges overrides `open_span` (the cache then fetches a shard over parallel ranged
    requests). Every method gets the caller's `RetryPolicy`: its retries, stall limit
    and deadline are the store's whole budget (`tune` turns the client's own off).

    Attributes:
        schemes: the lower-case URL schemes it serves (`""`: a plain local path).
        shards: the loader reads shards from it; False for a build's inputs only.
        authority: what a URL's authority names ("host", "bucket"), or "" for a store
            with none (one per process, as fsspec's `memory://`).
        rfc3986: its URLs keep to RFC 3986's characters (http.client needs it).
        credentials: the shape of a URL's credentials (`CREDENTIAL_SHAPES`), which
            decides what `shards.redact.url_credentials_problem` refuses.
        package: the pip package its client needs, named when the import fails.
        request_per_read: each read of an `open_span` reader is one request, so a
            ranged fetch reads a span in one read rather than in copy-sized chunks.
    """

    schemes: tuple[str, ...] = ()
    shards: bool = True
    authority: str = "bucket"
    rfc3986: bool = False
    credentials: str = "none"
    package: str = ""
    request_per_read: bool = False

    def open(
        self,
        url: str,
        retry: Any,
        *,
        storage_options: Mapping[str, Any],
        random_access: bool = False,
        expected_size: int | None = None,
    ) -> BinaryIO:
        """A readable file at `url` (validated), as `shards.storage.open_stream` returns.

        Raises:
            ObjectNotFoundError: nothing is there.
            ShardReadError: it could not be opened, or holds more than `expected_size`.
        """
        raise NotImplementedError

    def open_span(
        self,
        url: str,
        retry: Any,
        *,
        storage_options: Mapping[str, Any],
        size: int,
        start: int,
        stop: int,
        clock: Any,
        identity: Any,
    ) -> Any | None:
        """A retrying reader positioned at `start` whose requests end at `stop`, timed by
        `clock` and pinned to `identity` (shared by every span of one fetch); None when the
        store serves no ranges (the shard is then streamed over one connection)."""
        return None

    def walk(
        self, url: str, retry: Any, storage_options: Mapping[str, Any]
    ) -> Iterator[tuple[str, list[str], list[str]]]:
        """`(relative, subdirs, files)` under a prefix, top-down as `os.walk` (prune
        `subdirs` in place); a prefix holding nothing yields `("", [], [])`.

        Raises:
            UsageError: the store cannot be listed (a web server).
        """
        raise UsageError(
            f"{scheme_label(url)} cannot be listed; name the files (a brace pattern such as "
            "DIR/{00000..00009}.tar, or a list) or the dataset's manifest.json"
        )

    def write_bytes(self, url: str, data: bytes, storage_options: Mapping[str, Any]) -> None:
        """Store `data` at `url` all at once: a reader sees all of it or nothing.

        Raises:
            UsageError: the store cannot be written.
        """
        raise UsageError(f"cannot write to {scheme_label(url)}; write to a directory or a store")

    def remove(self, url: str, storage_options: Mapping[str, Any]) -> None:
        """Delete one file; a missing one is not an error."""
        raise UsageError(f"cannot delete from {scheme_label(url)}")

    def output_store(self, url: str, storage_options: Mapping[str, Any] | None = None) -> Any:
        """The `OutputStore` a build, `index` or the trainer writes to at `url`; None (the
        default) for `shards.storage.write.TransportStore`, made of `write_bytes`, `walk`,
        `open` and `remove`."""
        return None

    def tune(self, options: Mapping[str, Any], retry: Any) -> dict[str, Any]:
        """Client options with its own retries and socket waits set from `retry`."""
        return dict(options)

    @property
    def listable(self) -> bool:
        return type(self).walk is not Transport.walk

    @property
    def writable(self) -> bool:
        kind = type(self)
        return kind.write_bytes is not Transport.write_bytes or (
            kind.output_store is not Transport.output_store
        )


TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    """Serve each of `transport.schemes` with it (a scheme registered again is replaced)."""
    if transport.credentials not in CREDENTIAL_SHAPES:
        raise UsageError(
            f"{type(transport).__name__}.credentials={transport.credentials!r}; "
            f"one of {', '.join(CREDENTIAL_SHAPES)}"
        )
    for scheme in transport.schemes:
        TRANSPORTS[scheme.lower()] = transport
    return transport


def unregister(transport: Transport) -> None:
    """Stop serving the schemes `transport` serves (tests register toy stores)."""
    for scheme in transport.schemes:
        if TRANSPORTS.get(scheme) is transport:
            del TRANSPORTS[scheme]


def transport_of(scheme: str) -> Transport | None:
    """The transport serving a lower-case scheme (`""` for a plain path), None if none does."""
    return TRANSPORTS.get(scheme)


def scheme_label(url: str) -> str:
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    return f"{scheme}://" if scheme else "a local path"


class RegisteredSchemes(Collection[str]):
    """The schemes the registry serves now (only the loader's shard stores with `shards`):
    a view, so a store registered later is accepted everywhere at once."""

    def __init__(self, shards: bool) -> None:
        self.shards = shards

    def __contains__(self, scheme: object) -> bool:
        transport = TRANSPORTS.get(scheme) if isinstance(scheme, str) else None
        return transport is not None and (transport.shards or not self.shards)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(scheme for scheme in TRANSPORTS if scheme in self))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"RegisteredSchemes({sorted(self)})"


READ_SCHEMES = RegisteredSchemes(shards=False)
SHARD_SCHEMES = RegisteredSchemes(shards=True)
