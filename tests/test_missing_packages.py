"""studio on a machine without its optional packages (the borrowed GPU machine has no bitsandbytes, datasets,
deepspeed, platformdirs or torchao): everything imports, a run that needs none of them trains, and one that
needs a missing one fails naming it and the pip command."""

import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import quick_config
from studio.core.config import save_config
from studio.core.errors import StudioError, missing_package
from studio.core.run.commands import EXIT_FAILED, run_handler
from studio.core.run.events import read_events

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("bitsandbytes", "datasets", "deepspeed", "platformdirs", "torchao")
GUI = ("PySide6", "pyqtgraph")


def without(packages, *argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python ARGV`` with ``packages`` hidden (benchmarks/hide_packages) and this checkout's studio imported."""
    paths = [str(ROOT / "benchmarks" / "hide_packages"), str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "STUDIO_HIDE_PACKAGES": ",".join(packages),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_package_is_said_with_the_pip_command(capsys):
    def needs(module):
        def handler(args):
            raise ModuleNotFoundError(f"No module named '{module}'", name=module)
        return handler

    assert run_handler(needs("bitsandbytes"), None) == EXIT_FAILED
    assert "error: the Python package bitsandbytes is not installed" in capsys.readouterr().err
    assert run_handler(needs("yaml"), None) == EXIT_FAILED
    assert "pip install pyyaml" in capsys.readouterr().err
    with pytest.raises(ModuleNotFoundError):  # studio's own: a bug, not an installation to fix
        run_handler(needs("studio.nowhere"), None)
    assert missing_package(ValueError("datasets")) is None
    error = missing_package(ModuleNotFoundError("No module named 'deepspeed.ops'", name="deepspeed.ops"))
    assert isinstance(error, StudioError) and error.kind == "runtime" and "pip install deepspeed" in error.hint


@pytest.mark.slow
def test_every_module_but_the_windows_imports_without_the_optional_packages():
    import studio

    names = [m.name for m in pkgutil.walk_packages(studio.__path__, "studio.")
             if not m.name.startswith("studio.gui") and not m.name.endswith("__main__")]
    script = ("import importlib, importlib.util\n"
              f"for name in {names + ['gpu_checks', 'gpu_frontier', 'memory_frontier', 'throughput']!r}:\n"
              "    importlib.import_module(name)\n"
              f"assert all(importlib.util.find_spec(p) is None for p in {OPTIONAL + GUI!r})\n")
    done = without(OPTIONAL + GUI, "-c", script)
    assert "studio.train.worker" in names and len(names) > 50
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.slow
def test_a_run_trains_without_them_and_one_that_needs_datasets_names_it(tmp_path):
    data = ROOT / "resources" / "datasets" / "categories_instruction.jsonl"
    save_config(quick_config(data, training={"max_steps": 2}), tmp_path / "run.yaml")
    trained = without(("platformdirs", "deepspeed", "torchao", "bitsandbytes") + GUI, "-m", "studio.train",
                      str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "trained"))
    assert trained.returncode == 0, trained.stderr[-2000:]
    events = read_events(tmp_path / "trained" / "events.jsonl")
    assert [e["step"] for e in events if e["type"] == "step"] == [1, 2]
    assert events[-1]["type"] == "finished" and events[-1]["status"] == "completed"

    refused = without(OPTIONAL + GUI, "-m", "studio.train", str(tmp_path / "run.yaml"), "--run-dir",
                      str(tmp_path / "refused"))
    assert refused.returncode == EXIT_FAILED
    error = next(e for e in read_events(tmp_path / "refused" / "events.jsonl") if e["type"] == "error")
    assert error["kind"] == "runtime" and "datasets is not installed" in error["message"]
    assert "pip install datasets" in error["hint"] and "pip install datasets" in refused.stderr
