"""The Training runtime dialog: what it offers in each state, an offline setup that says what it needs, and the
check the desktop download runs at start."""

from __future__ import annotations

import shutil
import sys

import pytest

from studio.core.runtime.environment import (Machine, RuntimePlan, State, TorchBuild, begin_setup, find_uv,
                                             plan_for_this_machine, record_ready, runtime_state, torch_build)
from studio.gui.runtime.dialog import RuntimeDialog, check_runtime_at_start, open_runtime_dialog

GPU_MACHINE = Machine("Linux", (12, 9), ("NVIDIA GeForce RTX 4090",))
CUDA_BUILD = TorchBuild("cuda", "CUDA 12.8", "https://download.pytorch.org/whl/cu128")


def dialog_for(qtbot, plan: RuntimePlan, machine: Machine = GPU_MACHINE) -> RuntimeDialog:
    dialog = RuntimeDialog(plan, find_uv(), machine)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def test_first_start_offers_set_up_with_the_build_and_size(qtbot, tmp_path):
    dialog = dialog_for(qtbot, RuntimePlan(tmp_path / "runtime", CUDA_BUILD))
    assert dialog.action_button.text() == "Set up" and dialog.action_button.isEnabled()
    assert "not set up yet" in dialog.state_label.text() and "6.3 GB" in dialog.state_label.text()
    assert dialog.machine_label.text() == ("This machine: Linux, NVIDIA GeForce RTX 4090 (driver for CUDA 12.9). "
                                           "Training runtime: PyTorch 2.13.0, CUDA 12.8 build.")
    assert not dialog.cancel_button.isEnabled() and not dialog.progress_bar.isVisible()


def test_half_made_and_ready_runtimes_offer_resume_and_check(qtbot, tmp_path):
    plan = RuntimePlan(tmp_path / "runtime", CUDA_BUILD)
    begin_setup(plan)
    plan.python.parent.mkdir(parents=True)
    plan.python.write_text("")
    dialog = dialog_for(qtbot, plan)
    assert dialog.action_button.text() == "Resume" and "half made" in dialog.state_label.text()
    record_ready(plan, {"torch": "2.13.0+cu128"})
    dialog.refresh()
    assert dialog.action_button.text() == "Check again" and "ready" in dialog.state_label.text()


def test_offline_setup_says_what_it_needs_and_can_resume(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")
    for proxy in ("HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY"):  # every connection fails: nothing listens on port 9
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    plan = RuntimePlan(tmp_path / "runtime", torch_build(Machine("Linux")), python_request=sys.executable)
    dialog = dialog_for(qtbot, plan, Machine("Linux"))
    dialog.action_button.click()
    assert dialog.cancel_button.isEnabled() and not dialog.action_button.isEnabled()
    qtbot.waitUntil(lambda: dialog.step_label.text() == "Stopped.", timeout=120_000)
    text = dialog.result.text.text()
    assert "No connection" in text and "https://download.pytorch.org/whl/cpu" in text and "folder of" in text
    assert runtime_state(plan).state is State.INCOMPLETE
    assert dialog.action_button.text() == "Resume" and dialog.action_button.isEnabled()


def test_the_window_has_the_runtime_menu_item(qtbot, tmp_path, monkeypatch):
    from studio.gui.main_window import MainWindow

    monkeypatch.setenv("STUDIO_RUNTIME_DIR", str(tmp_path / "runtime"))
    window = MainWindow(tmp_path / "runs", attach_live_runs=False)
    qtbot.addWidget(window)
    assert window.runtime_action.text() == "Training runtime…"
    window.runtime_action.trigger()
    dialog = window.findChild(RuntimeDialog)
    assert dialog is not None and dialog.isVisible() and dialog.plan.root == tmp_path / "runtime"
    assert open_runtime_dialog(window) is dialog  # a second click raises the same dialog


@pytest.mark.parametrize("machine", [Machine("Linux"), Machine("Darwin")])
def test_machines_without_nvidia_say_so(qtbot, tmp_path, machine):
    dialog = dialog_for(qtbot, RuntimePlan(tmp_path, torch_build(machine)), machine)
    assert ("no NVIDIA GPU" in dialog.machine_label.text()) == (machine.system == "Linux")


def ready_runtime_running(python: str) -> RuntimePlan:
    """This machine's runtime (in the tests' STUDIO_RUNTIME_DIR) marked ready, its Python being ``python``."""
    plan = plan_for_this_machine()
    shutil.rmtree(plan.root, ignore_errors=True)
    plan.python.parent.mkdir(parents=True)
    plan.python.symlink_to(python)
    record_ready(plan, {"torch": "2.13.0+cpu", "python": "3.11.7"})
    return plan


def start_window(qtbot, tmp_path):
    from studio.gui.main_window import MainWindow

    window = MainWindow(tmp_path / "runs", attach_live_runs=False)
    qtbot.addWidget(window)
    check_runtime_at_start(window)
    return window


def test_a_ready_runtime_that_fails_its_check_at_start_is_unmarked_and_shown(qtbot, tmp_path):
    plan = ready_runtime_running(shutil.which("false"))  # a Python that prints nothing
    window = start_window(qtbot, tmp_path)
    qtbot.waitUntil(lambda: window.findChild(RuntimeDialog) is not None, timeout=30_000)
    dialog = window.findChild(RuntimeDialog)
    assert "did not answer its check" in dialog.result.text.text() and "Repair" in dialog.result.text.text()
    assert runtime_state(plan).state is State.INCOMPLETE  # never used while broken
    assert dialog.action_button.text() == "Resume"


@pytest.mark.slow
def test_a_healthy_runtime_says_so_in_the_status_bar_at_start(qtbot, tmp_path):
    ready_runtime_running(sys.executable)  # this Python has the whole ML stack
    window = start_window(qtbot, tmp_path)
    qtbot.waitUntil(lambda: window.statusBar().currentMessage().startswith("Training runtime ready"), timeout=300_000)
    assert "PyTorch 2.13.0" in window.statusBar().currentMessage()
    assert window.findChild(RuntimeDialog) is None
