"""The parts a training step's memory is itemized into, and the phases of a step, with their words.

The estimate, fit, the simulation, the CLI and the GUI all name memory by these
keys; the labels are what a user reads for them everywhere.
"""

from __future__ import annotations

PART_LABELS = {
    "weights": "base weights",
    "adapter_weights": "adapter weights",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "master_weights": "fp32 master weights",
    "activations": "saved activations",
    "logits_loss": "logits and loss",
    "temporaries": "temporaries",
    "communication": "communication buffers",
    "cuda_context": "CUDA context",
    "allocator_margin": "allocator margin",
}
PARTS = tuple(PART_LABELS)

PHASE_LABELS = {
    "forward": "the end of the forward pass (all activations and the loss)",
    "backward": "the backward pass",
    "optimizer": "the optimizer step",
}
PHASES = tuple(PHASE_LABELS)
