"""Layer split on the CPU: blocks beyond the device's limit are offloaded through accelerate's hooks and still train."""

import pytest
import torch

from helpers import losses, quick_config
from studio.core.memory.parts.states import block_weight_bytes, outer_weight_bytes
from studio.core.memory.regime import regime_for
from studio.core.model.info import load_model_config, model_shape
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.core.sizes import GIB
from studio.train.export.hf_format import export_run
from studio.train.model.build import build_model, load_base_model
from studio.train.worker import run

pytestmark = pytest.mark.slow


SPLIT_THRESHOLD = 0.7  # the last loss over the first; benchmarks/loss_margins.py shows the room across seeds


def split_config(data):
    """The tiny model's embeddings and two of its four blocks fit the compute device; two are offloaded."""
    config = quick_config(data, data={"format": "text"}, training={"max_steps": 10})
    shape = model_shape(load_model_config(config.model.name_or_path))
    regime = regime_for(config, shape, "cpu")
    limit = sum(outer_weight_bytes(shape, regime).values()) + 2.5 * block_weight_bytes(shape, regime)
    return config.replace(distributed={"layer_split": True, "max_gpu_memory_gib": limit / GIB, "max_cpu_memory_gib": 1.0})


def test_offloaded_blocks_are_fetched_per_forward_and_give_the_same_logits(story_data):
    config = split_config(story_data)
    cpu = torch.device("cpu")
    plain = load_base_model(config.replace(distributed={"layer_split": False}), cpu).eval()
    model = build_model(config, cpu).eval()
    offloaded = model.base_model.model.model.layers[3].self_attn.q_proj
    assert offloaded.base_layer.weight.device.type == "meta" and offloaded.base_layer._hf_hook.offload
    assert offloaded.lora_A["default"].weight.device.type == "cpu" and offloaded.lora_A["default"].weight.requires_grad
    assert model.base_model.model.model.layers[1].self_attn.q_proj.base_layer.weight.device.type == "cpu"
    ids = torch.tensor([[1, 5, 9, 14, 20, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)  # LoRA B starts at 0
    assert offloaded.base_layer.weight.device.type == "meta"  # dropped again after the forward


def test_a_lora_run_with_offloaded_blocks_learns_and_exports(tmp_path, story_data):
    code, run_dir = run(split_config(story_data), tmp_path / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    assert code == EXIT_OK, [e for e in events if e["type"] == "error"]
    placement = next(e for e in events if e["type"] == "run_started")["placement"]
    assert placement["layers"] == {"cpu": [0, 1], "offload": [2, 3]}, placement
    estimate = next(e for e in events if e["type"] == "estimate")
    assert [d["device"] for d in estimate["devices"]] == ["cpu", "host"]
    curve = losses(run_dir)
    assert curve[-1] < SPLIT_THRESHOLD * curve[0]
    _, verification = export_run(run_dir.path, "adapter")
    assert verification.passed and verification.max_abs_diff < 1e-3
