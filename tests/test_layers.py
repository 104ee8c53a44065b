"""The layering of docs/architecture.md, checked on the source: no import cycle between
cloudckpt's modules, and the data plane, planning and api keep to their places."""

from __future__ import annotations

import ast
import re
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
    return sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m == prefix or m.startswith(prefix + ".")
        for d in deps
        if any(d == f or d.startswith(f + ".") for f in forbidden)
    )


def test_the_data_plane_runs_no_collective_and_knows_no_protocol():
    assert (
        _violations(
            "cloudckpt.dataplane",
            (
                "cloudckpt.transport",
                "cloudckpt.api",
                "cloudckpt.runs.manager",
                "cloudckpt.cli.main",
                "cloudckpt.runs.preemption",
            ),
        )
        == []
    )


def test_planning_and_manifest_are_pure():
    impure = (
        "cloudckpt.dataplane",
        "cloudckpt.storage",
        "cloudckpt.transport",
        "cloudckpt.api",
        "cloudckpt.runtime.loop",
        "cloudckpt.statedict.pieces",
    )
    assert _violations("cloudckpt.planning", impure) == []
    assert _violations("cloudckpt.manifest", impure + ("cloudckpt.planning",)) == []
    for prefix in ("cloudckpt/planning", "cloudckpt/manifest"):
        for path in (PACKAGE.parent / prefix).glob("*.py"):
            tree = ast.parse(path.read_text())
            names = {
                a.name.split(".")[0]
                for n in ast.walk(tree)
                if isinstance(n, ast.Import)
                for a in n.names
            }
            names |= {
                (n.module or "").split(".")[0]
                for n in ast.walk(tree)
                if isinstance(n, ast.ImportFrom)
            }
            assert "torch" not in names, path


def test_only_the_api_drives_the_data_plane():
    graph = _graph(at_import_time=False)
    users = sorted(
        m
        for m, deps in graph.items()
        if not m.startswith("cloudckpt.dataplane")
        and any(d.startswith("cloudckpt.dataplane") for d in deps)
    )
    # the runtime context holds the staging pool (process state), and nothing else of it
    assert {
        d for d in graph["cloudckpt.runtime.context"] if d.startswith("cloudckpt.dataplane")
    } <= {"cloudckpt.dataplane.staging"}
    users = [m for m in users if m != "cloudckpt.runtime.context"]
    assert users and all(m.startswith("cloudckpt.api.") for m in users), users


def _private_uses(module: str, source: str) -> list[str]:
    """Underscore names of *other* cloudckpt modules that ``source`` (the text of ``module``)
    uses: ``from cloudckpt.x import _y`` and ``<cloudckpt.x>._y`` through any name bound to a
    cloudckpt module (``import cloudckpt.x as m``, ``from cloudckpt import x``). Dunders are
    public (``__version__``)."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the cloudckpt module it names
    found: list[str] = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("cloudckpt"):
                    if a.asname:
                        bound[a.asname] = a.name
                    else:
                        bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("cloudckpt"):
            for a in n.names:
                target = f"{n.module}.{a.name}"
                if target in MODULES:
                    bound[a.asname or a.name] = target
                elif private(a.name) and n.module != module:
                    found.append(f"{module} imports {n.module}.{a.name}")
    for n in ast.walk(tree):
        if not isinstance(n, ast.Attribute):
            continue
        chain, root = [n.attr], n.value
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if not isinstance(root, ast.Name) or root.id not in bound:
            continue
        owner = bound[root.id]
        for attr in reversed(chain[1:]):  # descend while the chain names submodules
            if f"{owner}.{attr}" not in MODULES:
                break
            owner = f"{owner}.{attr}"
        else:
            if private(n.attr) and owner != module:
                found.append(f"{module} uses {owner}.{n.attr}")
    return found


def test_the_private_name_scan_finds_each_form():
    src = (
        "import cloudckpt.runtime.loop as rt\nfrom cloudckpt.runtime import context\n"
        "from cloudckpt.runs.cleanup import _Sorter, carry_out\nimport cloudckpt\n"
        "rt._one_line(1); context._CONTEXT; cloudckpt.layout._STEP_RE\n"
        "context.current(); cloudckpt.__version__; rt.__name__\n"
    )
    assert sorted(_private_uses("cloudckpt.runs.manager", src)) == [
        "cloudckpt.runs.manager imports cloudckpt.runs.cleanup._Sorter",
        "cloudckpt.runs.manager uses cloudckpt.layout._STEP_RE",
        "cloudckpt.runs.manager uses cloudckpt.runtime.context._CONTEXT",
        "cloudckpt.runs.manager uses cloudckpt.runtime.loop._one_line",
    ]
    assert (
        _private_uses("cloudckpt.runtime.loop", "from cloudckpt.runtime.loop import _one_line\n")
        == []
    )


def test_no_module_uses_another_modules_private_names():
    """A module's underscore names are its own: what another module needs is public (the
    manager once imported run_cleanup's helpers). ``cloudckpt.testing`` (test support) aside."""
    found = [
        use
        for name, path in MODULES.items()
        if not (name == "cloudckpt.testing" or name.startswith("cloudckpt.testing."))
        for use in _private_uses(name, path.read_text())
    ]
    assert found == []


def _manifest_private_names() -> set[str]:
    """Underscore attributes and methods of :class:`~cloudckpt.manifest.model.Manifest`, from its
    source: ``self._x = ...`` (also ``self._x, self._y = ...``), ``self.__dict__["_x"]`` and its
    ``def _x``."""
    tree = ast.parse(MODULES["cloudckpt.manifest.model"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Manifest")
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            names.add(n.attr)
        elif (
            isinstance(n, ast.Subscript)
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "__dict__"
            and isinstance(n.slice, ast.Constant)
        ):
            names.add(n.slice.value)
    return {x for x in names if x.startswith("_") and not x.endswith("__")}


def _reads_of(names: set[str], module: str, source: str) -> list[str]:
    """``<expr>._x`` (``_x`` in ``names``) where ``<expr>`` is not ``self``, and
    ``<expr>.__dict__`` lookups of those names."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if (
            isinstance(n, ast.Attribute)
            and n.attr in names
            and not (isinstance(n.value, ast.Name) and n.value.id == "self")
        ):
            found.append(f"{module}:{n.lineno} reads {ast.unparse(n)}")
        elif (
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.args
            and isinstance(n.func.value, ast.Attribute)
            and n.func.value.attr == "__dict__"
            and isinstance(n.args[0], ast.Constant)
            and isinstance(n.args[0].value, str)
            and n.args[0].value.startswith("_cloudckpt")
        ):
            found.append(f"{module}:{n.lineno} keeps {n.args[0].value} in an object's __dict__")
    return found


def test_the_manifest_scan_finds_each_form():
    names = _manifest_private_names()
    assert {"_offsets", "_sizes", "_shapes", "_name_index", "_chunk_start", "_shape"} <= names
    src = (
        "def f(m, idx):\n    m._offsets; idx.manifest._shapes; m.columns.offsets; m.shapes\n"
        "    m.__dict__.get('_cloudckpt_index')\n"
        "class A:\n    def g(self):\n        return self._offsets\n"
    )
    assert _reads_of(names, "x", src) == [
        "x:2 reads m._offsets",
        "x:2 reads idx.manifest._shapes",
        "x:3 keeps _cloudckpt_index in an object's __dict__",
    ]


def test_no_module_reads_the_manifests_private_attributes():
    """What other modules need of a manifest is public (``Manifest.columns``, ``.shapes``,
    ``.derived``): the codec, the chunk index and load planning once read its underscore
    attributes and kept the chunk index in its ``__dict__``."""
    names = _manifest_private_names()
    found = [
        use
        for name, path in MODULES.items()
        if name != "cloudckpt.manifest.model"
        for use in _reads_of(names, name, path.read_text())
    ]
    assert found == []


# ---------------------------------------------------------------------------------------------
# The bands of docs/architecture.md: each box (a top-level module or package of cloudckpt) sits in
# one band; a module imports (at module level or inside a function) only its own band and those
# below. Inside a band, boxes may import each other in one direction only (no cycle, below).

BANDS: list[tuple[str, tuple[str, ...]]] = [
    ("face", ("cli", "__main__")),
    ("interop", ("export", "hf", "dcp", "integrations")),
    ("control", ("runs",)),
    ("protocol", ("api",)),
    ("mechanism", ("dataplane", "transport", "groups", "stored", "runtime", "statedict")),
    ("pure", ("layout", "manifest", "planning")),
    ("storage", ("storage",)),
    ("ground", ("errors", "options", "checksum", "wording", "http_numbers", "version")),
]
#: The package's own ``__init__`` (the lazy public façade: it names the api by strings) and the
#: test infrastructure stand outside the bands; no library module imports ``cloudckpt.testing``.
OUTSIDE_BANDS = ("__init__", "testing")
MAX_FLOORS = 11
MAX_MODULE_LINES = 450


def box_of(module: str) -> str:
    """``cloudckpt.storage.s3.store`` -> ``storage``; ``cloudckpt`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def band_of(box: str) -> int:
    """The band's rank, 0 for the top (face)."""
    for rank, (_, boxes) in enumerate(BANDS):
        if box in boxes:
            return rank
    raise AssertionError(f"cloudckpt.{box} is in no band of tests/test_layers.py")


def box_graph(*, at_import_time: bool = False) -> dict[str, set[str]]:
    """Box -> the other boxes its modules import (inside functions too, unless
    ``at_import_time``); the boxes outside the bands are left out."""
    graph: dict[str, set[str]] = {}
    for module, deps in _graph(at_import_time=at_import_time).items():
        box = box_of(module)
        if box in OUTSIDE_BANDS:
            continue
        graph.setdefault(box, set()).update(
            box_of(d) for d in deps if box_of(d) not in (box, "__init__")
        )
    return graph


def longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest path of an acyclic graph, as the list of its nodes (raises on a cycle)."""
    best: dict[str, list[str]] = {}

    def visit(node: str, path: tuple[str, ...]) -> list[str]:
        assert node not in path, f"cycle: {' -> '.join(path + (node,))}"
        if node not in best:
            below = [visit(d, path + (node,)) for d in sorted(graph.get(node, ()))]
            best[node] = [node] + max(below, key=len, default=[])
        return best[node]

    return max((visit(n, ()) for n in sorted(graph)), key=len, default=[])


def test_every_box_is_in_one_band():
    boxes = {box_of(m) for m in MODULES} - set(OUTSIDE_BANDS)
    named = [b for _, bs in BANDS for b in bs]
    assert len(named) == len(set(named))
    assert boxes == set(named), (sorted(boxes - set(named)), sorted(set(named) - boxes))


def test_every_import_points_to_its_own_band_or_below():
    upward = sorted(
        f"{module} ({BANDS[band_of(box_of(module))][0]}) imports {dep} "
        f"({BANDS[band_of(box_of(dep))][0]})"
        for module, deps in _graph(at_import_time=False).items()
        if box_of(module) not in OUTSIDE_BANDS
        for dep in deps
        if box_of(dep) != "__init__"
        and (box_of(dep) == "testing" or band_of(box_of(dep)) < band_of(box_of(module)))
    )
    assert upward == []


def test_the_band_check_sees_an_upward_import():
    assert band_of("storage") > band_of("api") > band_of("cli")
    assert box_of("cloudckpt.storage.s3.store") == "storage" and box_of("cloudckpt") == "__init__"


def test_boxes_import_each_other_without_a_cycle_in_at_most_eleven_floors():
    """The import depth: the longest chain of imports between boxes (inside functions too)."""
    chain = longest_chain(box_graph())
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)


def test_the_depth_check_counts_floors_and_finds_cycles():
    assert longest_chain({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == ["a", "b", "c"]
    try:
        longest_chain({"a": {"b"}, "b": {"a"}})
    except AssertionError as exc:
        assert "cycle: a -> b -> a" in str(exc)
    else:
        raise AssertionError("a cycle was not found")


def test_no_module_is_over_450_lines():
    long = sorted(
        f"{p.relative_to(PACKAGE.parent)}: {n} lines"
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    )
    assert long == []


def figures() -> dict[str, object]:
    """What the closing note of a layout change reports (``python tests/test_layers.py``)."""
    graph = box_graph()
    modules = _graph(at_import_time=False)
    library = {m: d for m, d in modules.items() if box_of(m) not in OUTSIDE_BANDS}
    return {
        "boxes": len(graph),
        "box arrows": sum(len(v) for v in graph.values()),
        "floors": len(longest_chain(graph)),
        "chain": " -> ".join(longest_chain(graph)),
        "modules": len(library),
        "module arrows": sum(len(d) for d in library.values()),
    }


if __name__ == "__main__":
    try:
        for key, value in figures().items():
            print(f"{key}: {value}")
    except AssertionError as exc:
        print(exc)


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_PATH = re.compile(r"^(?:cloudckpt/)?((?:\w+/)*\w+)(\.py)?(/)?(?:[.:](\w+))?$")


def named_modules(text: str) -> list[str]:
    """What the architecture page names as cloudckpt code, in code spans and its tree block:
    module files (``storage/s3/store.py``, bare ``store.py`` too), folders (``planning/save/``),
    a module's name (``dataplane/reader.fetch_regions``) and dotted modules
    (``cloudckpt.runtime.loop.reset``); each as the problem found, empty when it exists."""
    tree = text.split("```", 2)[1] if text.count("```") >= 2 else ""
    spans = [(line.split()[0], True) for line in tree.splitlines()[1:] if line.strip()]
    spans += [(span, False) for span in _CODE_SPAN.findall(text)]
    files = {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")}
    basenames = {f.rsplit("/", 1)[-1] for f in files}
    folders = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_dir() and p.name != "__pycache__"
    }
    names = {segment for f in folders for segment in f.split("/")}
    lazy = set(getattr(cloudckpt, "_LAZY", {}))
    problems = []
    for span, in_tree in spans:
        span = span.strip().rstrip(",")
        if span.startswith("cloudckpt.") and span.split(".")[1] in lazy:
            continue  # a public name of the package's lazy façade (cloudckpt.convert)
        if span.startswith("cloudckpt.") and re.fullmatch(r"[\w.]+", span):
            parts = span.split(".")[1:]
            for cut in range(len(parts), 0, -1):
                rel = "/".join(parts[:cut])
                if f"{rel}.py" in files or f"{rel}/__init__.py" in files:
                    rest = parts[cut:]
                    path = PACKAGE / (f"{rel}.py" if f"{rel}.py" in files else f"{rel}/__init__.py")
                    if rest and not re.search(rf"\b{re.escape(rest[0])}\b", path.read_text()):
                        problems.append(f"{span}: no {rest[0]} in {rel}")
                    break
            else:
                problems.append(f"{span}: no such module")
            continue
        m = _PATH.match(span)
        if not m or not (m.group(2) or m.group(3) or "/" in m.group(1)):
            continue
        rel, is_file, is_folder, attr = m.groups()
        if is_folder:
            if not in_tree and rel.split("/")[0] not in names:
                continue  # not a folder of cloudckpt's (an example key such as F/pins/)
            known = rel in folders or any(f.endswith("/" + rel) for f in folders)
            if not known and not (PACKAGE.parent / rel).is_dir():
                problems.append(f"{span}: no such folder")
        elif is_file:
            root_file = (PACKAGE.parent / f"{rel}.py").is_file()
            # relative to its section's folder (`s3/conn.py` under Storage) or anywhere (`store.py`)
            known = f"{rel}.py" in files or any(f.endswith(f"/{rel}.py") for f in files)
            if not known and not root_file and not ("/" not in rel and f"{rel}.py" in basenames):
                problems.append(f"{span}: no such module")
        elif f"{rel}.py" in files and attr:
            if not re.search(rf"\b{re.escape(attr)}\b", (PACKAGE / f"{rel}.py").read_text()):
                problems.append(f"{span}: no {attr} in {rel}.py")
        elif rel.split("/")[0] in folders and f"{rel}.py" not in files and rel not in folders:
            problems.append(f"{span}: no such module or folder")
    return problems


def test_the_architecture_page_names_only_modules_that_exist():
    text = ARCHITECTURE.read_text()
    assert text.startswith("# cloudckpt architecture") and "```" in text
    assert named_modules(text) == []


def test_the_name_check_finds_what_does_not_exist():
    text = (
        "```\ncloudckpt/\n  storage/   x\n  nothere/  y\n```\n"
        "`storage/s3/store.py` `storage/s3/nope.py` `planning/save/` `planning/nope/` `save/` "
        "`F/pins/` `cloudckpt.runtime.loop.reset` `cloudckpt.runtime.nope` `cloudckpt.convert` "
        "`dataplane/reader.nope_fn`"
    )
    assert named_modules(text) == [
        "nothere/: no such folder",
        "storage/s3/nope.py: no such module",
        "planning/nope/: no such folder",
        "cloudckpt.runtime.nope: no nope in runtime",
        "dataplane/reader.nope_fn: no nope_fn in dataplane/reader.py",
    ]
