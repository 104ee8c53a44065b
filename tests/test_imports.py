"""No import cycles between cloudckpt's modules: neither at module level nor through the imports
inside functions (those of ``cloudckpt/testing/`` aside: test infrastructure)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cloudckpt"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph(*, inside_functions: bool, skip: str = "cloudckpt.testing") -> dict[str, set[str]]:
    """Module -> the cloudckpt modules it imports (``from pkg import submodule`` points at the
    submodule, not at the package)."""
    mods = _modules()

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        if name.startswith(skip):
            continue
        tree = ast.parse(path.read_text(), str(path))
        nodes = ast.walk(tree) if inside_functions else tree.body
        targets: list[str] = []
        for node in nodes:
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    targets.append(sub if sub in mods else node.module)
        graph[name] = {
            o
            for t in targets
            if t.startswith("cloudckpt")
            for o in [owner(t)]
            if o and o != name and not o.startswith(skip)
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("inside_functions", [False, True], ids=["module-level", "all"])
def test_no_import_cycles(inside_functions):
    assert cycles(import_graph(inside_functions=inside_functions)) == []


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_runtime_state_lives_below_the_api():
    """runtime/context.py imports planning at module level, and storage / the staging pool's module
    on first use: nothing that uses it (api, transport, runtime, manager)."""
    eager = import_graph(inside_functions=False)["cloudckpt.runtime.context"]
    assert {".".join(m.split(".")[:2]) for m in eager} == {"cloudckpt.planning"}, eager
    lazy = import_graph(inside_functions=True)["cloudckpt.runtime.context"]
    assert all(
        m.startswith(("cloudckpt.planning", "cloudckpt.storage")) or m.endswith(".staging")
        for m in lazy
    ), lazy
