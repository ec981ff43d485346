"""The package's shape: no import cycle, small modules and classes, a re-export-only root.

These read the source with :mod:`ast` (only the last test imports the package), so
they see every import, wherever it sits in a file: at module level, inside a
function, or under ``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import importlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = "aiodatadist"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
# Compiled or stub-only modules: import targets, with no imports of their own.
TARGETS = set(MODULES) | {_module_name(p) for p in ROOT.rglob("*.pyi")}


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names (before its imported names)."""
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    # A module's own package is its name minus the last part; a package is its own.
    drop = node.level - 1 if _is_package(importer) else node.level
    base = base[: len(base) - drop] if drop else base
    return ".".join([*base, node.module] if node.module else base)


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every package module ``name`` imports, with the line, anywhere in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in TARGETS:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(name, node)
            if not (module == PACKAGE or module.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{module}.{alias.name}"
                # ``from . import x``: the submodule x if there is one, else the package.
                yield (sub if sub in TARGETS else module), node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """importer -> {imported module: first line}, for the package's own modules."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in MODULES.items():
        edges: dict[str, int] = {}
        for target, line in _imports(name, path):
            if target != name and target in TARGETS:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        # Shortest way back to start inside the component (breadth-first).
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in component and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(parent[path[-1]])
        cycles.append(path[::-1])
    return cycles


def _component(graph: dict[str, dict[str, int]], start: str) -> set[str]:
    """The modules that both reach ``start`` and are reached from it."""

    def reach(edges: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges.get(todo.pop(), set()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    forward = {v: set(ws) for v, ws in graph.items()}
    backward: dict[str, set[str]] = {}
    for v, ws in graph.items():
        for w in ws:
            backward.setdefault(w, set()).add(v)
    return reach(forward) & reach(backward)


def test_import_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    assert "aiodatadist.errors" in graph["aiodatadist._validate"]
    assert "aiodatadist._native" in graph["aiodatadist._executor"]  # from . import _native
    assert "aiodatadist._leases" in graph["aiodatadist._fdchannel"]
    fake = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert _cycles(fake) == [["a", "b", "c", "a"]]


def test_no_import_cycle() -> None:
    graph = import_graph()
    cycles = _cycles(graph)
    lines = []
    for cycle in cycles:
        steps = [f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(cycle)]
        line = " -> ".join([*steps, cycle[-1]])
        component = _component(graph, cycle[0])
        if len(component) > len(cycle) - 1:
            line += f"\n    (all of them import each other: {', '.join(sorted(component))})"
        lines.append(line)
    assert not cycles, "import cycles:\n  " + "\n  ".join(lines)


def test_modules_and_classes_are_small() -> None:
    offenders = []
    for name, path in MODULES.items():
        text = path.read_text()
        n = len(text.splitlines())
        if n > MAX_MODULE_LINES:
            offenders.append(f"module {name}: {n} lines (at most {MAX_MODULE_LINES})")
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    offenders.append(
                        f"class {name}.{node.name}: {size} lines (at most {MAX_CLASS_LINES})"
                    )
    assert not offenders, "too large:\n  " + "\n  ".join(offenders)


def _bound_names(tree: ast.Module) -> tuple[set[str], list[str]]:
    """Names the root module binds, and the statements that are not re-exports."""
    bound: set[str] = set()
    other: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Try) and all(
            isinstance(n, (ast.Import, ast.ImportFrom)) for n in node.body
        ):
            # Loading the native core, failing with a useful message.
            for n in node.body:
                assert isinstance(n, (ast.Import, ast.ImportFrom))
                bound |= {a.asname or a.name for a in n.names}
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "__all__"
        ):
            continue
        else:
            other.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return bound, other


def _root_all() -> list[str]:
    tree = ast.parse((ROOT / "__init__.py").read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == "__all__"
        ):
            names = ast.literal_eval(node.value)
            assert isinstance(names, list)
            return names
    raise AssertionError("aiodatadist/__init__.py has no __all__ = [...]")


def _public(name: str) -> bool:
    return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))


def test_root_only_reexports() -> None:
    tree = ast.parse((ROOT / "__init__.py").read_text())
    bound, other = _bound_names(tree)
    assert not other, "aiodatadist/__init__.py does more than re-export:\n  " + "\n  ".join(other)
    public = {n for n in bound if _public(n)}
    names = _root_all()
    exported = set(names)
    assert len(exported) == len(names), "__all__ lists a name twice"
    assert exported == public, (
        f"bound but not in __all__: {sorted(public - exported)}; "
        f"in __all__ but not bound: {sorted(exported - public)}"
    )


@pytest.mark.parametrize("name", sorted(_root_all()))
def test_root_names_importable(name: str) -> None:
    module = importlib.import_module(PACKAGE)
    assert getattr(module, name) is not None
    namespace: dict[str, object] = {}
    exec(f"from {PACKAGE} import {name}", namespace)
    assert namespace[name] is getattr(module, name)
