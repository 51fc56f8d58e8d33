"""LoRA's all-linear default finds the right layers in every supported architecture family, trains (the loss
falls), and exports: the adapter and the merged model both pass the export's verification."""

import pytest

from helpers import losses, quick_config, with_demo_tokenizer
from model_factory import make_tiny_model
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.train.export.hf_format import export_run
from studio.train.worker import run

EXPECTED_TARGETS = {
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "mistral": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gpt2": {"c_attn", "c_proj", "c_fc"},  # Conv1D layers, not nn.Linear
    "gpt_neox": {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"},
    "phi": {"q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"},
    "qwen3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "smollm3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "granite": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "olmo2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma3_text": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "gemma3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},  # not the vision tower's
    # the router and the experts are parameters (peft's ParamWrapper)
    "qwen3_moe": {"q_proj", "k_proj", "v_proj", "o_proj", "gate", "experts.gate_up_proj", "experts.down_proj"},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(EXPECTED_TARGETS))
def test_all_linear_targets_and_training(tmp_path, story_data, family):
    folder = with_demo_tokenizer(make_tiny_model(family, tmp_path / family, vocab_size=1200))
    config = quick_config(story_data, model={"name_or_path": str(folder)}, data={"format": "text"},
                          training={"max_steps": 8, "learning_rate": 1e-2})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
    assert set(events[0]["adapted_modules"]) == EXPECTED_TARGETS[family]
    assert not [e for e in events if e["type"] == "warning" and "pads" in e["message"]]  # it packed
    curve = losses(run_dir)
    assert curve[-1] < curve[0], curve
    for kind in ("adapter", "merged"):
        _, verification = export_run(run_dir.path, kind, tmp_path / kind, dtype="float32")
        assert verification.passed, (kind, verification)
