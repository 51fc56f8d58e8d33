"""Faults injected on purpose: a killed worker, a killed window, a full disk, memory running out."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from kill_resume import kill_config, kill_loop  # noqa: E402


@pytest.mark.slow
def test_a_worker_killed_at_random_points_resumes_to_the_same_losses(tmp_path, small_data):
    report = kill_loop(kill_config(small_data, steps=16), tmp_path, kills=2, seed=3)
    assert report.kills == 2 and len(report.resumes) == 2
    assert report.missing_steps == [] and report.torn_left_at_end == []
    assert report.max_loss_error <= 1e-4
