"""Attention for packed rows: each example attends causally to itself alone, with no mask at all.

A packed micro-batch is one row of examples laid end to end, with position ids
restarting at 0 for each (studio.train.data.packing). transformers' own sdpa path
keeps them apart with a block-diagonal mask over the whole row, whose cost is the
square of the row: on the CPU that mask also rules out sdpa's fast causal kernel.
Here the row is cut where the position ids restart and sdpa runs on each example
with ``is_causal``, so attention costs what the examples cost alone, as
flash-attention's variable-length kernels do on a GPU. The numbers are those of
separate, unpadded examples (tests compare per-example losses on every supported
architecture).

Registered with transformers as ``studio_packed``; batches that carry a padding
mask (evaluation, ``packing: none``) go through plain sdpa and its mask unchanged.
Families that run eager attention (Gemma 2: sdpa cannot soft-cap its scores) get
``studio_packed_eager``: the same cuts, each example through the family's own
eager attention (its soft-capping included) with a causal, windowed mask.

Whether a model keeps packed examples apart is not looked up in a list: ``probe``
runs it once on a packed row of two short examples and checks that every
attention call received the position ids and cut the row there.
"""

from __future__ import annotations

import sys
import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

NAME = "studio_packed"
EAGER_NAME = "studio_packed_eager"
_PACKED_FOR = {"sdpa": NAME, "eager": EAGER_NAME}  # the model's own attention -> its packed counterpart


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


class _Probe:
    """While a probe runs, one entry per attention call: whether it cut the row at the restarted positions."""

    calls: list[bool] | None = None


def _packed(attend, query, key, value, position_ids, sliding_window, kwargs):
    """``attend(q, k, v, mask)`` on each example of each row (see the module docstring), concatenated."""
    kwargs.pop("is_causal", None)
    rows = []
    rows_bounds = _LastBounds.of(position_ids)
    if len(rows_bounds) != query.shape[0]:  # position ids shared by every row
        rows_bounds = rows_bounds * query.shape[0]
    if _Probe.calls is not None:
        _Probe.calls.append(all(len(bounds) > 1 for bounds in rows_bounds))
    for row, bounds in enumerate(rows_bounds):
        parts = [attend(query[row:row + 1, :, start:end], key[row:row + 1, :, start:end],
                        value[row:row + 1, :, start:end], window_mask(end - start, sliding_window, query.device))
                 for start, end in bounds]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


def _is_packed_row(query, key, attention_mask, position_ids) -> bool:
    """Unpadded rows with position ids, no cached keys (generation's queries meet those)."""
    packed = attention_mask is None and position_ids is not None and key.shape[2] == query.shape[2]
    if not packed and _Probe.calls is not None:
        _Probe.calls.append(False)
    return packed


@torch.compiler.disable  # the cuts are data: under torch.compile the layers around it stay compiled
def packed_attention(module, query, key, value, attention_mask, position_ids=None, sliding_window=None, **kwargs):
    """sdpa per example of each row (see the module docstring); shapes and output as sdpa_attention_forward.

    Padded batches, and queries that meet cached keys (generation), are plain sdpa's."""
    if not _is_packed_row(query, key, attention_mask, position_ids):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def attend(q, k, v, mask):
        return sdpa_attention_forward(module, q, k, v, mask, is_causal=True, **kwargs)[0]
    return _packed(attend, query, key, value, position_ids, sliding_window, kwargs)


@torch.compiler.disable
def packed_eager_attention(module, query, key, value, attention_mask, position_ids=None, sliding_window=None,
                           **kwargs):
    """The family's own eager attention per example of each row; padded batches are plain eager's."""
    eager = sys.modules[type(module).__module__].eager_attention_forward  # every modeling file defines its own
    if not _is_packed_row(query, key, attention_mask, position_ids):
        return eager(module, query, key, value, attention_mask, **kwargs)

    def attend(q, k, v, mask):
        length = q.shape[2]
        allowed = mask if mask is not None else torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
        additive = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        additive = additive.masked_fill(~allowed, torch.finfo(q.dtype).min).reshape(1, 1, length, length)
        return eager(module, q, k, v, additive, **kwargs)[0]
    return _packed(attend, query, key, value, position_ids, sliding_window, kwargs)


def packed_mask(*args, attention_mask=None, **kwargs):
    """No mask for unpadded rows (packed_attention makes them causal); sdpa's own for padded ones."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def packed_eager_mask(*args, attention_mask=None, **kwargs):
    """No mask for unpadded rows; eager's own (additive) for padded ones."""
    return None if attention_mask is None else eager_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(NAME, packed_attention)
AttentionMaskInterface.register(NAME, packed_mask)
AttentionInterface.register(EAGER_NAME, packed_eager_attention)
AttentionMaskInterface.register(EAGER_NAME, packed_eager_mask)


def packed_implementation(model) -> str | None:
    """The packed attention for this model's own (sdpa or eager, through transformers' interface), or None."""
    return _PACKED_FOR.get(getattr(getattr(model, "config", None), "_attn_implementation", None))


def attend_packed(model) -> None:
    """Switch the model (and its sub-models) to the packed counterpart of its attention."""
    model.set_attn_implementation(packed_implementation(model))


def probe(model) -> bool:
    """Whether the model keeps packed examples apart: one forward pass of a row of two short examples under
    packed attention, in which every attention call must have received the position ids and cut the row.

    The model comes back with the attention it had."""
    own = model.config._attn_implementation
    device = model.get_input_embeddings().weight.device
    ids = torch.zeros(1, 4, dtype=torch.long, device=device)
    positions = torch.tensor([[0, 1, 0, 1]], device=device)
    training = model.training
    # a 16-bit output layer (lean weights) computes on fp32 hidden states only under autocast, as in training
    head = model.get_output_embeddings()
    dtype = head.weight.dtype if head is not None else torch.float32
    _Probe.calls = []
    try:
        attend_packed(model)
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            model.eval()(input_ids=ids, position_ids=positions, use_cache=False)
        return bool(_Probe.calls) and all(_Probe.calls)
    finally:
        _Probe.calls = None
        model.set_attn_implementation(own)
        model.train(training)
