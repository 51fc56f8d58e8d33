"""The training loss: summed next-token cross-entropy over the target tokens, in fp32.

Two ways to the same number (and the same gradients, tests prove it):

- full: the model computes the logits of every position, which are upcast to fp32
  and reduced with ``cross_entropy``. Memory: several fp32 copies of
  (positions x vocabulary), padding and prompt positions included.
- chunked: the model returns its final hidden states instead (``logits_to_keep``
  of nothing), only the positions whose next token carries a loss are gathered,
  and those are projected to the vocabulary a chunk at a time under activation
  checkpointing. The fp32 logits of one chunk exist at a time, in the forward and
  again in the backward pass; prompt and padding positions never meet the output
  layer at all, which also saves its compute.

The chunked path needs logits that are exactly ``output_layer(hidden)``; models
that scale or soft-cap their logits (Gemma 2, Cohere, Granite) use the full path.
"""

from __future__ import annotations

import torch
from torch.nn.functional import cross_entropy
from torch.utils.checkpoint import checkpoint

from studio.core.estimate import CHUNKED_LOSS_BYTES as CHUNK_BYTES  # fp32 logits of one chunk
from studio.train.data import IGNORE_INDEX
from studio.train.packing import model_inputs

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def token_loss_sum(model, batch: dict[str, torch.Tensor], output_layer: torch.nn.Module | None = None) -> torch.Tensor:
    """Summed cross-entropy over the target tokens (labels != -100); chunked when given the output layer."""
    targets = batch["labels"][:, 1:]
    if output_layer is None:
        logits = model(**model_inputs(batch)).logits
        logits = logits[:, -batch["input_ids"].shape[1]:]  # prompt tuning prepends its virtual tokens' logits
        shifted = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
        return cross_entropy(shifted, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    hidden = predicting_hidden_states(model, batch)
    keep = targets != IGNORE_INDEX
    return chunked_cross_entropy(hidden[keep], targets[keep], output_layer)


def predicting_hidden_states(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The final hidden states of the positions that predict a next token (all but the last), no logits."""
    nothing = torch.zeros(0, dtype=torch.long, device=batch["input_ids"].device)
    outputs = model(**model_inputs(batch), logits_to_keep=nothing, output_hidden_states=True)
    length = batch["input_ids"].shape[1]  # prompt tuning prepends its virtual tokens
    return outputs.hidden_states[-1][:, -length:-1]


def chunked_cross_entropy(hidden: torch.Tensor, targets: torch.Tensor, output_layer: torch.nn.Module,
                          chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """sum(cross_entropy(output_layer(hidden).float(), targets)) without all the logits at once."""
    vocab = output_layer.weight.shape[0]
    chunk = max(1, chunk_bytes // (4 * vocab))
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk):
        total = total + checkpoint(_chunk_loss, hidden[start:start + chunk], targets[start:start + chunk],
                                   output_layer, use_reentrant=False)
    return total


def _chunk_loss(hidden: torch.Tensor, targets: torch.Tensor, output_layer: torch.nn.Module) -> torch.Tensor:
    # Under a layer split the head may sit on another GPU (its hook moves the input there): the loss comes back.
    logits = output_layer(hidden).float()
    return cross_entropy(logits, targets.to(logits.device), reduction="sum").to(hidden.device)


def lean_output_layer(model) -> torch.nn.Module | None:
    """The model's output layer if its logits are plainly ``layer(hidden)``, else None (use the full loss)."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    layer = model.get_output_embeddings()
    return layer if isinstance(getattr(layer, "weight", None), torch.Tensor) else None
