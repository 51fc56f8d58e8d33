"""Tiled MLP (``training.tiled_mlp``): each block's MLP recomputed over tiles of the tokens in backward.

The worker (``studio.train.savers.tiled``) runs the MLP on ``mlp_tiles`` tiles of the tokens without autograd
and keeps only its input; backward recomputes one tile's MLP at a time and takes its gradients at once, so
the intermediate (tokens x intermediate_size, several copies: the gate, the up projection, the activation,
their product, an adapter's copy of the down projection's input) is never whole, and the input's gradient
is written tile by tile into one buffer. ``tiled_feedforward`` counts that for the activation tape: the MLP
becomes one node that saves its input, and whose backward holds one tile's recomputation and backward and
the parameter gradients summed over the tiles so far."""

from __future__ import annotations

import math
from typing import Callable

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.parts.tape import forward_transient, simulate_backward
from studio.core.memory.regime import Regime
from studio.core.model.families import EXPERTS, ROUTER
from studio.core.model.info import ModelShape


def mlp_tiles(shape: ModelShape, tokens: int) -> int:
    """Tiles of ``tokens`` per MLP: as many as make one tile's intermediate no larger than the block's hidden
    states (intermediate_size / hidden_size, rounded up), and no tile longer than hidden_size tokens, so that
    at any length one tile's intermediate is about one MLP weight matrix (as Arctic's long-sequence training
    tiles). studio.train.savers.tiled asks this rule too."""
    return max(1, math.ceil(shape.intermediate / shape.hidden), math.ceil(tokens / shape.hidden))


def tiles_its_mlp(shape: ModelShape) -> bool:
    """Whether the model's MLP is one module applied token by token (a mixture of experts routes instead)."""
    return not any(layer.kind in (ROUTER, EXPERTS) for layer in shape.block_linears)


def untiled_model_refusal(shape: ModelShape) -> str | None:
    """Why the model's MLP cannot be tiled (tiles_its_mlp), or None where it can."""
    if tiles_its_mlp(shape):
        return None
    return (f"{shape.family.name} routes tokens to experts, and only a plain MLP (Llama's gated one, GPT-2's, "
            "NeoX's, Phi's) can be tiled")


def tiled_mlp_refusal(config: RunConfig) -> str | None:
    """Why the run cannot tile its MLPs, or None where it can: the tiles' gradients are summed for each whole
    weight, which ZeRO-3 and FSDP shard."""
    if not config.distributed.shards_weights:
        return None
    return f"the tiles' gradients are summed for each whole weight, and {config.distributed.sharding} shards the weights"


def check_tiled_mlp(shape: ModelShape) -> None:
    """Refuse a model whose MLP cannot be tiled, naming the setting."""
    if refusal := untiled_model_refusal(shape):
        raise StudioError(f"training.tiled_mlp: {refusal}", "turn training.tiled_mlp off for this model", kind="config")


def feedforward_for(shape: ModelShape, regime: Regime) -> Callable | None:
    """What the activation tape runs for each MLP (``activations(..., feedforward)``): tiled, or None."""
    if not regime.tiled_mlp:
        return None
    check_tiled_mlp(shape)
    tiles = mlp_tiles(shape, regime.tokens)
    return lambda tape, x, compute: tiled_feedforward(tape, x, compute, tiles)


def tiled_feedforward(tape, x, compute: Callable, tiles: int):
    """The MLP ``compute`` on ``x`` (tape values of studio.core.memory.parts.tape), tiled: one node in ``tape``."""
    start = len(tape.nodes)
    tile_in = tape.new(math.ceil(x.elements / tiles), x.dtype, x.requires_grad)
    tile_out = compute(tile_in)
    tile_nodes = tape.nodes[start:]
    del tape.nodes[start:]
    moment, parameter_grads = simulate_backward(tile_nodes, tile_out, recomputed=True)
    out = tape.new(tile_out.elements * tiles, tile_out.dtype, tile_out.requires_grad)
    if x.requires_grad or parameter_grads:
        tape.save(x)  # the tiled MLP keeps its input for the recomputation
    # a tile's output gradient is a view of the whole one, which the tape counts already, and its input
    # gradient is copied into the whole one (the node's input gradient)
    tile = moment.total - tile_out.nbytes
    tape.record([out], [x], temporary=tile + parameter_grads, parameter_grad=parameter_grads,
                forward_temporary=forward_transient(tile_nodes) + tile_out.nbytes)
    return out
