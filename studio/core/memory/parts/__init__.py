"""The parts a training step's memory is itemized into, and the phases of a step, with their words.

The estimate, fit, the simulation, the CLI and the GUI all name memory by these
keys; the labels are what a user reads for them everywhere. The modules count the
parts, each importing only those listed before it:

* ``states``: the model states: the weights as loaded, the trainable tensors, gradients, optimizer state;
* ``tape``: the activations, from interpreting each decoder block's recipe;
* ``logits``: the logits and the loss, full or chunked;
* ``tiled``: the tiled MLP's part of the tape;
* ``offload``: the block inputs that activation offload keeps in host RAM;
* ``generation``: what sampling a GRPO group holds between steps (its KV cache, one block's work);
* ``vision``: a vision-language model's images: their patches and tokens at the processor's resolution, and what
  the vision tower holds for them.
"""

from __future__ import annotations

# Short: the GUI's legend shows up to four of them side by side in a 1280-pixel window.
PART_LABELS = {
    "weights": "weights",
    "adapter_weights": "adapter",
    "gradients": "gradients",
    "optimizer_state": "optimizer",
    "master_weights": "master weights",
    "activations": "activations",
    "logits_loss": "logits and loss",
    "temporaries": "temporaries",
    "communication": "communication",
    "cuda_context": "CUDA context",
    "blas_workspaces": "cuBLAS workspaces",
    "allocator_margin": "allocator",
}
PARTS = tuple(PART_LABELS)
OVERHEAD_PARTS = ("cuda_context", "blas_workspaces", "allocator_margin")
"""What a CUDA process holds beside the step's tensors (a simulation, on fake tensors, counts the tensors alone)."""

PHASE_LABELS = {
    "forward": "the end of the forward pass (all activations and the loss)",
    "backward": "the backward pass",
    "optimizer": "the optimizer step",
    "generation": "sampling the completions (GRPO, between steps)",
}
PHASES = tuple(PHASE_LABELS)
