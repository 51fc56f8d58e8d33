"""The GPU self-test in the window: its dialog runs ``studio doctor`` and says per technique what it found, with
the fix; the techniques that failed are marked beside their controls; a first start with a GPU offers it once."""

import os
import sys
from functools import partial

import pytest
from test_doctor import NO_BITSANDBYTES, ROOT, gpu_found
from test_gui import open_window

from studio.core.memory.sharding import save_calibration
from studio.core.run.commands import self_test_command
from studio.core.runtime.self_test import default_report_path, finish, judge
from studio.gui.runtime.self_test import SelfTestDialog
from studio.gui.state import settings as app_settings
from studio.gui.state.hardware import Gpu

@pytest.mark.slow
def test_the_dialog_runs_the_self_test_and_names_each_failure_with_its_fix(qtbot, app_dirs, monkeypatch):
    (app_dirs / "inject").mkdir()
    (app_dirs / "inject" / "sitecustomize.py").write_text(NO_BITSANDBYTES)  # as where bitsandbytes is missing
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(app_dirs / "inject"), str(ROOT)]))
    dialog = SelfTestDialog()
    qtbot.addWidget(dialog)
    dialog.command = partial(self_test_command, sys.executable, only="qlora_nf4,adamw_8bit")
    dialog.show()
    assert dialog.start_button.text() == "Start" and not dialog.open_button.isEnabled()
    with qtbot.waitSignal(dialog.report_ready, timeout=180_000) as ready:
        dialog.start()
        assert dialog.running and not dialog.start_button.isEnabled() and dialog.busy.isVisible()
    report = ready.args[0]
    assert [r.status for r in report.results] == ["failed", "failed"]
    assert dialog.summary.text.text().startswith("<b>Self-test on the CPU (PyTorch sees no GPU): 0 of 2 techniques")
    shown = dialog.results.text()
    assert "✗ <b>QLoRA (4-bit NF4 base)</b>: bitsandbytes is not installed" in shown
    assert "<i>Fix:</i> install it with `pip install bitsandbytes`" in shown
    assert "No CUDA calibration saved: there is no GPU to measure." in shown
    assert dialog.report_path.is_file() and dialog.open_button.isEnabled()
    assert dialog.start_button.text() == "Run again" and not dialog.busy.isVisible()
    dialog.grab().save(str(app_dirs / "self-test.png"))


def failing_report():
    """A GPU whose tiled MLP computes something else, and no bitsandbytes."""
    cpu = [6.5, 6.1, 5.8, 5.6, 5.4]
    found = gpu_found({"lora_bf16": cpu, "tiled_mlp": [x * 1.05 for x in cpu]}, {"lora_bf16": cpu, "tiled_mlp": cpu})
    found["techniques"]["qlora_nf4"] = {"precision": "bf16", "missing": "bitsandbytes",
                                        "because": "ImportError: No module named 'bitsandbytes'"}
    return found


def test_the_window_marks_each_technique_that_failed_beside_its_control(qtbot, app_dirs):
    finish(failing_report(), default_report_path())
    window = open_window(qtbot)  # reads the newest report at start
    panel = window.techniques_panel
    tiled = panel.savers["tiled_mlp"].self_test_mark
    assert not tiled.isHidden() and tiled.text().startswith(
        "Tiled MLP (long sequences) failed the GPU self-test: it trains (loss 6.8250 → 5.6700 over 5 steps), but its "
        "losses differ from the CPU's by 5.00% (at most 1.00% allowed). Fix: turn tiled MLP (long sequences) off")
    assert "QLoRA (4-bit NF4 base) failed the GPU self-test: bitsandbytes is not installed" in panel.method.self_test_mark.text()
    assert panel.precision.self_test_mark.isHidden()  # bf16 passed
    window.show_self_test(judge(gpu_found({"tiled_mlp": [5.0, 4.0]}, {"tiled_mlp": [5.0, 4.0]})))  # fixed since
    assert tiled.isHidden() and panel.method.self_test_mark.isHidden()


def test_a_first_start_with_a_gpu_offers_the_self_test_once(qtbot, app_dirs, monkeypatch):
    monkeypatch.setattr("studio.gui.main_window.detect_gpus", lambda: [Gpu("NVIDIA GeForce RTX 4090", 24 * 2**30, 0)])
    window = open_window(qtbot)
    assert window.self_test_action.text() == "GPU self-test…"
    window.offer_self_test()
    assert window.self_test_offer.isVisible() and "NVIDIA GeForce RTX 4090" in window.self_test_offer.text.text()
    assert app_settings.load_settings().self_test_offered
    again = open_window(qtbot)
    again.offer_self_test()
    assert not again.self_test_offer.isVisible()  # remembered: offered once, never forced
    window.self_test_action.trigger()
    assert window.self_test_dialog.isVisible() and not window.self_test_dialog.running


def test_a_gpu_already_calibrated_is_not_offered_the_self_test(qtbot, app_dirs, monkeypatch):
    monkeypatch.setattr("studio.gui.main_window.detect_gpus", lambda: [Gpu("NVIDIA GeForce RTX 4090", 24 * 2**30, 0)])
    save_calibration({"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-1", "measured_at": "2025-12-01",
                      "context_bytes": 600 * 2**20, "allocator_fraction": 0.02})
    window = open_window(qtbot)
    window.offer_self_test()
    assert not window.self_test_offer.isVisible() and not app_settings.load_settings().self_test_offered
