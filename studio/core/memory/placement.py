"""Layer split: which device holds each part of the model (model parallel in one process).

The decoder blocks are spread over the GPUs in order, each GPU taking as many as
its weight budget allows; the embeddings go with the first block and the final
norm and output head with the last one on a GPU. Blocks that fit on no GPU are
offloaded: kept in CPU RAM and fetched to the first GPU for each forward pass
(accelerate's offload hooks). A model that fits neither is refused with the
number of GiB missing.

Pure Python: the estimator, the GUI and the worker all call ``plan_placement``.
"""

from __future__ import annotations

from dataclasses import dataclass

from studio.core.errors import StudioError
from studio.core.memory.parts.states import block_weight_bytes, outer_weight_bytes
from studio.core.memory.regime import Regime
from studio.core.memory.results import DeviceEstimate, complete_parts
from studio.core.memory.sharding import CudaOverheads, ScaleOut
from studio.core.model.info import ModelShape
from studio.core.sizes import format_bytes

OFFLOAD = "offload"  # kept in CPU RAM, run on the first device


@dataclass(frozen=True)
class DeviceBudget:
    """A device that computes (``cuda:0``, or ``cpu`` on a machine without GPU) and the weight bytes it may hold."""

    device: str
    weight_bytes: int


@dataclass(frozen=True)
class Placement:
    """Every module of the model with its device (or OFFLOAD), in the model's order."""

    modules: tuple[tuple[str, str], ...]
    module_bytes: tuple[int, ...]
    layer_modules: tuple[str, ...]  # the decoder blocks' module names, in order

    @property
    def device_map(self) -> dict[str, str]:
        return dict(self.modules)

    @property
    def execution_device(self) -> str:
        """Where the offloaded blocks run: the first device."""
        return next(device for _, device in self.modules if device != OFFLOAD)

    def bytes_on(self, device: str) -> int:
        return sum(size for (_, where), size in zip(self.modules, self.module_bytes) if where == device)

    def layers_on(self, device: str) -> list[int]:
        where = self.device_map
        return [index for index, name in enumerate(self.layer_modules) if where[name] == device]

    @property
    def devices(self) -> list[str]:
        """The devices in use, in the model's order (OFFLOAD last)."""
        seen = list(dict.fromkeys(device for _, device in self.modules))
        return sorted(seen, key=lambda d: d == OFFLOAD)

    @property
    def offloaded_layers(self) -> list[int]:
        return self.layers_on(OFFLOAD)

    def summary(self) -> str:
        """``cuda:0: layers 0-13 (12.1 GiB); cuda:1: layers 14-27 (11.9 GiB); CPU RAM: layers 28-31 (3.5 GiB)``."""
        parts = []
        for device in self.devices:
            name = "CPU RAM (offloaded)" if device == OFFLOAD else device
            parts.append(f"{name}: {_ranges(self.layers_on(device))} ({format_bytes(self.bytes_on(device))})")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"device_map": self.device_map, "summary": self.summary(),
                "layers": {device: self.layers_on(device) for device in self.devices},
                "weight_bytes": {device: self.bytes_on(device) for device in self.devices}}


def _ranges(indices: list[int]) -> str:
    if not indices:
        return "no layers"
    spans, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1 if current is not None else True:
            spans.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ("layer " if len(indices) == 1 else "layers ") + ", ".join(spans)


def model_modules(shape: ModelShape, regime: Regime) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[tuple[str, int]]]:
    """(head of the model, blocks, tail): module names with their weight bytes, in forward order."""
    outer = outer_weight_bytes(shape, regime)
    embeddings = [name.rsplit(".", 1)[0] for name, _ in shape.family.embeddings]
    head = [(name, outer.get(name, 0)) for name in embeddings]
    block = block_weight_bytes(shape, regime)
    blocks = [(shape.family.block_prefix.format(index).rstrip("."), block) for index in range(shape.layers)]
    tail = [(shape.family.final_norm, outer.get(shape.family.final_norm, 0)), ("lm_head", outer.get("lm_head", 0))]
    return head, blocks, tail


def plan_placement(shape: ModelShape, regime: Regime, budgets: list[DeviceBudget], offload_bytes: int = 0) -> Placement:
    """Blocks in order onto the devices, the rest offloaded to CPU RAM up to ``offload_bytes``.

    The embeddings take room on the first device and the final norm and head on
    the last device that holds blocks (a tied head shares the embeddings' weight
    and costs nothing). Raises StudioError naming how much memory is missing.
    """
    if not budgets:
        raise StudioError("a layer split needs at least one device", "run it on a machine with a GPU", kind="config")
    head, blocks, tail = model_modules(shape, regime)
    tied_head = shape.tie_embeddings  # lm_head is the embeddings' weight: it stays on their device
    tail_bytes = sum(b for _, b in tail)
    free = [b.weight_bytes for b in budgets]
    free[0] -= sum(b for _, b in head)
    placed: list[tuple[str, str]] = [(name, budgets[0].device) for name, _ in head]
    device, last = 0, 0
    for name, size in blocks:  # the last device keeps room for the tail
        while device < len(budgets) and size + (tail_bytes if device == len(budgets) - 1 else 0) > free[device]:
            device += 1
        if device == len(budgets):
            placed.append((name, OFFLOAD))
            continue
        free[device] -= size
        placed.append((name, budgets[device].device))
        last = device
    if free[last] < tail_bytes and last < len(budgets) - 1:
        last += 1  # the next device, which has room for it
    for name, size in tail:
        where = 0 if name == "lm_head" and tied_head else last
        placed.append((name, budgets[where].device))
        free[where] -= size
    placement = Placement(tuple(placed), tuple(b for _, b in head + blocks + tail), tuple(name for name, _ in blocks))
    _check_fits(placement, budgets, free, offload_bytes)
    return placement


def _check_fits(placement: Placement, budgets: list[DeviceBudget], free: list[int], offload_bytes: int) -> None:
    offloaded = placement.bytes_on(OFFLOAD)
    over_devices = sum(-f for f in free if f < 0)
    missing = max(0, offloaded - offload_bytes) + over_devices
    if missing <= 0:
        return
    sizes = ", ".join(f"{b.device} {format_bytes(b.weight_bytes)}" for b in budgets)
    raise StudioError(
        f"the model's weights do not fit the layer split: {format_bytes(missing)} missing "
        f"(weights {format_bytes(sum(placement.module_bytes))}; devices take {sizes}; "
        f"CPU RAM takes {format_bytes(offload_bytes)})",
        "raise distributed.max_cpu_memory_gib (or max_gpu_memory_gib), use qlora, or add GPUs",
        kind="config")


# ---------------------------------------------------------------- the estimate of a layer split

_WITH_BLOCKS = ("adapter_weights", "gradients", "optimizer_state", "master_weights", "activations")
_WITH_HEAD = ("logits_loss", "temporaries")


def split_devices(phases: dict[str, dict[str, int]], shape: ModelShape, regime: Regime, scale_out: ScaleOut,
                  overheads: CudaOverheads):
    """Per-device estimates of a layer split, the host RAM of offloaded blocks, and the placement.

    ``phases`` are the single-device parts of each phase. A device holds the
    weights placed on it and, for the blocks it runs, their share of adapters,
    gradients, optimizer state and activations; the device with the head holds
    the logits and loss. Offloaded blocks run on the first device: their weights
    are fetched there for each forward and autograd keeps them until backward,
    unless gradient checkpointing drops them (then one block at a time).
    """
    cuda = regime.device_type == "cuda"
    names = [f"cuda:{i}" for i in range(len(scale_out.split_devices))] if cuda else ["cpu"]
    room = max(sum(parts.values()) - parts["weights"] for parts in phases.values())
    block = block_weight_bytes(shape, regime)
    budgets = _split_budgets(scale_out, names, room, overheads if cuda else None)
    placement = plan_placement(shape, regime, budgets, scale_out.split_offload_bytes)
    if placement.offloaded_layers and not scale_out.split_weight_limit:  # room for the block being fetched
        budgets[0] = DeviceBudget(budgets[0].device, max(0, budgets[0].weight_bytes - block))
        placement = plan_placement(shape, regime, budgets, scale_out.split_offload_bytes)
    offloaded = len(placement.offloaded_layers)
    onload = (min(offloaded, 1) if regime.checkpointing else offloaded) * block
    head_device = placement.device_map["lm_head"]
    devices = []
    for name in [n for n in names if n in placement.devices]:
        runs = len(placement.layers_on(name)) + (len(placement.offloaded_layers) if name == names[0] else 0)
        share = runs / shape.layers
        per_phase = {}
        for phase, parts in phases.items():
            local = {k: int(parts.get(k, 0) * share) for k in _WITH_BLOCKS}
            local.update({k: parts.get(k, 0) if name == head_device else 0 for k in _WITH_HEAD})
            local["weights"] = placement.bytes_on(name) + (onload if name == names[0] else 0)
            per_phase[phase] = local
        devices.append(DeviceEstimate.at_peak(name, per_phase))
    offloaded_bytes = placement.bytes_on(OFFLOAD)
    host = DeviceEstimate("host", complete_parts({"weights": offloaded_bytes}), "forward") if offloaded_bytes else None
    return devices, host, placement


def _split_budgets(scale_out: ScaleOut, names: list[str], room: int, overheads: CudaOverheads | None) -> list[DeviceBudget]:
    """Weight bytes per device: its tensor memory (after the CUDA context and the allocator's margin
    over the tensor peak) minus the room the rest of the step needs."""
    if scale_out.split_weight_limit:
        return [DeviceBudget(name, scale_out.split_weight_limit) for name in names]

    def tensor_bytes(size: int) -> int:
        if overheads is None:
            return size
        return int((size - overheads.context_bytes) / (1 + overheads.allocator_fraction))

    return [DeviceBudget(name, max(0, tensor_bytes(size) - room)) for name, size in zip(names, scale_out.split_devices)]
