"""What a training step minimizes, behind one small interface the loop calls (``Objective``).

* ``next_token``: supervised fine-tuning, the summed next-token cross-entropy over the target tokens, with the
  full logits or chunked (the lean loss); and the target tokens' log-probabilities, chunked too.
* ``preference``: learning from preference pairs (DPO, ORPO, SimPO), a pair's two sequences in one forward, with
  TRL's losses and metrics.
* ``unpaired``: learning from completions labelled desirable or undesirable (KTO), with TRL's loss and metrics.
* ``grpo``: learning from rewards (GRPO): the clipped loss of sampled completions weighed by their advantage over
  their group, with TRL's loss types and metrics.
* ``rollout``: what GRPO learns from: a group of completions sampled per prompt with the training weights,
  scored by the reward functions, and the group-relative advantages, with the metrics TRL logs of them;
* ``vllm_sampling``: the same groups sampled by vLLM (grpo.generation_backend vllm), on an NVIDIA GPU.

The loop (``studio.train.worker``) takes each micro-batch from ``batch``, divides each ``loss_sum`` by the
``units`` of the whole step (of every rank), so that gradient accumulation and several processes equal one
bigger batch, and reports the mean as the step's loss; evaluation does the same over held-out rows. What an
objective logs beside its loss (``metrics``) is made of sums it keeps over the micro-batches (``metric_sums``),
taken after each step and summed over the ranks.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from studio.core.config import RunConfig
from studio.train.objectives.grpo import Grpo
from studio.train.objectives.next_token import NextToken
from studio.train.objectives.preference import Preference
from studio.train.objectives.unpaired import UnpairedPreference


class Objective(Protocol):
    def batch(self, rows: list[dict[str, Any]], packed: bool) -> dict[str, torch.Tensor]:
        """One micro-batch of tokenized rows: packed end to end (the model attends per example), or padded."""

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        """What the step's loss is a mean over, in this micro-batch (target tokens, for next-token loss)."""

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss of this micro-batch, summed over its units, in fp32."""

    metric_sums: tuple[str, ...]
    """The sums the objective's metrics are made of, kept over micro-batches (summed over the ranks in this order)."""

    def take_metric_sums(self) -> dict[str, float]:
        """Each of ``metric_sums`` over the micro-batches since the last call."""

    def metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        """What the objective logs beside the loss (TRL's names), from the sums of a step or an evaluation and its
        units."""


def objective_for(config: RunConfig, model, pad_token_id: int, frozen_copy=None) -> Objective:
    """The run's objective, for its unwrapped model (``frozen_copy``: the reference of full fine-tuning)."""
    if config.objective == "grpo":
        return Grpo.for_run(config, model, pad_token_id, frozen_copy)
    if config.objective == "kto":
        return UnpairedPreference.for_run(config, model, pad_token_id, frozen_copy)
    if config.learns_preferences:
        return Preference.for_run(config, model, pad_token_id, frozen_copy)
    return NextToken.for_run(config, model, pad_token_id)
