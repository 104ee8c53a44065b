"""The layering of docs/architecture.md, checked on the source: no import cycle between
cloudckpt's modules, and the data plane, planning and api keep to their places."""

from __future__ import annotations

import ast
from pathlib import Path

import cloudckpt

PACKAGE = Path(cloudckpt.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("cloudckpt",) + path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _imports(nodes) -> set[str]:
    """cloudckpt modules (and packages) named by the import statements among ``nodes``."""
    out: set[str] = set()
    for n in nodes:
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("cloudckpt"):
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in MODULES)
        elif isinstance(n, ast.Import):
            out.update(a.name for a in n.names if a.name.startswith("cloudckpt"))
    return out


def _graph(*, at_import_time: bool) -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        graph[name] = _imports(tree.body if at_import_time else ast.walk(tree))
    return graph


def test_no_import_cycle():
    graph = _graph(at_import_time=True)
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"import cycle: {' -> '.join(path + (module,))}"
        if module in done:
            return
        for dep in sorted(graph.get(module, ())):
            # importing a package's submodule runs the package's __init__ first: not an edge
            # back from the package to itself
            if dep != module and not module.startswith(dep + "."):
                visit(dep, path + (module,))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def _violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    graph = _graph(at_import_time=False)
    return sorted(f"{m} imports {d}" for m, deps in graph.items()
                  if m == prefix or m.startswith(prefix + ".")
                  for d in deps if any(d == f or d.startswith(f + ".") for f in forbidden))


def test_the_data_plane_runs_no_collective_and_knows_no_protocol():
    assert _violations("cloudckpt.dataplane", ("cloudckpt.transport", "cloudckpt.api",
                                               "cloudckpt.manager", "cloudckpt.cli",
                                               "cloudckpt.preemption")) == []


def test_planning_and_manifest_are_pure():
    impure = ("cloudckpt.dataplane", "cloudckpt.storage", "cloudckpt.transport", "cloudckpt.api",
              "cloudckpt.runtime", "cloudckpt.statedict")
    assert _violations("cloudckpt.planning", impure) == []
    assert _violations("cloudckpt.manifest", impure + ("cloudckpt.planning",)) == []
    for prefix in ("cloudckpt/planning", "cloudckpt/manifest"):
        for path in (PACKAGE.parent / prefix).glob("*.py"):
            tree = ast.parse(path.read_text())
            names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                     for a in n.names}
            names |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                      if isinstance(n, ast.ImportFrom)}
            assert "torch" not in names, path


def test_only_the_api_drives_the_data_plane():
    graph = _graph(at_import_time=False)
    users = sorted(m for m, deps in graph.items() if not m.startswith("cloudckpt.dataplane")
                   and any(d.startswith("cloudckpt.dataplane") for d in deps))
    # the runtime context holds the staging pool (process state), and nothing else of it
    assert {d for d in graph["cloudckpt.context"] if d.startswith("cloudckpt.dataplane")} \
        <= {"cloudckpt.dataplane.staging"}
    users = [m for m in users if m != "cloudckpt.context"]
    assert users and all(m.startswith("cloudckpt.api.") for m in users), users
