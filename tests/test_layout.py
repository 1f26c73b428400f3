"""The house's layout rules, checked on the code itself: the names each package lends resolve statically
(TYPE_CHECKING imports naming the same modules as its lazy table), and no module imports a module named for
the command lines from library code."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "dalifeed"


@pytest.mark.parametrize("package", ["dalifeed.convert", "dalifeed.pipelines", "dalifeed.train"])
def test_a_packages_lent_names_are_imported_for_type_checkers_from_the_same_modules(package):
    module = importlib.import_module(package)
    tree = ast.parse(Path(module.__file__).read_text())
    checked = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                if isinstance(stmt, ast.ImportFrom):
                    where = "." * stmt.level + (stmt.module or "")
                    if where.startswith("dalifeed."):  # an absolute import of a sibling package's module
                        where = ".." + where[len("dalifeed."):]
                    for alias in stmt.names:
                        checked[alias.asname or alias.name] = where
    assert checked == module._WHERE
    # pipelines' lobby stays small: its twelve names and the two loader types make_loader returns for mixed data
    assert len(module.__all__) <= (14 if package == "dalifeed.pipelines" else len(module._WHERE))


LIBRARY = ("format.py", "shardfolder.py", "decode.py", "budget.py", "defaults.py", "s3.py", "runtime.py", "usage.py",
           "stack.py", "atomic.py", "nvml.py", "pipelines")


def test_library_code_does_not_import_the_command_lines_modules():
    """cliutil.py and entry.py are click's and the console scripts' side: the modules a library user imports
    do not import them."""
    offenders = []
    for name in LIBRARY:
        for path in (ROOT / name).rglob("*.py") if (ROOT / name).is_dir() else [ROOT / name]:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[-1] in ("cliutil", "entry"):
                    offenders.append(f"{path.relative_to(ROOT)}: from {node.module}")
    assert offenders == []
