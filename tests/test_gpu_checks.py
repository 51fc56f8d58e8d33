"""The prepared GPU checks stay runnable: every config they train is one the worker accepts."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from gpu_checks import check_config, checks, offload_comparison, offload_markdown  # noqa: E402
from studio.core.validation import validate  # noqa: E402


@pytest.mark.parametrize("name, sections", checks(gpus=2).items())
def test_every_gpu_check_is_a_valid_run_config(name, sections):
    assert validate(check_config(sections)) == []


def test_the_offload_comparison_runs_on_the_cpu(tmp_path):
    """The GPU's offload rows, on a small model on the CPU: the offload saves device memory as predicted, and
    the host RAM it takes is what the estimate says."""
    import torch

    small = {"num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2}
    plain, offloaded = offload_comparison(torch.device("cpu"), tmp_path / "model", small, length=256, steps=1)
    assert offloaded["measured_mib"] < plain["measured_mib"]
    assert plain["host_predicted_mib"] == 0 and offloaded["host_measured_mib"] == offloaded["host_predicted_mib"] > 0
    assert "step time x" in offload_markdown([plain, offloaded])
