"""Our packages import one way (`preprocess -> shards <- pipeline <- trainers`), without circles.

Reads every module of the four packages with `ast` (nothing is imported), takes every
import statement, at the top of a module or inside a function, and builds the graph of
imports between our own modules. A circle, or an import across a floor, fails with the
file and line of each import that makes it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("shards", "pipeline", "preprocess", "trainers")

# What each package must never import (a package or module, by its first name).
# `shards` is the on-disk contract both sides share, and stays free of torch and Ray so
# Ray workers and quick tests stay light; the offline build and the loader never meet.
FORBIDDEN = {
    "shards": ("preprocess", "pipeline", "trainers", "torch", "ray"),
    "pipeline": ("preprocess", "trainers"),
    "preprocess": ("pipeline", "trainers"),
}
# Joining Ray is shared by the build and the loader, which may not import each other, so
# it lives on their common floor, in the one module of `shards` that may touch Ray, and
# only inside its functions (importing `shards` loads no Ray).
LAZY_RAY = "shards.cluster"


@dataclass(frozen=True)
class Import:
    """One import statement: `source` imports `target` at `path:line`."""

    source: str  # our module, dotted
    target: str  # a dotted name as imported: ours (a module) or another library's
    path: Path
    line: int

    def where(self) -> str:
        """`pipeline/loader.py:12`: the file relative to the repository, and the line."""
        depth = self.source.count(".") + 1 + (self.path.name == "__init__.py")
        return f"{'/'.join(self.path.parts[-depth:])}:{self.line}"


def find_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """`{dotted name: file}` of every module of `packages` under `root`."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def absolute_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The dotted module a `from ... import` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join([*package, *([node.module] if node.module else [])])


def our_module(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of our modules, else None."""
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else None


def iter_imports(module: str, path: Path, modules: dict[str, Path]):
    """Every import of `module`, wherever it stands; `from pkg import mod` names `pkg.mod`."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, path, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(module, path, node)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                yield Import(module, name if name in modules else base, path, node.lineno)


def import_graph(modules: dict[str, Path]) -> dict[str, list[Import]]:
    """`{module: imports of our other modules}`; an import of a package counts as its `__init__`."""
    graph: dict[str, list[Import]] = {name: [] for name in modules}
    for name, path in modules.items():
        for found in iter_imports(name, path, modules):
            target = our_module(found.target, modules)
            if target is not None and target != name:
                graph[name].append(Import(name, target, found.path, found.line))
    return graph


def path_back(graph: dict[str, list[Import]], start: str, module: str, seen: set[str]):
    """The imports that lead from `module` back to `start`, or None (depth first)."""
    for edge in graph[module]:
        if edge.target == start:
            return [edge]
        if edge.target in seen:
            continue
        seen.add(edge.target)
        rest = path_back(graph, start, edge.target, seen)
        if rest:
            return [edge, *rest]
    return None


def find_circles(graph: dict[str, list[Import]]) -> list[list[Import]]:
    """One circle (as its imports, in order) for each module that is the first of one."""
    circles = []
    done: set[str] = set()  # every circle through these was looked for already
    for start in sorted(graph):
        circle = path_back(graph, start, start, set(done))
        if circle:
            circles.append(circle)
        done.add(start)
    return circles


def floor_breaks(modules: dict[str, Path]) -> list[Import]:
    """Imports, ours or other libraries', that `FORBIDDEN` refuses to their package."""
    breaks = []
    for name, path in modules.items():
        refused = FORBIDDEN.get(name.split(".")[0], ())
        for found in iter_imports(name, path, modules):
            lazy_ray = name == LAZY_RAY and found.target.split(".")[0] == "ray"
            if found.target.split(".")[0] in refused and not lazy_ray:
                breaks.append(found)
    return breaks


def describe_circle(circle: list[Import]) -> str:
    return " -> ".join(f"{edge.source} ({edge.where()})" for edge in circle) + (
        f" -> {circle[0].source}"
    )


def test_our_modules_import_each_other_without_circles():
    circles = find_circles(import_graph(find_modules(ROOT, PACKAGES)))
    assert not circles, "import circles (move the shared piece down to one side):\n" + "\n".join(
        describe_circle(circle) for circle in circles
    )


def test_no_package_imports_across_its_floor():
    breaks = floor_breaks(find_modules(ROOT, PACKAGES))
    assert not breaks, "imports the one-way floors refuse:\n" + "\n".join(
        f"{found.where()}: {found.source} imports {found.target}" for found in breaks
    )


def test_every_package_was_read():
    modules = find_modules(ROOT, PACKAGES)
    for package in PACKAGES:
        assert package in modules  # its __init__.py
        assert sum(name.startswith(f"{package}.") for name in modules) >= 5


def test_the_one_module_of_shards_that_touches_ray_imports_it_only_inside_functions():
    path = ROOT / (LAZY_RAY.replace(".", "/") + ".py")
    tree = ast.parse(path.read_text())
    top_level = [
        node
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom))
        and any(
            (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
            == "ray"
            for alias in node.names
        )
    ]
    assert not top_level, f"{LAZY_RAY} imports ray at module level (line {top_level[0].lineno})"
    assert "import ray" in path.read_text()  # it does use Ray, lazily: the rule has a subject


def write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def small_tree(tmp_path):
    """Two packages whose imports are written to test the checker itself."""
    write_tree(
        tmp_path,
        {
            "shards/__init__.py": "",
            "shards/io.py": "import json\n",
            "shards/tar.py": "from . import io\n\ndef read():\n    import torch.nn\n",
            "pipeline/__init__.py": "def __getattr__(name):\n    from pipeline import loader\n",
            "pipeline/loader.py": "from pipeline.urls import expand\nfrom shards import tar\n",
            "pipeline/urls.py": "def expand():\n    from .loader import build\n",
            "pipeline/plan.py": "import pipeline\n",
        },
    )
    return find_modules(tmp_path, ("shards", "pipeline"))


def test_the_checker_finds_a_circle_through_a_function_level_import(small_tree):
    circles = find_circles(import_graph(small_tree))
    assert [[(edge.source, edge.target, edge.line) for edge in c] for c in circles] == [
        [("pipeline.loader", "pipeline.urls", 1), ("pipeline.urls", "pipeline.loader", 2)]
    ]
    assert "pipeline/urls.py:2" in describe_circle(circles[0])


def test_the_checker_resolves_relative_imports_and_package_imports(small_tree):
    graph = import_graph(small_tree)
    assert [edge.target for edge in graph["shards.tar"]] == ["shards.io"]
    assert [edge.target for edge in graph["pipeline"]] == ["pipeline.loader"]
    assert [edge.target for edge in graph["pipeline.plan"]] == ["pipeline"]
    assert graph["shards.io"] == []


def test_the_checker_finds_torch_imported_inside_a_function_of_shards(small_tree):
    breaks = floor_breaks(small_tree)
    assert [(found.source, found.target, found.line) for found in breaks] == [
        ("shards.tar", "torch.nn", 4)
    ]
