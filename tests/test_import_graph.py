"""No two modules of the package import each other.

A pair that does (``model/hf.py`` and ``model/hf_compressed.py`` once did, through imports hidden inside
functions) works only in one import order and breaks when a user or a test imports the other module first.
The graph is read with ``ast`` from the sources, imports inside functions included, so a deferred import cannot
hide a circle.
"""

import ast
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trace_lightning"


def module_name(file: Path) -> str:
    parts = file.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(f): f for f in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(source: str, me: str, is_package: bool, modules: set[str]) -> set[str]:
    """The package modules that module ``me`` names in any import statement of ``source``, at any depth.

    ``from pkg import sub`` names ``pkg.sub`` only (Python runs a parent package's ``__init__`` before any of its
    modules, so that link is no choice of ours); ``from pkg import name`` names ``pkg``. Relative imports resolve
    against ``me``."""
    package = me if is_package else me.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(source)
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking_block(block) for n in ast.walk(block)}
    for node in ast.walk(tree):
        if id(node) in typing_only:  # annotations only: never imported at run time, so no circle
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names}
            found |= subs & modules if subs <= modules else subs & modules | {base}
    return {name for name in found if name in modules and name != me}


def _is_type_checking_block(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) without an else."""
    if not isinstance(node, ast.If) or node.orelse:
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_graph() -> dict[str, set[str]]:
    files = package_modules()
    return {name: imported_modules(f.read_text(), name, f.name == "__init__.py", set(files))
            for name, f in files.items()}


def test_graph_sees_function_level_and_relative_imports() -> None:
    source = "def f():\n    from trace_lightning.model.hf import load_hf\n    from . import config\n" \
             "    from ..quant import e2m1\n    import torch\n"
    found = imported_modules(source, "trace_lightning.model.probe", False, set(package_modules()))
    assert found == {"trace_lightning.model.hf", "trace_lightning.model.config", "trace_lightning.quant.e2m1"}
    found = imported_modules("from trace_lightning.model import load_hf\n", "trace_lightning.lit.probe", False,
                             set(package_modules()))
    assert found == {"trace_lightning.model"}
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trace_lightning.lit.worker import W\n"
    assert imported_modules(typing_only, "trace_lightning.lit.probe", False, set(package_modules())) == set()


def test_no_two_package_modules_import_each_other() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "trace_lightning.model.config" in graph["trace_lightning.model.hf"]
    pairs = [(a, b) for a, b in combinations(sorted(graph), 2) if b in graph[a] and a in graph[b]]
    assert pairs == []


@pytest.mark.parametrize("first", ["trace_lightning.model.hf", "trace_lightning.model.hf_compressed"])
def test_either_hf_module_imports_first(first: str) -> None:
    code = f"import {first}; import trace_lightning.model.hf as h; print(h.load_hf.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "load_hf"
