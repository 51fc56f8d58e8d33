"""Tiled MLP (``training.tiled_mlp``): each block's MLP over tiles of tokens, recomputed tile by tile in backward.

The MLP works token by token, so running it on tiles of the tokens computes the same rows. ``_TiledMLP``
runs the tiles without autograd in the forward pass and keeps only the MLP's input; backward recomputes one
tile at a time (under the forward's autocast and random state, so dropout draws the same masks) and takes
its gradients at once. So the MLP's intermediate (tokens x intermediate_size, several copies) is never
whole, the input's gradient is written tile by tile into one buffer (never joined from pieces), and each
trained parameter's gradient is summed over the tiles and handed to autograd once, as without tiles (DDP
and ZeRO see one gradient per step). The sums are over the same tokens in another order, so they agree with
the untiled ones to float rounding.

The number of tiles is the estimate's rule (``studio.core.memory.parts.tiled.mlp_tiles``), asked for each call's
token count.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.parts.tiled import check_tiled_mlp, mlp_tiles
from studio.core.model.info import ModelShape, UnknownArchitectureError, model_shape

_AUTOCAST_DEVICES = ("cuda", "cpu")


def apply(model: torch.nn.Module, config: RunConfig) -> None:
    """Tile the MLPs where ``training.tiled_mlp`` asks for it."""
    if config.training.tiled_mlp:
        tile_mlps(model)


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
    blocks = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and hasattr(m, "mlp")]
    for block in blocks:
        block.mlp.forward = functools.partial(_tiled, block.mlp, block.mlp.forward, shape)
    return len(blocks)


@torch.compiler.disable  # dynamo cannot trace the tiles' recomputation in backward: the MLP runs eagerly
def _tiled(mlp: torch.nn.Module, forward, shape: ModelShape, hidden: torch.Tensor) -> torch.Tensor:
    if not torch.is_grad_enabled():  # nothing kept for a backward pass: nothing to tile
        return forward(hidden)
    trained = [p for p in mlp.parameters() if p.requires_grad]
    tiles = mlp_tiles(shape, hidden.numel() // hidden.shape[-1])
    return _TiledMLP.apply(forward, tiles, hidden, *trained)


class _TiledMLP(torch.autograd.Function):
    """``forward`` (one MLP) on ``hidden`` in ``tiles`` tiles of tokens; ``trained``: its parameters that train."""

    @staticmethod
    def forward(ctx, forward, tiles: int, hidden: torch.Tensor, *trained: torch.Tensor) -> torch.Tensor:
        ctx.forward, ctx.tiles, ctx.trained = forward, tiles, trained
        ctx.autocast = {device: (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                        for device in _AUTOCAST_DEVICES}
        ctx.random = _random_state(hidden.device)
        ctx.save_for_backward(hidden)
        rows = hidden.reshape(-1, hidden.shape[-1])
        out = None
        for start, tile in _tiles(rows, tiles):
            tile_out = forward(tile)
            if out is None:
                out = tile_out.new_empty((rows.shape[0], tile_out.shape[-1]))
            out[start:start + tile.shape[0]] = tile_out
        return out.view(*hidden.shape[:-1], -1)

    @staticmethod
    def backward(ctx, out_grad: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        rows, out_grad = hidden.reshape(-1, hidden.shape[-1]), out_grad.reshape(-1, out_grad.shape[-1])
        wants_input = ctx.needs_input_grad[2]
        hidden_grad = torch.empty_like(rows) if wants_input else None
        trained_grads = [None] * len(ctx.trained)
        with _replayed(ctx.random, hidden.device), _autocast_as(ctx.autocast), torch.enable_grad():
            for start, tile in _tiles(rows, ctx.tiles):
                tile = tile.detach().requires_grad_(wants_input)
                tile_out = ctx.forward(tile)
                inputs = ([tile] if wants_input else []) + list(ctx.trained)
                grads = torch.autograd.grad(tile_out, inputs, out_grad[start:start + tile.shape[0]], allow_unused=True)
                if wants_input:
                    hidden_grad[start:start + tile.shape[0]] = grads[0]
                trained_grads = [_summed(total, grad) for total, grad in zip(trained_grads, grads[wants_input:])]
        input_grad = hidden_grad.view_as(hidden) if wants_input else None
        return None, None, input_grad, *trained_grads


def _tiles(rows: torch.Tensor, tiles: int):
    """(first row, tile) for each tile of ``rows``."""
    start = 0
    for tile in rows.chunk(tiles):
        yield start, tile
        start += tile.shape[0]


def _summed(total: torch.Tensor | None, grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:  # a parameter one tile does not reach (a disabled adapter) adds nothing
        return total
    return grad if total is None else total.add_(grad)


def _random_state(device: torch.device) -> tuple:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@contextlib.contextmanager
def _replayed(state: tuple, device: torch.device):
    """The random state the forward pass began with (dropout redraws its masks), restored afterwards."""
    cpu_state, cuda_state = state
    with torch.random.fork_rng(devices=[device] if cuda_state is not None else [], device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)
        yield


@contextlib.contextmanager
def _autocast_as(state: dict):
    """Autocast as the forward pass had it, for each device (backward may run on another thread, without it)."""
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield
