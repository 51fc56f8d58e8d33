"""Reinforcement learning with verifiable rewards: GRPO, as TRL 1.16's GRPOTrainer computes its loss.

The loop samples ``group_size`` completions of each prompt and scores them (``studio.core.rewards``);
``group_advantages`` turns each completion's reward into its advantage over its group (TRL's default
``scale_rewards="group"``: minus the group's mean, over its standard deviation). Each row this objective is given is
one completion: its prompt's and its own token ids, its advantage, and when the loop has them the sampling model's
per-token log-probabilities (``old_logps``: needed when ``num_iterations`` is above 1; without them the current
ones, detached, as TRL) and the reference's (``ref_logps``; without them the reference runs here, as DPO's).

Per completion token, with ``ratio = exp(logp - old_logp)`` and advantage ``A``:
``-min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)``, plus with ``beta`` the KL estimate to the
reference (k3: ``exp(ref - logp) - (ref - logp) - 1``), times the ratio (TRL's ``use_bias_correction_kl``).
The log-probabilities are those of the logits divided by the sampling temperature, as TRL's.

The loss types differ in what the step's loss is a mean over, which is this objective's ``units``: grpo, the
completions (each completion's own token mean summed); dr_grpo, the completions too (the token sum over
max_completion_length); dapo, the completion tokens (their sum). The loop's division by the step's units of every
rank then equals TRL's loss with gradient accumulation and several processes, one generation batch per step.
"""

from __future__ import annotations

from typing import Any

import torch

from studio.core.config import RunConfig
from studio.train.data.packing import pack
from studio.train.data.prepare import IGNORE_INDEX, as_token_list, collate
from studio.train.objectives.next_token import run_output_layer, token_logps
from studio.train.objectives.preference import MetricTally, reference_for

STD_FLOOR = 1e-4  # TRL's: a group whose rewards are all equal gets advantages of 0, not a division by 0
METRIC_SUMS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "tokens")
"""What GRPO keeps over a step: the KL estimate, the entropy of each token's distribution (at the sampling
temperature), and how many tokens the clip held below, above and either way, summed over the completion tokens
(TRL's means of them), and the tokens."""


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each completion's advantage over its group (consecutive ``group_size`` completions of one prompt), as TRL's
    ``sum_then_normalize`` with ``scale_rewards="group"``: ``(reward - group mean) / (group std + 1e-4)``, the std
    with Bessel's correction. A completion no reward scored (NaN) counts in neither and gets an advantage of 0."""
    grouped = rewards.view(-1, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    variance = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1)
    std = torch.where(count > 1, variance.sqrt(), torch.full_like(variance, float("nan")))
    return torch.nan_to_num((grouped - mean) / (std + STD_FLOOR), nan=0.0).view(-1)


class Grpo:
    """GRPO's clipped loss on sampled completions, summed over the units of its loss type; TRL's metrics kept until
    taken."""

    metric_sums = METRIC_SUMS

    def __init__(self, config: RunConfig, output_layer: torch.nn.Module | None, pad_token_id: int, reference=None):
        self.settings, self.output_layer, self.pad_token_id = config.grpo, output_layer, pad_token_id
        self.reference = reference
        self._sums = MetricTally()

    @classmethod
    def for_run(cls, config: RunConfig, model, pad_token_id: int, frozen_copy=None) -> "Grpo":
        """The run's objective on its (unwrapped) model; its reference (beta above 0) as DPO's."""
        layer = run_output_layer(config, model)
        return cls(config, layer, pad_token_id, reference_for(config, model, layer, frozen_copy))

    # ------------------------------------------------------------------ the interface the loop calls
    def batch(self, rows: list[dict[str, Any]], packed: bool) -> dict[str, torch.Tensor]:
        """Each completion after its prompt, packed or padded (the completion's tokens are the targets), with its
        advantage, its tokens' completion (``completion_of``) and the log-probabilities the rows carry."""
        if self.settings.num_iterations > 1 and "old_logps" not in rows[0]:
            # the current log-probabilities would stand in for the sampling model's: a ratio of 1, never clipped
            raise ValueError("grpo.num_iterations above 1 needs the sampling model's old_logps in each row")
        return self._layout(rows, packed)

    def _layout(self, rows: list[dict[str, Any]], packed: bool) -> dict[str, torch.Tensor]:
        sequences = [completion_sequence(row) for row in rows]
        batch = pack(sequences) if packed else collate(sequences, self.pad_token_id)
        lengths = torch.tensor([len(as_token_list(row["completion_ids"])) for row in rows])
        batch["advantages"] = torch.tensor([float(row["advantage"]) for row in rows])
        batch["completion_of"] = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        for column in ("old_logps", "ref_logps"):
            if column in rows[0]:
                batch[column] = torch.tensor([x for row in rows for x in row[column]], dtype=torch.float32)
        return batch

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return len(batch["completion_of"]) if self.settings.loss_type == "dapo" else len(batch["advantages"])

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        settings, completion_of = self.settings, batch["completion_of"]
        reference = self._reference_logps(model, batch) if settings.beta else None
        entropies: list[torch.Tensor] = []  # from the logits the log-probabilities are taken of
        logps = token_logps(model, batch, self.output_layer, settings.temperature, entropies)
        old = batch.get("old_logps", logps.detach())
        advantages = batch["advantages"].to(logps.device)[completion_of]
        ratio = torch.exp(logps - old)
        clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.epsilon_high)
        losses = -torch.min(ratio * advantages, clipped * advantages)
        kl = None
        if reference is not None:
            kl = (torch.exp(reference - logps) - (reference - logps) - 1) * ratio
            losses = losses + settings.beta * kl
        self._tally(ratio.detach(), advantages, torch.cat(entropies), None if kl is None else kl.detach())
        return self._reduce(losses, completion_of, len(batch["advantages"]))

    def take_metric_sums(self) -> dict[str, float]:
        return self._sums.take()

    def metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        """TRL's: the KL estimate (beta above 0), the entropy and the clipped tokens' shares, means over the
        completion tokens."""
        tokens = max(sums.get("tokens", 0.0), 1.0)
        names = METRIC_SUMS[1:-1] + (("kl",) if self.settings.beta else ())
        return {name: sums.get(name, 0.0) / tokens for name in names}

    def reference_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reference's log-probabilities of the completion tokens, at the sampling temperature (no gradients)."""
        with torch.no_grad(), self.reference(model) as (reference, output_layer):
            return token_logps(reference, batch, output_layer, self.settings.temperature)

    @torch.no_grad()
    def sampling_logps(self, model, rows: list[dict[str, Any]], device: torch.device) -> list[list[float]]:
        """Each completion's per-token log-probabilities under ``model`` as it sampled them (``old_logps``: the
        clipped ratio's denominator over the generation batch's several iterations)."""
        batch = {k: v.to(device) for k, v in self._layout(rows, packed=False).items()}
        logps = token_logps(model, batch, self.output_layer, self.settings.temperature).float().cpu()
        return [part.tolist() for part in logps.split(torch.bincount(batch["completion_of"].cpu()).tolist())]

    # ------------------------------------------------------------------ parts
    def _reference_logps(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["ref_logps"] if "ref_logps" in batch else self.reference_logps(model, batch)

    def _reduce(self, losses: torch.Tensor, completion_of: torch.Tensor, completions: int) -> torch.Tensor:
        """The per-token losses summed over the loss type's units (see the module docstring)."""
        loss_type = self.settings.loss_type
        if loss_type == "dapo":
            return losses.sum()
        if loss_type == "dr_grpo":
            return losses.sum() / self.settings.max_completion_length
        per_completion = losses.new_zeros(completions).index_add(0, completion_of.to(losses.device), losses)
        lengths = torch.bincount(completion_of, minlength=completions).clamp(min=1).to(losses.device)
        return (per_completion / lengths).sum()

    def _tally(self, ratio: torch.Tensor, advantages: torch.Tensor, entropies: torch.Tensor,
               kl: torch.Tensor | None) -> None:
        low = (ratio < 1 - self.settings.epsilon) & (advantages < 0)
        high = (ratio > 1 + self.settings.epsilon_high) & (advantages > 0)
        self._sums["clip_ratio/low_mean"] += float(low.sum())
        self._sums["clip_ratio/high_mean"] += float(high.sum())
        self._sums["clip_ratio/region_mean"] += float((low | high).sum())
        self._sums["entropy"] += float(entropies.sum())
        self._sums["tokens"] += len(ratio)
        if kl is not None:
            self._sums["kl"] += float(kl.sum())


def completion_sequence(row: dict[str, Any]) -> dict[str, list[int]]:
    """A completion after its prompt, its own tokens the only targets."""
    prompt, completion = as_token_list(row["prompt_ids"]), as_token_list(row["completion_ids"])
    return {"input_ids": prompt + completion, "labels": [IGNORE_INDEX] * len(prompt) + completion}
