"""The memory savers' worker code (their table: ``studio.core.memory.savers``).

* ``tiled``: each MLP recomputed over tiles of tokens in backward, never whole (the tiled MLP);
* ``offload``: the block inputs that gradient checkpointing keeps, in CPU RAM (activation offload);
* ``host_weights``: the frozen input embedding and output layer in CPU RAM;
* ``host_memory``: the mark on tensors made for CPU RAM, which the memory tracker counts apart.

The savers that change the model's modules are applied when it is built (``apply_when_built``); the
weights in CPU RAM after the engine has placed the model, which would move them.
"""

from __future__ import annotations

import torch

from studio.core.config import RunConfig
from studio.train.savers import offload, tiled


def apply_when_built(model: torch.nn.Module, config: RunConfig) -> None:
    """Each saver that changes the model's modules, where its switch asks for it."""
    for saver in (tiled, offload):
        saver.apply(model, config)
