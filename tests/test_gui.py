"""The desktop app, offscreen with pytest-qt: the window, the pickers, the toggles and the estimate, charts,
history, persistence, and how a crashed worker is reported. The real-worker runs are in test_gui_runs.py."""

import json
import re
import shutil
from html import escape as html_escape
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import parse_command
from PySide6.QtWidgets import QMessageBox

from studio.core.config import choice_values, save_config
from studio.core.memory.parts import PARTS
from studio.core.presets import DEMO_MODEL, DEMO_TRAIN, demo_config, vision_demo_config
from studio.core.sizes import GIB, format_bytes
from studio.gui import errors
from studio.gui.log_dialog import LogDialog
from studio.gui.main_window import MainWindow
from studio.gui.panels.estimate import PART_COLORS
from studio.gui.process import background_python
from studio.gui.state.job_state import State
from studio.gui.state.model_summary import human_count, summarize_model
from studio.gui.state.series import RunSeries
from studio.gui.widgets.charts import NO_RUN, WAITING, ChartsPanel
from studio.gui.widgets.common import TRAINED_BG
from studio.gui.widgets.controls import ChoiceControl, RadioChoice, options_for

ML_STACK = ("torch", "transformers", "peft", "bitsandbytes", "deepspeed", "accelerate", "torchao", "datasets")


def open_window(qtbot) -> MainWindow:
    window = MainWindow()
    window.ask_close_choice = lambda: "stop"
    qtbot.addWidget(window)
    window.resize(1280, 800)
    window.show()
    wait_for_preview(qtbot, window)  # the data is read once the window is on screen: a user sees it loaded
    return window


@pytest.fixture
def window(qtbot, app_dirs):
    return open_window(qtbot)


def wait_for_preview(qtbot, window):
    qtbot.waitUntil(lambda: not window.data_panel.task.busy, timeout=10000)


# ---------------------------------------------------------------- opening

def test_window_opens_preset_to_the_demo_so_start_works_at_once(window, qtbot):
    config = window.store.config
    assert config == demo_config()
    assert config.model.name_or_path == str(DEMO_MODEL) and config.data.train_files == (str(DEMO_TRAIN),)
    assert window.start_action.isEnabled() and not window.stop_action.isEnabled()
    assert window.model_panel.facts["Architecture"].text().startswith("LlamaForCausalLM")
    assert window.estimate_panel.verdict_status == "fits"
    assert window.charts.loss.placeholder.text() == NO_RUN and not window.charts.loss.showing_plot
    wait_for_preview(qtbot, window)
    assert window.data_panel.preview.rows == len(DEMO_TRAIN.read_text().splitlines())


def test_the_gui_process_never_imports_the_ml_stack(tmp_path):
    code = textwrap.dedent(f"""
        import os, sys, time
        os.environ.update(QT_QPA_PLATFORM="offscreen", STUDIO_CONFIG_DIR={str(tmp_path)!r}, STUDIO_RUNS_DIR={str(tmp_path)!r})
        from studio.gui.app import create_app
        from studio.gui.main_window import MainWindow
        app = create_app([])
        window = MainWindow(); window.show()
        end = time.time() + 2
        while time.time() < end:
            app.processEvents(); time.sleep(0.01)
        window.close()
        print(",".join(sorted(m for m in sys.modules if m.split(".")[0] in {ML_STACK!r})))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1:] in ([], [""])


def test_studio_without_subcommand_opens_the_window(monkeypatch):
    import studio.cli
    import studio.gui.app

    opened = []
    monkeypatch.setattr(studio.gui.app, "main", lambda: opened.append(True) or 0)
    assert studio.cli.main([]) == 0 and opened == [True]


# ---------------------------------------------------------------- techniques and the estimate

def test_toggles_change_the_estimate(window):
    panel, techniques = window.estimate_panel, window.techniques_panel
    before = panel.estimate.peak_bytes
    techniques.micro_batch.spin.setValue(64)
    bigger = panel.estimate.peak_bytes
    assert bigger > before
    techniques.savers["gradient_checkpointing"].check.click()
    checkpointed = panel.estimate.peak_bytes
    assert window.store.config.training.gradient_checkpointing and checkpointed < bigger
    techniques.method.buttons[0].click()  # full fine-tuning: gradients and optimizer state for every weight
    assert window.store.config.method == "full"
    assert panel.estimate.parts["gradients"] > 0 and panel.estimate.trainable_parameters == panel.estimate.parameters
    full = panel.estimate.peak_bytes
    techniques.optimizer.combo.setCurrentIndex(4)  # adafactor: almost no optimizer state
    assert window.store.config.training.optimizer == "adafactor" and panel.estimate.peak_bytes < full


def test_activation_offload_needs_checkpointing_and_moves_memory_to_cpu_ram(window):
    panel, techniques = window.estimate_panel, window.techniques_panel
    assert not techniques.savers["activation_offload"].isEnabled()  # checkpointing is off
    techniques.savers["gradient_checkpointing"].check.click()
    assert techniques.savers["activation_offload"].isEnabled()
    checkpointed = panel.estimate.peak_bytes
    techniques.savers["activation_offload"].check.click()
    assert window.store.config.training.activation_offload
    assert panel.estimate.peak_bytes < checkpointed
    assert panel.estimate.devices[-1].device == "host"
    assert "CPU RAM for offloaded activations" in panel.phase.text() and "available." in panel.phase.text()


def test_cpu_ram_the_machine_lacks_is_said_in_red(window, monkeypatch):
    from studio.gui.panels import estimate as estimate_panel

    monkeypatch.setattr(estimate_panel, "available_ram", lambda: 1024)
    window.store.update(training={"gradient_checkpointing": True, "activation_offload": True})
    assert "More than this machine has free: the run would not start" in window.estimate_panel.phase.text()


def test_the_tiled_mlp_toggle_lowers_the_estimate(window):
    panel, techniques = window.estimate_panel, window.techniques_panel
    techniques.max_length.spin.setValue(4096)
    untiled = panel.estimate.peak_bytes
    techniques.savers["tiled_mlp"].check.click()
    assert window.store.config.training.tiled_mlp and panel.estimate.peak_bytes < untiled


def test_the_lean_loss_toggle_shows_its_memory_effect(window, tmp_path):
    from model_factory import make_tiny_model

    panel, techniques = window.estimate_panel, window.techniques_panel
    window.store.update(model={"name_or_path": str(make_tiny_model("llama", tmp_path, weights=False, vocab_size=32000))})
    assert window.store.config.training.chunked_loss and window.store.config.data.packing == "padding_free"
    lean = panel.estimate.parts["logits_loss"]
    techniques.savers["chunked_loss"].check.click()
    assert not window.store.config.training.chunked_loss
    assert panel.estimate.parts["logits_loss"] > 1.5 * lean  # every position a target: the worst case
    assert "logits memory" in techniques.savers["chunked_loss"].explain.text()


def test_the_output_layer_toggle_moves_it_to_cpu_ram_and_needs_the_lean_loss(window, tmp_path):
    from model_factory import make_tiny_model

    panel, techniques = window.estimate_panel, window.techniques_panel
    window.store.update(model={"name_or_path": str(make_tiny_model("llama", tmp_path, weights=False, vocab_size=32000))})
    on_device = panel.estimate.devices[0].phases["backward"]
    techniques.savers["output_layer_on_cpu"].check.click()
    assert window.store.config.training.output_layer_on_cpu
    assert panel.estimate.devices[-1].device == "host" and "CPU RAM for offloaded weights" in panel.phase.text()
    host = panel.estimate.devices[-1]
    saved = on_device - panel.estimate.devices[0].phases["backward"]
    assert saved == 32000 * 64 * 4 and host.parts["weights"] == 2**23  # pinned on CUDA: a power of two
    techniques.savers["chunked_loss"].check.click()
    assert not techniques.savers["output_layer_on_cpu"].isEnabled() and "lean loss" in techniques.savers["output_layer_on_cpu"].toolTip()


def test_effective_batch_is_shown(window):
    window.techniques_panel.micro_batch.spin.setValue(4)
    window.techniques_panel.accumulation.spin.setValue(8)
    assert "4 x 8 = 32" in window.techniques_panel.effective_batch.text()


def test_impossible_combinations_are_disabled_with_the_reason(window):
    techniques = window.techniques_panel
    techniques.load_in.combo.setCurrentIndex(2)  # 4-bit base weights with LoRA
    assert window.store.config.quantization.load_in == "4bit"
    full = techniques.method.buttons[0]
    assert not full.isEnabled() and "cannot be fully fine-tuned" in full.toolTip()
    assert not techniques.method.reasons[0].isHidden()
    techniques.load_in.combo.setCurrentIndex(0)
    techniques.method.buttons[0].click()  # full: quantized bases and LoRA settings no longer apply
    model = techniques.load_in.combo.model()
    assert not model.item(2).isEnabled() and "cannot be fully fine-tuned" in model.item(2).toolTip()
    assert "Not available now" in techniques.load_in.reason.text()
    assert not techniques.rank.isEnabled() and "Only for adapter methods" in techniques.lora_note.text()
    dtype_items = techniques.weight_dtype.combo.model()
    assert not dtype_items.item(2).isEnabled() and "loses small updates" in dtype_items.item(2).toolTip()


def test_every_choice_control_offers_exactly_the_schemas_values(window):
    choices = window.findChildren(ChoiceControl)
    assert len({control.path for control in choices}) >= 13
    for control in choices:
        assert [option.value for option in control.options] == list(choice_values(control.path)), control.path
        assert control.combo.count() == len(control.options)
    for control in window.findChildren(RadioChoice):  # the methods, in the order the GUI presents them
        assert sorted(option.value for option in control.options) == sorted(choice_values(control.path))


def test_choice_words_that_miss_or_invent_a_value_fail_when_the_panel_is_built():
    words = {"fp32": ("fp32", ""), "bf16": ("bf16", "")}
    with pytest.raises(ValueError, match="fp16"):
        options_for("training.precision", words)
    with pytest.raises(ValueError, match="int4"):
        options_for("training.precision", {**words, "fp16": ("fp16", ""), "int4": ("int4", "")})


def test_every_memory_part_has_its_colour():
    assert set(PART_COLORS) == set(PARTS)


def test_fit_to_my_gpu_applies_the_changes_and_says_why(window):
    window.store.update(training={"micro_batch_size": 64}, data={"max_length": 256})
    panel = window.estimate_panel
    panel.set_data_lengths(None, complete=False)  # the worst case: every row max_length tokens
    target_gib = 0.8 * panel.estimate.peak_bytes / GIB
    panel.picker.select_custom(target_gib)
    assert panel.verdict_status == "does not fit"
    panel.fit_button.click()
    assert panel.verdict_status in ("fits", "tight")
    assert window.store.config != demo_config().replace(training={"micro_batch_size": 64}, data={"max_length": 256})
    assert "Now it fits" in panel.result.text() and "saves" in panel.result.text()


def test_fit_to_my_gpu_with_room_switches_slow_savers_off_and_says_it_is_faster(window):
    window.store.update(training={"micro_batch_size": 1, "gradient_accumulation_steps": 8,
                                  "gradient_checkpointing": True, "tiled_mlp": True}, data={"max_length": 256})
    panel = window.estimate_panel
    panel.set_data_lengths(None, complete=False)
    panel.picker.select_custom(64.0)  # far more than the demo model needs
    assert panel.verdict_status == "fits"
    panel.fit_button.click()
    training = window.store.config.training
    assert not training.tiled_mlp and training.micro_batch_size * training.gradient_accumulation_steps == 8
    text = panel.result.text()
    assert "Faster, and it still fits" in text and "x as fast" in text and "“Tiled MLP (long sequences)” off" in text


def test_fit_to_my_gpu_fits_the_data_s_own_rows_and_keeps_max_length(window):
    from studio.core.memory.estimate import estimate
    from studio.core.memory.run_data import config_for_longest_row
    from studio.gui.state.memory import model_config_of

    window.store.update(training={"micro_batch_size": 64}, data={"max_length": 2048})
    panel = window.estimate_panel
    panel.set_data_lengths((120,) * 40 + (300,), complete=True)  # every row's length known, none near 2,048
    config = window.store.config
    own = estimate(model_config_of(config), config_for_longest_row(config, 300)).peak_bytes
    panel.picker.select_custom(0.8 * own / GIB)  # too small for the data as set up, far too small for 2,048
    panel.fit_button.click()
    assert "Now your data fits" in panel.result.text()
    fitted = window.store.config
    assert fitted.data.max_length == 2048 and fitted != config
    assert estimate(model_config_of(fitted), config_for_longest_row(fitted, 300)).peak_bytes <= 0.8 * own


def test_simulate_runs_in_a_subprocess_with_progress(window, qtbot):
    stand_in = "import json, time; time.sleep(1); print(json.dumps({'simulated': {'peak_bytes': 50_000_000, 'peak_phase': 'backward'}}))"
    panel = window.estimate_panel
    panel.simulate_command = lambda path: [sys.executable, "-c", stand_in] if path.is_file() else []
    panel.simulate_button.click()
    assert panel.simulating and panel.progress.isVisible() and "Simulating" in panel.result.text()
    qtbot.waitUntil(lambda: not panel.simulating, timeout=20000)
    assert "Simulated peak" in panel.result.text() and "backward pass" in panel.result.text()
    assert not panel.progress.isVisible()


@pytest.mark.slow
def test_a_model_no_family_describes_is_measured_in_the_background_then_estimated(window, qtbot, tmp_path,
                                                                                   monkeypatch):
    from model_factory import make_tiny_model

    monkeypatch.setenv("STUDIO_TRACE_CACHE", str(tmp_path / "traces"))  # the trace subprocess inherits it
    folder = make_tiny_model("stablelm", tmp_path / "stablelm", weights=False)
    window.store.update(model={"name_or_path": str(folder)}, data={"max_length": 64})
    panel = window.estimate_panel
    assert panel.estimate is None and "measuring the model" in panel.verdict.text()
    assert "the memory estimate measures it" in window.model_panel.facts["Parameters"].text()
    assert window.minimumSizeHint().width() <= 1280  # the note wraps: the window stays on a laptop screen
    qtbot.waitUntil(lambda: panel.estimate is not None, timeout=300_000)
    assert panel.estimate.kind == "derived" and "derived from a traced training step" in panel.phase.text()
    before = panel.estimate.peak_bytes
    window.store.update(lora={"r": 64})  # recounted from the trace: no new one, the estimate follows at once
    assert panel.estimate is not None and panel.estimate.peak_bytes > before


# ---------------------------------------------------------------- model and data

def test_what_config_check_finds_disables_start_with_the_reason(window, monkeypatch, tmp_path):
    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_text((DEMO_MODEL / "config.json").read_text())
    window.model_panel.use_model(str(broken))
    assert not window.start_action.isEnabled() and window.start_reason_action.isVisible()
    assert "model cannot be loaded" in window.start_reason.text()
    # listed once, in the model's tab: not again under the tabs
    assert "no weights" in window.model_panel.banner.text.text() and not window.problems.isVisibleTo(window)
    assert "no weights" in run_config_check(window, tmp_path)
    for name in ("model.safetensors", "tokenizer.json"):  # the user copies the missing files in, picks it again
        shutil.copy(DEMO_MODEL / name, broken / name)
    window.model_panel.use_model(str(broken))
    assert window.start_action.isEnabled() and not window.start_reason_action.isVisible()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    window.model_panel.use_model("someone/not-downloaded")
    assert not window.start_action.isEnabled() and "HF_HUB_OFFLINE" in window.model_panel.banner.text.text()
    assert "not in the Hugging Face cache" in run_config_check(window, tmp_path)
    window.model_panel.demo_button.click()
    assert window.start_action.isEnabled() and not window.start_reason_action.isVisible() and not window.problems.isVisible()


def run_config_check(window, tmp_path) -> str:
    """What `studio config check` says about the window's config (its stderr)."""
    path = tmp_path / "checked.yaml"
    save_config(window.store.config, path)
    done = subprocess.run([sys.executable, "-m", "studio", "config", "check", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    return done.stderr


def test_model_picker_hub_id_offline_then_demo(window, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    panel = window.model_panel
    panel.hub_id.setText("someone/not-downloaded")
    panel.hub_id.returnPressed.emit()
    assert window.store.config.model.name_or_path == "someone/not-downloaded"
    assert panel.banner.isVisible() and "not on this machine yet" in panel.banner.text.text()
    assert "No estimate" in window.estimate_panel.verdict.text()
    assert window.start_action.isEnabled()  # the worker downloads it at Start
    estimate = window.estimate_panel  # nothing left of the previous model's estimate, nothing to check it with
    assert not any(label.isVisibleTo(estimate) for label in estimate.legend_labels)
    assert not estimate.fit_button.isEnabled() and not estimate.simulate_button.isEnabled()
    panel.demo_button.click()
    assert not panel.banner.isVisible()
    assert panel.facts["Parameters"].text() == human_count(summarize_model(str(DEMO_MODEL)).parameters)
    assert str(DEMO_MODEL) in [panel.recent.itemText(i) for i in range(panel.recent.count())]
    panel.choose_folder_dialog = lambda: str(DEMO_MODEL)
    panel.folder_button.click()
    assert panel.facts["Weights"].text().startswith("<span") and "present locally" in panel.facts["Weights"].text()


def test_the_hub_id_field_shows_the_hub_model_in_use_and_nothing_for_a_folder(window, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    panel = window.model_panel
    assert panel.hub_id.text() == ""  # the demo model is a folder
    panel.hub_id.setText("Qwen/Qwen3-0.6B")
    panel.hub_id.returnPressed.emit()
    assert window.store.config.model.name_or_path == "Qwen/Qwen3-0.6B" and panel.hub_id.text() == "Qwen/Qwen3-0.6B"
    panel.demo_button.click()
    assert panel.hub_id.text() == ""
    window.store.update(model={"name_or_path": "someone/other-model"})  # as a loaded config or a recent one sets it
    assert panel.hub_id.text() == "someone/other-model"
    panel.choose_folder_dialog = lambda: str(DEMO_MODEL)
    panel.folder_button.click()
    assert panel.hub_id.text() == ""


def test_data_preview_marks_the_learned_part_and_the_histogram_the_cut(window, qtbot):
    data = window.data_panel
    wait_for_preview(qtbot, window)
    output = json.loads(DEMO_TRAIN.read_text().splitlines()[0])["output"]
    learned = f"background-color:{TRAINED_BG}"
    html = data.examples.toHtml()
    assert learned in html and html.index(learned) < html.index(html_escape(output))
    assert data.format.combo.itemText(0) == "auto (detected: instruction)"
    assert data.histogram.bars is not None
    assert data.histogram.cut_line.value() == window.store.config.data.max_length
    shorter = max(8, int(np.median(data.preview.lengths)))
    window.techniques_panel.max_length.spin.setValue(shorter)
    assert data.histogram.cut_line.value() == shorter and f"longer than {shorter} tokens" in data.cut_note.text()


def test_the_demo_detects_its_format_so_other_files_get_their_fields_named(window, qtbot, tmp_path):
    data = window.data_panel
    wait_for_preview(qtbot, window)
    assert window.store.config.data.format == "auto" and data.format.combo.currentIndex() == 0
    assert data.preview.format == "instruction"
    unknown = tmp_path / "scores.csv"
    unknown.write_text("foo,bar\n1,2\n")
    data.set_files([str(unknown)])
    qtbot.waitUntil(lambda: not data.task.busy and data.banner.isVisibleTo(data), timeout=10000)
    assert "scores.csv:2: cannot tell the row format from its fields (foo, bar)" in data.banner.text.text()
    data.format.combo.setCurrentIndex(1)  # a format chosen by hand: the fields are still named, with what it needs
    qtbot.waitUntil(lambda: not data.task.busy, timeout=10000)
    # the setting by its label in the window, not its config key
    assert "(foo, bar): “Format” is instruction, whose rows need instruction and output" in data.banner.text.text()


def test_data_format_override_and_other_files(window, qtbot, tmp_path):
    data = window.data_panel
    wait_for_preview(qtbot, window)
    data.format.combo.setCurrentIndex(2)  # chat: these rows are instructions
    qtbot.waitUntil(lambda: not data.task.busy, timeout=10000)
    assert not data.banner.isHidden() and "messages" in data.banner.text.text()
    data.format.combo.setCurrentIndex(0)
    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text("prompt,completion\nName a fruit.,plum\nName an animal.,otter\n")
    data.choose_files_dialog = lambda: [str(csv_file)]
    data.files.selectAll()
    data._remove_selected()
    data._add_files()
    qtbot.waitUntil(lambda: data.preview is not None and data.preview.format == "prompt_completion", timeout=10000)
    assert data.banner.isHidden() and data.preview.rows == 2 and window.store.config.data.train_files == (str(csv_file),)


# ---------------------------------------------------------------- charts and history

def test_charts_wait_for_the_first_step_then_stay_fast_with_100k_points(qtbot):
    charts = ChartsPanel(redraw_ms=10_000)
    qtbot.addWidget(charts)
    charts.resize(800, 500)
    charts.show()
    run = RunSeries("r")
    charts.show_runs([run])
    assert charts.loss.placeholder.text() == WAITING and not charts.loss.showing_plot
    steps = np.arange(1, 100_001, dtype=float)
    run.loss.extend(steps, 2 + np.sin(steps / 500))
    run.loss_smoothed.extend(steps, 2 + np.sin(steps / 500))
    run.lr.extend(steps, np.full(len(steps), 1e-4))
    run.tokens_per_s.extend(steps, np.full(len(steps), 500.0))
    started = time.perf_counter()
    charts.redraw()
    charts.grab()
    first = time.perf_counter() - started
    run.loss.append(100_001, 2.0)
    started = time.perf_counter()
    charts.redraw()
    charts.grab()
    again = time.perf_counter() - started
    assert charts.loss.showing_plot and len(charts.loss.curves["0.raw"].xData) == 100_001
    assert first < 3.0 and again < 1.0, (first, again)


def test_memory_chart_draws_each_gpus_own_estimate_beside_its_curve(qtbot):
    """Two ranks (ZeRO: equal shares) share one estimate line; a layer split's devices each get their own. The line
    is the estimate of the reserved curve: without the CUDA context (here 0.5 GiB)."""
    charts = ChartsPanel(redraw_ms=10_000)
    qtbot.addWidget(charts)
    charts.show()

    def gpu_run(estimates: dict[str, float]) -> RunSeries:
        gib = 2**30
        step = {"type": "step", "step": 1, "loss": 1.0, "memory": [
            {"device": device, "kind": "cuda", "label": "H100", "allocated_bytes": gib, "nvml_total_bytes": 80 * gib}
            for device in estimates]}
        estimate = {"type": "estimate", "peak_bytes": int(max(estimates.values()) * gib), "devices": [
            {"device": device, "total_bytes": int(total * gib), "parts": {"cuda_context": gib // 2}}
            for device, total in estimates.items()]
            + [{"device": "host", "total_bytes": 64 * gib}]}
        return RunSeries.from_events([estimate, step])

    def estimate_labels() -> list[str]:
        return sorted(line.label.format for key, line in charts.memory.lines.items() if key.startswith("estimate"))

    charts.show_runs([gpu_run({"cuda:0": 20.0, "cuda:1": 20.0})])
    charts.redraw()
    assert estimate_labels() == ["each GPU reserved estimate 19.5 GiB"]
    charts.show_runs([gpu_run({"cuda:0": 30.0, "cuda:1": 12.5})])
    charts.redraw()
    assert estimate_labels() == ["cuda:0 reserved estimate 29.5 GiB", "cuda:1 reserved estimate 12.0 GiB"]


def write_run(root: Path, name: str, losses: list[float]) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text("name: x\n")
    events = [{"type": "run_started", "time": time.time(), "total_steps": len(losses), "config": {"method": "lora"}}]
    events += [{"type": "step", "step": i + 1, "loss": loss, "lr": 1e-3, "time": time.time()} for i, loss in enumerate(losses)]
    events.append({"type": "finished", "status": "completed", "step": len(losses)})
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return folder


def test_history_rebuilds_charts_from_events_and_overlays_two_runs(window, app_dirs):
    first = write_run(app_dirs / "runs", "first", [3.0, 2.0, 1.0])
    second = write_run(app_dirs / "runs", "second", [3.0, 2.5, 2.0, 1.5])
    history = window.history
    history.refresh_now()
    assert history.table.topLevelItemCount() == 2
    assert "Select a run" in history.charts.loss.placeholder.text()  # not "open one in History": this is History
    history.select(first)
    assert [r.name for r in history.charts.runs] == ["first"] and history.charts.loss.showing_plot
    assert list(history.charts.loss.curves["0.raw"].yData) == [3.0, 2.0, 1.0]
    history.select(first, second)
    assert len(history.charts.runs) == 2 and "1.raw" in history.charts.loss.curves
    assert not history.buttons["Resume"].isEnabled()  # completed runs have nothing to resume


def test_window_state_and_last_choices_persist(qtbot, app_dirs):
    window = open_window(qtbot)
    window.techniques_panel.micro_batch.spin.setValue(3)
    window.estimate_panel.picker.combo.setCurrentIndex(4)
    card = window.estimate_panel.picker.card_name
    window.run_tabs.setCurrentIndex(1)
    window.resize(1100, 760)
    window.close()
    again = open_window(qtbot)
    assert again.store.config.training.micro_batch_size == 3
    assert again.estimate_panel.picker.card_name == card and again.run_tabs.currentIndex() == 1
    assert (app_dirs / "config" / "window.ini").is_file()


# ---------------------------------------------------------------- worker failures

CRASHING_WORKER = """
import json, os, sys, time
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
    f.write(json.dumps({"type": "run_started", "time": time.time(), "total_steps": 10, "start_step": 0}) + "\\n")
    f.write(json.dumps({"type": "step", "time": time.time(), "step": 1, "loss": 2.5, "lr": 1e-3}) + "\\n")
print("Fatal Python error: Segmentation fault", file=sys.stderr, flush=True)
time.sleep(1)
os._exit(139)
"""


def test_a_crashed_worker_is_reported_not_called_success(window, qtbot, tmp_path):
    script = tmp_path / "crashing_worker.py"
    script.write_text(CRASHING_WORKER)
    window.controller.worker_command = lambda config, run_dir: [sys.executable, str(script), str(config), "--run-dir", str(run_dir)]
    window.start_action.trigger()
    qtbot.waitUntil(lambda: window.controller.job.state is State.CRASHED, timeout=20000)
    assert window.status.text().startswith("Crashed") and "Completed" not in window.status.text()
    assert window.run_banner.isVisible() and "crashed" in window.run_banner.text.text()
    assert window.charts.loss.showing_plot  # the step it made is shown
    assert window.start_action.isEnabled() and window.log_action.isEnabled()
    dialog = LogDialog(window.controller.run_dir.path, window)
    assert "Segmentation fault" in dialog.tabs.widget(1).toPlainText()


def test_unexpected_exceptions_show_a_readable_dialog(qtbot, monkeypatch):
    shown = {}

    def fake_exec(box):
        shown["text"], shown["details"] = box.text(), box.detailedText()

    monkeypatch.setattr(QMessageBox, "exec", fake_exec)
    try:
        raise ValueError("boom")
    except ValueError:
        errors.show_exception(*sys.exc_info())
    assert shown["text"] == "Something went wrong in the app: ValueError: boom" and "Traceback" in shown["details"]


# ---------------------------------------------------------------- try it and export

def test_try_it_shows_both_answers_and_a_readable_failure(window, qtbot, app_dirs):
    run = write_run(app_dirs / "runs", "tried", [2.0, 1.0])
    answers = json.dumps({"base": "drink .", "tuned": "a kind of fruit", "checkpoint": "step-000002"})
    panel = window.try_panel
    panel.command = lambda run_dir, prompt, tokens, image: [sys.executable, "-c", f"print({answers!r})"]
    panel.set_run(run)
    panel.prompt.setPlainText("What kind of thing is a plum?")
    panel.generate_button.click()
    qtbot.waitUntil(panel.generate_button.isEnabled, timeout=20000)  # enabled again once the process ended
    assert panel.answers["tuned"].toPlainText() == "a kind of fruit" and panel.answers["base"].toPlainText() == "drink ."
    assert "step-000002" in panel.titles["tuned"].text() and not panel.progress.isVisible()
    failing = "import sys; print('error: the run has no checkpoint yet\\n  hint: train it first', file=sys.stderr); sys.exit(2)"
    panel.command = lambda run_dir, prompt, tokens, image: [sys.executable, "-c", failing]
    panel.generate_button.click()
    qtbot.waitUntil(lambda: "failed" in panel.status.text(), timeout=20000)
    assert "no checkpoint yet" in panel.status.text() and "train it first" in panel.status.text()


def test_every_command_the_window_starts_is_read_back_by_the_module_it_runs(window, app_dirs, monkeypatch):
    run = write_run(app_dirs / "runs", "commanded", [2.0])
    config = run / "config.yaml"
    worker, resume = window.controller.worker_command(config, run), window.controller.resume_command(run)
    assert worker[0] == resume[0] == background_python()  # the windowless one on Windows
    module, args = parse_command(worker)
    assert module == "studio.train" and (args.config, args.run_dir, args.resume) == (config, run, None)
    assert parse_command(resume)[1].resume == run
    module, args = parse_command(window.estimate_panel.simulate_command(config))
    assert (args.command, args.config, args.simulate, args.json) == ("estimate", config, True, True)
    module, args = parse_command(window.try_panel.command(run, "What is a plum?", 9))
    assert (args.command, args.run_dir, args.prompt, args.max_new_tokens, args.json) == ("generate", run, "What is a plum?", 9, True)
    args = parse_command(window.try_panel.command(run, "What colour is this shape?", 4, run / "red.png"))[1]
    assert (args.prompt, args.image) == ("What colour is this shape?", run / "red.png")
    started = []
    monkeypatch.setattr(window.export_panel._process, "start", lambda command, working_dir=None: started.append(command))
    window.export_panel.set_run(run)
    window.export_panel.start_export()
    module, args = parse_command(started[0])
    assert (args.command, args.run_dir, args.kind, args.out) == ("export", run, "adapter", run / "exports" / "adapter")
    module, args = parse_command(window.export_panel.check_command(run))
    assert (args.command, args.run_dir, args.kind, args.check) == ("export", run, "gguf", True)


def test_gguf_export_and_publish_build_the_command_line_command(window, app_dirs, monkeypatch):
    run = write_run(app_dirs / "runs", "gguf", [2.0])
    started = []
    panel = window.export_panel
    monkeypatch.setattr(panel._process, "start", lambda command, working_dir=None: started.append(command))
    monkeypatch.setattr("studio.gui.panels.export.check_can_push", lambda repo: None)  # as if logged in
    panel.set_run(run)
    panel.gguf.setChecked(True)
    assert not panel.dtype.isEnabled() and all(box.isEnabled() for box in panel.quants.values())
    panel.quants["f16"].setChecked(True)
    panel.repo.setText("you/plums")
    panel.private.setChecked(True)
    panel.start_publish()
    module, args = parse_command(started[0])
    assert (args.kind, args.quant, args.out) == ("gguf", ["f16", "q8_0"], run / "exports" / "gguf")
    assert (args.push_to_hub, args.private) == ("you/plums", True)


REFUSED_GGUF = ("import sys; print('error: llama.cpp\\'s converter cannot make a GGUF of this model: it does not "
                "recognise the model\\'s BPE tokenizer', file=sys.stderr); print('  hint: export the merged model "
                "instead', file=sys.stderr); sys.exit(1)")


def test_gguf_is_offered_only_once_llama_cpp_can_convert_the_run_and_says_why_not(window, app_dirs, qtbot):
    run = write_run(app_dirs / "runs", "tiny-tokenizer", [2.0])
    (run / "checkpoints" / "step-000001").mkdir(parents=True)
    (run / "checkpoints" / "step-000001" / "COMPLETE").write_text("")
    checks = []
    panel = window.export_panel
    panel.check_command = lambda run_dir: checks.append(run_dir) or [sys.executable, "-c", REFUSED_GGUF]
    panel.set_run(run)
    assert panel.export_button.isEnabled() and not checks  # the adapter needs no check
    panel.gguf.setChecked(True)
    assert not panel.export_button.isEnabled() and "Checking that llama.cpp can convert" in panel.kind_reason.text()
    qtbot.waitUntil(lambda: run in panel.gguf_verdicts, timeout=20000)
    reason = panel.kind_reason.text()
    assert reason.startswith("No GGUF for this run: llama.cpp's converter cannot make a GGUF of this model: it does "
                             "not recognise the model's BPE tokenizer. To do: export the merged model instead.")
    assert not panel.export_button.isEnabled() and not any(box.isEnabled() for box in panel.quants.values())
    panel.merged.setChecked(True)  # the other kinds stay offered
    assert panel.export_button.isEnabled() and panel.kind_reason.isHidden()
    panel.gguf.setChecked(True)
    assert checks == [run] and not panel.export_button.isEnabled()  # asked once per run

    other = write_run(app_dirs / "runs", "convertible", [2.0])
    shutil.copytree(run / "checkpoints", other / "checkpoints")
    panel.check_command = lambda run_dir: [sys.executable, "-c", "print('GGUF can be made')"]
    panel.set_run(other)
    qtbot.waitUntil(lambda: panel.gguf_verdicts.get(other) == "", timeout=20000)
    assert panel.export_button.isEnabled() and all(box.isEnabled() for box in panel.quants.values())
    assert panel.kind_reason.isHidden()


def test_publishing_without_a_login_says_so_before_any_work(window, app_dirs, monkeypatch, tmp_path):
    import huggingface_hub

    run = write_run(app_dirs / "runs", "unpublished", [2.0])
    started = []
    panel = window.export_panel
    monkeypatch.setattr(panel._process, "start", lambda command, working_dir=None: started.append(command))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    panel.set_run(run)
    panel.repo.setText("you/plums")
    panel.start_publish()
    assert not started and "not logged in" in panel.status.text() and "hf auth login" in panel.status.text()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    panel.start_publish()
    assert not started and "switched off" in panel.status.text()


def test_a_finished_export_says_what_it_wrote_in_words(window, app_dirs, qtbot):
    run = write_run(app_dirs / "runs", "said", [2.0])
    record = json.dumps({"form": "merged model in float32", "verification": {
        "passed": True, "samples": 4, "max_abs_diff": 0.0, "top1_agreement": 1.0}})
    panel = window.export_panel
    panel.command = lambda run_dir, kind, out, *_: [sys.executable, "-c", (
        f"import pathlib; out = pathlib.Path({str(out)!r}); out.mkdir(parents=True, exist_ok=True); "
        f"(out / 'studio_export.json').write_text({record!r})")]
    panel.set_run(run)
    for button, words in ((panel.merged, "Exported the merged model to"), (panel.adapter, "Exported the adapter to")):
        button.setChecked(True)
        panel.start_export()
        qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)
        assert panel.status.text().startswith(f"{words} <b>{panel.output_folder()}</b>"), panel.status.text()


def test_export_needs_a_checkpoint_and_full_fine_tunes_export_merged(window, app_dirs):
    run = write_run(app_dirs / "runs", "unsaved", [2.0])
    (run / "config.yaml").write_text("method: full\n")
    panel = window.export_panel
    panel.set_run(run)
    assert not panel.export_button.isEnabled() and "checkpoint" in panel.export_button.toolTip()
    assert panel.merged.isChecked() and not panel.adapter.isEnabled() and "no adapter" in panel.kind_reason.text()


OOM_WORKER = """
import json, os, sys, time
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
fix = {"description": "gradient checkpointing", "changes": {"training": {"gradient_checkpointing": True}}}
events = [{"type": "run_started", "total_steps": 10, "start_step": 0},
          {"type": "error", "kind": "oom", "part": "the backward pass", "fix": fix,
           "message": "out of memory in the backward pass: CUDA out of memory",
           "hint": "the last checkpoint is kept. Cheapest change that fits: gradient checkpointing"},
          {"type": "finished", "status": "failed", "step": 0}]
with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
    for event in events:
        f.write(json.dumps({**event, "time": time.time()}) + "\\n")
sys.exit(1)
"""


def test_out_of_memory_offers_the_suggested_change_and_applies_it(window, qtbot, tmp_path):
    script = tmp_path / "oom_worker.py"
    script.write_text(OOM_WORKER)
    window.controller.worker_command = lambda config, run_dir: [sys.executable, str(script), str(config), "--run-dir", str(run_dir)]
    assert not window.store.config.training.gradient_checkpointing
    window.start_action.trigger()
    qtbot.waitUntil(lambda: window.controller.job.state is State.FAILED, timeout=20000)
    assert "backward pass" in window.run_banner.text.text() and window.apply_fix_button.isVisible()
    window.apply_fix_button.click()
    assert window.store.config.training.gradient_checkpointing
    assert window.techniques_panel.savers["gradient_checkpointing"].check.isChecked()
    assert not window.apply_fix_button.isVisible() and "Applied" in window.run_banner.text.text()


def test_prompt_tuning_runs_cannot_export_merged(window, app_dirs):
    run = write_run(app_dirs / "runs", "prompt", [2.0])
    (run / "config.yaml").write_text("method: prompt_tuning\n")
    panel = window.export_panel
    panel.set_run(run)
    assert panel.adapter.isChecked() and not panel.merged.isEnabled()
    assert "cannot be merged" in panel.kind_reason.text() and "cannot be merged" in panel.merged.toolTip()
    (run / "config.yaml").write_text("method: ia3\n")
    panel.set_run(run)
    assert panel.merged.isEnabled() and panel.kind_reason.isHidden()


def test_each_method_shows_its_adapter_group_title_and_settings(window):
    techniques = window.techniques_panel
    seen = {}
    for option, button in zip(techniques.method.options, techniques.method.buttons):
        button.click()
        shown = [name for name, widget in (("adapter", techniques.lora_group), ("rank", techniques.rank),
                                           ("dora", techniques.dora), ("rslora", techniques.rslora),
                                           ("virtual", techniques.virtual_group), ("budget", techniques.adalora_group))
                 if widget.isVisibleTo(techniques)]
        seen[option.label] = (techniques.lora_group.title(), techniques.rank.isEnabled(), " ".join(shown))
    lora = ("LoRA adapter", True, "adapter rank dora rslora")
    assert seen == {
        "Full fine-tuning": ("LoRA adapter", False, "adapter rank"),  # greyed out under the note
        "LoRA": lora, "QLoRA": lora,
        "AdaLoRA": ("AdaLoRA adapter", True, "adapter rank budget"),
        "IA3": ("IA3 adapter", True, "adapter"),
        "LoHa": ("LoHa adapter", True, "adapter rank"), "LoKr": ("LoKr adapter", True, "adapter rank"),
        "Prefix tuning": ("LoRA adapter", False, "virtual"), "Prompt tuning": ("LoRA adapter", False, "virtual"),
    }
    assert list(seen) == ["Full fine-tuning", "LoRA", "QLoRA", "AdaLoRA", "IA3", "LoHa", "LoKr", "Prefix tuning",
                          "Prompt tuning"]


def test_method_specific_settings_show_only_when_they_apply(window):
    techniques = window.techniques_panel
    by_value = {option.value: button for option, button in zip(techniques.method.options, techniques.method.buttons)}
    by_value["prompt_tuning"].click()
    assert not techniques.virtual_group.isHidden() and techniques.adalora_group.isHidden()
    assert techniques.lora_group.isHidden()  # prefix and prompt tuning adapt no layer
    by_value["adalora"].click()
    assert techniques.virtual_group.isHidden() and not techniques.adalora_group.isHidden()
    assert techniques.rank.isEnabled() and techniques.dora.isHidden() and techniques.lora_group.title() == "AdaLoRA adapter"
    by_value["ia3"].click()
    assert techniques.rank.isHidden() and not techniques.targets.isHidden()
    # LoHa cannot adapt a 4-bit base: with one chosen, the method is disabled with validation's reason
    techniques.load_in.combo.setCurrentIndex(2)
    assert not by_value["loha"].isEnabled() and "quantized layers" in by_value["loha"].toolTip()
    # QAT fake-quantizes full-precision weights: not on a bitsandbytes base
    assert not techniques.qat_weights.combo.model().item(1).isEnabled()
    techniques.load_in.combo.setCurrentIndex(1)
    assert not techniques.qat_activations.isEnabled()
    techniques.qat_weights.combo.setCurrentIndex(1)
    assert window.store.config.qat.weights == "int4" and techniques.qat_activations.isEnabled()


def test_the_estimate_and_fit_write_gpu_sizes_alike(window):
    panel = window.estimate_panel
    panel.picker.select_custom(24)
    panel.fit_button.click()  # the demo fits as it is: fit's own words under the estimate's verdict
    verdict, words = panel.verdict.text(), panel.result.text()
    assert f"{format_bytes(panel.estimate.peak_bytes)} of 24.00 GiB (" in verdict and " of 24.00 GiB." in words
    sizes = re.findall(r"[\d.,]+ [KMG]iB", verdict + words)
    assert len(sizes) >= 4 and all(re.fullmatch(r"[\d,]+\.\d\d [KMG]iB", size) for size in sizes), sizes


def test_the_estimate_shows_the_data_s_own_peak_beside_the_worst_case(window, qtbot):
    from studio.core.memory.estimate import estimate
    from studio.core.memory.run_data import config_for_tokens, largest_possible_micro_batch
    from studio.gui.state.memory import model_config_of

    window.store.update(data={"max_length": 2048})  # the demo's rows are far shorter
    wait_for_preview(qtbot, window)
    panel, config = window.estimate_panel, window.store.config
    qtbot.waitUntil(lambda: "Your data" in panel.data_peak.text(), timeout=10000)
    lengths = panel.data_lengths
    assert lengths and len(lengths) == window.data_panel.preview.sampled
    tokens = largest_possible_micro_batch(lengths, config.training.micro_batch_size, 2048, padded=False)
    own = estimate(model_config_of(config), config_for_tokens(config, tokens)).peak_bytes
    assert format_bytes(own) in panel.data_peak.text() and own < panel.estimate.peak_bytes
    micro = config.training.micro_batch_size  # micro-batch beside micro-batch, not beside a row
    assert (f"make micro-batches of at most {tokens:,} tokens); the verdict above is the worst case, micro-batches "
            f"of {micro * 2048:,} tokens ({micro} rows of 2,048).") in panel.data_peak.text()
    window.store.update(data={"max_length": min(lengths)})  # every micro-batch at the cut: nothing to add
    assert panel.data_peak.text() == ""


# ---------------------------------------------------------------- only runs that can finish start

def test_data_problems_keep_start_off_and_say_where(window, qtbot, tmp_path):
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"instruction": "What is a plum?", "output": "a fruit"}\n{"instruction": "no answer"}\n')
    window.data_panel.set_files([str(bad)])
    qtbot.waitUntil(lambda: bool(window.data_panel.problems), timeout=10000)
    assert not window.start_action.isEnabled()
    assert "the data has problems (see 2 Data)" in window.start_reason.text()
    assert "rows.jsonl:2" in window.start_action.toolTip()
    window.data_panel.set_files([str(DEMO_TRAIN)])
    qtbot.waitUntil(lambda: window.start_action.isEnabled(), timeout=10000)


def test_a_file_whose_only_row_is_cut_before_its_response_keeps_start_off_until_the_length_keeps_it(
        window, qtbot, tmp_path):
    long = tmp_path / "long-prompt.jsonl"
    long.write_text(json.dumps({"instruction": "Summarize: " + "word " * 200, "output": "done"}) + "\n")
    window.data_panel.set_files([str(long)])
    qtbot.waitUntil(lambda: bool(window.data_panel.problems), timeout=10000)
    assert not window.start_action.isEnabled() and "long-prompt.jsonl:1" in window.start_action.toolTip()
    window.store.update(data={"max_length": 1024})
    qtbot.waitUntil(lambda: window.start_action.isEnabled(), timeout=10000)


def test_a_4bit_base_keeps_start_off_on_a_machine_without_an_nvidia_gpu(window):
    """bitsandbytes' CPU path may compute wrong numbers: the run would train, and its export would not verify."""
    window.estimate_panel.detected = []  # this machine, as NVML sees it
    window.store.update(method="qlora")
    assert not window.start_action.isEnabled()
    assert "listed under the tabs" in window.start_reason.text()
    assert "4-bit base weights need an NVIDIA GPU" in window.problems.text()
    assert "quantization.load_in" not in window.problems.text()  # named by its label: “Base weights”
    window.estimate_panel.detected = [object()]  # a machine with one
    window.store.update(training={"seed": 7})
    assert window.start_action.isEnabled()


def test_demo_model_resets_what_a_big_model_needed_and_says_what_it_changed(window):
    window.store.update(method="qlora", training={"precision": "bf16", "optimizer": "adamw_8bit",
                                                  "gradient_checkpointing": True, "activation_offload": True})
    window.model_panel.demo_button.click()
    config = window.store.config
    assert config.method == "lora" and config.effective_load_in == "none" and config.training == demo_config().training
    assert config.data.train_files == demo_config().data.train_files
    text = window.changes_notice.text.text()
    assert window.changes_notice.isVisible() and "Method: QLoRA → LoRA" in text and "Optimizer: AdamW 8-bit → AdamW" in text
    assert "Offload layer inputs to CPU RAM: on → off" in text and "Precision: bf16 (mixed) → fp32" in text


def test_new_setup_starts_over_from_the_demo_and_lists_what_it_changed(window, tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n')
    window.store.update(data={"train_files": (str(data),)}, lora={"r": 32})
    window.new_setup_action.trigger()
    assert window.store.config == demo_config()
    text = window.changes_notice.text.text()
    assert "A new setup: the demo's model" in text and "Rank: 32 → 8" in text
    assert "Training files: mine.jsonl → categories_instruction.jsonl" in text


def test_choosing_zero_switches_the_output_layer_off_cpu_and_says_why_in_the_window_s_words(window):
    window.store.update(training={"output_layer_on_cpu": True}, distributed={"num_processes": 2})
    sharding = window.scale_panel.sharding
    zero2 = next(i for i, option in enumerate(sharding.options) if option.value == "zero2")
    assert sharding.combo.model().item(zero2).isEnabled()  # the saver does not block it: the later choice wins
    sharding.combo.setCurrentIndex(zero2)
    config = window.store.config
    assert config.distributed.sharding == "zero2" and not config.training.output_layer_on_cpu
    text = window.changes_notice.text.text()
    assert window.changes_notice.isVisible() and "Output layer in CPU RAM is off now" in text
    assert "distributed." not in text and "“Sharding”" in text and "&#x27;" not in text


def test_a_new_problem_shows_under_the_tabs_even_where_the_estimate_was_scrolled(window, qtbot):
    window.resize(1280, 640)
    scroll = window.under_tabs.verticalScrollBar()
    qtbot.waitUntil(lambda: scroll.maximum() > 0, timeout=5000)
    scroll.setValue(scroll.maximum())
    window.store.update(method="qlora")  # a 4-bit base: this machine has no NVIDIA GPU
    assert window.problems.isVisibleTo(window) and scroll.value() == 0


def test_setup_new_vision_setup_loads_the_vision_demo(window):
    window.vision_setup_action.trigger()
    assert window.store.config == vision_demo_config()
