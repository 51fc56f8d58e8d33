import os
import tempfile

# Before anything imports Qt: render offscreen, no display needed.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Runs started without a run directory, per-machine records and memory traces stay out of the user's folders:
# the runs folder's parent is the data folder (memory-calibration.jsonl, gpu-calibration.json), a session's own.
os.environ["STUDIO_RUNS_DIR"] = os.path.join(tempfile.mkdtemp(prefix="studio-test-data-"), "runs")
os.environ["STUDIO_TRACE_CACHE"] = tempfile.mkdtemp(prefix="studio-test-traces-")
os.environ["STUDIO_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="studio-test-runtime-")  # never the user's runtime
os.environ["STUDIO_TOOLS_DIR"] = tempfile.mkdtemp(prefix="studio-test-tools-")  # llama.cpp's converter, installed once

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from studio.core.presets import DEMO_DATASETS, DEMO_TRAIN  # noqa: E402


def first_lines(source: Path, count: int, target: Path) -> Path:
    target.write_text("".join(source.read_text().splitlines(keepends=True)[:count]))
    return target


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """32 rows of the demo task (alpaca instructions)."""
    return first_lines(DEMO_TRAIN, 32, tmp_path_factory.mktemp("data") / "train.jsonl")


@pytest.fixture(scope="module")
def story_data(tmp_path_factory) -> Path:
    """8 lines of plain text, one micro-batch: every technique must start memorizing them in 12 steps."""
    return first_lines(DEMO_DATASETS / "facts.txt", 8, tmp_path_factory.mktemp("data") / "facts.txt")


@pytest.fixture
def app_dirs(tmp_path, monkeypatch):
    """The window's settings and runs in the test's own folder, never the user's."""
    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "runs"))
    return tmp_path


@pytest.fixture(autouse=True)
def no_memory_trace_outlives_its_test():
    """A window's memory trace runs detached, on purpose (its file serves later windows): a test's own traces end
    with it, so that no later test trains beside them on the two cores (a GRPO run slowed 60-fold behind two)."""
    yield
    import sys

    memory = sys.modules.get("studio.gui.state.memory")
    for tracing in getattr(memory, "_tracing", {}).values():
        if tracing.process.poll() is None:
            tracing.process.kill()
            tracing.process.wait()


@pytest.fixture(autouse=True)
def qt_objects_die_with_their_test(request):
    """Widgets a test made are deleted, and their Python wrappers collected, when it ends, not in the middle of a
    later test: a wrapper outliving its widget crashed CI once (a segfault as the next chart was being built)."""
    yield
    if "qtbot" not in request.fixturenames:
        return
    import gc

    from PySide6.QtCore import QCoreApplication, QEvent

    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
    gc.collect()
    QCoreApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete)
