#!/usr/bin/env python3
"""Print kiln's package graph from its imports; exit 1 when the graph has a cycle.

A node is a package (a directory with ``__init__.py``: ``kiln.core``, ``kiln.backends.python``)
or a module directly under ``kiln`` (``kiln.cli``). An edge A -> B means some module of A
imports some module of B, anywhere in the file: function-level and ``TYPE_CHECKING`` imports
count, because they are what ties packages together once the code runs.

    python scripts/package_graph.py [--src src] [--root kiln] [--edges]

Output: the packages bottom-up (each line: its depth, the package and the packages it imports;
depth 0 imports none of kiln's packages, depth n imports one of depth n-1), then the
cycles (strongly connected components of more than one package), each with one import per edge
as evidence. A cycle between a package and its own subpackages only (``llm`` and ``llm.models``:
the models use the package's layers, its runner uses the models) is an import between modules
of one package, as import-linter's layers see it: it is printed, and fails only with --strict.
An import that pyproject.toml's import-linter contracts ignore (``ignore_imports``) is no edge.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import sys
import tomllib
from collections import defaultdict
from pathlib import Path


def module_index(src: Path, root: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under src/root."""
    index: dict[str, Path] = {}
    for path in sorted((src / root).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        index[".".join(parts)] = path
    return index


def node_of(module: str, index: dict[str, Path], root: str) -> str:
    """The package a module belongs to (a top-level module of root is a node of its own)."""
    path = index[module]
    if path.name == "__init__.py":
        return module
    parent = module.rpartition(".")[0]
    return module if parent == root else parent


def imported_modules(module: str, path: Path, index: dict[str, Path], root: str) -> list[str]:
    """The modules of root that a file imports (resolving relative imports and
    ``from package import submodule``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - (1 if is_package else 0)
                base = base[: len(base) - drop] if drop else base
                prefix = ".".join(base)
                base_name = f"{prefix}.{node.module}" if node.module else prefix
            else:
                base_name = node.module or ""
            names = []
            for alias in node.names:
                sub = f"{base_name}.{alias.name}"
                names.append(sub if sub in index else base_name)
        else:
            continue
        for name in names:
            if name != root and not name.startswith(root + "."):
                continue
            # the longest prefix that is a module of ours (``import kiln.core.types.X``)
            while name and name not in index:
                name = name.rpartition(".")[0]
            if name:
                found.append(name)
    return found


def ignored_imports(pyproject: Path) -> list[tuple[str, str]]:
    """The ``ignore_imports`` of the import-linter contracts (``"a.b -> c.**"``), as
    (importer, imported) glob pairs: an import the contract lets through is no edge here
    either, so both checks agree."""
    if not pyproject.is_file():
        return []
    config = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    contracts = config.get("tool", {}).get("importlinter", {}).get("contracts", [])
    pairs = []
    for contract in contracts:
        for line in contract.get("ignore_imports", []):
            importer, _, imported = line.partition("->")
            pairs.append(tuple(p.strip().replace("**", "*") for p in (importer, imported)))
    return pairs  # type: ignore[return-value]


def build_graph(
    src: Path, root: str, ignore: list[tuple[str, str]] | None = None
) -> tuple[dict[str, set[str]], dict[tuple[str, str], tuple[str, str]]]:
    index = module_index(src, root)
    graph: dict[str, set[str]] = defaultdict(set)
    evidence: dict[tuple[str, str], tuple[str, str]] = {}
    for module, path in index.items():
        a = node_of(module, index, root)
        graph[a]
        for target in imported_modules(module, path, index, root):
            if any(
                fnmatch.fnmatchcase(module, a) and fnmatch.fnmatchcase(target, b)
                for a, b in ignore or ()
            ):
                continue
            b = node_of(target, index, root)
            graph[b]
            if a == b:
                continue
            graph[a].add(b)
            evidence.setdefault((a, b), (module, target))
    return graph, evidence


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in reverse topological order (leaves first)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            advanced = False
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    advanced = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                out.append(sorted(component))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent.parent
    parser.add_argument("--src", type=Path, default=here / "src")
    parser.add_argument("--root", default="kiln")
    parser.add_argument("--edges", action="store_true", help="one import as evidence per edge")
    parser.add_argument(
        "--strict", action="store_true", help="a package-subpackage cycle fails too"
    )
    parser.add_argument("--quiet", action="store_true", help="print only the cycles")
    args = parser.parse_args(argv)

    graph, evidence = build_graph(
        args.src, args.root, ignored_imports(args.src.resolve().parent / "pyproject.toml")
    )
    components = strongly_connected(graph)
    strip = len(args.root) + 1

    def short(name: str) -> str:
        return name[strip:] if name != args.root else args.root

    # depth: 0 for a package that imports none of ours, else 1 + its deepest import (a
    # cycle's packages share one depth): the listing reads bottom-up, layer by layer
    depth: dict[str, int] = {}
    for component in components:  # leaves first
        members = set(component)
        below = [depth[b] for p in component for b in graph[p] - members]
        for package in component:
            depth[package] = 1 + max(below) if below else 0
    if not args.quiet:
        print(
            f"# {args.root} package graph: {len(graph)} packages, "
            f"{sum(map(len, graph.values()))} edges; depth 0 imports none of ours"
        )
        for package in sorted(graph, key=lambda p: (depth[p], p)):
            deps = ", ".join(short(b) for b in sorted(graph[package]))
            print(f"{depth[package]:2}  {short(package):20} -> {deps or '-'}")
            if args.edges:
                for b in sorted(graph[package]):
                    module, target = evidence[(package, b)]
                    print(f"{'':28}{short(b)}: {module} imports {target}")
    cycles = [c for c in components if len(c) > 1]
    failed = False
    for component in cycles:
        members = set(component)
        top = min(component, key=len)
        inner = all(p == top or p.startswith(top + ".") for p in component)
        failed = failed or args.strict or not inner
        label = f"within {short(top)}" if inner else "CYCLE"
        print(f"\n{label}: {' '.join(short(p) for p in component)}")
        for a in component:
            for b in sorted(graph[a] & members):
                module, target = evidence[(a, b)]
                print(f"  {short(a)} -> {short(b)}: {module} imports {target}")
    if not failed:
        print("no cycles between packages")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
