"""Samples while training: the model answers a few prompts greedily every ``schedule.sample_every`` steps.

The answers before the first step are the base model's; each ``samples`` event (step, seconds, samples:
prompt, reference, answer) lets the window show how every prompt's answer changed over the steps.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from studio.core.config import SAMPLE_NEW_TOKENS, SAMPLED_HELD_OUT_ROWS, RunConfig
from studio.core.data.row_formats import Example
from studio.train.data.prepare import encode_prompt
from studio.train.evaluation.compare import held_out_examples, row_text
from studio.train.evaluation.exact_match import generate_answers
from studio.train.evaluation.generate import prompt_example


def why_no_samples(config: RunConfig) -> tuple[str, str] | None:
    """(message, hint) when a run that asks for samples cannot have them; None when it can."""
    sharding = config.distributed.sharding
    if config.distributed.num_processes > 1 and sharding in ("zero3", "fsdp"):
        return (f"no samples while training: {sharding} shards the weights across the processes, and one process "
                "answers the prompts", "evaluate after training with `studio eval RUN`")
    if not (config.data.sample_prompts or config.data.eval_files or config.data.eval_fraction):
        return ("no samples while training: there are no sample prompts and no held-out rows to take them from",
                "list data.sample_prompts, or hold out rows (data.eval_files or data.eval_fraction)")
    return None


def sample_examples(config: RunConfig) -> list[Example]:
    """The user's sample prompts, else the first held-out rows that ask something (text rows do not) in words alone
    (samples of rows with images are not taken yet: `studio eval` and Try it answer them)."""
    if config.data.sample_prompts:
        return [prompt_example(config, prompt) for prompt in config.data.sample_prompts]
    rows, _ = held_out_examples(config)
    return [row for row in rows if row.kind != "text" and not row.images][:SAMPLED_HELD_OUT_ROWS]


class Sampler:
    """The prompts, tokenized once as training renders them, and the model's answers to them now."""

    def __init__(self, config: RunConfig, tokenizer: Any):
        self.tokenizer = tokenizer
        examples = sample_examples(config)
        self.shown = [row_text(example) for example in examples]
        self.prompts = [encode_prompt(example, tokenizer, config.data.template)[0] for example in examples]
        if config.data.sample_prompts:
            for shown in self.shown:
                shown["reference"] = None  # the user's prompt: no answer to compare with

    @torch.no_grad()
    def samples(self, model: torch.nn.Module) -> dict[str, Any]:
        """{"seconds", "samples": [{"location", "prompt", "reference", "answer"}]} with the weights as they are."""
        started, training = time.perf_counter(), model.training
        model.eval()
        try:
            answers = generate_answers(model, self.tokenizer, self.prompts, SAMPLE_NEW_TOKENS) if self.prompts else []
        finally:
            model.train(training)
        samples = [{**shown, "answer": answer.strip()} for shown, answer in zip(self.shown, answers)]
        return {"seconds": round(time.perf_counter() - started, 3), "samples": samples}
