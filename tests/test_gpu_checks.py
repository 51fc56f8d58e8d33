"""The prepared GPU checks stay runnable: every config they train is one the worker accepts."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from gpu_checks import check_config, checks, offload_comparison, offload_markdown  # noqa: E402
from studio.core.memory.estimate import estimate  # noqa: E402
from studio.core.validation import validate  # noqa: E402


@pytest.mark.parametrize("name, sections", checks(gpus=2).items())
def test_every_gpu_check_is_a_valid_run_config(name, sections):
    assert validate(check_config(sections)) == []


def test_the_frontier_checks_are_valid_run_configs_at_the_lengths_that_fit(tmp_path):
    from gpu_checks import FRONTIER_CARDS_GIB, frontier_checks
    from model_factory import make_tiny_model
    from memory_frontier import LLAMA_31_8B

    folder = make_tiny_model("llama", tmp_path / "model", weights=False)
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B), encoding="utf-8")
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a b c"}\n', encoding="utf-8")
    found = frontier_checks(folder, data)
    assert len(found) == len(FRONTIER_CARDS_GIB)
    for name, sections in found.items():
        config = check_config(sections)
        assert config.method == "qlora" and config.lora.r == 32 and config.training.lean_weights
        assert validate(config, check_files=False) == [], name
        card = int(name.split(", ")[1].split()[0])
        assert estimate(LLAMA_31_8B, config).peak_bytes <= card * 2**30
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
