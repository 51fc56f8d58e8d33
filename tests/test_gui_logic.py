"""The app's pure-Python parts, without Qt: job states, chart series, run history, preview, memory, settings."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from studio.core.config import RunConfig
from studio.core.data.row_formats import Example
from studio.core.presets import DEMO_MODEL, DEMO_TRAIN, demo_config
from studio.core.run.directory import RunDir
from studio.gui.state import memory, settings
from studio.gui.state.changes import value_words
from studio.gui.state.console import console_error, loading_detail
from studio.gui.state.data_preview import TokenizerInfo, build_preview, render_example
from studio.gui.state.job_state import Job, State, status_text
from studio.gui.state.model_summary import ModelNotFound, summarize_model
from studio.gui.state.run_history import live_runs, record_for, scan_runs
from studio.gui.state.series import RunSeries, Series, smooth


def step(n, loss=2.0, t=None, **extra):
    return {"type": "step", "step": n, "loss": loss, "lr": 1e-3, "tokens_per_s": 100.0, "epoch": n / 10,
            "time": t if t is not None else 1000.0 + n, "memory": [{"device": "cpu", "kind": "process",
                                                                    "label": "process memory", "rss_bytes": 2**30}], **extra}


# ---------------------------------------------------------------- job states

def test_job_goes_through_its_states_and_only_completed_is_success():
    job = Job()
    job.begin()
    assert job.state is State.STARTING and job.headline() == "Starting"
    job.apply({"type": "run_started", "total_steps": 10, "start_step": 0})
    assert job.state is State.RUNNING
    for n in range(1, 4):
        job.apply(step(n, t=1000.0 + 2 * n))
    assert job.eta_seconds() == pytest.approx(14.0)  # 7 steps left at 2 s each
    assert "step 3/10" in status_text(job) and "14 s left" in status_text(job) and "100 tokens/s" in status_text(job)
    job.apply({"type": "finished", "status": "completed", "step": 10})
    assert job.state is State.FINISHED and job.headline() == "Completed"


def test_error_event_makes_the_run_failed_with_its_hint():
    job = Job()
    job.begin()
    job.apply({"type": "error", "kind": "model", "message": "cannot load the model", "hint": "check the folder"})
    job.apply({"type": "finished", "status": "failed"})
    assert job.state is State.FAILED and job.headline() == "Failed"
    assert job.error.message == "cannot load the model" and job.error.hint == "check the folder"


def test_a_worker_gone_without_finished_event_is_a_crash_not_a_success():
    job = Job()
    job.begin()
    job.apply({"type": "run_started", "total_steps": 5})
    job.process_gone()
    assert job.state is State.CRASHED and "Completed" not in status_text(job)
    job.process_gone()  # idempotent
    assert job.state is State.CRASHED


def test_readable_console_error_makes_it_failed_and_user_stop_before_start_is_cancelled():
    job = Job()
    job.begin()
    job.process_gone(console_error("[studio] x\nerror: 1 problem(s):\n  - data.train_files: no training data\n  hint: fix it"))
    assert job.state is State.FAILED and "no training data" in job.error.message and job.error.hint == "fix it"
    job = Job()
    job.begin()
    job.request_stop()
    job.process_gone(stopped_by_user=True)
    assert job.state is State.FINISHED and job.headline() == "Cancelled"


def test_second_stop_press_aborts_and_resume_restarts_the_state():
    job = Job()
    job.begin()
    job.apply({"type": "run_started", "total_steps": 5})
    assert job.request_stop() is False and job.state is State.STOPPING
    assert job.request_stop() is True
    job.apply({"type": "finished", "status": "stopped", "step": 2})
    assert job.headline() == "Stopped and saved"
    job.begin()
    job.apply({"type": "run_started", "total_steps": 5, "start_step": 2})
    assert job.state is State.RUNNING and job.step == 2 and job.final_status == ""
    with pytest.raises(RuntimeError):
        job.begin()


def test_console_error_reads_tracebacks_and_ignores_noise():
    assert console_error("W1129 noisy warning\nLoading weights 38/38") is None
    found = console_error("Traceback (most recent call last):\n  File x\nModuleNotFoundError: No module named 'torch'")
    assert "No module named 'torch'" in found.message


def test_loading_note_comes_from_meaningful_console_lines():
    assert loading_detail("Loading weights: 100%|██████████| 38/38 [00:00<00:00, 3441.15it/s]") == \
        "Loading weights: 100% 38/38 [00:00<00:00, 3441.15it/s]"
    assert loading_detail("model.safetensors:  45%|████▌     | 450M/1.00G [00:10<00:12]").startswith("model.safetensors: 45%")
    assert "tokenizer" in loading_detail("[studio] run directory /tmp/x")
    assert loading_detail("W1129 17:29:05 site-packages/torch/utils/_pytree.py:630] deprecated") == ""


# ---------------------------------------------------------------- series

def test_series_grows_by_doubling_and_keeps_every_point():
    series = Series(capacity=4)
    for i in range(1000):
        series.append(i, i * 2)
    assert len(series) == 1000 and series.y[-1] == 1998 and len(series._x) == 1024
    series.truncate_after(499)
    assert len(series) == 500 and series.x[-1] == 499


def test_run_series_smooths_and_a_resume_drops_the_lost_steps():
    events = [{"type": "run_started", "start_step": 0}] + [step(n, loss=float(n)) for n in range(1, 7)]
    run = RunSeries.from_events(events)
    assert run.loss.y.tolist() == [1, 2, 3, 4, 5, 6]
    assert np.allclose(run.loss_smoothed.y, smooth(run.loss.y)) and run.loss_smoothed.y[0] == 1.0
    assert run.memory["cpu"].series["process"].y[0] == 1.0 and not run.memory["cpu"].is_gpu
    run.add({"type": "run_started", "start_step": 4})  # crashed after 6, resumed from the checkpoint at 4
    run.add(step(5, loss=50.0))
    assert run.loss.x.tolist() == [1, 2, 3, 4, 5] and run.loss.y[-1] == 50.0
    assert np.allclose(run.loss_smoothed.y, smooth(run.loss.y))


def test_gpu_memory_series_keep_capacity():
    run = RunSeries()
    run.add({"type": "step", "step": 1, "loss": 1.0, "memory": [{"device": "cuda:0", "kind": "cuda", "label": "RTX",
             "allocated_bytes": 2**30, "reserved_bytes": 2 * 2**30, "nvml_used_bytes": 3 * 2**30,
             "nvml_total_bytes": 24 * 2**30}]})
    trace = run.memory["cuda:0"]
    assert trace.is_gpu and trace.capacity_bytes == 24 * 2**30
    assert {k: s.y[0] for k, s in trace.series.items()} == {"allocated": 1.0, "reserved": 2.0, "nvml used": 3.0}


# ---------------------------------------------------------------- run history

def write_run(root, name, events, pid=None, config=None):
    rd = RunDir(root / name)
    rd.path.mkdir(parents=True)
    rd.config.write_text("name: x\nmethod: lora\n", encoding="utf-8")
    rd.events.write_text("".join(json.dumps(e) + "\n" for e in events), encoding="utf-8")
    if pid is not None:
        rd.worker_info.write_text(json.dumps({"pid": pid, "started": time.time()}), encoding="utf-8")
    return rd


def test_history_lists_runs_with_status_and_finds_the_live_one(tmp_path):
    started = {"type": "run_started", "time": 1.0, "total_steps": 4, "config": {"model": {"name_or_path": "/m/tiny"},
                                                                                "method": "qlora"}}
    write_run(tmp_path, "done", [started, step(4, loss=0.5), {"type": "finished", "status": "completed"}])
    write_run(tmp_path, "crashed", [dict(started, time=2.0), step(1)], pid=2**22 + 12345)  # no such process
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        write_run(tmp_path, "live", [dict(started, time=3.0), step(2)], pid=live.pid)
        records = {r.name: r for r in scan_runs(tmp_path)}
        assert [r.name for r in scan_runs(tmp_path)] == ["live", "crashed", "done"]
        assert records["done"].status == "completed" and records["done"].last_loss == 0.5
        assert records["done"].model == "tiny" and records["done"].method == "qlora"
        assert records["crashed"].status == "crashed" and records["live"].status == "running"
        assert live_runs(tmp_path) == [tmp_path / "live"]
    finally:
        live.kill()
        live.wait()
    assert record_for(tmp_path / "live").status == "crashed"
    assert record_for(tmp_path / "nothing") is None


# ---------------------------------------------------------------- model and data preview

def stored_parameters(weights: Path) -> int:
    """Parameters in a safetensors file, from its header (8-byte length, then JSON)."""
    with open(weights, "rb") as file:
        header = json.loads(file.read(int.from_bytes(file.read(8), "little")))
    return sum(int(np.prod(t["shape"])) for name, t in header.items() if name != "__metadata__")


def test_demo_model_summary_matches_its_files():
    config = json.loads((DEMO_MODEL / "config.json").read_text())
    summary = summarize_model(str(DEMO_MODEL))
    assert summary.architecture == config["architectures"][0] and summary.vocabulary == config["vocab_size"]
    assert summary.context_length == config["max_position_embeddings"]
    assert summary.parameters == stored_parameters(DEMO_MODEL / "model.safetensors")
    assert summary.weights_local and summary.local_folder and summary.special_tokens.get("eos_token")


def test_a_hub_id_not_on_this_machine_gets_an_offline_friendly_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound) as raised:
        summarize_model("Qwen/Qwen2.5-0.5B")
    assert "offline" in raised.value.hint and "local folder" in raised.value.hint
    assert "(hf download Qwen/Qwen2.5-0.5B)" in raised.value.hint  # the current CLI: huggingface-cli is deprecated


def demo_tokenizer():
    summary = summarize_model(str(DEMO_MODEL))
    return TokenizerInfo(summary.chat_template, summary.special_tokens, summary.folder / "tokenizer.json")


def first_row() -> dict:
    return json.loads(DEMO_TRAIN.read_text().splitlines()[0])


def test_preview_masks_the_prompt_and_learns_the_response():
    preview = build_preview([str(DEMO_TRAIN)], "auto", "auto", demo_tokenizer())
    assert preview.format == "instruction" and preview.rows == len(DEMO_TRAIN.read_text().splitlines())
    row, first = first_row(), preview.examples[0]
    masked = "".join(text for text, learned in first.segments if not learned)
    learned = "".join(text for text, learned in first.segments if learned)
    assert row["instruction"] in masked and row["output"] not in masked and learned.startswith(row["output"])
    assert preview.unit == "tokens" and first.tokens == preview.lengths[0]
    longest, shortest = int(preview.lengths.max()), int(preview.lengths.min())
    assert preview.truncated(longest) == 0 and preview.truncated(shortest - 1) == preview.sampled


@pytest.mark.slow
def test_preview_token_counts_are_the_workers():
    from studio.core.data.dataset import inspect_files
    from studio.train.data.prepare import encode, render_segments
    from studio.train.model.build import load_tokenizer

    preview = build_preview([str(DEMO_TRAIN)], "auto", "auto", demo_tokenizer())
    tokenizer = load_tokenizer(demo_config())
    examples = inspect_files([str(DEMO_TRAIN)], "auto", keep=len(preview.examples)).examples
    for example, shown in zip(examples, preview.examples):
        segments = render_segments(example, tokenizer, "auto")
        assert tuple(segments) == shown.segments
        assert len(encode(segments, tokenizer, 10_000)["input_ids"]) == shown.tokens


def test_builtin_templates_plain_text_and_train_on_prompt():
    tokenizer = demo_tokenizer()
    eos = tokenizer.eos
    example = Example("instruction", messages=({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}))
    assert render_example(example, "alpaca", tokenizer) == [("### Instruction:\nhi\n\n### Response:\n", False),
                                                           ("yo" + eos, True)]
    assert render_example(example, "chatml", tokenizer, train_on_prompt=True) == [
        ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>", True)]
    assert render_example(Example("text", text="once"), "none", tokenizer) == [("once" + eos, True)]


def test_without_a_tokenizer_lengths_are_characters():
    preview = build_preview([str(DEMO_TRAIN)], "instruction", "chatml", TokenizerInfo())
    assert preview.unit == "characters" and preview.examples[0].tokens is None and preview.truncated(1) == 0


# ---------------------------------------------------------------- memory

def test_estimate_follows_the_config_and_fit_says_what_it_changed():
    config = demo_config().replace(training={"micro_batch_size": 64}, data={"max_length": 256})
    big = memory.estimate_run(config).peak_bytes
    assert memory.estimate_run(config.replace(training={"micro_batch_size": 8})).peak_bytes < big
    target = int(0.8 * big)
    suggestion = memory.suggest_fit(config, target)
    assert suggestion.verdict != "does not fit" and suggestion.peak_bytes <= target
    assert suggestion.changes and all("saves" in change for change in suggestion.changes)
    assert suggestion.config.effective_batch_size == config.effective_batch_size  # the solver keeps it


def test_simulation_output_is_parsed_from_studio_estimate_json():
    nested = json.dumps({"peak_bytes": 1, "simulated": {"peak_bytes": 99, "peak_phase": "forward"}}, indent=2)
    assert memory.parse_simulation("a library's chatter\n" + nested).peak_bytes == 99  # studio estimate --json
    failed = memory.parse_simulation('{"error": "unknown architecture", "hint": "pick another"}')
    assert failed.peak_bytes is None and failed.error == "unknown architecture" and failed.hint == "pick another"
    assert memory.parse_simulation("").error


# ---------------------------------------------------------------- settings

def test_settings_and_last_choices_round_trip_and_survive_a_broken_file(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_CONFIG_DIR", str(tmp_path))
    assert settings.read_last_config()[0] == demo_config()  # first start: the demo preset
    state = settings.load_settings()
    state.remember_model("a")
    state.remember_model("b")
    state.remember_model("a")
    state.gpu_card = "Tesla T4"
    settings.save_settings(state)
    assert settings.load_settings().recent_models == ["a", "b"] and settings.load_settings().gpu_card == "Tesla T4"
    chosen = demo_config().replace(method="qlora", training={"micro_batch_size": 2})
    settings.save_last_config(chosen)
    assert settings.read_last_config()[0] == chosen
    settings.settings_path().write_text("{not json")
    settings.choices_path().write_text("method: [")
    assert settings.load_settings() == settings.AppSettings() and settings.read_last_config()[0] == demo_config()
    assert os.path.exists(str(settings.settings_path()) + ".broken")
    assert isinstance(settings.read_last_config()[0], RunConfig)


# ---------------------------------------------------------------- desktop menu entry

def test_desktop_entry_installs_with_its_icon(tmp_path):
    import configparser
    import struct

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    subprocess.run([sys.executable, str(root / "packaging" / "install_desktop_entry.py")], env=env, check=True,
                   capture_output=True)
    entry = configparser.ConfigParser(interpolation=None)
    entry.read(tmp_path / "applications" / "finetune-studio.desktop")
    desktop = entry["Desktop Entry"]
    assert desktop["Type"] == "Application" and desktop["Name"] == "Finetune Studio"
    assert desktop["Icon"] == "finetune-studio" and "studio" in desktop["Exec"] and desktop["Terminal"] == "false"
    assert (tmp_path / "icons/hicolor/scalable/apps/finetune-studio.svg").is_file()
    png = (tmp_path / "icons/hicolor/256x256/apps/finetune-studio.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (256, 256)
    subprocess.run([sys.executable, str(root / "packaging" / "install_desktop_entry.py"), "--uninstall"], env=env,
                   check=True, capture_output=True)
    assert not (tmp_path / "applications" / "finetune-studio.desktop").exists()


def test_the_workers_estimate_event_becomes_the_charts_estimate_of_reserved_memory():
    """The line is drawn beside the allocator's reserved curve, so it leaves out the CUDA context."""
    run = RunSeries("r")
    run.add({"type": "run_started", "start_step": 0})
    assert run.estimate_bytes is None
    device = {"device": "cuda:0", "total_bytes": 5_000_000, "parts": {"cuda_context": 1_000_000}}
    assert run.add({"type": "estimate", "peak_bytes": 5_000_000, "peak_phase": "forward", "devices": [device]})
    assert run.estimate_bytes == 4_000_000 and run.estimate_by_device == {"cuda:0": 4_000_000}


def test_garbage_is_collected_on_the_gui_thread_while_a_window_lives(qtbot):
    """A collection on a background thread can free Qt objects there and deadlock PySide."""
    import gc

    from PySide6.QtCore import QObject

    from studio.gui.tasks import GuiThreadGarbageCollector

    owner = QObject()
    collector = GuiThreadGarbageCollector(owner, interval_ms=10)
    assert not gc.isenabled()
    kept = [[] for _ in range(5000)]  # allocations beyond the interpreter's threshold: a collection is due
    assert gc.get_count()[0] > gc.get_threshold()[0]
    qtbot.waitUntil(lambda: gc.get_count()[0] < gc.get_threshold()[0], timeout=2000)  # the timer collected
    del kept
    collector.stop()
    assert gc.isenabled()


def test_a_time_left_never_reads_as_a_clock_time():
    from studio.gui.state.job_state import format_duration

    assert [format_duration(s) for s in (45, 22 * 60 + 13, 3600 + 5 * 60 + 20)] == ["45 s", "22 min 13 s", "1 h 05 min"]


def test_throughput_has_a_smoothed_line_that_restarts_with_a_resumed_run():
    from studio.gui.state.series import RunSeries

    events = [{"type": "run_started", "start_step": 0}]
    events += [{"type": "step", "step": n, "tokens_per_s": 1000.0 + 400 * (n % 2)} for n in range(1, 41)]
    run = RunSeries.from_events(events)
    assert len(run.tokens_per_s_smoothed) == 40 and run.tokens_per_s_smoothed.y[-10:].std() < run.tokens_per_s.y[-10:].std() / 4
    run.add({"type": "run_started", "start_step": 20})
    assert len(run.tokens_per_s) == len(run.tokens_per_s_smoothed) == 20


def test_samples_are_kept_per_prompt_and_a_resumed_run_drops_the_lost_steps():
    from studio.gui.state.series import SampleHistory

    def samples(step, *answers):
        return {"type": "samples", "step": step, "samples": [
            {"prompt": f"q{i}", "reference": "a kind of fruit", "location": f"held.jsonl:{i + 1}", "answer": a}
            for i, a in enumerate(answers)]}

    history = SampleHistory()
    for event in ({"type": "run_started", "start_step": 0, "config": {"schedule": {"sample_every": 10}}},
                  samples(0, "drink .", "kind"), samples(10, "a kind of", "a kind"), samples(20, "a kind of fruit", "x"),
                  {"type": "run_started", "start_step": 10}, samples(20, "a kind of fruit", "a kind of fruit")):
        history.add(event)
    first = history.prompts[0]
    assert history.every == 10 and first.base_answer == "drink ." and first.location == "held.jsonl:1"
    assert first.newest_first() == [(20, "a kind of fruit"), (10, "a kind of")]  # step 20 trained again, once
    assert history.prompts[1].newest_first()[0] == (20, "a kind of fruit")


def test_a_list_of_choices_reads_as_its_labels():
    assert value_words("schedule.trackers", ("wandb", "mlflow")) == "Weights & Biases, MLflow"
    assert value_words("schedule.trackers", ()) == "none"
    assert value_words("training.precision", "bf16") == "bf16 (mixed)"
