"""The architecture's contract (docs/architecture.md): layers, no upward import, no cycle, the ML stack kept out.

The layers, lowest first: ``studio.core`` (pure Python), then ``studio.train`` (the
worker) and ``studio.gui`` (the window) side by side, then the command line on
top (``studio.cli``, ``studio.cli_memory``, ``studio.__main__``). A module may
import its own layer and the layers below it. Imports inside functions count:
a lazy import up the stack is still an upward dependency.

Inside a layer, each concern is a sub-package (``studio.core.memory``,
``studio.train.export``, ``studio.gui.state``, ...) whose ``__init__`` names its
files; the sub-packages and the layer's own modules import each other without a
cycle, and a few rules say which concern may not reach which.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from studio.core.memory.savers import SAVER_SPECS

ROOT = Path(__file__).resolve().parents[1]
STUDIO = ROOT / "studio"
ML_STACK = {"torch", "transformers", "peft", "bitsandbytes", "deepspeed", "accelerate", "torchao", "datasets"}
QT = {"PySide6", "pyqtgraph", "shiboken6"}

# Which studio layers each layer may import (its own included). "package" is studio/__init__.py: the version.
LAYERS = {
    "package": {"package"},
    "core": {"package", "core"},
    "train": {"package", "core", "train"},
    "gui": {"package", "core", "gui"},
    "cli": {"package", "core", "train", "gui", "cli"},
}


def layer_of(module: str) -> str:
    if module == "studio":
        return "package"
    parts = module.split(".")
    return parts[1] if parts[1] in LAYERS else "cli"  # studio.cli, studio.cli_memory, studio.__main__


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the studio package."""
    files = {}
    for path in sorted(STUDIO.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imports_of(module: str, path: Path) -> list[tuple[str, list[str]]]:
    """(imported module, names taken from it) for each import statement, relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.append((base, [alias.name for alias in node.names]))
    return found


def studio_graph() -> dict[str, set[str]]:
    """Module -> the studio modules it imports (a ``from package import module`` names the module)."""
    files = module_files()
    graph = {}
    for module, path in files.items():
        targets = set()
        for base, names in imports_of(module, path):
            targets |= {t for t in [base, *(f"{base}.{n}" for n in names)] if t in files and t != module}
        graph[module] = targets
    return graph


def third_party(package: str) -> dict[str, set[str]]:
    """Top-level names imported by each file of ``studio/<package>``."""
    files = {m: p for m, p in module_files().items() if layer_of(m) == package}
    return {m: {base.split(".")[0] for base, _ in imports_of(m, p) if base} for m, p in files.items()}


def test_no_layer_imports_a_layer_above_or_beside_it():
    upward = sorted(f"{module} -> {target}" for module, targets in studio_graph().items() for target in targets
                    if layer_of(target) not in LAYERS[layer_of(module)])
    assert not upward, "imports that break the layers: " + ", ".join(upward)


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle of ``graph`` found by a depth-first walk, as ``a -> b -> a``."""
    state, cycles = {}, []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path)
        path.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycle():
    cycles = cycles_in(studio_graph())
    assert not cycles, "import cycles: " + "; ".join(cycles)


def test_no_private_name_crosses_a_module():
    files = module_files()
    crossing = sorted(f"{module} takes {base}.{name}" for module, path in files.items()
                      for base, names in imports_of(module, path) if base.startswith("studio")
                      for name in names if name.startswith("_") and not name.startswith("__"))
    assert not crossing, "private names used across files: " + ", ".join(crossing)


@pytest.mark.parametrize("package, forbidden", [("core", QT | ML_STACK), ("train", QT), ("gui", ML_STACK)])
def test_package_never_imports(package, forbidden):
    offenders = {f: sorted(names & forbidden) for f, names in third_party(package).items() if names & forbidden}
    assert not offenders, f"studio/{package} imports what it must not: {offenders}"


def test_importing_core_loads_no_torch_or_qt():
    code = ("import sys, pkgutil, importlib, studio.core as c\n"
            "for m in pkgutil.walk_packages(c.__path__, 'studio.core.'): importlib.import_module(m.name)\n"
            "import studio.cli\n"
            "bad = sorted(n for n in sys.modules if n.split('.')[0] in %r)\n"
            "print(','.join(bad))" % (ML_STACK | QT,))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


# ---------------------------------------------------------------- the sub-packages


def unit_of(module: str) -> str:
    """A layer's sub-package (``studio.core.memory``, its own sub-packages included) or one of its own modules."""
    parts = module.split(".")
    return ".".join(parts[:3]) if layer_of(module) in ("core", "train", "gui") and len(parts) > 2 else module


def imports_between(prefix: str, target: str) -> list[str]:
    """``module -> imported`` for every import of a module under ``target`` by a module under ``prefix``."""
    return sorted(f"{module} -> {imported}" for module, imported_modules in studio_graph().items()
                  if module.startswith(prefix) for imported in imported_modules if imported.startswith(target))


def test_no_import_cycle_between_sub_packages():
    units: dict[str, set[str]] = {}
    for module, targets in studio_graph().items():
        units.setdefault(unit_of(module), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    cycles = cycles_in(units)
    assert not cycles, "cycles between sub-packages: " + "; ".join(cycles)


def packages() -> list[Path]:
    return sorted(init.parent for init in STUDIO.rglob("__init__.py"))


@pytest.mark.parametrize("package", packages(), ids=lambda path: ".".join(path.relative_to(ROOT).parts))
def test_every_package_names_its_files(package):
    """Its __init__ docstring names each module and sub-package (as ``name``), and it holds at most ten modules."""
    names = {path.stem for path in package.glob("*.py") if path.stem not in ("__init__", "__main__")}
    names |= {path.name for path in package.iterdir() if (path / "__init__.py").is_file()}
    named = set(re.findall(r"``(\w+)``", ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""))
    assert names <= named, f"{package} does not name {sorted(names - named)} in its __init__ docstring"
    assert len([path for path in package.glob("*.py") if path.stem not in ("__init__", "__main__")]) <= 10


def test_the_window_state_imports_no_qt():
    offenders = {f: sorted(names & QT) for f, names in third_party("gui").items()
                 if f.startswith("studio.gui.state") and names & QT}
    assert not offenders, f"studio.gui.state imports Qt: {offenders}"


def test_the_window_reaches_the_estimator_only_through_its_door():
    """studio.gui.state.memory is the window's only door to studio.core.memory."""
    crossing = [line for line in imports_between("studio.gui", "studio.core.memory")
                if not line.startswith("studio.gui.state.memory ->")]
    assert not crossing, "the window reaches the estimator around studio.gui.state.memory: " + ", ".join(crossing)


def test_exports_never_import_distributed_code():
    crossing = imports_between("studio.train.export", "studio.train.distributed")
    assert not crossing, "export code imports distributed code: " + ", ".join(crossing)


def test_the_measurements_never_import_the_loop():
    """Simulation and tracing replay the worker's step from its parts, never by importing the worker."""
    crossing = imports_between("studio.train.measure", "studio.train.worker")
    assert not crossing, "memory measurement imports the worker: " + ", ".join(crossing)


@pytest.mark.parametrize("saver", [name for name in SAVER_SPECS if name != "gradient_checkpointing"])
def test_a_memory_saver_is_named_in_at_most_five_files(saver):
    """Its switch, its row of the savers' table, its regime, its worker code and its estimate part: the rest reads
    the table (gradient checkpointing, a regime of its own that exports and tracing set, aside)."""
    files = sorted(str(path.relative_to(ROOT)) for path in STUDIO.rglob("*.py")
                   if re.search(rf"\b{saver}\b", path.read_text(encoding="utf-8")))
    assert len(files) <= 5, f"{saver} is named in {len(files)} files: {files}"


def holds_code(path: Path) -> bool:
    """A module with more than a docstring (a package's ``__init__`` may be its docstring alone)."""
    body = ast.parse(path.read_text(encoding="utf-8")).body
    return len(body) > 1 or not (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant))


def test_the_architecture_page_names_every_module():
    """docs/architecture.md names each module by its path, or by its name on the line of its package's path."""
    named = set()
    for line in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8").splitlines():
        named |= set(re.findall(r"`([\w/]+\.py)`", line))
        for folder in re.findall(r"`([\w/]+/)`", line):
            named |= {folder + name for name in re.findall(r"`(\w+\.py)`", line)}
    modules = {str(path.relative_to(STUDIO)) for path in STUDIO.rglob("*.py") if holds_code(path)}
    missing = sorted(modules - named)
    assert not missing, f"docs/architecture.md does not name: {missing}"
