"""The code's shape: no library module past 900 lines, every error class under `ShardpipeError`;
and the results page's: docs/BENCHMARKS.md at most 500 lines, every link into it a heading.

A module past 900 lines holds more than one job (STYLE.md: one module, one job); split
it along a seam. Every exception class of the library is one of ours, so the command
lines tell our errors (one line) from bugs (a traceback) by type alone. Warnings, and
classes that extend a builtin but are not exceptions (`str`, `dict`), are not errors.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

from shards.errors import ShardpipeError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shards", "pipeline", "preprocess", "trainers")
MAX_LINES = 900
# Modules past the cap today, each with who is splitting it; an entry is removed (the
# test says so) as soon as its module is back under the cap.
OVER_FOR_NOW: dict[str, str] = {}


def library_modules() -> list[Path]:
    """Every Python file of the four library packages."""
    return sorted(
        path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    )


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_library_module_is_over_the_line_cap():
    lines = {path.relative_to(ROOT).as_posix(): line_count(path) for path in library_modules()}
    over = {name: count for name, count in lines.items() if count > MAX_LINES}
    unexplained = {name: count for name, count in over.items() if name not in OVER_FOR_NOW}
    assert not unexplained, f"split these modules along a seam (at most {MAX_LINES} lines)"
    stale = sorted(set(OVER_FOR_NOW) - set(over))
    assert not stale, f"{stale} are under the cap now: remove them from OVER_FOR_NOW"


def resolve(expr: ast.expr, namespace: dict) -> object:
    """The object a base-class expression (`Name` or `a.b.Name`) names in `namespace`."""
    if isinstance(expr, ast.Name):
        if expr.id in namespace:
            return namespace[expr.id]
        return getattr(builtins, expr.id)
    if isinstance(expr, ast.Attribute):
        return getattr(resolve(expr.value, namespace), expr.attr)
    if isinstance(expr, ast.Subscript):  # `Generic[T]`, `Protocol[T]`: not an exception
        return object
    raise TypeError(f"cannot tell what the base {ast.unparse(expr)} is")


def class_bases(module: object, node: ast.ClassDef) -> tuple[type, ...]:
    """What a class defined anywhere in `module` derives from: a module-level class itself
    (as imported), a nested one its bases resolved in the module's namespace."""
    defined = vars(module).get(node.name)
    if isinstance(defined, type) and defined.__module__ == module.__name__:
        return (defined,)
    return tuple(resolve(base, vars(module)) for base in node.bases)


def error_classes_of(path: Path, module: object) -> dict[str, tuple[type, ...]]:
    """`{module:line ClassName: what it derives from}` of every exception class `path` (imported as
    `module`) defines, found by walking its syntax tree (classes inside functions too)."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        bases = class_bases(module, node)
        is_error = any(isinstance(b, type) and issubclass(b, BaseException) for b in bases)
        is_warning = any(isinstance(b, type) and issubclass(b, Warning) for b in bases)
        if is_error and not is_warning:
            found[f"{module.__name__}:{node.lineno} {node.name}"] = bases
    return found


def outside_the_root(classes: dict[str, tuple[type, ...]]) -> list[str]:
    """The classes that derive from no `ShardpipeError`."""
    return sorted(
        name
        for name, bases in classes.items()
        if not any(issubclass(base, ShardpipeError) for base in bases)
    )


def test_every_error_class_is_a_shardpipe_error():
    classes = {}
    for path in library_modules():
        classes.update(error_classes_of(path, importlib.import_module(module_name(path))))
    assert len(classes) > 30  # the walk found the library's classes
    outside = outside_the_root(classes)
    assert not outside, "derive these from ShardpipeError (DataError or UsageError)"


@pytest.mark.parametrize(
    ("source", "outside"),
    [
        ("class Bad(ValueError):\n    pass\n", True),
        ("def f():\n    class Hidden(Exception):\n        pass\n", True),
        ("def f():\n    class Hidden(errors.UsageError):\n        pass\n", False),
        ("class Good(DataError):\n    pass\n", False),
        ("class Text(str):\n    pass\n", False),
        ("class Note(UserWarning):\n    pass\n", False),
    ],
)
def test_the_walk_finds_error_classes_wherever_they_are(source, outside, tmp_path):
    path = tmp_path / "toy_errors.py"
    path.write_text("from shards import errors\nfrom shards.errors import DataError\n" + source)
    spec = importlib.util.spec_from_file_location("toy_errors", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    classes = error_classes_of(path, module)
    assert len(classes) == (0 if "Text" in source or "Note" in source else 1)
    assert bool(outside_the_root(classes)) == outside


# The results page: current figures with their commands and the decisions they support,
# history in git (issue 31). Its links and the other docs' links into it name its headings.
RESULTS_PAGE = ROOT / "docs" / "BENCHMARKS.md"
RESULTS_PAGE_MAX_LINES = 500
_LINK_INTO_RESULTS = re.compile(r"\]\((?:[\w./-]*BENCHMARKS\.md)?#([^)\s]+)\)")


def heading_anchor(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lowercase, punctuation but `-` and `_`
    dropped, spaces as hyphens (`Scale: 500,000 inputs` -> `scale-500000-inputs`)."""
    kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def links_into_results_page() -> list[tuple[str, str]]:
    """`(doc, anchor)` of every link to a heading of the results page: its own `(#...)`
    links and the `BENCHMARKS.md#...` links of README.md and the other docs."""
    others = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = []
    for doc in [RESULTS_PAGE, *(path for path in others if path.name != RESULTS_PAGE.name)]:
        for match in _LINK_INTO_RESULTS.finditer(doc.read_text(encoding="utf-8")):
            if doc == RESULTS_PAGE or "BENCHMARKS.md" in match.group(0):
                found.append((doc.name, match.group(1)))
    return found


def test_the_results_page_stays_a_results_page():
    lines = RESULTS_PAGE.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= RESULTS_PAGE_MAX_LINES, (
        f"docs/BENCHMARKS.md has {len(lines)} lines (at most {RESULTS_PAGE_MAX_LINES}): "
        "keep current figures, their commands and decisions; history is in git"
    )


def test_links_into_the_results_page_name_its_headings():
    text = RESULTS_PAGE.read_text(encoding="utf-8")
    anchors = {
        heading_anchor(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")
    }
    links = links_into_results_page()
    assert len(links) > 15  # the headline's links and LOADER.md's were found
    broken = sorted({link for link in links if link[1] not in anchors})
    assert not broken, "these links name no heading of docs/BENCHMARKS.md"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Scale: the loader at 10^6 to 10^9 samples", "scale-the-loader-at-106-to-109-samples"),
        ("Scale: 500,000 inputs, built then read", "scale-500000-inputs-built-then-read"),
        ("open_clip check", "open_clip-check"),
        ("Build, end to end", "build-end-to-end"),
    ],
)
def test_heading_anchors_are_githubs(heading, anchor):
    assert heading_anchor(heading) == anchor
