"""Attention for packed rows: each example attends causally to itself alone, with no mask at all.

A packed micro-batch is one row of examples laid end to end, with position ids
restarting at 0 for each (studio.train.packing). transformers' own sdpa path
keeps them apart with a block-diagonal mask over the whole row, whose cost is the
square of the row: on the CPU that mask also rules out sdpa's fast causal kernel.
Here the row is cut where the position ids restart and sdpa runs on each example
with ``is_causal``, so attention costs what the examples cost alone, as
flash-attention's variable-length kernels do on a GPU. The numbers are those of
separate, unpadded examples (tests compare per-example losses on every supported
architecture).

Registered with transformers as ``studio_packed``; batches that carry a padding
mask (evaluation, ``packing: none``) go through plain sdpa and its mask unchanged.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "studio_packed"


class _LastBounds:
    """The bounds of the last position ids seen: every layer of a forward pass gets the same tensor, and
    reading the cuts copies them to the host, which on a GPU would stall it once per layer."""

    ids: weakref.ref | None = None
    version = -1
    bounds: list[list[tuple[int, int]]] = []

    @classmethod
    def of(cls, position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
        if cls.ids is None or cls.ids() is not position_ids or cls.version != position_ids._version:
            cls.bounds = segment_bounds(position_ids)
            cls.ids, cls.version = weakref.ref(position_ids), position_ids._version
        return cls.bounds


def segment_bounds(position_ids: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the (start, end) of each run of positions counting up by one from wherever it starts."""
    restarts = torch.diff(position_ids, dim=-1) != 1
    bounds = []
    for row in restarts.cpu():
        cuts = [0, *(row.nonzero().flatten() + 1).tolist(), position_ids.shape[-1]]
        bounds.append(list(zip(cuts[:-1], cuts[1:])))
    return bounds


def window_mask(length: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """None (plain causal) unless a sliding window is shorter than the example: then the banded causal mask."""
    if window is None or length <= window:
        return None
    ones = torch.ones(length, length, dtype=torch.bool, device=device)
    return (ones.tril() & ~ones.tril(-window))[None, None]  # key within the last `window` positions, self included


@torch.compiler.disable  # the cuts are data: under torch.compile the layers around it stay compiled
def packed_attention(module, query, key, value, attention_mask, position_ids=None, sliding_window=None, **kwargs):
    """sdpa per example of each row (see the module docstring); shapes and output as sdpa_attention_forward.

    Padded batches, and queries that meet cached keys (generation), are plain sdpa's."""
    if attention_mask is not None or position_ids is None or key.shape[2] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs.pop("is_causal", None)
    rows = []
    rows_bounds = _LastBounds.of(position_ids)
    if len(rows_bounds) != query.shape[0]:  # position ids shared by every row
        rows_bounds = rows_bounds * query.shape[0]
    for row, bounds in enumerate(rows_bounds):
        parts = [sdpa_attention_forward(module, query[row:row + 1, :, start:end], key[row:row + 1, :, start:end],
                                        value[row:row + 1, :, start:end],
                                        window_mask(end - start, sliding_window, query.device), is_causal=True,
                                        **kwargs)[0]
                 for start, end in bounds]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


def packed_mask(*args, attention_mask=None, **kwargs):
    """No mask for unpadded rows (packed_attention makes them causal); sdpa's own for padded ones."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, packed_mask)


def can_attend_packed(model) -> bool:
    """Whether this model can switch to packed_attention: it runs sdpa through transformers' interface."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"


def attend_packed(model) -> None:
    """Switch the model (and its sub-models) to packed_attention."""
    model.set_attn_implementation(NAME)
