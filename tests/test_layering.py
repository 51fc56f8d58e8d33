"""The architecture's import rules: core is pure, train has no Qt, the GUI never loads the ML stack."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

STUDIO = Path(__file__).resolve().parents[1] / "studio"
ML_STACK = {"torch", "transformers", "peft", "bitsandbytes", "deepspeed", "accelerate", "torchao", "datasets"}
QT = {"PySide6", "pyqtgraph", "shiboken6"}


def imported_modules(package: str) -> dict[str, set[str]]:
    """Top-level module names imported anywhere (also inside functions) in each file."""
    found = {}
    for path in sorted((STUDIO / package).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(STUDIO))] = names
    return found


@pytest.mark.parametrize("package, forbidden", [("core", QT | ML_STACK), ("train", QT), ("gui", ML_STACK)])
def test_package_never_imports(package, forbidden):
    offenders = {f: sorted(names & forbidden) for f, names in imported_modules(package).items() if names & forbidden}
    assert not offenders, f"studio/{package} imports what it must not: {offenders}"


def test_importing_core_loads_no_torch_or_qt():
    code = ("import sys, pkgutil, importlib, studio.core as c\n"
            "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('studio.core.' + m.name)\n"
            "import studio.cli\n"
            "bad = sorted(n for n in sys.modules if n.split('.')[0] in %r)\n"
            "print(','.join(bad))" % (ML_STACK | QT,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""
