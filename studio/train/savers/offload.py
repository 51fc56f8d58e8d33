"""Offloaded activation checkpointing: each checkpointed block's input waits in CPU RAM for its recomputation.

With gradient checkpointing, a block keeps only its input for the backward pass (torch.utils.checkpoint saves
it as a saved tensor, through autograd's saved-tensor hooks). ``offload_checkpoint_inputs`` wraps the function
transformers checkpoints each block with in ``torch.autograd.graph.saved_tensors_hooks`` whose pack copies
that input to (pinned) CPU RAM and whose unpack brings it back when backward recomputes the block. Inside
the checkpointed block torch's own hooks take over, so only the block inputs pass through these.

On CUDA the copies run on a side stream: the copy out overlaps the block's forward, and when backward
unpacks block k's input it already starts bringing back block k-1's (prefetch), so that copy overlaps
block k's recomputation and backward. transformers' ``activation_checkpointing_enable(offload=True)``
does the same with ``save_on_cpu``, whose copies run on the compute stream and wait for it.

On the CPU, "device" and "host" are the same RAM: the copies are plain copies, made under
``studio.train.savers.host_memory.on_host`` so that the memory tracker counts them as host memory, and the estimate
(``studio.core.memory.parts.offload``) can be checked for the device and the host apart.
"""

from __future__ import annotations

import functools
import weakref

import torch

from studio.core.config import RunConfig
from studio.train.savers.host_memory import on_host

# Smaller saved tensors (torch's 0-element placeholder) are not worth a copy.
MIN_OFFLOAD_BYTES = 1024


class _Offloaded:
    """One block input: its CPU copy, and its device copy while it is on its way back."""

    __slots__ = ("host", "device", "previous", "ready", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, previous: weakref.ref | None):
        self.host = host
        self.device = device
        # the input saved just before this one: backward needs it next. A weak reference, so that a finished
        # micro-batch's inputs are freed with its graph rather than kept by the next one's.
        self.previous = previous
        self.ready: torch.Tensor | None = None  # the device copy, fetched ahead of its unpack


class ActivationOffloader:
    """The pack and unpack hooks, and the side streams the copies run on (CUDA: one per device)."""

    def __init__(self):
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: weakref.ref | None = None  # the input saved last (weak: autograd's graph owns it)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        if tensor.untyped_storage().nbytes() < MIN_OFFLOAD_BYTES or tensor.layout != torch.strided:
            return tensor
        with on_host():
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                               pin_memory=tensor.device.type == "cuda")
        if tensor.device.type == "cuda":
            stream = self._stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
            tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            host.copy_(tensor)
        packed = _Offloaded(host, tensor.device, self._last)
        self._last = weakref.ref(packed)
        return packed

    def unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        tensor = packed.ready if packed.ready is not None else self._fetch(packed)
        packed.ready = None
        if tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).wait_stream(self._stream(tensor.device))
        previous = packed.previous() if packed.previous is not None else None
        if previous is not None and previous.ready is None:
            previous.ready = self._fetch(previous)  # overlaps this block's recomputation and backward
        return tensor

    def _fetch(self, packed: _Offloaded) -> torch.Tensor:
        """A new device copy of ``packed``'s CPU copy (asynchronous on CUDA).

        The copy is allocated on the compute stream, whose cached blocks the rest of the step reuses (a block
        allocated on the side stream stays reserved for that stream), and filled on the side stream."""
        if packed.device.type != "cuda":
            return packed.host.clone()  # a distinct tensor: the device's
        device_copy = torch.empty_like(packed.host, device=packed.device)
        stream = self._stream(packed.device)
        stream.wait_stream(torch.cuda.current_stream(packed.device))  # the memory is free on the compute stream
        with torch.cuda.stream(stream):
            device_copy.copy_(packed.host, non_blocking=True)
        device_copy.record_stream(stream)  # not reused before the copy into it has run
        return device_copy

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def apply(model: torch.nn.Module, config: RunConfig) -> None:
    """Offload the checkpointed block inputs where ``training.activation_offload`` asks for it (with checkpointing)."""
    if config.training.gradient_checkpointing and config.training.activation_offload:
        offload_checkpoint_inputs(model)


def offload_checkpoint_inputs(model: torch.nn.Module) -> int:
    """Offload the input of every block that ``model`` checkpoints; returns how many blocks that is.

    transformers gives each checkpointed block (a ``GradientCheckpointingLayer``) the checkpoint function as
    ``_gradient_checkpointing_func``; it is wrapped so that the input it saves is offloaded.
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    offloader = ActivationOffloader()
    blocks = 0
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) and module.gradient_checkpointing:
            checkpoint_function = module._gradient_checkpointing_func
            module._gradient_checkpointing_func = _offloading(checkpoint_function, offloader)
            blocks += 1
    return blocks


def _offloading(checkpoint_function, offloader: ActivationOffloader):
    @functools.wraps(checkpoint_function)
    def checkpoint_with_offload(function, *args, **kwargs):
        with offloader.hooks():
            return checkpoint_function(function, *args, **kwargs)

    return checkpoint_with_offload
