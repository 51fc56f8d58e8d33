"""Micro-batches without padding: several examples per row, each attending only to itself.

``pack`` takes the very examples the plain right-padded ``collate`` would have put
in one micro-batch and lays them end to end in rows no wider than the longest of
them (first-fit decreasing), with position ids that restart at 0 for each example
and no attention mask. From such position ids transformers builds a block-diagonal
causal mask for sdpa and eager attention (masking_utils.find_packed_sequence_indices;
flash-attention reads the same ids), so every example sees exactly what it would
see alone: the per-example losses are those of the padded batch (tests prove it).
The first label of each example is -100: nothing predicts it from the example
before, so the target tokens and the loss are unchanged too.

Rows are never wider than the padded batch and there are at most as many, so the
compute can only shrink; what stays is the gap at the end of the last rows, filled
with pad tokens that form their own segment (no loss, nobody attends to them).

Only architectures that build their mask from the position ids keep packed
examples apart; others (OPT, Bloom, MPT: verified to mix them) train padded, see
``packs_exactly``.

``length_grouped`` is the cheaper option: it keeps padding, but orders each epoch
so a micro-batch holds examples of similar length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from studio.core.modelinfo import SUPPORTED_MODEL_TYPES
from studio.train.data import IGNORE_INDEX, _as_list

GROUP_MICRO_BATCHES = 50  # length-grouping sorts within this many micro-batches (as transformers' sampler)


def packs_exactly(model) -> bool:
    """Whether this model keeps packed examples apart: the families studio.core.modelinfo knows all derive
    their attention mask from the position ids (checked in their modeling code; tests cover four)."""
    return getattr(getattr(model, "config", None), "model_type", None) in SUPPORTED_MODEL_TYPES


def pack(features: list[dict[str, Any]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A packed batch: input_ids, labels and position_ids (rows of equal width), no attention_mask."""
    examples = [(_as_list(f["input_ids"]), _as_list(f["labels"])) for f in features]
    width = max(len(ids) for ids, _ in examples)
    rows = first_fit_decreasing([len(ids) for ids, _ in examples], width)
    input_ids, labels, positions = [], [], []
    for row in rows:
        ids, row_labels, row_positions = [], [], []
        for index in row:
            example_ids, example_labels = examples[index]
            ids += example_ids
            row_labels += [IGNORE_INDEX] + example_labels[1:]
            row_positions += range(len(example_ids))
        gap = width - len(ids)
        input_ids.append(ids + [pad_token_id] * gap)
        labels.append(row_labels + [IGNORE_INDEX] * gap)
        positions.append(row_positions + list(range(gap)))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long)  # noqa: E731
    return {"input_ids": as_tensor(input_ids), "labels": as_tensor(labels), "position_ids": as_tensor(positions),
            "real_tokens": torch.tensor(sum(len(ids) for ids, _ in examples)), "examples": torch.tensor(len(examples))}


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity`` (longest first, deterministic)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = lengths[index]
        slot = next((b for b, free in enumerate(room) if free >= size), None)
        if slot is None:
            bins.append([index])
            room.append(capacity - size)
        else:
            bins[slot].append(index)
            room[slot] -= size
    return bins


def real_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The non-padding tokens of a padded or packed batch."""
    if "real_tokens" in batch:
        return int(batch["real_tokens"])
    return int(batch["attention_mask"].sum())


def example_count(batch: dict[str, torch.Tensor]) -> int:
    """The examples in a padded (one per row) or packed batch."""
    return int(batch["examples"]) if "examples" in batch else len(batch["input_ids"])


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | bool]:
    """What the model is called with: padded batches carry a mask, packed ones position ids.

    No cache: transformers derives the packed mask from the position ids only without one.
    """
    keys = ("input_ids", "attention_mask", "position_ids")
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
