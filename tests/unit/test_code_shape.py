"""The shape the code promises to keep: no import cycle, no module over 400 lines.

Import edges are read from the source with `ast` (not by importing), counting every import of
a `difftune` module that runs, wherever it sits (module level or inside a function: a lazy
import is still an import); only imports under `if TYPE_CHECKING:` (annotations, never run)
are left out. `from a.b import c` is an edge to `a.b.c` when that is a module, else to `a.b`.
A cycle is any strongly connected group of more than one module.
"""

from __future__ import annotations

import ast
from pathlib import Path

import difftune

ROOT = Path(difftune.__file__).parent
LIMIT = 400


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (packages by their __init__)."""
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    """An `if TYPE_CHECKING:` block (its imports never run)."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING")


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The difftune modules that `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _is_package_edge(a: str, b: str) -> bool:
    """A package's __init__ re-exporting its own submodules (not a cycle of meaning)."""
    return b.startswith(a + ".")


def test_no_import_cycle() -> None:
    modules = _modules()
    graph = {n: {m for m in _edges(n, p, modules) if not _is_package_edge(n, m)}
             for n, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_over_the_limit() -> None:
    sizes = {n: len(p.read_text(encoding="utf-8").splitlines()) for n, p in _modules().items()}
    assert {n: s for n, s in sizes.items() if s > LIMIT} == {}
