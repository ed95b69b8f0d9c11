"""The package's layering (docs/DESIGN.md §4), checked on every import of every module, those inside
functions included: arrows point down only, ``models/`` and ``storage/`` import neither each other nor anything
above them, Prefect and MLflow stay in their layers, and no modules import each other in a circle."""
from __future__ import annotations

import ast
import os
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bottom to top; a module may import its own layer and the layers below (models and storage: not each other)
RANK = {"errors": 0, "constants": 0, "models": 1, "storage": 1, "core": 2, "tracking": 3, "tasks": 4, "flows": 5}
# third-party packages a layer may not import
FORBIDDEN = {
    "models": {"prefect", "mlflow", "fsspec", "s3fs", "zarr", "prefect_dask"},
    "storage": {"prefect", "mlflow", "prefect_dask"},
    "core": {"prefect", "mlflow", "prefect_dask"},
    "tracking": {"prefect", "prefect_dask"},
    "tasks": {"mlflow"},
    "flows": {"mlflow"},
}


def _modules() -> dict[str, str]:
    """Every module of the installed package (``bcdflow.core.config``) -> its file, from pyproject's mapping."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    out = {}
    for pkg in setup["packages"]:
        folder = os.path.join(REPO, setup.get("package-dir", {}).get(pkg, pkg.replace(".", "/")))
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                out[pkg if name == "__init__.py" else f"{pkg}.{name[:-3]}"] = os.path.join(folder, name)
    return out


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """Absolute names imported by ``module`` anywhere in its file; ``from pkg import sub`` counts as ``pkg.sub``
    where ``sub`` is a module."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "errors"  # bcdflow/__init__.py sits at the bottom with errors.py


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    mine = _layer(module)
    for target in IMPORTS[module]:
        top = target.split(".")[0]
        assert top not in FORBIDDEN.get(mine, ()), f"{module} imports {target}: not in the {mine} layer"
        if top != "bcdflow" or target == "bcdflow":
            continue
        theirs = _layer(target)
        assert RANK[theirs] < RANK[mine] or theirs == mine, f"{module} ({mine}) imports {target} ({theirs}): up"


def test_no_import_circles():
    graph = {m: {t for t in IMPORTS[m] if t in MODULES and t != m} for m in MODULES}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_one_top_level_package():
    """``pip install`` adds ``bcdflow`` and nothing else at the top of site-packages."""
    assert {m.split(".")[0] for m in MODULES} == {"bcdflow"}
    assert len(MODULES) > 40  # the mapping found the layer folders
