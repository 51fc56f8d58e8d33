"""Faults injected on purpose: a killed worker, a killed window, a full disk, memory running out."""

import sys
from types import SimpleNamespace
from pathlib import Path

import pytest
import torch

from helpers import quick_config
from studio.core.events import read_events
from studio.train.oom import SIMULATE_ENV, MemoryCap, consistent_after, overflowed_part
from studio.train.worker import EXIT_FAILED, EXIT_OK, run, token_loss_sum

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kill_resume import kill_config, kill_loop  # noqa: E402


@pytest.mark.slow
def test_a_worker_killed_at_random_points_resumes_to_the_same_losses(tmp_path, small_data):
    report = kill_loop(kill_config(small_data, steps=16), tmp_path, kills=2, seed=3)
    assert report.kills == 2 and len(report.resumes) == 2
    assert report.missing_steps == [] and report.torn_left_at_end == []
    assert report.max_loss_error <= 1e-4


def _oom_config(small_data):
    # Rows longer than max_length, so every step has the same size and the estimate is exact.
    return quick_config(small_data, training={"max_steps": 3, "micro_batch_size": 16}, data={"max_length": 24})


@pytest.mark.slow
def test_running_out_of_memory_saves_the_last_step_and_suggests_a_fix_that_fits(tmp_path, small_data, monkeypatch):
    config = _oom_config(small_data)
    code, reference = run(config, tmp_path / "fits", watch_stdin=False)
    steady_peak = next(e for e in read_events(reference.events) if e["type"] == "memory_measured")["peak_bytes"]
    # Step 1 runs without the optimizer state; the second step, which holds it, no longer fits.
    monkeypatch.setenv(SIMULATE_ENV, f"{steady_peak - 300 * 1024}B")

    code, run_dir = run(config, tmp_path / "overflows", watch_stdin=False)
    assert code == EXIT_FAILED
    error = next(e for e in read_events(run_dir.events) if e["type"] == "error")
    assert error["kind"] == "oom" and error["part"] in ("the forward pass", "the loss over the logits", "the backward pass")
    assert error["part"] in error["message"] and "step 1 was saved" in error["hint"]
    assert [p.name for p in run_dir.complete_checkpoints()] == ["step-000001"]

    fix = error["fix"]
    assert fix["description"] in error["hint"] and fix["needed_bytes"] <= fix["gpu_bytes"]
    code, fixed = run(config.replace(**fix["changes"]), tmp_path / "fixed", watch_stdin=False)
    assert code == EXIT_OK, "the suggested change must fit the same memory"


def test_the_overflowing_part_is_read_from_where_memory_ran_out():
    def model(input_ids, attention_mask):
        return SimpleNamespace(logits=torch.randn(*input_ids.shape, 500))

    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "labels": torch.zeros(2, 64, dtype=torch.long)}
    batch["attention_mask"] = torch.ones_like(batch["input_ids"])
    with pytest.raises(torch.OutOfMemoryError) as caught, MemoryCap(256 * 1024, "cpu"):
        token_loss_sum(model, batch)
    assert overflowed_part(caught.value) == "the loss over the logits"
    assert consistent_after("the backward pass") and not consistent_after("the optimizer step")
