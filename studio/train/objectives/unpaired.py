"""Learning from unpaired preferences: KTO, as TRL's KTOTrainer computes it (loss_type kto).

Each row is one completion after its prompt, labelled desirable or not. A row's loss compares its completion's
log-ratio to the reference (summed log-probabilities, model minus reference) with the KL estimate ``kl``: a
desirable row's is ``desirable_weight * (1 - sigmoid(beta * (ratio - kl)))``, an undesirable row's
``undesirable_weight * (1 - sigmoid(beta * (kl - ratio)))``. ``kl`` is the micro-batch's mean log-ratio over its
mismatched sequences (each row's prompt with another row's completion, ``kl_completion_ids``: see
``studio.train.data.prepare``), detached and clamped at 0, as TRL's (with several processes TRL also averages it over
them; here each process keeps its own).

The unit of the step's mean is the row, so one micro-batch gives TRL's loss (the mean of the weighted row losses).
The completions are one forward with gradients (packed or padded, the response tokens' log-probabilities chunked as
``next_token.token_logps`` takes them); the mismatched sequences one more without, and the reference (the same
options as DPO's, ``preference.reference_for``) one of each, or its log-probabilities precomputed into the rows.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from studio.core.config import RunConfig
from studio.train.data.packing import pack
from studio.train.data.prepare import IGNORE_INDEX, as_token_list, collate
from studio.train.objectives.next_token import run_output_layer, token_logps
from studio.train.objectives.preference import MetricTally, SequenceLogps, reference_columns, reference_for

METRIC_SUMS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl", "count/chosen",
               "count/rejected")
"""What KTO keeps over a step: its rewards and log-probabilities summed over the desirable (chosen) and undesirable
(rejected) rows, the KL estimate over all rows, and the rows of each label."""

KL_PREFIX = "kl_"  # the batch's mismatched sequences: kl_input_ids, kl_labels, ...


class UnpairedPreference:
    """KTO: per-row losses summed, and TRL's metrics (means over the rows of each label) kept until taken."""

    metric_sums = METRIC_SUMS
    reference_columns = ("ref_logps", "ref_KL_logps")

    def __init__(self, config: RunConfig, output_layer: torch.nn.Module | None, pad_token_id: int,
                 reference: Callable[[Any], Any]):
        self.settings, self.output_layer, self.pad_token_id = config.preference, output_layer, pad_token_id
        self.reference, self.max_length = reference, config.data.max_length
        self._sums = MetricTally()

    @classmethod
    def for_run(cls, config: RunConfig, model, pad_token_id: int, frozen_copy=None) -> "UnpairedPreference":
        """The run's objective on its (unwrapped) model; its reference as DPO's (``Preference.for_run``)."""
        layer = run_output_layer(config, model)
        return cls(config, layer, pad_token_id, reference_for(config, model, layer, frozen_copy))

    # ------------------------------------------------------------------ the interface the loop calls
    def batch(self, rows: list[dict[str, Any]], packed: bool) -> dict[str, torch.Tensor]:
        """The completions, and under ``kl_`` the mismatched sequences, packed or padded, with each row's label."""
        lay_out = pack if packed else lambda features: collate(features, self.pad_token_id)
        batch = lay_out([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
        mismatched = lay_out([mismatched_sequence(r, self.max_length) for r in rows])
        batch.update({KL_PREFIX + name: value for name, value in mismatched.items()})
        batch["label"] = torch.tensor([bool(r["label"]) for r in rows])
        return {**batch, **reference_columns(rows, self.reference_columns)}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return len(batch["label"])

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        desirable = batch["label"]
        # the forwards without gradients first: they then never stand beside the activations the model saves
        with torch.no_grad():
            mismatched = self._logps(model, kl_sequences(batch), self.output_layer)
        reference, reference_mismatched = self._reference_logps(model, batch)
        logps = SequenceLogps(token_logps(model, batch, self.output_layer), batch, len(desirable)).responses(False)
        kl = (mismatched - reference_mismatched).mean().clamp(min=0)
        ratios = logps - reference
        beta, settings = self.settings.beta, self.settings
        losses = torch.where(desirable, settings.desirable_weight * (1 - torch.sigmoid(beta * (ratios - kl))),
                             settings.undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratios))))
        self._tally(desirable, logps.detach(), beta * ratios.detach(), float(kl))
        return losses.sum()

    def take_metric_sums(self) -> dict[str, float]:
        return self._sums.take()

    def metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        """TRL's: each label's rewards and log-probabilities a mean over its rows (none: not logged), the margin
        between the two means, the KL estimate a mean over the rows."""
        found = {"kl": sums.get("kl", 0.0) / max(units, 1)}
        for side in ("chosen", "rejected"):
            if count := sums.get(f"count/{side}", 0):
                found.update({f"{what}/{side}": sums[f"{what}/{side}"] / count for what in ("rewards", "logps")})
        if "rewards/chosen" in found and "rewards/rejected" in found:
            found["rewards/margins"] = found["rewards/chosen"] - found["rewards/rejected"]
        return found

    def reference_logps(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed log-probabilities of the batch's completions and mismatched ones (no gradients)."""
        with torch.no_grad(), self.reference(model) as (reference, output_layer):
            return self._logps(reference, batch, output_layer), self._logps(reference, kl_sequences(batch),
                                                                            output_layer)

    # ------------------------------------------------------------------ parts
    def _logps(self, model, batch: dict[str, torch.Tensor], output_layer) -> torch.Tensor:
        rows = batch["label"].shape[0]
        return SequenceLogps(token_logps(model, batch, output_layer), batch, rows).responses(average=False)

    def _reference_logps(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.reference_columns[0] in batch:
            return batch[self.reference_columns[0]], batch[self.reference_columns[1]]
        return self.reference_logps(model, batch)

    def _tally(self, desirable: torch.Tensor, logps: torch.Tensor, rewards: torch.Tensor, kl: float) -> None:
        for side, rows in (("chosen", desirable), ("rejected", ~desirable)):
            self._sums[f"rewards/{side}"] += float(rewards[rows].sum())
            self._sums[f"logps/{side}"] += float(logps[rows].sum())
            self._sums[f"count/{side}"] += int(rows.sum())
        self._sums["kl"] += kl * len(desirable)


def mismatched_sequence(row: dict[str, Any], max_length: int) -> dict[str, list[int]]:
    """The row's prompt followed by its mismatched completion, cut to ``max_length`` keeping the start, as TRL's
    collator cuts it."""
    labels = as_token_list(row["labels"])
    prompt = as_token_list(row["input_ids"])[:next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)]
    completion = as_token_list(row["kl_completion_ids"])
    ids = (prompt + completion)[:max_length]
    return {"input_ids": ids, "labels": ([IGNORE_INDEX] * len(prompt) + completion)[:max_length]}


def kl_sequences(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's mismatched sequences as a batch of their own (with the rows' labels, for their count)."""
    sequences = {name[len(KL_PREFIX):]: value for name, value in batch.items() if name.startswith(KL_PREFIX)}
    return {**sequences, "label": batch["label"]}
