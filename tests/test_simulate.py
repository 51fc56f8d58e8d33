"""Measuring and simulating the worker's training step (studio.train.memtrack, studio.train.simulate)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from model_factory import make_tiny_model  # noqa: E402
from studio.core.config import RunConfig, save_config  # noqa: E402
from studio.core.estimate import estimate  # noqa: E402
from studio.train.memtrack import LiveTensorTracker  # noqa: E402


def test_tracker_counts_live_storages_once():
    with LiveTensorTracker() as tracker:
        a = torch.ones(1000)  # 4000 bytes
        view = a[10:20]
        b = a * 2
        assert tracker.live_bytes == 8000
        del b
        assert tracker.live_bytes == 4000
        with tracker.phase("step"):
            c = torch.zeros(500, dtype=torch.float64)
    assert tracker.report.peak_bytes == 8000 and tracker.report.peak_phase == "setup"
    assert tracker.report.phase_peaks["step"] == 8000
    del view, c


def test_tracker_counts_existing_weights():
    model = torch.nn.Linear(10, 10)
    with LiveTensorTracker() as tracker:
        tracker.add_module(model)
        model(torch.ones(2, 10)).sum().backward()
    assert tracker.report.peak_bytes >= (100 + 10) * 4 * 2  # weights and their gradients


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"), vocab_size=2048)


@pytest.mark.slow
@pytest.mark.parametrize("method, checkpointing", [("lora", False), ("qlora", True)])
def test_simulation_matches_the_measured_step_and_the_estimate(tiny_llama, method, checkpointing):
    from studio.train.simulate import measure_step, simulate_step

    config = RunConfig(method=method).replace(
        model={"name_or_path": str(tiny_llama)}, data={"max_length": 64},
        training={"micro_batch_size": 2, "gradient_checkpointing": checkpointing})
    measured = measure_step(config, torch.device("cpu"))
    simulated = simulate_step(config)
    analytic = estimate(json.loads((tiny_llama / "config.json").read_text()), config, device_type="cpu")
    assert simulated.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.01)
    assert analytic.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.05)


@pytest.mark.slow
def test_simulation_runs_in_a_child_process(tiny_llama, tmp_path):
    from studio.cli_memory import simulate_in_subprocess

    path = tmp_path / "run.yaml"
    save_config(RunConfig().replace(model={"name_or_path": str(tiny_llama)}, data={"max_length": 32},
                                    training={"micro_batch_size": 1}), path)
    result = simulate_in_subprocess(path)
    assert result["peak_bytes"] > 0 and result["peak_phase"]
