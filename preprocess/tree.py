"""Walk an ImageFolder tree (`root/<class>/.../<file>`) for the listing, one entry at a time.

Symlinks are followed, file and directory links alike, as torchvision's
ImageFolder does; a directory link to one of its own ancestors is a loop, left out
and named. With `confine` a directory link resolving outside the root is left out
(`outside_input`); file links are checked when the shard task opens them, which
also catches a link that appears after listing (`preprocess.images.read_source`).
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from collections.abc import Iterator

from preprocess.listing import (
    IMAGE_SUFFIXES,
    InputError,
    LeftOut,
    SourceItem,
    file_suffix,
    is_hidden,
    is_utf8,
)


def printable_name(name: str) -> str:
    """`name` with bytes that are not UTF-8 shown as `\\xNN`: safe to print and to store."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def is_inside(path: str, root: str) -> bool:
    """Whether the resolved `path` is `root` or below it (both resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


_BAD_NAME = "the file name is not UTF-8; rename it (for example with `convmv`) and rerun"
_BAD_NAME_DIR = "the directory name is not UTF-8, so nothing below it was read; rename it and rerun"


def _sorted_entries(path: str) -> list[os.DirEntry]:
    with os.scandir(path) as entries:
        return sorted(entries, key=_entry_name)


def _entry_name(entry: os.DirEntry) -> str:
    return entry.name


def _is_dir(entry: os.DirEntry) -> bool:
    """Follows links; a broken or looping link is not a directory."""
    try:
        return entry.is_dir()
    except OSError:
        return False


class TreeScan:
    """One walk of an ImageFolder tree: the inputs found and an account of the rest.

    `root/<class>/.../<file>`: the class is the first directory level. Files with
    an image suffix are inputs. Hidden entries, other suffixes and files directly
    under the root are counted (without `classes`, `--label none`, files directly under
    the root are inputs too: a flat folder builds); names that are not UTF-8, loops, unreadable
    directories and non-regular files are left out and named. Only the root's
    entries (the classes) are sorted; a directory's entries are read as they come,
    so a flat directory of millions of files streams too.

    Directories are walked with an explicit stack (a hostile tree may be deeper than
    Python's recursion limit). Each pending directory carries the resolved paths of
    its ancestors, which is what loop detection compares a directory link against;
    for a plain directory the resolved path is its parent's plus its name, so only
    links pay for a `realpath`.
    """

    def __init__(self, root: str, confine: bool, classes: bool = True) -> None:
        self.root = root
        self.confine = confine
        self.classes = classes
        self.root_images = 0  # image files directly under the root (no class)
        self.left_out: list[LeftOut] = []
        self.ignored: Counter = Counter()
        self.suffixes: Counter = Counter()
        self.links = 0
        self.pending: list[tuple[str, str, str, tuple[str, ...]]] = []

    def leave_out(self, rel: str, reason: str, detail: str, is_input: bool) -> None:
        self.left_out.append(LeftOut(printable_name(rel), reason, detail, is_input))

    def iter_tree(self) -> Iterator[SourceItem]:
        """The inputs of the whole tree, class directory by class directory."""
        try:
            entries = _sorted_entries(self.root)
        except OSError as error:
            raise InputError(
                f"cannot list the input root {self.root}: {error.strerror}; check its permissions"
            ) from error
        for entry in entries:
            if not self.classes:  # `--label none`: a flat folder, or any tree, without classes
                item = self._visit(entry, "", None, (self.root,))
                if item is not None:
                    yield item
                yield from self._drain()
            elif is_hidden(entry.name):
                self.ignored["hidden"] += 1
            elif not _is_dir(entry):
                self.ignored["no_class"] += 1
                self.root_images += file_suffix(entry.name) in IMAGE_SUFFIXES
            elif not is_utf8(entry.name):
                self.leave_out(entry.name, "bad_name", _BAD_NAME_DIR, False)
            else:
                yield from self.iter_class(entry, "", (self.root,), label=entry.name)

    def iter_class(
        self, entry: os.DirEntry, rel: str, chain: tuple[str, ...], label: str
    ) -> Iterator[SourceItem]:
        """The inputs below the directory `entry` (a class directory, or one below it)."""
        self._push(entry, rel, chain, label)
        yield from self._drain()

    def _drain(self) -> Iterator[SourceItem]:
        """The inputs below the directories pushed and not walked yet."""
        while self.pending:
            path, dir_rel, dir_label, dir_chain = self.pending.pop()
            try:
                entries = os.scandir(path)
            except OSError as error:
                detail = f"cannot list it ({error.strerror}); fix its permissions and rerun"
                self.leave_out(dir_rel, "unreadable_dir", detail, False)
                continue
            with entries:
                for child in entries:
                    item = self._visit(child, dir_rel, dir_label, dir_chain)
                    if item is not None:
                        yield item

    def _push(self, entry: os.DirEntry, parent_rel: str, chain: tuple[str, ...], label: str):
        rel = f"{parent_rel}/{entry.name}" if parent_rel else entry.name
        if not entry.is_symlink():
            real = os.path.join(chain[-1], entry.name)
            if real in chain:  # a bind mount onto an ancestor, or a tree reached via a link
                self.leave_out(rel, "loop", f"{real} is one of its own ancestors", False)
                return
            self.pending.append((entry.path, rel, label, (*chain, real)))
            return
        real = os.path.realpath(entry.path)
        if self.confine and not is_inside(real, self.root):
            detail = f"a directory link to {real}, outside the input root {self.root} (--confine-to-input)"
            self.leave_out(rel, "outside_input", detail, False)
            return
        if any(is_inside(ancestor, real) for ancestor in chain):
            detail = f"a directory link to {real}, which contains it; link a sibling tree instead"
            self.leave_out(rel, "loop", detail, False)
            return
        self.links += 1
        self.pending.append((entry.path, rel, label, (*chain, real)))

    def _visit(
        self, entry: os.DirEntry, rel: str, label: str | None, chain: tuple[str, ...]
    ) -> SourceItem | None:
        """The input `entry` is, or None (after pushing a directory or accounting for it)."""
        name = entry.name
        if is_hidden(name):
            self.ignored["hidden"] += 1
            return None
        if _is_dir(entry):
            if not is_utf8(name):
                self.leave_out(_joined(rel, name), "bad_name", _BAD_NAME_DIR, False)
            else:
                self._push(entry, rel, chain, label)
            return None
        suffix = file_suffix(name)
        if suffix not in IMAGE_SUFFIXES:
            self.ignored["other_suffix"] += 1
            self.suffixes[suffix] += 1
            return None
        child_rel = _joined(rel, name)
        if not is_utf8(name):
            self.leave_out(child_rel, "bad_name", _BAD_NAME, True)
            return None
        problem = _not_a_file(entry)
        if problem is not None:
            self.leave_out(child_rel, problem[0], problem[1], False)
            return None
        self.links += entry.is_symlink()
        return SourceItem(entry.path, child_rel, label)


def _joined(rel: str, name: str) -> str:
    """`name` below the tree path `rel` (`""`: the root)."""
    return f"{rel}/{name}" if rel else name


def _not_a_file(entry: os.DirEntry) -> tuple[str, str] | None:
    """Why an image-suffixed entry cannot be an input, or None when it can.

    A broken link stays an input: its target may come back, and the task reports it
    `missing`, which a rerun retries.
    """
    try:
        if entry.is_file():
            return None
        mode = entry.stat().st_mode
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "loop", "a symlink that resolves to itself; fix or remove the link"
        return "not_regular", f"cannot stat it ({error.strerror})"
    return "not_regular", f"not a regular file (mode {mode:o}); only files are read"
