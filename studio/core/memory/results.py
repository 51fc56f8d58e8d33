"""What an estimate says: the bytes of each part at each device's peak, and the verdict against a GPU's
size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from studio.core.memory.parts import PARTS, PHASES

# The estimate never says "fits" closer than this to the GPU's size.
TIGHT_FRACTION = 0.90


def complete_parts(parts: dict[str, int]) -> dict[str, int]:
    """Every part in PARTS' order, 0 for those ``parts`` does not name."""
    return {name: int(parts.get(name, 0)) for name in PARTS}


@dataclass(frozen=True)
class DeviceEstimate:
    """The peak on one device: bytes by part (they sum to ``total_bytes``)."""

    device: str
    parts: dict[str, int]
    peak_phase: str
    phases: dict[str, int] = field(default_factory=dict)

    @classmethod
    def at_peak(cls, device: str, phases: dict[str, dict[str, int]]) -> "DeviceEstimate":
        """The device at the largest of its phases, given every part at each phase's peak moment (a run that
        samples nothing has no generation phase)."""
        totals = {name: sum(parts.values()) for name, parts in phases.items()}
        peak = max((name for name in PHASES if name in totals), key=lambda name: totals[name])
        return cls(device, complete_parts(phases[peak]), peak, totals)

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> dict:
        return {"device": self.device, "parts": dict(self.parts), "total_bytes": self.total_bytes,
                "peak_phase": self.peak_phase, "phases": dict(self.phases)}


@dataclass(frozen=True)
class LoadingEstimate:
    """What the processes named by ``processes`` hold while the model loads: their weights once built
    (``weights_bytes``), and the checkpoint each reads into CPU RAM on the way (``checkpoint_bytes``)."""

    processes: str
    weights_bytes: int
    checkpoint_bytes: int

    def to_json(self) -> dict:
        return {"processes": self.processes, "weights_bytes": self.weights_bytes, "checkpoint_bytes": self.checkpoint_bytes}


@dataclass(frozen=True)
class Verdict:
    """Whether the estimate fits a GPU: fits, tight (within 10 % of its size) or does not fit."""

    status: str
    gpu_bytes: int
    needed_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_bytes - self.needed_bytes

    def to_json(self) -> dict:
        return {"status": self.status, "gpu_bytes": self.gpu_bytes, "needed_bytes": self.needed_bytes,
                "headroom_bytes": self.headroom_bytes}


def verdict_for(needed_bytes: int, gpu_bytes: int) -> Verdict:
    if needed_bytes > gpu_bytes:
        status = "does not fit"
    elif needed_bytes > TIGHT_FRACTION * gpu_bytes:
        status = "tight"
    else:
        status = "fits"
    return Verdict(status, gpu_bytes, needed_bytes)


@dataclass(frozen=True)
class Estimate:
    """The estimate of one run: the peak per device and where it happens.

    ``devices[0]`` is the first GPU (or the CPU when ``device_type`` is cpu);
    with several GPUs each gets an entry; with offload a ``host`` entry holds
    the CPU RAM the offloaded state needs.
    """

    devices: tuple[DeviceEstimate, ...]
    peak_phase: str
    parameters: int
    trainable_parameters: int
    tokens_per_micro_batch: int
    notes: tuple[str, ...] = ()
    placement: Any = None  # a layer split's studio.core.memory.placement.Placement
    # "described" (the model's family, by hand) or "derived" (a traced step); left out of repr, which
    # fit results print, so that described estimates read as they always did
    kind: str = field(default="described", repr=False)
    # with several processes: what each holds while the model loads (whole, or ZeRO-3's shards)
    loading: tuple[LoadingEstimate, ...] = field(default=(), repr=False)
    # a pipeline's: it and the other ways over its GPUs (studio.core.memory.placement.WayCost)
    comparison: tuple[Any, ...] = field(default=(), repr=False)

    @property
    def peak_device(self) -> DeviceEstimate:
        """The fullest device that computes (a layer split fills its devices unevenly; the host is not one)."""
        return max((d for d in self.devices if d.device != "host"), key=lambda d: d.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_device.total_bytes

    @property
    def parts(self) -> dict[str, int]:
        return self.peak_device.parts

    def predicted_readings(self) -> dict[str, int]:
        """What each reading of the peak device should show at the peak: the allocator's allocated (the tensors)
        and reserved (the tensors and its margin) bytes, and NVML's used (with the CUDA context too)."""
        parts = self.parts
        reserved = self.peak_bytes - parts["cuda_context"]
        return {"allocated_bytes": reserved - parts["allocator_margin"], "reserved_bytes": reserved,
                "nvml_used_bytes": self.peak_bytes}

    @property
    def host_bytes(self) -> int:
        """The CPU RAM the run keeps beside its devices (offloaded state, activations, weights); 0 for none."""
        return sum(d.total_bytes for d in self.devices if d.device == "host")

    def verdict(self, gpu_bytes: int) -> Verdict:
        return verdict_for(self.peak_bytes, gpu_bytes)

    def to_json(self, gpu_bytes: int | None = None) -> dict:
        out: dict[str, Any] = {
            "devices": [device.to_json() for device in self.devices],
            "peak_phase": self.peak_phase, "peak_bytes": self.peak_bytes,
            "parameters": self.parameters, "trainable_parameters": self.trainable_parameters,
            "tokens_per_micro_batch": self.tokens_per_micro_batch, "notes": list(self.notes),
        }
        if self.placement is not None:
            out["placement"] = self.placement.to_json()
        if self.kind != "described":  # absent: described, as every estimate was before derived ones
            out["kind"] = self.kind
        if self.loading:
            out["loading"] = [entry.to_json() for entry in self.loading]
        if self.comparison:
            out["comparison"] = [way.to_json() for way in self.comparison]
        if gpu_bytes:
            out["verdict"] = self.verdict(gpu_bytes).to_json()
        return out

