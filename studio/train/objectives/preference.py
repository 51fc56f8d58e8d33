"""Learning from preference pairs: DPO (sigmoid, IPO, robust, hinge), ORPO and SimPO, as TRL computes them.

A micro-batch of pairs is one forward: the chosen sequences, then the rejected ones, packed end to end (or padded,
as the run's other micro-batches). The model returns no logits: only the response tokens' hidden states meet the
output layer, a chunk at a time (``next_token.token_logps``), and each sequence's log-probability is the sum of its
response tokens' (SimPO and ORPO: their mean, as TRL's CPO and ORPO trainers take it).

The unit of the step's mean is the pair: ``loss_sum`` is the sum of the per-pair losses, and a term TRL computes as
a token mean over the micro-batch (the chosen rows' cross-entropy of ``sft_weight`` and of ORPO) enters as that mean
times the micro-batch's pairs, so that one micro-batch gives TRL's loss exactly (tests compare loss, gradients and
metrics with TRL's trainers) and accumulation weighs micro-batches by their pairs, as TRL's does by their count.

DPO compares the model with its reference: the base with the adapter off for adapter methods (no second copy), a
frozen copy of the starting weights for full fine-tuning, or the reference's log-probabilities computed once before
training (``precomputed``: the rows carry them).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.nn.functional import logsigmoid, relu

from studio.core.config import PreferenceConfig, RunConfig
from studio.train.data.images import IMAGE_COLUMN, REJECTED_IMAGE_COLUMN, SEQUENCE_INPUTS
from studio.train.data.packing import pack
from studio.train.data.prepare import IGNORE_INDEX, collate
from studio.train.objectives.next_token import lean_output_layer, run_output_layer, token_logps

METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected")
"""What each objective logs beside its loss, with TRL's names; each a mean over the step's pairs."""


class Preference:
    """The pairwise objectives: per-pair losses summed, and TRL's metrics summed over the pairs until taken."""

    metric_sums = METRIC_NAMES
    reference_columns = ("ref_chosen_logps", "ref_rejected_logps")

    def __init__(self, config: RunConfig, output_layer: torch.nn.Module | None, pad_token_id: int,
                 reference: Callable[[Any, dict], Any] | None = None):
        self.objective, self.settings = config.objective, config.preference
        self.output_layer, self.pad_token_id = output_layer, pad_token_id
        self.reference = reference  # model -> a context giving (the reference, its lean output layer); None: none
        self._sums = MetricTally()

    @classmethod
    def for_run(cls, config: RunConfig, model, pad_token_id: int, frozen_copy=None) -> "Preference":
        """The run's objective on its (unwrapped) model; DPO's reference: ``frozen_copy`` when given (full
        fine-tuning, each step), else the model with its adapter off, else (precomputed, full fine-tuning) the model
        itself, as it is before the first step."""
        layer = run_output_layer(config, model)
        return cls(config, layer, pad_token_id, reference_for(config, model, layer, frozen_copy))

    # ------------------------------------------------------------------ the interface the loop calls
    def batch(self, rows: list[dict[str, Any]], packed: bool) -> dict[str, torch.Tensor]:
        """The chosen sequences then the rejected ones, packed or padded; ``completion`` marks the response
        targets (ORPO's cross-entropy also learns the chosen prompts, so its labels cover them). A pair's images
        go with both its sequences (padded: rows with images are not packed), as TRL's vision collator repeats
        them."""
        whole_chosen = self.objective == "orpo"
        chosen = [{"input_ids": r["input_ids"], "labels": r["input_ids"] if whole_chosen else r["labels"],
                   **_images_of(r)} for r in rows]
        rejected = [{"input_ids": r["rejected_input_ids"], "labels": r["rejected_labels"],
                     **_images_of(r, REJECTED_IMAGE_COLUMN)} for r in rows]
        responses = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows] + rejected
        lay_out = pack if packed else lambda features: collate(features, self.pad_token_id)
        batch = lay_out(chosen + rejected)
        batch["completion"] = lay_out(responses)["labels"] != IGNORE_INDEX
        batch["pairs"] = torch.tensor(len(rows))
        return {**batch, **reference_columns(rows, self.reference_columns)}

    def units(self, batch: dict[str, torch.Tensor]) -> int:
        return int(batch["pairs"])

    def loss_sum(self, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pairs = int(batch["pairs"])
        # the reference first: its no-grad forward then never stands beside the activations the model saves
        reference_chosen, reference_rejected = self._reference_logps(model, batch) if self.objective == "dpo" \
            else (None, None)
        logps = SequenceLogps(token_logps(model, batch, self.output_layer), batch, 2 * pairs)
        chosen, rejected = self.ranked(logps, pairs)
        if self.objective == "dpo":
            losses, chosen_rewards, rejected_rewards = dpo_losses(
                chosen - reference_chosen, rejected - reference_rejected, logps.response_lengths().split(pairs),
                self.settings)
        elif self.objective == "simpo":
            losses, chosen_rewards, rejected_rewards = simpo_losses(chosen, rejected, self.settings)
        else:
            losses, chosen_rewards, rejected_rewards = orpo_losses(chosen, rejected, self.settings)
        total = losses.sum()
        sft_weight = 1.0 if self.objective == "orpo" else self.settings.sft_weight
        if sft_weight:
            total = total + sft_weight * pairs * logps.cross_entropy(first=pairs)
        self._tally(chosen, rejected, chosen_rewards, rejected_rewards)
        return total

    def ranked(self, logps: "SequenceLogps", pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each chosen and rejected response's log-probability as the objective ranks them: summed (DPO), their
        per-token mean (SimPO and ORPO)."""
        return logps.responses(average=self.objective != "dpo").split(pairs)

    def take_metric_sums(self) -> dict[str, float]:
        return self._sums.take()

    def metrics(self, sums: dict[str, float], units: int) -> dict[str, float]:
        """Each metric a mean over the pairs."""
        return per_unit(sums, units)

    def reference_logps(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """The reference's summed log-probabilities of the batch's chosen and rejected responses (no gradients)."""
        pairs = int(batch["pairs"])
        with torch.no_grad(), self.reference(model) as (reference, output_layer):
            logps = SequenceLogps(token_logps(reference, batch, output_layer), batch, 2 * pairs)
            return logps.responses(average=False).split(pairs)

    # ------------------------------------------------------------------ parts
    def _reference_logps(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if self.reference_columns[0] in batch:
            return tuple(batch[column] for column in self.reference_columns)
        return self.reference_logps(model, batch)

    def _tally(self, chosen, rejected, chosen_rewards, rejected_rewards) -> None:
        values = {"rewards/chosen": chosen_rewards, "rewards/rejected": rejected_rewards,
                  "rewards/accuracies": (chosen_rewards > rejected_rewards).float(),
                  "rewards/margins": chosen_rewards - rejected_rewards, "logps/chosen": chosen, "logps/rejected": rejected}
        for name, value in values.items():
            self._sums[name] += float(value.detach().sum())


def _images_of(row: dict[str, Any], own: str | None = None) -> dict[str, bytes]:
    """A pair's image inputs for one of its sequences (none without images): the pair's, with the per-token ones of
    the ``own`` column (the rejected sequence's) in place of the chosen's."""
    if not row.get(IMAGE_COLUMN):
        return {}
    return {IMAGE_COLUMN: row[IMAGE_COLUMN], **({SEQUENCE_INPUTS: row[own]} if own else {})}


class MetricTally(defaultdict):
    """An objective's metric sums over the micro-batches since they were last taken (the loop takes them per step)."""

    def __init__(self):
        super().__init__(float)

    def take(self) -> dict[str, float]:
        sums = dict(self)
        self.clear()
        return sums


class SequenceLogps:
    """Per-token log-probabilities of a batch's targets, gathered per sequence (a pair batch: chosen ones first);
    the response tokens are those ``completion`` marks (without it: every target)."""

    def __init__(self, logps: torch.Tensor, batch: dict[str, torch.Tensor], sequences: int):
        targets = batch["labels"][:, 1:] != IGNORE_INDEX
        self.logps, self.sequences = logps, sequences
        self.sequence = sequence_ids(batch)[:, 1:][targets]  # the sequence of each target token
        completion = batch.get("completion", batch["labels"] != IGNORE_INDEX)
        self.completion = completion[:, 1:][targets]  # whether it is a response token

    def _per_sequence(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        total = values.new_zeros(self.sequences)
        return total.index_add(0, self.sequence[mask], values[mask])

    def response_lengths(self) -> torch.Tensor:
        return self._per_sequence(torch.ones_like(self.logps), self.completion)

    def responses(self, average: bool) -> torch.Tensor:
        """Each sequence's response log-probability: summed over its tokens, or their mean."""
        sums = self._per_sequence(self.logps, self.completion)
        return sums / self.response_lengths() if average else sums

    def cross_entropy(self, first: int) -> torch.Tensor:
        """The mean cross-entropy over the target tokens of the ``first`` sequences (a pair batch's chosen)."""
        return -self.logps[self.sequence < first].mean()


def per_unit(sums: dict[str, float], units: int) -> dict[str, float]:
    """Metrics that are means over the units: their sums divided by the units."""
    return {name: total / max(units, 1) for name, total in sums.items()}


def reference_columns(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The reference's precomputed log-probabilities the rows carry (``columns``), as batch tensors; none: {}."""
    if columns[0] not in rows[0]:
        return {}
    return {column: torch.tensor([r[column] for r in rows], dtype=torch.float32) for column in columns}


def sequence_ids(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Which sequence each position belongs to: its row when padded; when packed, counted where positions restart."""
    if "position_ids" in batch:
        return torch.cumsum(batch["position_ids"] == 0, dim=1) - 1
    rows = batch["input_ids"].shape[0]
    return torch.arange(rows, device=batch["input_ids"].device)[:, None].expand_as(batch["input_ids"])


# ---------------------------------------------------------------------- the losses, per pair, as TRL's


def dpo_losses(chosen_ratio, rejected_ratio, lengths, settings: PreferenceConfig):
    """DPO's per-pair loss from the log-ratios to the reference (TRL DPOTrainer, f-divergence reverse KL)."""
    beta, smoothing, delta = settings.beta, settings.label_smoothing, chosen_ratio - rejected_ratio
    if settings.dpo_loss == "sigmoid":
        losses = -logsigmoid(beta * delta)
    elif settings.dpo_loss == "hinge":
        losses = relu(1 - beta * delta)
    elif settings.dpo_loss == "ipo":  # on per-token log-ratios, as TRL normalizes it
        chosen_length, rejected_length = (length.clamp(min=1.0) for length in lengths)
        losses = (chosen_ratio / chosen_length - rejected_ratio / rejected_length - 1 / (2 * beta)) ** 2
    else:  # robust
        losses = ((1 - smoothing) * -logsigmoid(beta * delta) - smoothing * -logsigmoid(-beta * delta)) \
            / (1 - 2 * smoothing)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def simpo_losses(chosen, rejected, settings: PreferenceConfig):
    """SimPO's per-pair loss on average log-probabilities (TRL CPOTrainer, loss_type simpo)."""
    beta, smoothing = settings.beta, settings.label_smoothing
    logits = chosen - rejected - settings.simpo_gamma / beta
    losses = -logsigmoid(beta * logits) * (1 - smoothing) - logsigmoid(-beta * logits) * smoothing
    return losses, beta * chosen.detach(), beta * rejected.detach()


def orpo_losses(chosen, rejected, settings: PreferenceConfig):
    """ORPO's odds-ratio term per pair, negated to be minimized (TRL ORPOTrainer); its cross-entropy is added by
    the objective."""
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -settings.beta * logsigmoid(log_odds), settings.beta * chosen.detach(), settings.beta * rejected.detach()


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, stable on both sides of -ln 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


# ---------------------------------------------------------------------- the reference


def reference_for(config: RunConfig, model, output_layer, frozen_copy=None):
    """The reference of an objective that has one (dpo, kto), as a context on the trained model that gives (the
    reference, its lean output layer); None without one. See ``Preference.for_run``."""
    if not config.uses_reference:
        return None
    if frozen_copy is not None:
        return as_model(frozen_copy, lean_output_layer(frozen_copy) if output_layer is not None else None)
    if config.uses_adapter:
        return adapter_off(model, output_layer)
    return as_model(None, output_layer)


def adapter_off(model, output_layer):
    """The reference of an adapter method: the same model with its adapter disabled (the same output layer)."""
    peft_model = getattr(model, "module", model)

    @contextlib.contextmanager
    def reference(trained):
        with peft_model.disable_adapter():
            yield trained, output_layer
    return reference


def as_model(frozen, output_layer):
    """The reference of full fine-tuning: a frozen copy of the starting weights; None: the trained model itself
    (its log-probabilities precomputed before the first step)."""
    return lambda trained: contextlib.nullcontext((trained if frozen is None else frozen, output_layer))
