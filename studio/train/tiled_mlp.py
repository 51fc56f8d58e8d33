"""Tiled MLP (``training.tiled_mlp``): each block's MLP over tiles of tokens, each tile checkpointed.

The MLP works token by token, so running it on tiles of the tokens and joining the outputs computes the
same thing. Each tile goes through ``torch.utils.checkpoint`` (non-reentrant, so it nests inside the
blocks' own checkpointing): the forward pass keeps only the tiles' input, and backward recomputes one
tile's MLP at a time, so the MLP's intermediate (tokens x intermediate_size, several copies) is never
whole. The parameter gradients of the tiles are summed by autograd before they reach ``.grad`` (once, as
without tiles); the sums are over the same tokens in another order, so they agree with the untiled ones
to float rounding. Dropout inside the MLP (an adapter's, GPT-2's) draws its mask per tile.

The number of tiles is the estimate's rule (``studio.core.memory.tiled.mlp_tiles``).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from studio.core.errors import StudioError
from studio.core.memory.tiled import check_tiled_mlp, mlp_tiles
from studio.core.modelinfo import UnknownArchitectureError, model_shape


def tile_mlps(model: torch.nn.Module) -> int:
    """Tile the MLP of every decoder block of ``model``; returns how many. Refuses models without a plain MLP."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    try:
        shape = model_shape(model.config.to_dict())
    except UnknownArchitectureError as exc:
        raise StudioError(f"training.tiled_mlp: {exc.model_type} is not a family studio describes, so its MLP "
                          "is not known to be a plain one", "turn training.tiled_mlp off for this model",
                          kind="config") from exc
    check_tiled_mlp(shape)
    tiles = mlp_tiles(shape)
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "mlp")]
    for block in blocks:
        block.mlp.forward = functools.partial(_tiled, block.mlp.forward, tiles)
    return len(blocks)


@torch.compiler.disable  # dynamo cannot trace a checkpoint inside the compiled block: the MLP runs eagerly
def _tiled(forward, tiles: int, hidden: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # nothing kept for a backward pass: nothing to save
        return forward(hidden)
    flat = hidden.reshape(-1, hidden.shape[-1])
    outputs = [checkpoint(forward, tile, use_reentrant=False) for tile in flat.chunk(tiles)]
    return torch.cat(outputs).view(*hidden.shape[:-1], -1)
