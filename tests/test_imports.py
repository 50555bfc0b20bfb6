"""The package's modules import one another without a circle: every ``import`` statement of ``flowgrpo/`` (at module
level or inside a function, but not under ``if TYPE_CHECKING:``) is an edge of a graph that must have no cycle.

Importing ``a.b.c`` from outside ``a.b`` runs ``a/b/__init__.py`` too, so the edge reaches each package above the
module that does not hold the importer. A name imported from a package that is a submodule (``from . import x``)
is an edge to that submodule.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "flowgrpo"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node outside ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(unresolved: list[str] | None = None) -> dict[str, set[str]]:
    """``module → modules of the package it imports``; relative imports that name no module of the package are
    appended to ``unresolved``."""
    files = {_module_name(p): p for p in (ROOT / PACKAGE).rglob("*.py")}
    packages = {name for name, p in files.items() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name if name in packages else name.rpartition(".")[0]  # the package relative imports start from
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
                continue
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            if node.level and module not in files and unresolved is not None:
                unresolved.append(f"{name}: from {'.' * node.level}{node.module or ''} import ...")
            targets.add(module)
            targets.update(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in files)
        edges = set()
        for target in targets:
            if target not in files:
                continue
            edges.add(target)
            parent = target.rpartition(".")[0]
            while parent and not (name == parent or name.startswith(parent + ".")):
                edges.add(parent)  # importing a submodule from outside its package runs the package first
                parent = parent.rpartition(".")[0]
        graph[name] = edges - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_relative_import_names_a_module_of_the_package():
    unresolved: list[str] = []
    import_graph(unresolved)
    assert unresolved == []


def test_the_circle_check_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_and_package_imports():
    graph = import_graph()
    assert "flowgrpo.models" in graph["flowgrpo.builders.model"]  # `from ..models import load_adapter` in a function
    assert "flowgrpo.algorithms" in graph["flowgrpo.trainer"]  # the package, run before its submodules
    assert "flowgrpo.seeding" in graph["flowgrpo.rollout"]
