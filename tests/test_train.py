"""The real worker on the embedded tiny model: every technique trains, the run directory is complete."""

import json

import pytest

from helpers import losses, quick_config, with_demo_tokenizer
from studio.core.errors import ProblemsError
from studio.core.run.commands import EXIT_FAILED, EXIT_OK
from studio.core.run.events import read_events
from studio.train.worker import run


def train(tmp_path, config):
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
    return run_dir, events


# Later losses must average below this fraction of the first ones. benchmarks/loss_margins.py shows each
# case's room across seeds, which stands in for the rounding of another CPU: 1.5x or more for every case.
TECHNIQUE_THRESHOLD = 0.8
TECHNIQUES = {
    "lora_fp32": {},
    "lora_bf16": {"training": {"precision": "bf16"}},
    "lora_fp16": {"training": {"precision": "fp16"}},
    "full_bf16": {"method": "full", "training": {"precision": "bf16", "learning_rate": 5e-4}},
    "qlora_nf4": {"method": "qlora", "training": {"precision": "bf16"}},
    "qlora_fp4_single_quant": {"method": "qlora", "quantization": {"quant_type": "fp4", "double_quant": False}},
    "lora_8bit_base": {"quantization": {"load_in": "8bit"}},
    "dora": {"lora": {"use_dora": True}},
    "rslora": {"lora": {"use_rslora": True, "r": 32}, "training": {"learning_rate": 1e-3}},
    "lora_dropout_attention_only": {"lora": {"dropout": 0.1, "target_modules": ("q_proj", "v_proj")},
                                    "training": {"learning_rate": 1.5e-2}},
    "checkpointing": {"training": {"gradient_checkpointing": True}},
    "qlora_checkpointing": {"method": "qlora", "training": {"gradient_checkpointing": True}},
    "qlora_upcast_weights": {"method": "qlora", "training": {"precision": "bf16", "lean_weights": False}},
    "embedding_on_cpu": {"method": "qlora", "training": {"precision": "bf16", "embedding_on_cpu": True,
                                                         "gradient_checkpointing": True}},
    "activation_offload": {"training": {"gradient_checkpointing": True, "activation_offload": True}},
    "qlora_activation_offload": {"method": "qlora", "training": {"gradient_checkpointing": True,
                                                                 "activation_offload": True}},
    "tiled_mlp": {"training": {"tiled_mlp": True}},
    "qlora_tiled_mlp_offload": {"method": "qlora", "training": {"tiled_mlp": True, "gradient_checkpointing": True,
                                                                "activation_offload": True}},
    "accumulation": {"training": {"micro_batch_size": 4, "gradient_accumulation_steps": 2}},
    "adamw_8bit": {"training": {"optimizer": "adamw_8bit"}},
    "paged_adamw_8bit": {"training": {"optimizer": "paged_adamw_8bit"}},
    # SGD with momentum swings on LoRA's zero-started adapters at every rate that learns in 12 steps (the
    # verdict then hangs on the CPU's rounding); on the whole model it descends smoothly
    "sgd": {"method": "full", "training": {"optimizer": "sgd", "learning_rate": 0.03}},
    "adafactor": {"training": {"optimizer": "adafactor"}},
    "qat_lora_int4_int8": {"qat": {"weights": "int4", "activations": "int8"}},
    "qat_full_int8": {"method": "full", "qat": {"weights": "int8"}, "training": {"learning_rate": 5e-4}},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", TECHNIQUES)
def test_technique_trains_and_loss_falls(tmp_path, story_data, name):
    config = quick_config(story_data, **TECHNIQUES[name]).replace(data={"format": "text"})
    run_dir, events = train(tmp_path, config)
    curve = losses(run_dir)
    assert len(curve) == 12
    assert sum(curve[-4:]) / 4 < TECHNIQUE_THRESHOLD * sum(curve[:4]) / 4, f"{name}: loss did not fall: {curve}"
    assert events[-1] == {**events[-1], "type": "finished", "status": "completed"}


def test_the_worker_keeps_the_outer_weights_in_cpu_ram_and_trains_the_same(tmp_path, story_data):
    """QLoRA on an untied model, the embedding and the output layer in CPU RAM: the same losses as with them on the
    device, and the worker's measured step counts them in host RAM."""
    from model_factory import make_tiny_model

    model = with_demo_tokenizer(make_tiny_model("llama", tmp_path / "model", vocab_size=1280))
    config = quick_config(story_data, method="qlora", model={"name_or_path": str(model)}, data={"format": "text"},
                          training={"precision": "bf16", "max_steps": 3})
    curves, measured = [], []
    for index, on_cpu in enumerate((False, True)):
        lean = config.replace(training={"embedding_on_cpu": on_cpu, "output_layer_on_cpu": on_cpu})
        run_dir, events = train(tmp_path / str(index), lean)
        curves.append(losses(run_dir))
        measured.append(next(e for e in events if e["type"] == "memory_measured"))
    assert curves[0] == curves[1]
    assert "host_bytes" not in measured[0] and measured[1]["host_bytes"] == 2 * 1280 * 64 * 2  # both, bf16


def test_run_directory_and_events(tmp_path, small_data):
    config = quick_config(small_data, data={"eval_fraction": 0.25}, training={"max_steps": 4},
                          schedule={"eval_every": 2, "save_every": 2, "keep_checkpoints": 1})
    run_dir, events = train(tmp_path, config)
    assert (run_dir.path / "config.yaml").is_file() and (run_dir.path / "train.log").is_file()
    assert [p.name for p in run_dir.complete_checkpoints()] == ["step-000004"]  # keeps the newest one

    started = events[0]
    assert started["type"] == "run_started" and started["total_steps"] == 4
    assert started["data"]["train"]["rows"] == 24 and started["data"]["eval"]["rows"] == 8
    assert {"q_proj", "v_proj", "down_proj"} <= set(started["adapted_modules"])
    assert 0 < started["trainable_params"] < started["total_params"]
    assert "torch" in started["versions"] and started["devices"]

    step = next(e for e in events if e["type"] == "step")
    assert {"step", "epoch", "loss", "lr", "grad_norm", "tokens_per_s", "samples_per_s", "memory"} <= set(step)
    assert step["memory"][0]["device"] == "cpu" and step["memory"][0]["rss_bytes"] > 0
    assert [e["step"] for e in events if e["type"] == "eval"] == [2, 4]
    assert all(e["eval_loss"] > 0 for e in events if e["type"] == "eval")
    assert [e["type"] for e in events[-2:]] == ["checkpoint", "finished"]

    predicted = next(e for e in events if e["type"] == "estimate")
    measured = next(e for e in events if e["type"] == "memory_measured")
    assert measured["step"] == 2 and measured["predicted_bytes"] == predicted["peak_bytes"]
    # on the CPU every reading is of the live tensors: no CUDA context, no allocator margin
    assert measured["predicted_allocated_bytes"] == measured["predicted_reserved_bytes"] == predicted["peak_bytes"]
    # the phase is the measured step's own: the one whose tracked peak is the step's peak
    assert set(measured["phase_bytes"]) >= {"forward", "backward", "optimizer"}
    assert measured["phase_bytes"][measured["peak_phase"]] == measured["peak_bytes"] == max(
        measured["phase_bytes"].values())
    # The estimate assumes every row is max_length tokens long; these rows are shorter.
    assert 0.4 * predicted["peak_bytes"] < measured["peak_bytes"] <= 1.05 * predicted["peak_bytes"]


def test_invalid_config_is_refused_before_anything_is_written(tmp_path, small_data):
    from studio.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {{name_or_path: {tmp_path / 'nowhere'}}}\ndata: {{train_files: [{small_data}]}}\n"
                   "training: {micro_batch_size: 0, optimizer: adamm}\n")
    assert main(["train", str(bad), "--run-dir", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


def test_missing_model_folder_is_refused_before_a_run_starts(tmp_path, small_data):
    config = quick_config(small_data, model={"name_or_path": str(tmp_path / "no-such-model")})
    with pytest.raises(ProblemsError, match="model.name_or_path: .*no-such-model: no such model folder"):
        run(config, tmp_path / "run", watch_stdin=False)
    assert not (tmp_path / "run").exists()


def test_bad_data_row_fails_naming_file_and_line(tmp_path, small_data):
    data = tmp_path / "broken.jsonl"
    data.write_text(small_data.read_text() + '{"instruction": "x", "input": "y"}\n')
    code, run_dir = run(quick_config(data), tmp_path / "run", watch_stdin=False)
    error = next(e for e in read_events(run_dir.events) if e["type"] == "error")
    assert code == EXIT_FAILED and error["kind"] == "data"
    assert "broken.jsonl:33" in error["message"] and "output" in error["message"]
    assert json.loads(run_dir.events.read_text().splitlines()[-1])["status"] == "failed"


def test_rows_cut_before_their_response_are_named_in_a_warning_and_the_rest_trains(tmp_path, small_data):
    data = tmp_path / "some-long.jsonl"
    long = {"instruction": "Repeat: " + "word " * 100, "output": "x"}
    data.write_text(small_data.read_text() + json.dumps(long) + "\n")
    run_dir, events = train(tmp_path, quick_config(data, training={"max_steps": 2}))
    [warning] = [e for e in events if e["type"] == "warning" and "left out" in e["message"]]
    assert warning["message"].startswith("1 of 33 training rows is left out") and "(some-long.jsonl:33: after " in \
        warning["message"]
    assert warning["hint"].startswith("the run trains on the other 32 rows; to keep it, raise data.max_length to")
    started = next(e for e in events if e["type"] == "run_started")
    assert (started["data"]["train"]["rows"], started["data"]["train"]["dropped"]) == (32, 1)


def test_an_unreachable_hub_fails_at_once_for_a_model_not_cached(tmp_path, small_data, monkeypatch):
    from studio.train.model import build as model

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(model, "_hub_reachable", lambda: False)
    code, run_dir = run(quick_config(small_data, model={"name_or_path": "someone/not-cached"}), tmp_path / "run",
                        watch_stdin=False)
    error = next(e for e in read_events(run_dir.events) if e["type"] == "error")
    assert code == EXIT_FAILED and error["kind"] == "model"
    assert "cannot reach the Hugging Face Hub" in error["message"] and "local model folder" in error["hint"]
