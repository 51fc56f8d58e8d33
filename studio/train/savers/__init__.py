"""The memory savers' worker code (the table of savers: ``studio.core.memory.savers``).

* ``tiled_mlp``: each MLP recomputed over tiles of tokens in backward (``training.tiled_mlp``);
* ``activation_offload``: the checkpointed block inputs in CPU RAM (``training.activation_offload``);
* ``host_weights``: the frozen input embedding and output layer in CPU RAM;
* ``host_memory``: the mark on tensors made for CPU RAM, which the memory tracker counts apart.
"""
