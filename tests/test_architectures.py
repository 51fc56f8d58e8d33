"""LoRA's all-linear default finds the right layers in every supported architecture family, and trains."""

import pytest

from helpers import quick_config, with_demo_tokenizer
from model_factory import make_tiny_model
from studio.core.commands import EXIT_OK
from studio.core.events import read_events
from studio.train.worker import run

EXPECTED_TARGETS = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "mistral": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},  # Conv1D layers, not nn.Linear
    "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    "phi": {"q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EXPECTED_TARGETS))
def test_all_linear_targets_and_training(tmp_path, story_data, family):
    folder = with_demo_tokenizer(make_tiny_model(family, tmp_path / family, vocab_size=1200))
    config = quick_config(story_data, model={"name_or_path": str(folder)}, data={"format": "text"},
                          training={"max_steps": 2})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
    assert set(events[0]["adapted_modules"]) == EXPECTED_TARGETS[family]
