"""What a preference step costs, before the run: two sequences per pair in one forward, the per-token
log-probabilities a chunk at a time, and the reference: the base with the adapter off (nothing more), a frozen
copy of the weights (full fine-tuning), or log-probabilities computed once (nothing more). Measured here on the
CPU against the estimate, as the worker's own step runs (studio.train.measure.simulate.measure_step)."""

from __future__ import annotations

import json

import pytest
import torch

from model_factory import make_tiny_model
from studio.core.config import RunConfig
from studio.core.memory.estimate import estimate
from studio.core.memory.parts.states import weight_bytes
from studio.core.memory.regime import regime_for
from studio.core.model.info import model_shape


def _config(folder, objective="dpo", method="lora", **sections) -> RunConfig:
    return RunConfig(method=method, objective=objective).replace(
        model={"name_or_path": str(folder)}, data={"max_length": 96},
        training={"micro_batch_size": 2, "precision": "bf16" if method != "full" else "fp32"}).replace(**sections)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama") / "model", vocab_size=2048)


@pytest.mark.slow
@pytest.mark.parametrize("objective, method, reference", [
    ("dpo", "lora", "each_step"), ("dpo", "full", "each_step"), ("dpo", "full", "precomputed"),
    ("orpo", "qlora", "each_step"), ("simpo", "lora", "each_step"), ("kto", "lora", "each_step"),
    ("kto", "full", "each_step")])
def test_the_estimate_of_a_preference_step_is_its_measured_peak(llama, objective, method, reference):
    from studio.train.measure.simulate import measure_step

    config = _config(llama, objective, method, preference={"reference": reference})
    measured = measure_step(config, torch.device("cpu")).peak_bytes
    predicted = estimate(json.loads((llama / "config.json").read_text()), config, device_type="cpu").peak_bytes
    assert predicted == pytest.approx(measured, rel=0.01)


def test_a_pair_costs_two_sequences_and_a_frozen_reference_its_weights_which_precomputing_saves(llama):
    model_config = json.loads((llama / "config.json").read_text())
    sft = estimate(model_config, _config(llama, "sft"), device_type="cpu")
    dpo = estimate(model_config, _config(llama), device_type="cpu")
    assert dpo.tokens_per_micro_batch == 2 * sft.tokens_per_micro_batch and dpo.peak_bytes > sft.peak_bytes
    assert "base with the adapter off: no second copy" in dpo.notes[-1]
    frozen = _config(llama, method="full")
    copy = weight_bytes(model_shape(model_config), regime_for(frozen, model_shape(model_config), "cpu"))
    each_step = estimate(model_config, frozen, device_type="cpu")
    precomputed = estimate(model_config, frozen.replace(preference={"reference": "precomputed"}), device_type="cpu")
    assert each_step.parts["weights"] - precomputed.parts["weights"] == copy
    assert "frozen copy of the weights" in each_step.notes[-1] and "computed once" in precomputed.notes[-1]
