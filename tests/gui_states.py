"""Every state of the window that the issue tracker and docs/gui.md name, set up on an open window without
the ML stack (scripted stand-ins for the worker, export, simulation and generation), and a check that the
window fits a screen with no label cut off. Used by test_gui_layout.py; each state is a function of
(window, qtbot, tmp_path)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path

from PySide6.QtCore import QPoint, QRect, Qt
from PySide6 import QtGui
from PySide6.QtGui import QTextDocument
from PySide6.QtWidgets import QAbstractScrollArea, QApplication, QLabel, QWidget

from studio.core.config import RunConfig
from studio.core.presets import DEMO_MODEL
from studio.gui.state.job_state import State
from test_estimate import LLAMA_31_8B
from test_gui import OOM_WORKER
from test_hub_config import cache_model

# What a window manager takes from a screen around the window: a title bar and a panel or taskbar.
FRAME_WIDTH, FRAME_HEIGHT = 16, 80

# A worker that writes `steps` step events (1 or 2 GPUs), then finishes or keeps running until told to stop.
FAKE_WORKER = r"""
import json, os, sys, time
run_dir = sys.argv[sys.argv.index("--run-dir") + 1]
steps, gpus, finish = int(os.environ["FAKE_STEPS"]), int(os.environ["FAKE_GPUS"]), os.environ["FAKE_FINISH"] == "1"
def write(event):
    with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({**event, "time": time.time()}) + "\n")
write({"type": "run_started", "total_steps": 400, "start_step": 0})
write({"type": "estimate", "peak_bytes": 9 * 2**30})
os.makedirs(os.path.join(run_dir, "tensorboard"), exist_ok=True)
for step in range(1, steps + 1):
    memory = [{"device": f"cuda:{i}", "label": f"GPU {i}", "allocated_bytes": (6 + step / 40) * 2**30,
               "reserved_bytes": 8 * 2**30, "nvml_used_bytes": 8.5 * 2**30, "nvml_total_bytes": 24 * 2**30}
              for i in range(gpus)]
    write({"type": "step", "step": step, "epoch": step / 100, "loss": 2.5 / (1 + step / 20) + 0.05 * (step % 3),
           "lr": 2e-4 * min(1, step / 10), "tokens_per_s": 4000 + 300 * (step % 5), "memory": memory})
    if step % 20 == 0:
        write({"type": "eval", "step": step, "eval_loss": 2.4 / (1 + step / 20)})
    if step % 40 == 0:
        write({"type": "samples", "step": step, "seconds": 1.8, "samples": [
            {"location": "held.jsonl:1", "prompt": "What kind of thing is a plum?", "reference": "a kind of fruit",
             "answer": "a kind of fruit" if step > 40 else "a kind of"}]})
    time.sleep(0.01)
if finish:
    checkpoint = os.path.join(run_dir, "checkpoints", f"step-{steps:06d}")
    os.makedirs(checkpoint)
    open(os.path.join(checkpoint, "COMPLETE"), "w").close()
    write({"type": "checkpoint", "step": steps, "path": checkpoint})
    write({"type": "finished", "status": "completed", "step": steps})
    sys.exit(0)
while not any(os.path.exists(os.path.join(run_dir, name)) for name in ("STOP", "ABORT")):
    time.sleep(0.05)
write({"type": "finished", "status": "stopped", "step": steps})
"""



# ---------------------------------------------------------------- the check


def layout_problems(window: QWidget, width: int, height: int) -> list[str]:
    """What does not fit on a ``width`` x ``height`` screen: the window's minimum size, and every visible
    label whose text needs more room than it has (cut off, or overlapping its neighbours)."""
    problems = []
    usable = (width - FRAME_WIDTH, height - FRAME_HEIGHT)
    minimum = window.minimumSizeHint().expandedTo(window.minimumSize())
    if minimum.width() > usable[0] or minimum.height() > usable[1]:
        problems.append(f"the window needs at least {minimum.width()}x{minimum.height()}, the screen leaves "
                        f"{usable[0]}x{usable[1]}")
    for label in window.findChildren(QLabel):
        if label.isVisible() and label.text():
            problem = _label_problem(window, label)
            if problem:
                problems.append(problem)
    return problems + text_problems(window)


# ---------------------------------------------------------------- the words


def shown_text(label: QLabel) -> str:
    """What a label shows: its text as it is, or as rendered when Qt takes it for rich text (entities decoded)."""
    text, form = label.text(), label.textFormat()
    if form == Qt.TextFormat.PlainText or (form == Qt.TextFormat.AutoText and not QtGui.Qt.mightBeRichText(text)):
        return text
    document = QTextDocument()
    document.setHtml(text)
    return document.toPlainText()


def visible_texts(window: QWidget) -> list[tuple[QLabel, str]]:
    return [(label, shown_text(label)) for label in window.findChildren(QLabel) if label.isVisible() and label.text()]


# An HTML entity left in plain text ("the model&#x27;s"): escaped text in a label that shows it as it is
_ENTITY = re.compile(r"&(#x?[0-9a-fA-F]+|[a-z]+);")
# Every config key (``training.output_layer_on_cpu``): the window names a setting by the label of its control
CONFIG_KEYS = {f"{section}.{field.name}" for section, value in vars(RunConfig()).items()
               if dataclasses.is_dataclass(value) for field in dataclasses.fields(value)}
_CONFIG_KEY = re.compile(r"\b[a-z]+\.[a-z_]+\b")


def text_problems(window: QWidget) -> list[str]:
    """Words on screen that are not the window's: HTML entities shown raw, config keys instead of labels."""
    problems = []
    for label, text in visible_texts(window):
        name = f"label {text[:60]!r}"
        entity = _ENTITY.search(text)
        if entity:
            problems.append(f"{name} shows the entity {entity.group()!r} (escaped text in a plain-text label)")
        keys = sorted({key for key in _CONFIG_KEY.findall(text) if key in CONFIG_KEYS})
        if keys:
            problems.append(f"{name} names {', '.join(keys)}: the window calls settings by their labels")
    return problems


def _sentences(text: str) -> set[str]:
    """A text's sentences and list items (those longer than a few words), normalized for comparing."""
    parts = re.split(r"(?<=[.!?])\s+|\n|\u2029", text)
    return {" ".join(part.split()).strip(" .;:⚠").lower() for part in parts if len(part.split()) >= 5}


def repeated_texts(window: QWidget) -> list[str]:
    """Sentences that two visible labels both show (the window says each thing once)."""
    seen: dict[str, QLabel] = {}
    problems = []
    for label, text in visible_texts(window):
        for sentence in _sentences(text):
            first = seen.setdefault(sentence, label)
            if first is not label:
                problems.append(f"{sentence[:80]!r} is shown twice ({first.text()[:40]!r}, {label.text()[:40]!r})")
    return problems


def _inside_scroll_area(widget: QWidget) -> bool:
    """A label in a scroll area (a settings column, a list) is scrolled to: it may lie outside the window."""
    parent = widget.parentWidget()
    while parent is not None:
        if isinstance(parent, QAbstractScrollArea):
            return True
        parent = parent.parentWidget()
    return False


def _label_problem(window: QWidget, label: QLabel) -> str:
    name = f"label {label.text()[:60]!r}"
    width, height = label.width(), label.height()
    needed_width = label.minimumSizeHint().width()
    if needed_width > width + 1:
        return f"{name} is cut off: {width} px wide, needs {needed_width}"
    if label.wordWrap():
        needed = label.heightForWidth(width)
        if needed > height + 1:
            return f"{name} is cut off: {height} px high, needs {needed} at {width} px"
    elif label.sizeHint().height() > height + 1:
        return f"{name} is cut off: {height} px high, needs {label.sizeHint().height()}"
    shown = QRect(label.mapTo(window, QPoint(0, 0)), label.size())
    if not window.rect().contains(shown) and not _inside_scroll_area(label):
        return f"{name} lies outside the window ({shown.getRect()})"
    return ""


# ---------------------------------------------------------------- the states


def _fake_worker(window, tmp_path: Path, script: str, **env) -> None:
    path = tmp_path / "worker.py"
    path.write_text(script)
    window.controller.worker_command = lambda config, run_dir: [sys.executable, str(path), str(config), "--run-dir",
                                                                str(run_dir)]

    os.environ.update({f"FAKE_{k.upper()}": str(v) for k, v in env.items()})


def _train(window, qtbot, tmp_path, steps=120, gpus=1, finish=False) -> None:
    _fake_worker(window, tmp_path, FAKE_WORKER, steps=steps, gpus=gpus, finish=int(finish))
    window.start_action.trigger()
    done = (lambda: window.controller.job.state is State.FINISHED) if finish else \
        (lambda: window.controller.series.step_count >= steps)
    qtbot.waitUntil(done, timeout=30000)
    qtbot.wait(300)


def preset_model(window, qtbot, tmp_path):
    window.setup_tabs.setCurrentWidget(window.model_panel)


def preset_data(window, qtbot, tmp_path):
    window.setup_tabs.setCurrentWidget(window.data_panel)
    qtbot.waitUntil(lambda: not window.data_panel.task.busy, timeout=10000)


def preset_techniques(window, qtbot, tmp_path):
    window.setup_tabs.setCurrentWidget(window.techniques_panel)


def scale_out_offload(window, qtbot, tmp_path):
    window.setup_tabs.setCurrentWidget(window.scale_panel)
    window.store.update(method="full", distributed={"num_processes": 2, "sharding": "zero2", "offload_optimizer": "cpu"})


def zero3_full_logits(window, qtbot, tmp_path):
    window.setup_tabs.setCurrentWidget(window.scale_panel)
    window.store.update(method="full", distributed={"num_processes": 4, "sharding": "zero3"})


def hub_id_typed(window, qtbot, tmp_path):

    os.environ.pop("HF_HUB_OFFLINE", None)
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "empty-cache")
    window.model_panel.hub_id.setText("Qwen/Qwen2.5-0.5B-Instruct")
    window.model_panel.hub_id.returnPressed.emit()


def hub_id_offline(window, qtbot, tmp_path):

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "empty-cache")
    window.model_panel.use_model("meta-llama/Llama-3.2-1B-Instruct")


def folder_without_weights(window, qtbot, tmp_path):
    broken = tmp_path / "a-model-folder-copied-without-its-weights-and-tokenizer"
    broken.mkdir()
    shutil.copy(DEMO_MODEL / "config.json", broken / "config.json")
    window.model_panel.use_model(str(broken))


def remote_code_on(window, qtbot, tmp_path):
    window.store.update(model={"trust_remote_code": True})


def data_problems(window, qtbot, tmp_path):
    bad = tmp_path / "mixed.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"messages": [{"role": "user"}]}\nnot json\n')
    window.setup_tabs.setCurrentWidget(window.data_panel)
    window.data_panel.set_files([str(bad)])
    qtbot.waitUntil(lambda: not window.data_panel.task.busy, timeout=10000)


def rows_beyond_max_length(window, qtbot, tmp_path):
    """A file whose only row's prompt is longer than the sequence length: nothing to learn, named in red."""
    long = tmp_path / "long-prompt.jsonl"
    long.write_text(json.dumps({"instruction": "Summarize: " + "word " * 200, "output": "done"}) + "\n")
    window.setup_tabs.setCurrentWidget(window.data_panel)
    window.data_panel.set_files([str(long)])
    qtbot.waitUntil(lambda: not window.data_panel.task.busy and bool(window.data_panel.problems), timeout=10000)


def unknown_columns(window, qtbot, tmp_path):
    """The demo preset, then a CSV whose columns fit no row format: its fields are named."""
    scores = tmp_path / "scores.csv"
    scores.write_text("foo,bar\n" + "".join(f"{i},{i * i}\n" for i in range(30)))
    window.setup_tabs.setCurrentWidget(window.data_panel)
    window.data_panel.set_files([str(scores)])
    qtbot.waitUntil(lambda: not window.data_panel.task.busy, timeout=10000)


def does_not_fit(window, qtbot, tmp_path):
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    window.store.update(training={"micro_batch_size": 64}, data={"max_length": 256})
    panel = window.estimate_panel
    panel.picker.select_custom(round(0.8 * panel.estimate.peak_bytes / 2**30, 2))


def fit_to_gpu(window, qtbot, tmp_path):
    does_not_fit(window, qtbot, tmp_path)
    window.estimate_panel.fit_button.click()


EIGHT_B = "meta-llama/Llama-3.1-8B-Instruct"


def choose_8b_model(window, tmp_path: Path) -> None:
    """Llama-3.1-8B's config.json alone in an offline Hugging Face cache: its estimate, no weights, no network."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_HUB_CACHE"] = str(tmp_path / "hub")
    cache_model(tmp_path / "hub", EIGHT_B, {**LLAMA_31_8B, "architectures": ["LlamaForCausalLM"]})
    window.model_panel.use_model(EIGHT_B)


def eight_b_fit_with_problems(window, qtbot, tmp_path):
    """The user trial: an 8B model chosen, a file with bad rows, Fit pressed: Start is off for problems in three
    places (the model's weights are not here, the data's rows, 4-bit base weights without an NVIDIA GPU)."""
    choose_8b_model(window, tmp_path)
    bad = tmp_path / "mixed.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{"messages": [{"role": "user"}]}\n')
    window.data_panel.set_files([str(bad)])
    qtbot.waitUntil(lambda: not window.data_panel.task.busy and bool(window.data_panel.problems), timeout=10000)
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    window.estimate_panel.fit_button.click()


LONG_NOTES_SETUP = {"method": "qlora", "training": {
    "gradient_checkpointing": True, "activation_offload": True, "tiled_mlp": True, "output_layer_on_cpu": True,
    "embedding_on_cpu": True, "optimizer": "adamw_8bit"}, "data": {"max_length": 8192}}


def long_estimate_notes(window, qtbot, tmp_path):
    """Many savers on for an 8B model (QLoRA, activation offload, tiled MLP, output layer and embedding in CPU RAM,
    8-bit AdamW) at long rows: the estimate has much to say under the tabs."""
    choose_8b_model(window, tmp_path)
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    window.store.update(**LONG_NOTES_SETUP)


def minimum_size(window, qtbot, tmp_path):
    """The window made as small as it goes (a 1280x720 screen leaves room for it): nothing cut off there either."""
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    window.resize(window.minimumSizeHint().expandedTo(window.minimumSize()))


minimum_size.keeps_size = True  # checked at its own size, not resized to each screen


def simulated(window, qtbot, tmp_path):
    panel = window.estimate_panel
    result = json.dumps({"simulated": {"peak_bytes": 240_000_000, "peak_phase": "backward"}})
    panel.simulate_command = lambda path: [sys.executable, "-c", f"print({result!r})"]
    panel.simulate_button.click()
    qtbot.waitUntil(lambda: not panel.simulating, timeout=20000)


def simulation_dropped(window, qtbot, tmp_path):
    panel = window.estimate_panel
    panel.simulate_command = lambda path: [sys.executable, "-c", "import time; time.sleep(5)"]
    panel.simulate_button.click()
    window.store.update(training={"micro_batch_size": 4})
    qtbot.waitUntil(lambda: not panel.simulating, timeout=20000)


def unreadable_last_choices(window, qtbot, tmp_path):
    from studio.core.errors import StudioError
    window.unreadable_choices = StudioError("last-choices.yaml:3: training.micro_batch_size must be a number",
                                            "the file was written by a newer version")
    window._show_unreadable_choices()


def loading_model(window, qtbot, tmp_path):
    _fake_worker(window, tmp_path, "import time; print('Loading weights 12/38', flush=True); time.sleep(20)",
                 steps=0, gpus=0, finish=0)
    window.start_action.trigger()
    qtbot.wait(1500)


def training(window, qtbot, tmp_path):
    _train(window, qtbot, tmp_path)


def training_two_gpus(window, qtbot, tmp_path):
    _train(window, qtbot, tmp_path, gpus=2)


def completed(window, qtbot, tmp_path):
    _train(window, qtbot, tmp_path, finish=True)


def run_failed(window, qtbot, tmp_path):
    _fake_worker(window, tmp_path, OOM_WORKER)
    window.start_action.trigger()
    qtbot.waitUntil(lambda: window.controller.job.state is State.FAILED, timeout=30000)


def history_compare(window, qtbot, tmp_path):
    _train(window, qtbot, tmp_path, steps=60, finish=True)
    first = window.controller.run_dir.path
    window.store.update(name="slower-lr")
    _train(window, qtbot, tmp_path, steps=40, finish=True)
    window.run_tabs.setCurrentWidget(window.history)
    window.history.refresh_now()
    window.history.select(first, window.controller.run_dir.path)


def history_empty(window, qtbot, tmp_path):
    window.run_tabs.setCurrentWidget(window.history)
    window.history.refresh_now()


def export_verified(window, qtbot, tmp_path):
    _train(window, qtbot, tmp_path, steps=20, finish=True)
    run = window.controller.run_dir.path
    record = json.dumps({"form": "merged model in bfloat16", "verification": {
        "passed": True, "samples": 8, "max_abs_diff": 0.0312, "top1_agreement": 1.0, "base_max_abs_diff": 4.1}})
    panel = window.export_panel
    panel.command = lambda run_dir, kind, out, *_: [sys.executable, "-c", (
        f"import pathlib; out = pathlib.Path({str(out)!r}); out.mkdir(parents=True, exist_ok=True); "
        f"(out / 'studio_export.json').write_text({record!r})")]
    panel.set_run(run)
    window.run_tabs.setCurrentWidget(panel)
    panel.export_button.click()
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)


def gguf_published(window, qtbot, tmp_path):
    """A GGUF export in two types, published to the Hub (a stand-in command: no network, no login needed)."""
    _train(window, qtbot, tmp_path, steps=20, finish=True)
    check = {"passed": True, "samples": 8, "exact": False, "base_max_abs_diff": None}
    files = {quant: {"file": f"run-{quant}.gguf", "bytes": size, "modelfile": {"file": f"Modelfile.{quant}"},
                     "verification": {**check, "max_abs_diff": diff, "top1_agreement": agreement}}
             for quant, size, diff, agreement in (("f16", 2.9e8, 0.0021, 1.0), ("q8_0", 1.6e8, 0.034, 0.994))}
    record = json.dumps({"form": "GGUF f16, q8_0", "files": files, "verification": files["q8_0"]["verification"]})
    panel = window.export_panel
    panel.command = lambda run_dir, kind, out, *_: [sys.executable, "-c", (
        f"import pathlib; out = pathlib.Path({str(out)!r}); out.mkdir(parents=True, exist_ok=True); "
        f"(out / 'studio_export.json').write_text({record!r}); print('published: https://huggingface.co/you/plums')")]
    panel.check_command = lambda run_dir: [sys.executable, "-c", "print('GGUF can be made')"]
    panel.set_run(window.controller.run_dir.path)
    window.run_tabs.setCurrentWidget(panel)
    panel.gguf.setChecked(True)
    qtbot.waitUntil(lambda: panel.gguf_verdicts.get(panel.run_dir) == "", timeout=20000)
    panel.quants["f16"].setChecked(True)
    panel.repo.setText("you/plums")
    panel.start_export(push_to="you/plums")  # the button asks the Hub login first; a state has none
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)


GGUF_REFUSED = ("import sys; from studio.train.export.llama_cpp import UNKNOWN_BPE_HINT; print(\"error: llama.cpp's "
                "converter cannot make a GGUF of this model: it does not recognise the model's BPE tokenizer "
                "(llama.cpp knows one by the tokens it makes of a test text; a GGUF of this one would split text "
                "differently from training)\", file=sys.stderr); print('  hint: ' + UNKNOWN_BPE_HINT, "
                "file=sys.stderr); sys.exit(1)")


def gguf_refused(window, qtbot, tmp_path):
    """GGUF chosen for the demo model, whose tokenizer llama.cpp does not know: why not, and what to do."""
    _train(window, qtbot, tmp_path, steps=20, finish=True)
    panel = window.export_panel
    panel.check_command = lambda run_dir: [sys.executable, "-c", GGUF_REFUSED]
    panel.set_run(window.controller.run_dir.path)
    window.run_tabs.setCurrentWidget(panel)
    panel.gguf.setChecked(True)
    qtbot.waitUntil(lambda: panel.run_dir in panel.gguf_verdicts, timeout=20000)


def try_it(window, qtbot, tmp_path):
    _train(window, qtbot, tmp_path, steps=20, finish=True)
    panel = window.try_panel
    answers = json.dumps({"base": "drink . drink . drink .", "tuned": "A plum is a kind of fruit: a drupe.",
                          "checkpoint": "step-000020"})
    panel.command = lambda run_dir, prompt, tokens, image: [sys.executable, "-c", f"print({answers!r})"]
    window.run_tabs.setCurrentWidget(panel)
    panel.prompt.setPlainText("What kind of thing is a plum?")
    panel.generate_button.click()
    qtbot.waitUntil(panel.generate_button.isEnabled, timeout=20000)


def evaluated(window, qtbot, tmp_path):
    """Evaluate, after the held-out comparison and a benchmark ran (scripted: their result files, as written)."""
    _train(window, qtbot, tmp_path, steps=20, finish=True)
    panel = window.evaluate_panel
    summary = {"base": {"rows": 80, "tokens": 410, "loss": 3.9, "perplexity": 49.4, "exact_match": 0.0,
                        "contains": 0.05, "f1": 0.12, "answered": 80},
               "tuned": {"rows": 80, "tokens": 410, "loss": 0.21, "perplexity": 1.23, "exact_match": 0.95,
                         "contains": 0.97, "f1": 0.98, "answered": 80}}
    rows = [{"location": f"categories_heldout.jsonl:{i}", "prompt": "What kind of thing is a plum?",
             "reference": "a kind of fruit", "tokens": 5, "base": {"loss_sum": 19.0, "answer": "drink . drink .", "f1": 0.0},
             "tuned": {"loss_sum": 1.0, "answer": "a kind of fruit", "f1": 1.0}} for i in range(1, 6)]
    evaluation = {"checkpoint": "step-000020", "data": ["categories_heldout.jsonl"], "summary": summary, "rows": rows}
    benchmarks = {"checkpoint": "step-000020", "limit": 100, "chat_template": True,
                  "tasks": {"arc_easy": {"base": {"acc": 0.25, "acc_norm": 0.27}, "tuned": {"acc": 0.31, "acc_norm": 0.3}}}}
    panel.command = _writes("evaluation.json", evaluation, "base model: 80/80 [####################]")
    panel.benchmarks_command = _writes("benchmarks.json", benchmarks, "benchmarks: 2/2 [####################]")
    window.run_tabs.setCurrentWidget(panel)
    panel.evaluate_button.click()
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)
    panel.tasks.setText("arc_easy")
    panel.benchmarks_button.click()
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)


def _writes(name, result, progress):
    """A stand-in for a studio eval command: its progress line, then its result file in the run directory."""
    return lambda run_dir, *_: [sys.executable, "-c", (
        f"import pathlib, sys; print({progress!r}, file=sys.stderr); "
        f"(pathlib.Path({str(run_dir)!r}) / {name!r}).write_text({json.dumps(result)!r})")]


def grpo_evaluation(rows: int = 12) -> dict:
    """What studio eval writes of a grpo run scored by two rewards: the first 3 prompts' completions miss the format."""
    def scores(answer, format_reward):
        return {"answer": answer, "reward": format_reward + 0.5, "full_reward": bool(format_reward),
                "rewards": {"matches_format": format_reward, "length_within": 1.0}}

    def figures(reward):
        return {"rows": rows, "eval_reward": reward + 0.5, "eval_rewards/matches_format/mean": reward,
                "eval_rewards/length_within/mean": 1.0, "full_reward": reward,
                "reward_functions": ["matches_format", "length_within"], "decoding": "greedy", "max_new_tokens": 12}
    listed = [{"location": f"grpo_heldout.jsonl:{i}", "prompt": "a melon is a", "reference": "fruit",
               "base": scores("fruit .", 0.0), "tuned": scores("kind of fruit ." if i > 3 else "fruit .", float(i > 3))}
              for i in range(1, rows + 1)]
    return {"checkpoint": "step-000020", "data": ["grpo_heldout.jsonl"], "rows": listed,
            "summary": {"base": figures(0.0), "tuned": figures(0.75)}}


def grpo_evaluated(window, qtbot, tmp_path):
    """Evaluate, after studio eval scored a grpo run's held-out prompts by its rewards (scripted: its result file)."""
    _train(window, qtbot, tmp_path, steps=20, finish=True)
    panel = window.evaluate_panel
    panel.command = _writes("evaluation.json", grpo_evaluation(), "base model: 12/12 [####################]")
    window.run_tabs.setCurrentWidget(panel)
    panel.evaluate_button.click()
    qtbot.waitUntil(lambda: not panel._process.running, timeout=20000)


def preference_setup(window, qtbot, tmp_path):
    """Setup ▸ New preference setup: the Objective section with DPO's settings, the pairs side by side."""
    window.new_preference_setup()
    window.setup_tabs.setCurrentWidget(window.data_panel)
    qtbot.waitUntil(lambda: not window.data_panel.task.busy and window.data_panel.preview is not None, timeout=10000)


def grpo_setup(window, qtbot, tmp_path):
    """Setup ▸ New GRPO setup, its notice read and dismissed: the rewards in the Techniques tab, a second one added
    (contains, its text not written yet), and a reward file not trusted yet."""
    window.new_grpo_setup()
    window.changes_notice.hide()
    panel = window.techniques_panel
    window.setup_tabs.setCurrentWidget(panel)
    panel.rewards.add_button.click()
    panel.rewards.rows[1].name.setCurrentIndex(3)  # contains
    window.store.update(grpo={"reward_file": str(tmp_path / "my_reward.py")})
    QApplication.processEvents()
    panel.ensureWidgetVisible(panel.reward_file)


STATES = (preset_model, preset_data, preset_techniques, scale_out_offload, zero3_full_logits, hub_id_typed,
          hub_id_offline, folder_without_weights, remote_code_on, data_problems, rows_beyond_max_length,
          unknown_columns, does_not_fit, fit_to_gpu, eight_b_fit_with_problems, long_estimate_notes, minimum_size,
          simulated, simulation_dropped, unreadable_last_choices,
          loading_model, training, training_two_gpus, completed, run_failed, history_compare, history_empty,
          export_verified, gguf_published, gguf_refused, try_it, evaluated, grpo_evaluated, preference_setup,
          grpo_setup)
TWO_GPU_STATES = (preset_techniques, fit_to_gpu, zero3_full_logits, training_two_gpus, long_estimate_notes)
