"""The logits and the loss: the worker's fp32 cross-entropy over every position, or its chunked (lean) loss."""

from __future__ import annotations

from studio.core.memory.regime import CHUNKED_LOSS_BYTES, DTYPE_BYTES, Regime
from studio.core.model.info import ModelShape


def logits_loss_bytes(shape: ModelShape, regime: Regime, logits_dtype: str) -> tuple[int, int]:
    """(forward, backward) peak bytes of the logits and the fp32 cross-entropy (the worker's token_loss_sum).

    Forward: the logits, their fp32 copy (none for fp32 logits: the labels are
    shifted, not the logits) and the log-softmax output. Backward (log-softmax
    backward): the saved log-softmax, the incoming gradient and the outgoing one,
    all fp32, for every position.
    """
    b, s, v = regime.micro_batch, regime.sequence, shape.vocab
    width = DTYPE_BYTES[logits_dtype]
    if regime.loss_impl == "chunked":
        positions = b * (s - 1)  # the last position of a row predicts nothing
        chunked = _chunked_logps_bytes if regime.token_logps else _chunked_loss_bytes
        return chunked(shape, regime, positions, 8 * positions)
    positions = b * s
    targets = 8 * positions  # int64 labels, shifted (a copy)
    fp32_copy = 0 if width == 4 else 4 * positions * v
    softcap = width * positions * v if shape.logit_softcap else 0  # tanh keeps its output for backward
    forward = width * positions * v + fp32_copy + 4 * positions * v + targets + softcap
    return forward, 12 * positions * v + targets + softcap


def chunked_loss_kept(shape: ModelShape, regime: Regime) -> int:
    """What the chunked loss keeps from its forward to its backward, at worst every position a target: the fp32
    gradient of the hidden states (and of a trained output layer) it computed in the forward."""
    positions = regime.micro_batch * (regime.sequence - 1)
    return 4 * positions * shape.hidden + (4 * shape.vocab * shape.hidden if regime.full else 0)


def _chunked_loss_bytes(shape: ModelShape, regime: Regime, positions: int, targets: int) -> tuple[int, int]:
    """The chunked loss: at worst every position a target; the logits of one chunk at a time.

    Forward (each chunk's gradients are computed there): the gathered hidden
    states, their fp32 gradient being filled, a trainable output layer's fp32
    gradient, and one chunk's fp32 log-softmax with the gradients of its backward.
    Backward: the kept fp32 gradient, its scaled copy and that copy cast back.
    """
    v, h = shape.vocab, shape.hidden
    chunk = min(positions, max(1, CHUNKED_LOSS_BYTES // (4 * v)))
    outer = DTYPE_BYTES[regime.outer_dtype]
    kept = chunked_loss_kept(shape, regime)
    forward = positions * h * outer + kept + 12 * chunk * v
    backward = 2 * kept + outer * positions * h
    return forward + targets, backward + targets



def _chunked_logps_bytes(shape: ModelShape, regime: Regime, positions: int, targets: int) -> tuple[int, int]:
    """The preference objectives' chunked log-probabilities (next_token.chunked_token_logps): at worst every
    position a target.

    Forward (no gradients yet): the gathered hidden states and one chunk's fp32 logits with their log-softmax (a
    16-bit projection is gone by then). Backward (the loss's, before the blocks'): the gathered hidden states,
    their gradient, a trainable output layer's gradient, and one chunk projected again: its fp32 logits, the saved
    log-softmax and its gradient.
    """
    v, h = shape.vocab, shape.hidden
    chunk = min(positions, max(1, CHUNKED_LOSS_BYTES // (4 * v)))
    outer = DTYPE_BYTES[regime.outer_dtype]
    gathered = positions * h * outer
    head_grad = 4 * v * h if regime.full else 0
    forward = gathered + 8 * chunk * v + 4 * positions
    backward = 2 * gathered + head_grad + 12 * chunk * v + 4 * positions
    return forward + targets, backward + targets
