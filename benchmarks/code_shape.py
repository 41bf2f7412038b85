"""The shape of the code, read from two checkouts: what issue 20's redesign set out to change.

A redesign that claims "modules with one job, one storage layer, settings that nest, no
import circle" should show it in figures anyone can recount, not in prose. This reads the
source of each tree (AST only, nothing imported or run) and prints, per tree:

- the five largest modules of the four packages, in lines;
- the settings groups: every dataclass in a `config` module and every dataclass named
  `*Config`, `*Settings` or `*Options`, with its field count;
- hand mappings: calls that build one such settings object (or a `Partition`) from
  four or more fields of another object copied one by one (`X(a=c.a, b=c.b, ...)`);
- the modules outside `shards/storage/` that reach a transport or commit bytes themselves
  (`fsspec.open`, `url_to_fs`, `fsspec.filesystem`, `urlopen`, `HTTPConnection`,
  `os.fsync`, `os.replace`, `os.rename`): the storage layer's goal is none;
- import circles between modules (any `import`, lazy ones included);
- with `duplicates` on the PATH, its pair count over the packages (tests left out).

    python benchmarks/code_shape.py /tmp/before .
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("shards", "pipeline", "preprocess", "trainers")
TRANSPORT_CALLS = {
    "fsspec.open",
    "url_to_fs",
    "fsspec.filesystem",
    "urlopen",
    "HTTPConnection",
    "HTTPSConnection",
    "os.fsync",
    "os.replace",
    "os.rename",
}
STORAGE_LAYER = "shards/storage/"


def modules(tree: Path) -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of the four packages."""
    for package in PACKAGES:
        for path in sorted((tree / package).rglob("*.py")):
            parts = path.relative_to(tree).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def call_name(node: ast.Call) -> str:
    """`a.b.c` for a call of `a.b.c(...)`, the bare name for `c(...)`."""
    parts, func = [], node.func
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name):
        parts.append(func.id)
    return ".".join(reversed(parts))


def transport_calls(syntax: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(syntax):
        if isinstance(node, ast.Call):
            name = call_name(node)
            if name in TRANSPORT_CALLS or name.split(".")[-1] in {"urlopen", "url_to_fs"}:
                found.add(name)
    return found


def imported(syntax: ast.AST, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of the four packages that module `name` imports, anywhere in it."""
    package = name if is_package else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(syntax):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted.

    A package's `__init__` that re-exports its own modules is not a circle of
    design (Python resolves it by order), so edges from a package to its own
    submodules are left out.
    """
    edges = {
        node: {t for t in targets if not t.startswith(node + ".")}
        for node, targets in graph.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


SETTINGS_NAME = re.compile(r"\w*(Config|Settings|Options)$")


def config_groups(path: Path, syntax: ast.Module) -> list[tuple[str, int]]:
    """(class, field count) of each settings dataclass of a module."""
    in_config = path.stem == "config" or path.parent.name == "config"
    groups = []
    for node in syntax.body:
        if not isinstance(node, ast.ClassDef):
            continue
        if not (in_config or SETTINGS_NAME.match(node.name)):
            continue
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if not any("dataclass" in d for d in decorators):
            continue
        fields = [
            s
            for s in node.body
            if isinstance(s, ast.AnnAssign)
            and isinstance(s.target, ast.Name)
            and "ClassVar" not in ast.unparse(s.annotation)
        ]
        groups.append((node.name, len(fields)))
    return groups


def dataclass_fields(syntax: ast.Module) -> dict[str, dict[str, str]]:
    """{class: {field: annotation}} of the module's dataclasses."""
    found = {}
    for node in syntax.body:
        if isinstance(node, ast.ClassDef) and any(
            "dataclass" in ast.unparse(d) for d in node.decorator_list
        ):
            found[node.name] = {
                s.target.id: ast.unparse(s.annotation)
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
    return found


def hand_mappings(syntax: ast.AST, classes: dict[str, dict[str, str]]) -> list[str]:
    """Calls `Settings(a=c.a, b=c.x, ...)` that take four or more keywords from one
    object, as `Settings <- c: n scalar fields, m groups`: a group (a field whose type
    is a dataclass) passed whole is embedding, a scalar copied is a hand mapping."""
    found = []
    for node in ast.walk(syntax):
        if not isinstance(node, ast.Call):
            continue
        callee = call_name(node).split(".")[-1]
        if callee not in classes or not (SETTINGS_NAME.match(callee) or callee == "Partition"):
            continue
        bases: dict[str, list[str]] = {}
        for keyword in node.keywords:
            if isinstance(keyword.value, ast.Attribute) and keyword.arg:
                bases.setdefault(ast.unparse(keyword.value.value), []).append(keyword.arg)
        if not bases or max(map(len, bases.values())) < 4:
            continue
        base, names = max(bases.items(), key=lambda item: len(item[1]))
        annotations = classes[callee]
        groups = sum(
            1
            for name in names
            if any(part in classes for part in re.findall(r"\w+", annotations.get(name, "")))
        )
        found.append(f"{callee} <- {base}: {len(names) - groups} scalar fields, {groups} groups")
    return found


def duplicate_pairs(tree: Path) -> str:
    if not shutil.which("duplicates"):
        return "duplicates not on PATH"
    out = subprocess.run(
        ["duplicates", "--repo", str(tree), "--most", "200", "--seconds", "300"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    rows = [line for line in out.splitlines() if re.match(r"D\d+ ", line)]
    in_packages = [
        row
        for row in rows
        if all(side.split(":")[0].split("/")[0] in PACKAGES for side in row.split()[1:4:2])
    ]
    return f"{len(in_packages)} pairs within the packages ({len(rows)} in all, tests included)"


def shape(tree: Path) -> dict:
    sizes, graph, io_sites, groups, mappings = {}, {}, {}, {}, {}
    parsed = {}
    for name, path in modules(tree):
        source = path.read_text()
        sizes[str(path.relative_to(tree))] = len(source.splitlines())
        parsed[name] = (path, ast.parse(source))
    known = set(parsed)
    classes: dict[str, dict[str, str]] = {}
    for _, syntax in parsed.values():
        classes.update(dataclass_fields(syntax))
    for name, (path, syntax) in parsed.items():
        relative = str(path.relative_to(tree))
        graph[name] = imported(syntax, name, path.name == "__init__.py", known)
        calls = transport_calls(syntax)
        if calls and not relative.startswith(STORAGE_LAYER):
            io_sites[relative] = sorted(calls)
        for group, count in config_groups(path, syntax):
            groups[f"{relative}:{group}"] = count
        if found := hand_mappings(syntax, classes):
            mappings[relative] = found
    return {
        "largest": sorted(sizes.items(), key=lambda item: -item[1])[:5],
        "groups": groups,
        "io_sites": io_sites,
        "mappings": mappings,
        "circles": circles(graph),
        "duplicates": duplicate_pairs(tree),
    }


def report(label: str, result: dict) -> None:
    print(f"## {label}")
    print("largest modules: " + ", ".join(f"{p} {n:,}" for p, n in result["largest"]))
    groups = result["groups"]
    if groups:
        widest = max(groups.items(), key=lambda item: item[1])
        print(
            f"settings groups: {len(groups)}, largest {widest[0]} ({widest[1]} fields); "
            + ", ".join(f"{k.split(':')[1]} {v}" for k, v in groups.items())
        )
    mappings = result["mappings"]
    print(
        f"hand mappings between settings: {sum(map(len, mappings.values()))}"
        + "".join(f"; {path}: {', '.join(calls)}" for path, calls in mappings.items())
    )
    print(
        f"modules outside {STORAGE_LAYER} that reach a transport or commit bytes: "
        f"{len(result['io_sites'])}"
    )
    for path, calls in result["io_sites"].items():
        print(f"  {path}: {', '.join(calls)}")
    print("import circles: " + ("; ".join(" <-> ".join(c) for c in result["circles"]) or "none"))
    print(f"duplicates: {result['duplicates']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", type=Path, nargs="+", help="checkouts to read, e.g. before after")
    args = parser.parse_args(argv)
    for tree in args.trees:
        report(str(tree), shape(tree.resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
