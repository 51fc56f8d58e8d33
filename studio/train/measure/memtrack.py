"""Measure the peak memory of real (or fake) training steps.

On the CPU, and under FakeTensorMode, there is no allocator to ask, so
``LiveTensorTracker`` counts it: a TorchDispatchMode that sees every tensor an
operator returns, records the bytes of its untyped storage once per storage, and
subtracts them when the storage is freed (a weakref callback on the storage).
Tensors that existed before tracking began (weights, buffers, bitsandbytes
quantization state, inputs) are registered with ``add``. The peak of that count
is the peak of live tensor bytes, i.e. what CUDA's ``max_memory_allocated``
reports, minus allocator rounding.

Tensors made under ``studio.train.savers.host_memory.on_host()`` (offloaded activations) and the ``host``
tensors given to ``add_module`` (an embedding or output layer kept in CPU RAM) are meant for CPU RAM beside the
device: the tracker counts them apart, as ``host_bytes`` and its peak ``host_report``, so that a CPU run, whose
device and host are the same RAM, still measures the two apart.

On CUDA, ``CudaPeakTracker`` reads the allocator's own statistics instead.
Both offer ``phase(name)`` so a caller can tell which part of a step held the peak.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from studio.train.savers.host_memory import making_host_tensors


@dataclass
class PeakReport:
    """The peak of one tracked region: bytes, and the phase that held it."""

    peak_bytes: int = 0
    peak_phase: str = ""
    phase_peaks: dict[str, int] = field(default_factory=dict)

    def note(self, phase: str, live_bytes: int) -> None:
        if live_bytes > self.phase_peaks.get(phase, -1):
            self.phase_peaks[phase] = live_bytes
        if live_bytes > self.peak_bytes:
            self.peak_bytes, self.peak_phase = live_bytes, phase


class LiveTensorTracker(TorchDispatchMode):
    """Peak of live tensor storage bytes, counted operator by operator.

    Use it around a step::

        with LiveTensorTracker() as tracker:
            tracker.add_module(model)
            tracker.add(batch.values())
            with tracker.phase("forward"):
                ...
        tracker.report.peak_bytes
    """

    def __init__(self, device_type: str | None = None):
        super().__init__()
        self.device_type = device_type  # count only storages on this device type (None: all)
        self.live_bytes = 0
        self.report = PeakReport()
        # Host RAM beside the device, not in live_bytes: add_module's host tensors (kept there while the step
        # runs on the device) and tensors made on_host (offloaded activations)
        self.host_bytes = 0
        self.host_report = PeakReport()
        self._phase = "setup"
        self._storages: dict[int, weakref.ref] = {}
        self._host: set[int] = set()

    # ----------------------------------------------------------- registering
    def add(self, tensors: Iterable) -> None:
        """Count tensors that already exist (inputs, optimizer state carried over)."""
        for leaf in tree_leaves(list(tensors)):
            if isinstance(leaf, torch.Tensor):
                self._register(leaf)
        self.report.note(self._phase, self.live_bytes)

    def add_module(self, module: torch.nn.Module, host: Iterable[torch.Tensor] = ()) -> None:
        """Count a model's parameters, buffers and any bitsandbytes quantization state; ``host`` ones (kept in
        host RAM while the step computes on the device) count apart, in ``host_bytes``."""
        for tensor in host:
            self._host.add(tensor.untyped_storage()._cdata)
            self.host_bytes += self.counted_bytes(tensor.untyped_storage())
        self.host_report.note(self._phase, self.host_bytes)
        for tensor in [*module.parameters(), *module.buffers()]:
            self.add([tensor, *_quantization_tensors(tensor)])

    def _register(self, tensor: torch.Tensor, host: bool = False) -> None:
        if self.device_type is not None and tensor.device.type != self.device_type:
            return
        if self._host and tensor.untyped_storage()._cdata in self._host:
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse and other storage-less tensors
            return
        key = storage._cdata
        if key in self._storages:
            return
        nbytes = self.counted_bytes(storage)
        self._storages[key] = weakref.ref(storage, lambda _ref, key=key, nbytes=nbytes, host=host:
                                          self._release(key, nbytes, host))
        if host:
            self.host_bytes += nbytes
            self.host_report.note(self._phase, self.host_bytes)
        else:
            self.live_bytes += nbytes

    def counted_bytes(self, storage) -> int:
        """The bytes a storage counts for: its own (a subclass may count the block an allocator gives it)."""
        return storage.nbytes()

    def _release(self, key: int, nbytes: int, host: bool) -> None:
        if self._storages.pop(key, None) is not None:
            if host:
                self.host_bytes -= nbytes
            else:
                self.live_bytes -= nbytes

    # ----------------------------------------------------------- phases
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the peaks seen inside to ``name`` (e.g. forward, backward, optimizer)."""
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = previous

    @property
    def current_phase(self) -> str:
        return self._phase

    def mark(self, name: str) -> None:
        """Attribute what follows to ``name`` until the enclosing ``phase`` ends (for hooks inside a phase)."""
        self._phase = name

    # ----------------------------------------------------------- dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._register(leaf, host=making_host_tensors())
        self.report.note(self._phase, self.live_bytes)
        return out


class CudaPeakTracker:
    """The CUDA allocator's peak allocated (and reserved) bytes over a region, per phase.

    Same interface as LiveTensorTracker; the allocator already counts every tensor,
    so ``add`` and ``add_module`` have nothing to do.
    """

    def __init__(self, device: torch.device | None = None):
        self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.report = PeakReport()
        self.peak_reserved_bytes = 0
        self.host_bytes = 0
        self.host_report = PeakReport()  # add_module's host tensors only: offloaded activations are not measured here
        self._phase = "setup"

    def __enter__(self) -> "CudaPeakTracker":
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        self._note()

    def add(self, tensors: Iterable) -> None:
        pass

    def add_module(self, module: torch.nn.Module, host: Iterable[torch.Tensor] = ()) -> None:
        self.host_bytes += sum(tensor.untyped_storage().nbytes() for tensor in host)  # the allocator never sees them
        self.host_report.note(self._phase, self.host_bytes)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._note()  # what happened before belongs to the previous phase
        previous, self._phase = self._phase, name
        try:
            yield
        finally:
            self._note()
            self._phase = previous

    def _note(self) -> None:
        torch.cuda.synchronize(self.device)
        self.report.note(self._phase, torch.cuda.max_memory_allocated(self.device))
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)


def tracker_for(device: torch.device):
    """The right tracker for a device: the allocator's statistics on CUDA, counting elsewhere."""
    if device.type == "cuda":
        return CudaPeakTracker(device)
    return LiveTensorTracker(device.type)


def _quantization_tensors(param: torch.Tensor) -> list[torch.Tensor]:
    """Tensors bitsandbytes keeps beside a quantized weight (absmax, codebooks, row scales)."""
    found = []
    quant_state = getattr(param, "quant_state", None)
    while quant_state is not None:
        found += [v for v in vars(quant_state).values() if isinstance(v, torch.Tensor)]
        quant_state = getattr(quant_state, "state2", None)
    scales = getattr(param, "SCB", None)
    if isinstance(scales, torch.Tensor):
        found.append(scales)
    return found
