"""The estimate counts what sampling a GRPO group holds (issue 28): its generation phase equals the worker's
measurement on the CPU within 2 %, prompts of the longest length the run keeps and completions of the longest; a
big group of long completions beside a small micro-batch makes the generation the run's peak."""

import json

import pytest

from studio.core.memory.estimate import estimate
from studio.core.presets import DEMO_MODEL, grpo_demo_config
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.train.objectives.rollout import HfGenerate
from studio.train.worker import run

MODEL_CONFIG = json.loads((DEMO_MODEL / "config.json").read_text())


def _prompts_of(length: int, path):
    """Prompt rows of exactly ``length`` tokens as the worker encodes them (the bos token included)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    words = 1
    while len([tokenizer.bos_token_id, *tokenizer(" ".join(["fruit"] * words), add_special_tokens=False)["input_ids"]]) < length:
        words += 1
    text = " ".join(["fruit"] * words)
    assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1 == length
    path.write_text("".join(json.dumps({"prompt": text, "answer": "fruit"}) + "\n" for _ in range(16)))
    return path


@pytest.mark.parametrize("group,completion", [(8, 24), pytest.param(16, 40, marks=pytest.mark.heavy)])
def test_the_generation_phase_is_estimated_as_measured(tmp_path, monkeypatch, group, completion):
    """Every completion runs to the completion length (the estimate's worst case: an end token is not sampled)."""
    original = HfGenerate.__init__

    def full_length(self, settings, *args):
        original(self, settings, *args)
        self.generation.min_new_tokens = settings.max_completion_length

    monkeypatch.setattr(HfGenerate, "__init__", full_length)
    max_length = 64
    data = _prompts_of(max_length - completion, tmp_path / "long_prompts.jsonl")
    config = grpo_demo_config().replace(
        data={"train_files": (str(data),), "eval_files": (), "max_length": max_length},
        training={"max_steps": 2, "micro_batch_size": group, "gradient_accumulation_steps": 1},
        grpo={"group_size": group, "max_completion_length": completion}, schedule={"eval_every": 0})
    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    measured = next(e for e in read_events(rd.events) if e["type"] == "memory_measured")["phase_bytes"]["generation"]
    estimated = estimate(MODEL_CONFIG, config, device_type="cpu").devices[0].phases["generation"]
    assert abs(estimated / measured - 1) < 0.02


def test_a_big_group_of_long_completions_beside_a_small_micro_batch_is_the_peak():
    config = grpo_demo_config().replace(
        data={"max_length": 2048}, training={"micro_batch_size": 1, "gradient_accumulation_steps": 64,
                                             "gradient_checkpointing": True},
        grpo={"group_size": 64, "max_completion_length": 1536})
    result = estimate(MODEL_CONFIG, config, device_type="cpu")
    assert result.peak_phase == "generation"
    smaller = estimate(MODEL_CONFIG, config.replace(grpo={"group_size": 8}), device_type="cpu")
    assert smaller.devices[0].phases["generation"] < result.devices[0].phases["generation"] / 4
