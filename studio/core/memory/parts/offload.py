"""Offloaded activation checkpointing (``training.activation_offload``): where the block inputs live.

With gradient checkpointing each block keeps only its input for the backward pass
(``studio.core.memory.parts.tape``). The worker (``studio.train.savers.offload``) copies each of those inputs
to CPU RAM as the block runs and brings it back for the block's recomputation; while backward
recomputes block k it already brings back block k-1's input. So the device keeps

* at the end of the forward pass: no block input (every one is in host RAM), except the first block's
  where it is a leaf tensor that autograd keeps anyway (``first_input_stays``);
* while backward runs a later block: that block's input (counted with the recomputed block, as
  without offload) and the next one's, fetched ahead; none of the earlier blocks' (but that leaf). As
  the gradients of the blocks behind it add up, the second block's backward is the worst of these;
* while backward runs the first block: what it did without offload (there is no block before it), and
  the leaf beside the copy of it brought back.

The host holds every block's input from the forward pass until its block's backward is done: at most
all of them, at the end of the forward pass, in the input's dtype.
"""

from __future__ import annotations

from dataclasses import replace

from studio.core.memory.parts.tape import Activations
from studio.core.memory.regime import Regime, pinned_bytes
from studio.core.memory.results import DeviceEstimate, complete_parts
from studio.core.methods import INPUT_TOKENS
from studio.core.model.info import ModelShape


def offloaded_activations(acts: Activations, shape: ModelShape, regime: Regime) -> Activations:
    """``acts`` (with checkpointing) with the block inputs in host RAM instead of on the device, where the run
    offloads them."""
    if not regime.activation_offload:
        return acts
    layers, block_input = shape.layers, acts.block_input
    stays = block_input if first_input_stays(shape, regime) else 0
    prefetched = block_input if layers > 1 else 0
    # every later block's backward now meets the same activations and more gradients than the one before it:
    # the worst of them is the second block's, with the .grad of every block after it
    second_block = replace(acts.last_block, parameter_grads=acts.last_block.parameter_grads
                           + max(layers - 2, 0) * acts.block_grads)
    # the last block's forward: its own input on the device (the block before made it), the others' in host RAM
    return replace(acts, saved=acts.saved - layers * block_input + stays,
                   before_last_block=acts.before_last_block - (layers - 1) * block_input + prefetched + stays,
                   before_first_block=acts.before_first_block + stays, last_block=second_block,
                   forward_block=acts.forward_block - (layers - 1) * block_input + stays)


def first_input_stays(shape: ModelShape, regime: Regime) -> bool:
    """Whether the first block's input stays on the device although offloaded: the embeddings' output itself,
    which an adapter's checkpointing makes a leaf that needs a gradient (enable_input_require_grads); autograd
    keeps such a leaf until backward ends. Trained embeddings, a scaling, positions, dropout or prompt tuning's
    virtual tokens make the block input a new tensor instead, which goes."""
    family = shape.family
    new_tensor = family.embedding_scale or family.position_embeddings or shape.embedding_dropout > 0
    return not (regime.full or new_tensor or regime.method.token_entry == INPUT_TOKENS)


def host_activation_bytes(acts: Activations, shape: ModelShape, regime: Regime) -> int:
    """Host RAM of the offloaded block inputs of one micro-batch (all of them at the end of its forward pass), each
    pinned on CUDA (regime.pinned_bytes; the next micro-batch's reuse the blocks the allocator keeps)."""
    return shape.layers * pinned_bytes(acts.block_input, regime.device_type)


def with_host_activations(host: DeviceEstimate | None, acts: Activations, shape: ModelShape,
                          regime: Regime) -> DeviceEstimate | None:
    """The host's estimate with the offloaded activations added, where the run offloads them (to what optimizer
    or layer offload keeps there: that stays through the whole step)."""
    if not regime.activation_offload:
        return host
    activation_bytes = host_activation_bytes(acts, shape, regime)
    if host is None:
        return DeviceEstimate("host", complete_parts({"activations": activation_bytes}), "forward",
                              {"forward": activation_bytes})
    parts = {**host.parts, "activations": host.parts["activations"] + activation_bytes}
    phases = {**host.phases, "forward": host.phases.get("forward", host.total_bytes) + activation_bytes}
    return DeviceEstimate("host", parts, "forward", phases)
