"""The estimate of a model no family describes: traced from its own code, scaled in pure Python, checked
against real training steps; and the CLI that traces on demand."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from model_factory import make_tiny_model, tiny_config

from studio.core.config import RunConfig, save_config
from studio.core.memory.derived import (DERIVED, MOMENTS, TRACE_DEPTHS, TRACE_VERSION, Trace, TraceNeededError,
                                        derived_estimate, fit_sizes, neighbour_configs, regime_axes, regime_id,
                                        scale_points, trace_key, trace_points, value_at)
from studio.core.memory.estimate import estimate
from studio.core.memory.parts import OVERHEAD_PARTS
from studio.core.memory.sharding import ScaleOut
from studio.core.model.info import UnknownArchitectureError, model_shape


@pytest.fixture(autouse=True)
def trace_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_TRACE_CACHE", str(tmp_path / "traces"))
    return tmp_path / "traces"


def run(**sections) -> RunConfig:
    return RunConfig().replace(**sections)


def test_the_size_fit_recovers_every_term():
    coefficients = [1000.0, 24.0, 3.0, 512.0, 2.0]
    points = scale_points(128)
    fitted = fit_sizes(points, [value_at(coefficients, *point) for point in points])
    assert fitted == pytest.approx(coefficients, rel=1e-9)
    assert value_at(fitted, 7, 3000) == pytest.approx(value_at(coefficients, 7, 3000), rel=1e-9)
    without_scores = fit_sizes(points, [value_at(coefficients[:4], *point) for point in points], scores=False)
    assert without_scores == pytest.approx(coefficients[:4], rel=1e-6)  # least squares: five points, four terms


def test_trace_points_keep_the_chunked_loss_on_one_side_of_a_chunk():
    small_vocab = trace_points(512, chunked=True)  # a chunk holds 32k tokens: every point stays inside one
    assert max(b * s for b, s in small_vocab) < 32768
    big_vocab = trace_points(151936, chunked=True)  # 110 tokens a chunk: every point spans whole chunks
    assert min(b * s for b, s in big_vocab) >= 110
    assert len(small_vocab) == len(big_vocab) == 10


def test_a_model_no_family_describes_asks_for_its_trace_instead_of_refusing():
    with pytest.raises(UnknownArchitectureError):
        model_shape(tiny_config("stablelm"))
    with pytest.raises(TraceNeededError, match="stablelm") as raised:
        estimate(tiny_config("stablelm"), run())
    assert "studio estimate" in raised.value.hint


def test_fit_of_an_untraced_model_asks_for_its_trace():
    from studio.core.memory.fit import fit

    with pytest.raises(TraceNeededError, match="stablelm") as raised:
        fit(tiny_config("stablelm"), run(), 8 * 1024**3)
    assert "studio estimate" in raised.value.hint


def test_the_trace_key_follows_what_changes_the_step_and_not_what_the_estimate_scales_or_recounts():
    model = tiny_config("stablelm")
    base = trace_key(model, run())
    scaled = run(training={"micro_batch_size": 7, "optimizer": "adafactor", "gradient_accumulation_steps": 4},
                 data={"max_length": 999}, lora={"alpha": 3.0})
    assert trace_key(model, scaled) == base
    # toggles one trace answers: LoRA recounted from its block record, the others traced as regimes
    for toggled in (run(training={"precision": "fp32"}), run(training={"gradient_checkpointing": True}),
                    run(lora={"r": 32}), run(lora={"dropout": 0.0}), run(lora={"target_modules": ("q_proj",)}),
                    run(quantization={"load_in": "8bit"}), run(method="qlora")):
        assert trace_key(model, toggled) == base
    for changed in (run(method="full"), run(model={"attn_implementation": "eager"}), run(lora={"use_dora": True}),
                    run(quantization={"quant_type": "fp4"}), run(training={"output_layer_on_cpu": True}),
                    run(vision={"train_vision_tower": True}), run(vision={"train_projector": True})):
        assert trace_key(model, changed) != base
    assert trace_key(model, run(vision={"max_pixels": 1024})) == base  # the images are counted apart, not traced
    adalora = run(method="adalora")  # not recounted: its rank is part of the key
    assert trace_key(model, adalora.replace(lora={"r": 32})) != trace_key(model, adalora)
    assert trace_key({**model, "hidden_size": 128}, run()) != base


def test_a_pick_time_trace_covers_each_toggle_one_step_away():
    axes = [regime_axes(config) for config in neighbour_configs(run())]
    assert axes[0] == regime_axes(run())
    assert {a["checkpointing"] for a in axes} == {False, True} and {a["precision"] for a in axes} == {"bf16", "fp32"}
    assert {a["load_in"] for a in axes} == {"none", "4bit", "8bit"}
    # precision and loading one toggle away, each with and without checkpointing: not every combination
    assert len(axes) == 8 and len({regime_id(a) for a in axes}) == 8
    assert axes[1] == {**axes[0], "checkpointing": True}  # the commonest toggle right after the picked settings
    assert {a["load_in"] for a in map(regime_axes, neighbour_configs(run(method="full")))} == {"none"}


def synthetic_regime(per_block: int = 1000, once: int = 50, depth_bytes: int = 4_000) -> dict:
    """A traced regime whose steps follow known formulas: per block ``per_block`` bytes a token, once ``once``
    per token plus 4 KB, in the forward pass."""
    points = trace_points(512, chunked=True)
    depths = {}
    for depth in TRACE_DEPTHS:
        steps = [{moment: (depth * per_block + once) * b * s + 4096 if moment == "forward" else 0
                  for moment in MOMENTS} for b, s in points]
        depths[str(depth)] = {"model_bytes": 10_000 + depth * depth_bytes, "parameters": 2_500 + depth * 1_000,
                              "trainable": [[[8, 16], "fp32"], [[16, 8], "fp32"]] * depth, "steps": steps}
    return {"lora": None, "depths": depths}


def synthetic_trace(layers: int, regimes: dict | None = None) -> Trace:
    """A trace of ``regimes`` ({RunConfig: regime}; by default the default settings' ``synthetic_regime``);
    LoRA's settings are a regime axis (no block record)."""
    regimes = regimes or {run(): synthetic_regime()}
    points = trace_points(512, chunked=True)
    return Trace({"version": TRACE_VERSION, "model_type": "synthetic", "layers": layers, "vocab": 512,
                  "chunked": True, "scores": False, "points": [list(p) for p in points], "lora_recount": False,
                  "records": {}, "regimes": {regime_id(regime_axes(config, lora_axis=True)): regime
                                             for config, regime in regimes.items()}})


def test_a_trace_scales_to_any_depth_batch_length_optimizer_and_zero_stage():
    trace = synthetic_trace(layers=30)
    config = run(training={"micro_batch_size": 3, "optimizer": "adamw"}, data={"max_length": 700})
    result = derived_estimate(trace, config, "cpu")
    parts = result.devices[0].parts
    assert result.peak_phase == "forward" and result.kind == DERIVED
    assert parts["activations"] == 30 * 1000 * 2100 + 3 * 8 * 2100  # the blocks, and the inputs
    assert parts["logits_loss"] == 50 * 2100 + 4096
    assert parts["weights"] + parts["adapter_weights"] == 10_000 + 30 * 4_000
    assert parts["adapter_weights"] == 30 * 2 * 128 * 4 and result.trainable_parameters == 30 * 2 * 128
    assert result.parameters == 2_500 + 30 * 1_000 - 30 * 2 * 128  # the base model's, as described ones count
    assert parts["optimizer_state"] == 30 * 2 * (2 * 128 * 4 + 4)  # Adam: two moments and a step per tensor
    sgd = derived_estimate(trace, config.replace(training={"optimizer": "sgd"}), "cpu").devices[0].parts
    assert sgd["optimizer_state"] == 30 * 2 * 128 * 4
    sharded = derived_estimate(trace, config, "cuda", ScaleOut(num_gpus=4, zero_stage=3))
    assert len(sharded.devices) == 4 and sharded.devices[0].parts["communication"] > 0


def test_a_combination_the_trace_lacks_asks_for_its_trace_rather_than_adding_up_regimes():
    checkpointed, four_bit = run(training={"gradient_checkpointing": True}), run(quantization={"load_in": "4bit"})
    trace = synthetic_trace(10, {run(): synthetic_regime(), checkpointed: synthetic_regime(per_block=100),
                                 four_bit: synthetic_regime(per_block=1100, depth_bytes=1_000)})
    sized = {"data": {"max_length": 100}, "training": {"micro_batch_size": 1}}
    parts = derived_estimate(trace, checkpointed.replace(**sized), "cpu").devices[0].parts
    assert parts["activations"] == 10 * 100 * 100 + 3 * 8 * 100  # the checkpointed regime's own blocks
    both = run(training={"gradient_checkpointing": True}, quantization={"load_in": "4bit"})
    with pytest.raises(TraceNeededError) as raised:  # toggles that change the same tensors do not add up
        derived_estimate(trace, both, "cpu")
    assert raised.value.regime == regime_id(regime_axes(both, lora_axis=True))


# ---------------------------------------------------------------- against real steps

# (traced settings, the sizes estimated: a depth, micro-batch and length none of the traced steps had)
REAL_STEPS = [
    ({"method": "lora", "training": {"precision": "bf16", "optimizer": "adamw"}}, 3, 96),
    ({"method": "full", "training": {"precision": "fp32", "gradient_checkpointing": True, "optimizer": "adamw"},
      "model": {"attn_implementation": "eager"}}, 2, 200),
    ({"method": "lora", "training": {"precision": "fp32", "optimizer": "sgd", "gradient_accumulation_steps": 2},
      "lora": {"r": 4}}, 3, 160),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, step", [("stablelm", 0), *(pytest.param(family, step, marks=pytest.mark.heavy)
                                                             for family, step in (("stablelm", 1), ("stablelm", 2),
                                                                                  ("starcoder2", 0)))])
def test_the_derived_estimate_matches_a_measured_training_step(tmp_path, family, step):
    import torch

    from studio.train.measure.simulate import measure_step
    from studio.train.measure.trace import write_trace

    folder = make_tiny_model(family, tmp_path / family, num_hidden_layers=5)
    model_config = json.loads((folder / "config.json").read_text())
    sections, batch, length = REAL_STEPS[step]
    config = run(model={"name_or_path": str(folder), **sections.get("model", {})},
                 **{k: v for k, v in sections.items() if k != "model"})
    write_trace(config, neighbours=False)
    sized = config.replace(training={"micro_batch_size": batch}, data={"max_length": length})
    started = time.perf_counter()
    derived = estimate(model_config, sized, "cpu")
    assert time.perf_counter() - started < 0.05
    assert derived.kind == DERIVED
    measured = measure_step(sized, torch.device("cpu"))
    assert derived.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.03), (sections, measured)
    assert derived.trainable_parameters == sum(p.numel() for p in _trainable(sized))


def _trainable(config):
    import torch

    from studio.train.model.build import build_model

    return [p for p in build_model(config, torch.device("cpu")).parameters() if p.requires_grad]


@pytest.mark.slow
def test_studio_estimate_traces_an_undescribed_model_once_and_says_which_kind_it_is(tmp_path, trace_cache):
    folder = make_tiny_model("stablelm", tmp_path / "model", weights=False)  # config.json is all it needs
    path = tmp_path / "run.yaml"
    save_config(run(model={"name_or_path": str(folder)}, data={"max_length": 64}), path)
    command = [sys.executable, "-m", "studio", "estimate", str(path)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "tracing one training step" in first.stderr
    assert "kind: derived from a traced training step" in first.stdout and "measured" in first.stdout
    assert len(list(trace_cache.glob("stablelm-*.json"))) == 1
    again = subprocess.run(command + ["--json", "--simulate"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)
    assert result["kind"] == DERIVED and "tracing" not in again.stderr
    tensors = result["peak_bytes"] - sum(result["devices"][0]["parts"][k] for k in OVERHEAD_PARTS)
    assert result["simulated"]["peak_bytes"] == pytest.approx(tensors, rel=0.03)


@pytest.mark.slow
@pytest.mark.heavy  # the trace itself: test_studio_estimate_traces_an_undescribed_model_once..., in CI
def test_a_training_run_of_an_undescribed_model_traces_it_and_records_the_estimate(tmp_path, story_data, trace_cache):
    from helpers import quick_config, with_demo_tokenizer

    from studio.core.run.events import read_events
    from studio.train.worker import run as train

    folder = with_demo_tokenizer(make_tiny_model("stablelm", tmp_path / "stablelm", vocab_size=1200))
    config = quick_config(story_data, model={"name_or_path": str(folder)}, data={"format": "text"},
                          training={"max_steps": 3})
    code, run_dir = train(config, tmp_path / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    assert code == 0, [e for e in events if e["type"] == "error"]
    (predicted,) = [e for e in events if e["type"] == "estimate"]
    assert predicted["kind"] == DERIVED and predicted["peak_bytes"] > 0
    assert not [e for e in events if e["type"] == "warning" and "no memory estimate" in e["message"]]
    assert list(trace_cache.glob("stablelm-*.json"))


def test_fit_skips_and_names_the_candidates_a_trace_holds_no_step_for(trace_cache):
    from studio.core.memory.derived import trace_path
    from studio.core.memory.fit import fit

    model = tiny_config("stablelm")
    config = run(training={"micro_batch_size": 4}, data={"max_length": 256})
    path = trace_path(model, config)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(synthetic_trace(2).data), encoding="utf-8")  # the picked settings only
    needed = estimate(model, config, "cuda").peak_bytes
    result = fit(model, config, needed // 2)
    assert result.estimate.kind == DERIVED and result.config.training.micro_batch_size < 4
    assert result.config.training.gradient_checkpointing is False  # its regime was never traced
    assert "Not tried" in result.explanation and '"checkpointing": true' in result.explanation


# ---------------------------------------------------------------- toggles after one trace

# Each a toggle (or two) a user flips after picking the model: none needs a new trace.
TOGGLES = [
    {"lora": {"r": 64}}, {"lora": {"r": 4}}, {"lora": {"target_modules": ("q_proj", "v_proj")}},
    {"lora": {"dropout": 0.0}}, {"training": {"precision": "fp32"}}, {"training": {"gradient_checkpointing": True}},
    {"quantization": {"load_in": "4bit"}}, {"quantization": {"load_in": "8bit"}},
    {"training": {"optimizer": "adamw_8bit", "gradient_accumulation_steps": 4, "micro_batch_size": 1}},
    {"training": {"gradient_checkpointing": True}, "quantization": {"load_in": "4bit"}, "lora": {"r": 8}},
    {"training": {"precision": "fp32", "gradient_checkpointing": True}, "lora": {"dropout": 0.0}},
]


@pytest.fixture(scope="module")
def picked_trace(tmp_path_factory):
    """A tiny StableLM (no family describes it) traced once as when it is picked: (model folder, trace cache)."""
    from studio.train.measure.trace import write_trace

    folder = make_tiny_model("stablelm", tmp_path_factory.mktemp("stablelm"), num_hidden_layers=5, weights=False)
    cache = tmp_path_factory.mktemp("traces")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STUDIO_TRACE_CACHE", str(cache))
        write_trace(run(model={"name_or_path": str(folder)}))
    return folder, cache


def _no_subprocess(*args, **kwargs):
    raise AssertionError("no subprocess may start for a toggle")


@pytest.fixture
def no_new_trace(picked_trace, monkeypatch):
    """The picked trace's cache in use, and no subprocess allowed: (model folder, its config.json, the cache)."""
    folder, cache = picked_trace
    monkeypatch.setenv("STUDIO_TRACE_CACHE", str(cache))
    monkeypatch.setattr(subprocess, "Popen", _no_subprocess)
    return folder, json.loads((folder / "config.json").read_text()), cache


@pytest.mark.slow
@pytest.mark.heavy  # the pick-time trace of 8 regimes: minutes
def test_after_one_trace_each_toggle_estimates_in_milliseconds_with_no_new_trace(no_new_trace):
    folder, model_config, cache = no_new_trace
    traced = {path: path.stat().st_mtime_ns for path in cache.iterdir()}
    picked = run(model={"name_or_path": str(folder)})
    peaks = set()
    for toggles in TOGGLES:
        started = time.perf_counter()
        derived = estimate(model_config, picked.replace(**toggles), "cpu")
        assert time.perf_counter() - started < 0.05, toggles
        assert derived.kind == DERIVED
        peaks.add(derived.peak_bytes)
    assert len(peaks) == len(TOGGLES)  # each toggle moves the estimate
    qlora = estimate(model_config, picked.replace(method="qlora"), "cpu")  # LoRA on a 4-bit base, by its name
    assert qlora.peak_bytes == estimate(model_config, picked.replace(quantization={"load_in": "4bit"}), "cpu").peak_bytes
    assert {path: path.stat().st_mtime_ns for path in cache.iterdir()} == traced


# Toggled settings against a fresh trace of exactly those settings (sizes none of the traces had). Within 3 %:
# the recount leaves out the adapters' few transient bytes in the backward pass, and two toggles at once add
# up each one's traced difference (docs/memory-accuracy.md: the same rows against real steps).
FRESH = [{"lora": {"r": 64, "target_modules": ("q_proj", "v_proj"), "dropout": 0.0}},
         {"training": {"gradient_checkpointing": True}, "quantization": {"load_in": "4bit"}}]


@pytest.mark.slow
@pytest.mark.heavy  # the pick-time trace of 8 regimes: minutes
def test_toggled_estimates_agree_with_a_fresh_trace_of_those_settings(picked_trace, tmp_path, monkeypatch):
    from studio.train.measure.trace import write_trace

    folder, cache = picked_trace
    model_config = json.loads((folder / "config.json").read_text())
    for number, toggles in enumerate(FRESH):
        config = run(model={"name_or_path": str(folder)}, training={"micro_batch_size": 3},
                     data={"max_length": 200}).replace(**toggles)
        monkeypatch.setenv("STUDIO_TRACE_CACHE", str(cache))
        toggled = estimate(model_config, config, "cpu")
        monkeypatch.setenv("STUDIO_TRACE_CACHE", str(tmp_path / str(number)))
        write_trace(config, neighbours=False)
        fresh = estimate(model_config, config, "cpu")
        assert toggled.peak_bytes == pytest.approx(fresh.peak_bytes, rel=0.03), toggles
        assert toggled.trainable_parameters == fresh.trainable_parameters


@pytest.mark.slow
@pytest.mark.heavy  # the pick-time trace of 8 regimes: minutes
def test_fit_searches_a_derived_model_over_the_traced_toggles(no_new_trace):
    from studio.core.memory.fit import fit

    folder, model_config, _ = no_new_trace
    config = run(model={"name_or_path": str(folder)}, training={"micro_batch_size": 8}, data={"max_length": 512})
    needed = estimate(model_config, config, "cpu").peak_bytes  # a tiny model: no CUDA context to outweigh it
    result = fit(model_config, config, int(needed * 0.75), device_type="cpu")
    assert result.fits and result.estimate.kind == DERIVED and result.changes
    assert result.estimate.peak_bytes == estimate(model_config, result.config, "cpu").peak_bytes
    assert "Not tried" not in result.explanation  # checkpointing and 4-bit were traced with the pick
