"""Micro-batches without padding: the examples of a micro-batch end to end in one row.

``pack`` takes the very examples the plain right-padded ``collate`` would have put
in one micro-batch and lays them end to end in a single row, with position ids
that restart at 0 for each example and no attention mask. The worker switches the
model to studio.train.data.packed_attention's ``packed_attention``, which cuts the row where
the position ids restart and runs causal sdpa on each example alone, so every
example sees exactly what it would see alone: the per-example losses are those of
the padded batch (tests prove it). The first label of each example is -100:
nothing predicts it from the example before, so the target tokens and the loss are
unchanged too. No position is padding, so no compute goes to it.

Only models whose modeling code hands the position ids to the attention pack,
which ``studio.train.data.packed_attention.probe`` checks on the model itself; others (OPT,
Bloom, MPT: verified to mix examples) train padded, see ``packing_refusal``, as do
attention kernels other than sdpa and eager.

``length_grouped`` is the cheaper option: it keeps padding, but orders each epoch
so a micro-batch holds examples of similar length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from studio.train.data.images import IMAGE_INPUTS
from studio.train.data.packed_attention import packed_implementation, probe
from studio.train.data.prepare import IGNORE_INDEX, as_token_list

GROUP_MICRO_BATCHES = 50  # length-grouping sorts within this many micro-batches (as transformers' sampler)


def packing_refusal(model) -> str | None:
    """Why this model cannot train packed examples apart, or None if it can (it was probed: see the module
    docstring; tests compare per-example losses for every family the estimator knows)."""
    if packed_implementation(model) is None:
        return "padding-free packing needs sdpa or eager attention (model.attn_implementation)"
    if not probe(model):
        return f"{model.config.model_type} models do not keep packed examples apart"
    return None


def pack(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A packed batch of one row: input_ids, labels and position_ids, no attention_mask."""
    input_ids, labels, positions = [], [], []
    for feature in features:
        ids = as_token_list(feature["input_ids"])
        input_ids += ids
        labels += [IGNORE_INDEX] + as_token_list(feature["labels"])[1:]
        positions += range(len(ids))
    as_row = lambda values: torch.tensor([values], dtype=torch.long)  # noqa: E731
    return {"input_ids": as_row(input_ids), "labels": as_row(labels), "position_ids": as_row(positions),
            "real_tokens": torch.tensor(len(input_ids)), "examples": torch.tensor(len(features))}


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The non-padding tokens of a padded or packed batch."""
    if "real_tokens" in batch:
        return int(batch["real_tokens"])
    return int(batch["attention_mask"].sum())


def example_count(batch: dict[str, torch.Tensor]) -> int:
    """The examples in a padded (one per row) or packed batch."""
    return int(batch["examples"]) if "examples" in batch else len(batch["input_ids"])


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """What the model is called with: padded batches carry a mask (and their images), packed ones position ids.

    No cache: transformers derives the packed mask from the position ids only without one.
    """
    keys = ("input_ids", "attention_mask", "position_ids", *IMAGE_INPUTS)
    return {**{k: batch[k] for k in keys if k in batch}, "use_cache": False}


def length_grouped(order: list[int], lengths: Sequence[int], micro_batch_size: int) -> list[int]:
    """``order`` with each run of GROUP_MICRO_BATCHES micro-batches sorted longest first.

    The groups follow the shuffled order, so an epoch stays random at the group level
    and the result is still a pure function of the order (deterministic resume).
    """
    size = micro_batch_size * GROUP_MICRO_BATCHES
    grouped = []
    for start in range(0, len(order), size):
        grouped += sorted(order[start:start + size], key=lambda row: -lengths[row])
    return grouped
