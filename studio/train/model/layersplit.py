"""Loading a model split over this machine's devices, blocks that do not fit offloaded to CPU RAM.

The placement (which block goes where) is computed in studio.core.memory.placement from
the model's config, the run config and each device's free memory, exactly as the
estimate shows it. Loading goes through transformers' ``device_map``: each module's
weights load straight onto their device. Offloaded blocks go through accelerate's
offload hooks: their weights stay in a CPU map, the module holds ``meta`` tensors,
and the hook copies the weights to the execution device (the first device) for
each forward and drops them after. On a machine with GPUs transformers attaches
these hooks itself; without GPUs (the CPU computes and holds the offload map)
``dispatch_offloaded`` attaches the same hooks.

peft moves a new adapter to its base layer's device, which for an offloaded layer
is ``meta``: ``materialize_offloaded_adapters`` creates those adapters again on the
execution device, with the base weight fetched for their initialization.
"""

from __future__ import annotations

import logging

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.estimate import ScaleOut, estimate
from studio.core.memory.placement import OFFLOAD, Placement
from studio.core.model.info import load_model_config

log = logging.getLogger("studio.train")


def compute_devices() -> list[tuple[str, int]]:
    """(device, free bytes) of each GPU, or of the CPU on a machine without GPU."""
    if torch.cuda.is_available():
        return [(f"cuda:{i}", torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())]
    import psutil

    return [("cpu", psutil.virtual_memory().available)]


def plan(config: RunConfig) -> Placement:
    """The placement this run loads with (the estimate's, on this machine's free memory)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    free = tuple(size for _, size in compute_devices())
    model_config = load_model_config(config.model.name_or_path, config.model.revision)
    placement = estimate(model_config, config, device_type, ScaleOut.from_config(config, free)).placement
    if placement.offloaded_layers and config.effective_load_in != "none":
        raise StudioError(
            f"blocks {placement.summary()} would be offloaded to CPU RAM, which a quantized (QLoRA) base cannot do: "
            "bitsandbytes keeps offloaded blocks unquantized and accelerate refuses to train them",
            "use more or larger GPUs, raise distributed.max_gpu_memory_gib, or use method lora", kind="config")
    log.info("layer split: %s", placement.summary())
    return placement


def hf_device_map(placement: Placement, config: RunConfig) -> dict[str, int | str]:
    """transformers' ``device_map``: GPUs by index, offloaded blocks (and the CPU) as "cpu".

    Modules the placement does not name (e.g. a rotary embedding with buffers only)
    go to the execution device.
    """
    def hf(device: str) -> int | str:
        return int(device.split(":")[1]) if device.startswith("cuda") else "cpu"

    device_map = {name: hf(device) for name, device in placement.modules}
    execution = hf(placement.execution_device)
    for name in _modules_with_tensors(config):
        if not any(name == key or name.startswith(key + ".") for key in device_map):
            device_map[name] = execution
    return device_map


def _modules_with_tensors(config: RunConfig) -> list[str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = config.model
    model_config = AutoConfig.from_pretrained(model.name_or_path, revision=model.revision or None,
                                              trust_remote_code=model.trust_remote_code)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config, trust_remote_code=model.trust_remote_code)
    return [name for name, module in skeleton.named_modules()
            if name and (any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False)))]


def dispatch_offloaded(model, placement: Placement, device_map: dict) -> None:
    """Attach accelerate's offload hooks to the offloaded blocks, unless transformers already did."""
    from accelerate.hooks import attach_align_device_hook_on_blocks
    from accelerate.utils import OffloadedWeightsLoader, extract_submodules_state_dict

    offloaded = [name for name, device in placement.modules if device == OFFLOAD]
    if offloaded and not hasattr(model, "_hf_hook"):
        execution = torch.device(placement.execution_device)
        weights = OffloadedWeightsLoader(state_dict=extract_submodules_state_dict(model.state_dict(), offloaded))
        attach_align_device_hook_on_blocks(
            model, execution_device={"": execution, **{name: execution for name in offloaded}},
            offload={name: True for name in offloaded}, weights_map=weights)
    model.hf_device_map = device_map  # accelerate.prepare leaves a split model where it is
    model.studio_placement = placement


def run_scale_out(config: RunConfig) -> ScaleOut:
    """The scale-out of this process's run: the world torchrun started, or this machine's devices for a split."""
    import os

    if config.distributed.layer_split:
        return ScaleOut.from_config(config, tuple(size for _, size in compute_devices()))
    world = int(os.environ.get("WORLD_SIZE", config.distributed.num_processes))
    return ScaleOut.from_config(config, num_machines=max(1, world // config.distributed.num_processes))


def placement_of(model) -> dict | None:
    """The layer split a model was loaded with, for the run_started event (None without a split)."""
    placement = getattr(model, "studio_placement", None)
    return placement.to_json() if placement is not None else None




def materialize_offloaded_adapters(model) -> None:
    """Create again on the execution device the LoRA adapters peft put on ``meta`` beside offloaded weights."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, layer in model.named_modules():
        if not isinstance(layer, BaseTunerLayer):
            continue
        if not any(p.device.type == "meta" for n, p in layer.named_parameters() if not n.startswith("base_layer")):
            continue
        if not isinstance(layer, LoraLayer):
            raise StudioError(f"{name}: only LoRA adapters can train on offloaded blocks",
                              "use LoRA, or give the model more GPU memory so no block is offloaded", kind="config")
        base = layer.get_base_layer()
        hook = base._hf_hook
        hook.pre_forward(base)  # fetch the base weight: the adapter takes its device and dtype, DoRA its norm
        try:
            for adapter in list(layer.lora_A):
                config = model.peft_config[adapter]
                rank, alpha = layer.r[adapter], layer.lora_alpha[adapter]
                layer.update_layer(adapter, rank, alpha, config)
        finally:
            hook.post_forward(base, None)
