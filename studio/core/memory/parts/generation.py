"""What sampling a GRPO group holds beside the model states (the estimate's ``generation`` phase).

The worker samples one prompt's group at a time with HF generate, in eval mode and without gradients, between
the steps (studio.train.objectives.rollout): nothing is kept for backward, so the group's memory is its KV cache
and one block's work at a time. Its largest moment is one of two, counted at the longest prompt the run keeps
(data.max_length minus the completion length):

* the prompt's forward (prefill), in the last block's MLP: the cache of every block over the prompt, the MLP's
  three wide tensors (the gate's and the up projection's outputs and the activation's) and the block's hidden
  states, with the rotary tables; the logits of the last position only (transformers keeps one);
* the last new token: the cache over the prompt and the completion, one block's keys twice while the new
  position is appended (the cache grows by concatenation: the old tensor lives until the new one is made), and
  the last position's logits.

Measured on the embedded model by tests/test_grpo_memory.py: within 2 % (1 to 1.5 % under, what generate
holds beside the cache and one block's work); a quantized weight's dequantized copy and what a mixture of experts
routes are not counted.
"""

from __future__ import annotations

from studio.core.memory.regime import DTYPE_BYTES, Regime
from studio.core.model.info import ModelShape

MLP_WIDE_TENSORS = 3  # the gate's output, its activation, the up projection's output (their product replaces one)
HIDDEN_TENSORS = 4  # the residual stream, the normed input, the attention's and the MLP's outputs
ID_BYTES = 8  # int64 token ids, attention mask and positions
LOGIT_COPIES = 2  # the last position's logits and their fp32 copy the sampler draws from


def kv_cache_bytes(shape: ModelShape, regime: Regime, positions: int) -> int:
    """Keys and values of every layer for ``positions`` tokens, in the compute dtype."""
    return 2 * shape.layers * _kv_bytes_per_position(shape, regime) * positions


def generation_parts(shape: ModelShape, regime: Regime) -> dict[str, int]:
    """The activations and logits of sampling one group, at the larger of its two moments (see the module doc)."""
    group, completion = regime.sampled_group, regime.completion_length
    prompt = max(1, regime.sequence - completion)
    logits = LOGIT_COPIES * group * shape.vocab * DTYPE_BYTES["fp32"]
    prefill = (kv_cache_bytes(shape, regime, group * prompt) + group * prompt * _block_work_per_token(shape, regime)
               + 3 * ID_BYTES * group * prompt)
    longest = group * (prompt + completion)
    last_token = (kv_cache_bytes(shape, regime, longest) + _kv_bytes_per_position(shape, regime) * longest
                  + 3 * ID_BYTES * longest)
    return {"activations": max(prefill, last_token), "logits_loss": logits}


def _kv_bytes_per_position(shape: ModelShape, regime: Regime) -> int:
    """One block's keys (or values) for one position."""
    return shape.kv_heads * shape.head_dim * DTYPE_BYTES[regime.compute]


def _block_work_per_token(shape: ModelShape, regime: Regime) -> int:
    """What the last block's MLP holds per token while it computes, with the hidden states and rotary tables."""
    width = shape.expert_intermediate * shape.experts_per_token if shape.experts else shape.intermediate
    rotary = 2 * shape.head_dim if shape.rotary_fraction else 0
    return (MLP_WIDE_TENSORS * width + HIDDEN_TENSORS * shape.hidden + rotary) * DTYPE_BYTES[regime.compute]
