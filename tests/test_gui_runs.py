"""The app driving the real training worker on the embedded demo model (a few steps each).

Each test starts real worker processes (about 15 s of imports each on two cores), so they are slow.
"""

import json
import shutil
import subprocess
import sys
import threading

import psutil
import pytest

from studio.core.presets import DEMO_MODEL
from studio.core.run.directory import RunDir
from studio.gui.main_window import MainWindow
from studio.gui.state.job_state import State

pytestmark = pytest.mark.slow
WORKER_TIMEOUT_MS = 120_000


@pytest.fixture
def app_dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "runs"))
    yield tmp_path
    for rd in (tmp_path / "runs").glob("*"):  # never leave a worker behind, whatever failed
        try:
            psutil.Process(json.loads(RunDir(rd).worker_info.read_text())["pid"]).kill()
        except (OSError, ValueError, KeyError, psutil.Error):
            pass


def open_window(qtbot, close_choice="stop") -> MainWindow:
    window = MainWindow()
    window.ask_close_choice = lambda: close_choice
    qtbot.addWidget(window)
    window.show()
    return window


def set_short_run(window, steps: int, micro_batch: int = 4) -> None:
    """Through the techniques panel, as a user would."""
    window.techniques_panel.max_steps.spin.setValue(steps)
    window.techniques_panel.micro_batch.spin.setValue(micro_batch)
    window.techniques_panel.log_every.spin.setValue(1)


def chart_steps(window) -> list[float]:
    curve = window.charts.loss.curves.get("0.raw")
    return [] if curve is None or curve.xData is None else list(curve.xData)


def test_start_trains_the_demo_model_loss_reaches_the_chart_and_export_verifies(qtbot, app_dirs):
    window = open_window(qtbot)
    set_short_run(window, steps=3)
    window.start_action.trigger()
    assert window.controller.job.state is State.STARTING and "loading model" in window.status.text()
    qtbot.waitUntil(lambda: len(chart_steps(window)) >= 1, timeout=WORKER_TIMEOUT_MS)
    assert window.charts.loss.showing_plot
    qtbot.waitUntil(lambda: window.controller.job.state is State.FINISHED, timeout=WORKER_TIMEOUT_MS)
    assert window.controller.job.final_status == "completed" and window.status.text().startswith("Completed")
    assert chart_steps(window) == [1.0, 2.0, 3.0]
    assert "process memory" in window.charts.memory.title.text().lower()

    export = window.export_panel
    assert export.run_dir == window.controller.run_dir.path and export.export_button.isEnabled()
    export.export_button.click()
    qtbot.waitUntil(lambda: not export._process.running, timeout=WORKER_TIMEOUT_MS)
    assert export.result_info is not None, export.status.text()
    assert export.result_info["verification"]["passed"] and "Verified" in export.status.text()
    adapter = export.output_folder()
    assert (adapter / "adapter_config.json").is_file()
    from safetensors import safe_open  # loadable: the tensors PEFT reads, by their PEFT names

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="numpy") as tensors:
        assert any("lora_A" in key for key in tensors.keys())


FIRST_WINDOW = """
import time
from studio.gui.app import create_app
from studio.gui.main_window import MainWindow
app = create_app([])
window = MainWindow()
window.ask_close_choice = lambda: "leave"
window.show()
techniques = window.techniques_panel
techniques.max_steps.spin.setValue(400)
techniques.micro_batch.spin.setValue(4)
techniques.log_every.spin.setValue(1)
window.start_action.trigger()
deadline = time.time() + 120
while window.controller.series.step_count < 1 and time.time() < deadline:
    app.processEvents()
    time.sleep(0.05)
print(window.controller.worker_pid, flush=True)
window.close()
"""
# The same first window, killed instead of closed: it gets no chance to say anything.
KILLED_WINDOW = FIRST_WINDOW.replace("setValue(400)", "setValue(25)").replace("window.close()", "time.sleep(600)")


def test_leave_running_reattach_stop_and_save_and_resume_continue_the_curve(qtbot, app_dirs):
    # The first window is another process, which exits: the run must outlive it.
    first = subprocess.run([sys.executable, "-c", FIRST_WINDOW], capture_output=True, text=True, timeout=180)
    pid = int(first.stdout.strip().splitlines()[-1])
    assert psutil.pid_exists(pid), first.stderr

    again = open_window(qtbot)
    run_dir = again.controller.run_dir.path
    assert again.controller.job.state is State.RUNNING and again.controller.worker_pid == pid
    assert len(chart_steps(again)) >= 1  # rebuilt from events.jsonl

    again.stop_action.trigger()
    qtbot.waitUntil(lambda: again.controller.job.state is State.FINISHED, timeout=WORKER_TIMEOUT_MS)
    assert again.controller.job.final_status == "stopped" and RunDir(run_dir).latest_checkpoint() is not None
    stopped_at = again.controller.job.step
    assert chart_steps(again)[-1] == stopped_at and again.resume_action.isEnabled()

    again.resume_action.trigger()
    qtbot.waitUntil(lambda: chart_steps(again)[-1] >= stopped_at + 2, timeout=WORKER_TIMEOUT_MS)
    steps = chart_steps(again)
    assert steps == list(range(1, len(steps) + 1))  # one continuous curve, no restart from step 1
    again.cancel_action.trigger()
    qtbot.waitUntil(lambda: not again.controller.job.active, timeout=WORKER_TIMEOUT_MS)
    assert again.controller.job.headline() == "Cancelled"


def read_line(process: subprocess.Popen, timeout: float) -> str:
    """The process's next line of output, or a failure after ``timeout`` (never a hung test)."""
    line = []
    reader = threading.Thread(target=lambda: line.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line and line[0].strip(), f"no line from the process within {timeout} s"
    return line[0]


@pytest.mark.heavy  # test_leave_running_reattach covers reattaching to a running worker
def test_a_killed_window_leaves_the_run_going_and_the_next_one_shows_its_whole_history(qtbot, app_dirs):
    first = subprocess.Popen([sys.executable, "-c", KILLED_WINDOW], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(read_line(first, timeout=180))
    finally:
        first.kill()  # SIGKILL / TerminateProcess: no close event, no stop request
    first.wait(timeout=30)
    assert psutil.pid_exists(pid)

    again = open_window(qtbot)
    assert again.controller.worker_pid == pid and again.controller.job.active
    qtbot.waitUntil(lambda: again.controller.job.state is State.FINISHED, timeout=WORKER_TIMEOUT_MS)
    assert again.controller.job.final_status == "completed"
    assert chart_steps(again) == list(range(1, 26))  # the steps made while no window was open included


def test_a_model_folder_that_cannot_load_never_reaches_the_worker(qtbot, app_dirs):
    broken = app_dirs / "broken-model"
    broken.mkdir()
    for source in DEMO_MODEL.iterdir():
        if source.suffix != ".safetensors":  # everything but the weights
            shutil.copy(source, broken / source.name)
    window = open_window(qtbot)
    window.model_panel.use_model(str(broken))
    assert "missing" in window.model_panel.facts["Weights"].text()
    assert not window.start_action.isEnabled() and "model cannot be loaded" in window.start_reason.text()
    window.start_action.trigger()
    assert window.controller.run_dir is None  # what studio config check finds stops Start, not the worker later


def test_a_worker_error_shows_its_message_and_hint(qtbot, app_dirs, monkeypatch):
    monkeypatch.setenv("STUDIO_SIMULATE_GPU_MEMORY", "12MiB")  # the worker runs as on a GPU this small
    window = open_window(qtbot)
    set_short_run(window, steps=2, micro_batch=8)
    window.start_action.trigger()
    qtbot.waitUntil(lambda: window.controller.job.state is State.FAILED, timeout=WORKER_TIMEOUT_MS)
    banner = window.run_banner.text.text()
    assert "Training failed" in banner and "out of memory in the forward pass" in banner and "What to do" in banner
    assert window.status.text().startswith("Failed") and window.apply_fix_button.isVisibleTo(window)


def test_after_a_run_samples_and_evaluate_show_what_it_learned_beside_the_base(qtbot, app_dirs):
    window = open_window(qtbot)
    set_short_run(window, steps=40, micro_batch=16)
    window.data_panel.sample_every.spin.setValue(20)
    window.start_action.trigger()
    qtbot.waitUntil(lambda: window.controller.job.state is State.FINISHED, timeout=WORKER_TIMEOUT_MS)
    # Samples: the reference, then the answer of each sampled step, newest first, then the base model's
    window.run_tabs.setCurrentWidget(window.samples_panel)
    panel = window.samples_panel
    prompts = window.controller.series.samples.prompts
    assert len(prompts) == 3 and all(p.location.startswith("categories_heldout.jsonl:") for p in prompts)
    assert [step for step, _ in prompts[0].newest_first()] == [40, 20] and prompts[0].base_answer is not None
    text = panel.view.toPlainText()
    first = text[:text.index("2. ")]
    assert first.index("reference") < first.index("step 40") < first.index("step 20") < first.index("base model")
    assert text.count("✓") >= 4 and "3 prompts" in panel.note.text()  # the demo learns its task in 20 steps
    # Evaluate: studio eval in a subprocess, its progress, then the table, the bars and every row
    evaluate = window.evaluate_panel
    window.run_tabs.setCurrentWidget(evaluate)
    assert evaluate.run_dir == window.controller.run_dir.path and "not been evaluated" in evaluate.status.text()
    evaluate.evaluate_button.click()
    assert not evaluate.evaluate_button.isEnabled() and evaluate.cancel_button.isVisible()
    qtbot.waitUntil(lambda: not evaluate._process.running, timeout=WORKER_TIMEOUT_MS)
    assert evaluate.result is not None, evaluate.status.text()
    table = {evaluate.table.item(r, 0).text(): (evaluate.table.item(r, 1).text(), evaluate.table.item(r, 2).text())
             for r in range(evaluate.table.rowCount())}
    assert table["exact match"][0] == "0.0%" and float(table["exact match"][1].rstrip("%")) >= 75
    assert evaluate.rows.topLevelItemCount() == 80 and evaluate.chart.isVisible()
    assert "80 held-out rows" in evaluate.status.text()
