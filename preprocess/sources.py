"""List the inputs of a build: an ImageFolder tree or a CSV/JSONL/Parquet list, local or remote.

`stream_sources` yields the `SourceItem`s (path, relative path, class name,
optional split) one at a time, in no particular order, and fills a `Listing` with an
account of every tree entry that is not an input: nothing is kept per input, so a list
of any length streams through in constant memory, and no image is opened here. It hands
a tree to `preprocess.tree`, a list file to `preprocess.list_file` and a URL to
`preprocess.remote`. Duplicates are found by the plan, which sorts (`preprocess.plan`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from preprocess.columns import InputColumns
from preprocess.list_file import iter_manifest
from preprocess.listing import MANIFEST_SUFFIXES, InputError, LeftOut, Listing, SourceItem
from preprocess.remote import is_list_file_url, iter_remote
from preprocess.tree import TreeScan
from shards.redact import redact_url
from shards.storage import is_remote, local_path


def list_sources(input_path: str) -> list[SourceItem]:
    """The inputs of a build, sorted by relative path (see `scan_sources`)."""
    return scan_sources(input_path).items


def scan_sources(
    input_path: str, confine: bool = False, columns: InputColumns | None = None
) -> Listing:
    """`stream_sources`, with every input held in `items`: for small inputs and tests."""
    listing, items = stream_sources(input_path, confine, columns)
    listing.items = sorted(items, key=_sort_key)
    return listing


def stream_sources(
    input_path: str,
    confine: bool = False,
    columns: InputColumns | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[Listing, Iterator[SourceItem]]:
    """The inputs of a build, one at a time, and the account of every other tree entry.

    The `Listing` is complete once the iterator is exhausted (its `root` at once);
    nothing per input is kept.

    Args:
        confine: leave out directory links that resolve outside the root.
        columns: what a list file's columns hold (default: a single `label`); a row
            whose extra values the loader would refuse is left out as a refused input
            (`LeftOut` with the loader's skip reason), never planned.
        storage_options: fsspec options for an input in an object store (`iter_remote`).

    Raises:
        InputError: a malformed manifest or escaping paths (while iterating), no
            inputs at all (at the end), or (at once) `--fields` or `--label multi`
            for an ImageFolder tree, which has no columns.
        FileNotFoundError: the input does not exist (at once).
    """
    columns = columns or InputColumns()
    if is_remote(input_path):
        listing = Listing([])
        _check_tree_columns(input_path, columns, is_list_file_url(input_path))
        items = iter_remote(input_path, listing, columns, storage_options=storage_options)
        return listing, _account(redact_url(input_path), listing, _label_free(items, columns))
    try:
        path = Path(local_path(input_path))  # a `file://` URL is a local input
    except ValueError as error:
        raise InputError(f"input {error}; pass a directory, a list file or a URL") from None
    if not path.exists():
        raise FileNotFoundError(f"input {input_path} does not exist; check --input")
    _check_tree_columns(input_path, columns, not path.is_dir())
    if path.is_dir():
        scan = TreeScan(os.path.realpath(path), confine)
        listing = Listing(
            [],
            scan.root,
            left_out=scan.left_out,
            ignored=scan.ignored,
            left_out_suffixes=scan.suffixes,
        )
        items = _label_free(scan.iter_tree(), columns)
        return listing, _account(input_path, listing, items, scan)
    if path.suffix.lower() in MANIFEST_SUFFIXES:
        listing = Listing([], str(path.resolve().parent))
        return listing, _account(input_path, listing, iter_manifest(path, listing, columns))
    raise InputError(
        f"input {input_path} is neither a directory nor a manifest "
        f"({', '.join(MANIFEST_SUFFIXES)}); pass an ImageFolder root or a list file"
    )


def _account(
    input_path: str, listing: Listing, items: Iterator[SourceItem], scan: TreeScan | None = None
) -> Iterator[SourceItem]:
    """Pass `items` through; at the end, complete `listing` and refuse an empty input."""
    count = 0
    for item in items:
        count += 1
        yield item
    if scan is not None:
        listing.links_followed = scan.links
    listing.left_out.sort(key=_left_out_key)
    if not count:
        refused = Counter(entry.reason for entry in listing.refused)
        why = f" ({', '.join(f'{r}: {n}' for r, n in sorted(refused.items()))} refused)"
        raise InputError(
            f"no images found under {input_path}{why if refused else ''}; an "
            "ImageFolder root holds one directory per class with image files in it"
        )


def _check_tree_columns(input_path: str, columns: InputColumns, is_list: bool) -> None:
    if is_list or (columns.label != "multi" and not columns.fields):
        return
    raise InputError(
        f"input {input_path} is an ImageFolder tree, which has no columns: --fields and "
        "--label multi need a CSV, JSONL or Parquet list of path,label,... (see docs/SHARDS.md)"
    )


def _label_free(items: Iterator[SourceItem], columns: InputColumns) -> Iterator[SourceItem]:
    """A tree's inputs without their class under `--label none`."""
    if columns.label != "none":
        yield from items
        return
    for item in items:
        if item.label is not None:  # a list file's rows come without one already
            item = SourceItem(item.path, item.rel, None, item.split, item.where, item.fields)
        yield item


def _sort_key(item: SourceItem) -> str:
    return item.rel


def _left_out_key(entry: LeftOut) -> str:
    return entry.path


def scan_image_folder(root: Path, confine: bool = False) -> Listing:
    """`root/<class>/.../<file>`, listed at once (see `stream_sources`)."""
    return scan_sources(str(root), confine)


def scan_manifest(manifest: Path) -> Listing:
    """A list file's inputs, listed at once (see `stream_sources`)."""
    return scan_sources(str(manifest))
