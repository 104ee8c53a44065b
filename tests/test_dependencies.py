"""pyproject.toml declares what cloudckpt imports, and nothing that blocks its users' installs.

- Every third-party module imported anywhere in ``cloudckpt/`` (lazy imports included) comes from
  a declared runtime dependency; ``cloudckpt/testing/`` may also use the ``test`` extra. The one
  kind of exception is listed in PINNED_BY: a module whose version a declared dependency pins
  exactly (botocore by aiobotocore), where declaring it too only makes pip fetch the newest
  release first and discard it.
- Every runtime dependency is imported by the library (no dependency kept "for the tests").
- No runtime dependency has an upper bound or a pin: ``pip install cloudckpt`` resolves beside any
  newer torch (or botocore, numpy, ...) the user has.
- The install commands (.ci/run, README, examples/demo.sh) install ``torch==2.13.0`` before the
  package, so the pin the machines need lives there and not in the package.
"""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "cloudckpt"


# module's distribution -> the declared dependency that pins it (and must keep requiring it)
PINNED_BY = {"botocore": "aiobotocore", "yarl": "aiohttp"}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _requirements(specs: list[str]) -> dict[str, Requirement]:
    reqs = [Requirement(s) for s in specs]
    return {canonicalize_name(r.name): r for r in reqs}


def runtime_requirements() -> dict[str, Requirement]:
    return _requirements(_project()["dependencies"])


def extra_test_requirements() -> dict[str, Requirement]:
    return _requirements(_project()["optional-dependencies"]["test"])


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (imported by the type checker, never run)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (
            (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
        ):
            inside |= {id(n) for child in node.body for n in ast.walk(child)}
    return inside


def third_party_imports(paths, *, type_checking: bool = False) -> dict[str, set[str]]:
    """Top-level module -> files importing it, for every non-stdlib, non-cloudckpt import: those
    that run (``type_checking=False``) or those only under ``if TYPE_CHECKING:`` (True)."""
    found: dict[str, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        typing_only = _type_checking_only(tree)
        for node in ast.walk(tree):
            if (id(node) in typing_only) != type_checking:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "cloudckpt" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(
                        str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
                    )
    return found


def _distributions(module: str) -> set[str]:
    dists = packages_distributions().get(module)
    assert dists, f"module {module!r} is imported but no installed distribution provides it"
    return {canonicalize_name(d) for d in dists}


def _declares(declared: set[str], module: str) -> bool:
    dists = _distributions(module)
    return bool(dists & declared) or any(PINNED_BY.get(d) in declared for d in dists)


def test_pinned_by_holds():
    from importlib.metadata import requires

    for dist, parent in PINNED_BY.items():
        needs = {
            canonicalize_name(Requirement(r).name)
            for r in requires(parent) or ()
            if "extra ==" not in r
        }
        assert dist in needs, f"{parent} no longer requires {dist}: declare {dist} directly"


def _library_files():
    return [
        p
        for p in PACKAGE.rglob("*.py")
        if "testing" not in p.relative_to(PACKAGE).parts and _integration_of(p) is None
    ]


def _integration_of(path: Path) -> str | None:
    """``name`` for a file of ``cloudckpt/integrations/<name>/`` (a trainer's package: it may
    import its own extra, ``cloudckpt[<name>]``), else None."""
    parts = path.relative_to(PACKAGE).parts
    return parts[1] if len(parts) > 2 and parts[0] == "integrations" else None


def _integration_files() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in (PACKAGE / "integrations").rglob("*.py"):
        name = _integration_of(path)
        if name is not None:
            found.setdefault(name, []).append(path)
    return found


def _testing_files():
    return list((PACKAGE / "testing").rglob("*.py"))


def test_every_library_import_is_a_declared_runtime_dependency():
    declared = set(runtime_requirements())
    imports = third_party_imports(_library_files())
    assert {"torch", "aiobotocore", "aiohttp", "botocore", "crc32c"} <= set(imports), (
        f"the scan of cloudckpt/ found too little: {sorted(imports)}"
    )
    missing = {m: sorted(files) for m, files in imports.items() if not _declares(declared, m)}
    assert not missing, f"imported but not declared in [project].dependencies: {missing}"


def _with_their_requirements(reqs: dict[str, Requirement]) -> set[str]:
    """The distributions ``reqs`` name and those they require (one level, no extras)."""
    from importlib.metadata import PackageNotFoundError, requires

    out = set(reqs)
    for name in reqs:
        try:
            needs = requires(name) or []
        except PackageNotFoundError:
            continue
        out |= {canonicalize_name(Requirement(r).name) for r in needs if "extra ==" not in r}
    return out


@pytest.mark.parametrize("name", sorted(_integration_files()))
def test_an_integration_imports_only_dependencies_and_its_own_extra(name):
    extras = _project()["optional-dependencies"]
    assert name in extras, f"cloudckpt/integrations/{name}/ has no extra cloudckpt[{name}]"
    declared = set(runtime_requirements()) | _with_their_requirements(_requirements(extras[name]))
    imports = third_party_imports(_integration_files()[name])
    missing = {m: sorted(files) for m, files in imports.items() if not _declares(declared, m)}
    assert not missing, f"imported but not in cloudckpt[{name}] nor what it requires: {missing}"


def test_imports_for_the_type_checker_only_are_declared_in_the_lint_extra():
    declared = set(runtime_requirements()) | set(
        _requirements(_project()["optional-dependencies"]["lint"])
    )
    imports = third_party_imports(list(PACKAGE.rglob("*.py")), type_checking=True)
    missing = {m: sorted(files) for m, files in imports.items() if not _declares(declared, m)}
    assert not missing, f"imported under TYPE_CHECKING but in no extra: {missing}"


def test_the_scan_tells_run_time_imports_from_type_checking_ones(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "from typing import TYPE_CHECKING\nimport msgpack\nif TYPE_CHECKING:\n"
        "    from typing_extensions import Self\n"
    )
    assert set(third_party_imports([path])) == {"msgpack"}
    assert set(third_party_imports([path], type_checking=True)) == {"typing_extensions"}


def test_testing_helpers_import_only_declared_dependencies():
    declared = set(runtime_requirements()) | set(extra_test_requirements())
    imports = third_party_imports(_testing_files())
    missing = {m: sorted(files) for m, files in imports.items() if not _declares(declared, m)}
    assert not missing, f"cloudckpt/testing imports undeclared modules: {missing}"


def test_every_runtime_dependency_is_imported_by_the_library():
    imported: set[str] = set()
    for module in third_party_imports(_library_files()):
        imported |= _distributions(module)
    unused = sorted(set(runtime_requirements()) - imported)
    assert not unused, (
        f"runtime dependencies the library never imports: {unused}; "
        "move what only tests or tools use to the test extra"
    )


def test_boto3_is_no_dependency_at_all():
    # boto3 pins botocore against aiobotocore's pin: pip backtracked through 20 boto3 releases
    assert "boto3" not in runtime_requirements()
    assert "boto3" not in extra_test_requirements()
    assert "boto3" not in third_party_imports(list(PACKAGE.rglob("*.py")))


@pytest.mark.parametrize("name", sorted(runtime_requirements()))
def test_runtime_dependency_has_no_upper_bound(name):
    req = runtime_requirements()[name]
    capped = [str(s) for s in req.specifier if s.operator in ("<", "<=", "==", "===", "~=", "!=")]
    assert not capped, (
        f"{req}: a library states the oldest version it supports, never an upper "
        "bound or a pin (pin in the install commands instead)"
    )


def test_torch_states_its_oldest_supported_version():
    torch = runtime_requirements()["torch"]
    lower = [s for s in torch.specifier if s.operator == ">="]
    assert len(lower) == 1 and lower[0].version == "2.6", str(torch)


@pytest.mark.parametrize(
    "path, package_install",
    [
        (".ci/run", r"pip install .*-e '\.\[test\]'"),
        ("README.md", r"pip install -e '\.\[test\]'"),
        ("examples/demo.sh", r"pip_step .*-e '\.\[test\]'"),  # pip_step: demo_lib.sh's pip install
        ("infra/docker/Dockerfile", r"pip install .*/src"),
    ],
)
def test_install_commands_install_pinned_torch_before_the_package(path, package_install):
    text = (ROOT / path).read_text()
    torch_at = re.search(r"(pip install|pip_step) [^\n]*torch==2\.13\.0", text)
    package_at = re.search(package_install, text)
    assert torch_at and package_at, f"{path}: no torch==2.13.0 install or no package install"
    assert torch_at.start() < package_at.start(), f"{path}: torch must be installed first"
