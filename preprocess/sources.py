"""List the inputs of a build: an ImageFolder tree or a CSV/JSONL/Parquet list, local or remote.

`stream_sources` yields the `SourceItem`s (path, relative path, class name,
optional split) one at a time, in no particular order, and fills a `Listing` with an
account of every tree entry that is not an input: nothing is kept per input, so a list
of any length streams through in constant memory, and no image is opened here. It hands
a tree to `preprocess.tree`, a list file to `preprocess.list_file` and a URL to
`preprocess.remote`. Duplicates are found by the plan, which sorts (`preprocess.plan`).
"""

from __future__ import annotations

import logging
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
from shards.manifest.foreign import shard_format_of
from shards.redact import redact_url
from shards.storage import is_remote, local_path


def list_sources(input_path: str) -> list[SourceItem]:
    """The inputs of a build, sorted by relative path (see `scan_sources`)."""
    return scan_sources(input_path).items


log = logging.getLogger(__name__)

# A class tree whose largest class holds more than this many times the images of its
# smallest gets a warning: usually a folder of stray files or an unfinished copy.
UNEQUAL_CLASSES = 10


def scan_sources(
    input_path: str,
    confine: bool = False,
    columns: InputColumns | None = None,
    *,
    input_root: str | None = None,
) -> Listing:
    """`stream_sources`, with every input held in `items`: for small inputs and tests."""
    listing, items = stream_sources(input_path, confine, columns, input_root=input_root)
    listing.items = sorted(items, key=_sort_key)
    return listing


def stream_sources(
    input_path: str,
    confine: bool = False,
    columns: InputColumns | None = None,
    *,
    storage_options: Mapping[str, Any] | None = None,
    input_root: str | None = None,
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
        input_root: what a local list file's paths are keyed relative to
            (`preprocess.list_file.ListRoot`); refused for a tree or a remote input.

    Raises:
        InputError: a malformed manifest or escaping paths (while iterating), no
            inputs at all (at the end), or (at once) `--fields` or `--label multi`
            for an ImageFolder tree, which has no columns.
        FileNotFoundError: the input does not exist (at once).
    """
    columns = columns or InputColumns()
    if input_root is not None and (is_remote(input_path) or Path(input_path).is_dir()):
        raise InputError(
            f"--input-root {input_root} keys the paths of a local list file; input "
            f"{redact_url(input_path)} is not one (a tree's keys are relative to its root); "
            "leave --input-root out"
        )
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
        scan = TreeScan(os.path.realpath(path), confine, classes=columns.label != "none")
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
        rows = iter_manifest(path, listing, columns, input_root=input_root, confine=confine)
        return listing, _account(input_path, listing, rows)
    raise InputError(
        f"input {input_path} is neither a directory nor a manifest "
        f"({', '.join(MANIFEST_SUFFIXES)}); pass an ImageFolder root or a list file"
    )


def _account(
    input_path: str, listing: Listing, items: Iterator[SourceItem], scan: TreeScan | None = None
) -> Iterator[SourceItem]:
    """Pass `items` through; at the end, complete `listing` and refuse an empty input."""
    count = 0
    classes: Counter = Counter()
    for item in items:
        count += 1
        if scan is not None and isinstance(item.label, str):
            classes[item.label] += 1
        yield item
    if scan is not None:
        listing.links_followed = scan.links
    listing.left_out.sort(key=_left_out_key)
    if not count:
        refused = Counter(entry.reason for entry in listing.refused)
        why = f" ({', '.join(f'{r}: {n}' for r, n in sorted(refused.items()))} refused)"
        raise InputError(
            f"no images found under {input_path}{why if refused else ''}; "
            + (_shards_hint(input_path) or _no_classes_hint(scan))
        )
    if classes:
        warn_class_balance(input_path, classes)


def _shards_hint(input_path: str) -> str | None:
    """For a folder of shards (img2dataset's tars, say) given as build input: they are
    read as they are, and `preprocess index` gives them a manifest. None otherwise."""
    if is_remote(input_path) or not os.path.isdir(input_path):
        return None
    found = Counter(fmt for fmt in map(shard_format_of, os.listdir(input_path)) if fmt is not None)
    if not found:
        return None
    from preprocess.verify import index_command  # verify reads shards: only when needed

    held = ", ".join(f"{n} {fmt} shard files" for fmt, n in sorted(found.items()))
    index = index_command(input_path, found.most_common(1)[0][0])
    return (
        f"it holds {held}, which are shards already: the loader reads them as they are "
        f"(LoaderConfig(source={input_path!r}), train --train-shards {input_path}), and "
        f"`{index}` saves their counts as a manifest"
    )


def _no_classes_hint(scan: TreeScan | None) -> str:
    """What to do about an input with no inputs: the flag for a flat folder of images."""
    if scan is not None and scan.root_images:
        return (
            f"{scan.root_images} images sit directly under the root, which has no class "
            "folders; pass --label none to build them without classes, or put them in one "
            "folder per class, or list them with their classes in a CSV (path,label)"
        )
    return "an ImageFolder root holds one directory per class with image files in it"


def warn_class_balance(input_path: str, classes: Counter) -> None:
    """One warning line for a tree with one class, or with very unequal classes."""
    if len(classes) == 1:
        (name,) = classes
        log.warning(
            "input %s has one class folder (%s, %d images): every sample gets label 0; "
            "pass --label none for data without classes",
            input_path,
            name,
            classes[name],
        )
        return
    (large, most), (small, least) = classes.most_common()[0], classes.most_common()[-1]
    if most > UNEQUAL_CLASSES * least:
        log.warning(
            "input %s has very unequal classes: %s holds %d images, %s only %d (over %dx); "
            "check for stray or unfinished folders",
            input_path,
            large,
            most,
            small,
            least,
            UNEQUAL_CLASSES,
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
