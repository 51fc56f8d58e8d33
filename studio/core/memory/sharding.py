"""How the run spreads over devices: ZeRO's shares of the model states per GPU, the host RAM of
offload, communication buckets, and what a CUDA process holds besides tensors: the defaults, or what
``studio doctor`` measured on this machine (its calibration file, read here as JSON)."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.folders import data_folder
from studio.core.memory.parts.states import ModelStates
from studio.core.memory.results import DeviceEstimate, LoadingEstimate, complete_parts
from studio.core.sizes import GIB, format_bytes


@dataclass(frozen=True)
class ScaleOut:
    """How the run is spread over devices; ``ScaleOut.from_config`` reads it from the distributed section.

    ``zero_stage`` 0 is plain data parallelism; 1, 2, 3 shard optimizer state,
    then gradients, then parameters over ``num_gpus`` (DeepSpeed ZeRO, mixed
    precision: 16-bit weights and gradients, fp32 master weights; FSDP's full
    sharding is counted as stage 3). ``split_devices`` holds the memory of each
    device of a layer split (one process, blocks spread over them, see
    studio.core.memory.placement), ``split_weight_limit`` the configured weight bytes
    per device (0: the device's memory minus room for the rest) and
    ``split_offload_bytes`` the CPU RAM that may hold the blocks that do not fit. ``pipeline_stages``: a
    pipeline's stages, one process (and GPU) each among the ``num_gpus`` (studio.core.memory.placement).
    """

    num_gpus: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    split_devices: tuple[int, ...] = ()
    split_weight_limit: int = 0
    split_offload_bytes: int = 0
    pipeline_stages: int = 0

    def __post_init__(self):
        if self.num_gpus < 1 or self.zero_stage not in (0, 1, 2, 3):
            raise StudioError(f"invalid scale-out: {self.num_gpus} GPUs, ZeRO stage {self.zero_stage}",
                              "use at least one GPU and a ZeRO stage from 0 to 3", kind="config")
        if self.offload_params and self.zero_stage != 3:
            raise StudioError("parameter offload needs ZeRO stage 3", "set zero_stage to 3", kind="config")
        if self.offload_optimizer and self.zero_stage == 0:
            raise StudioError("optimizer offload needs a ZeRO stage", "set zero_stage to 1, 2 or 3", kind="config")
        if self.layer_split and (self.num_gpus > 1 or self.uses_zero):
            raise StudioError("a layer split runs in one process without sharding", "use num_gpus 1 and zero_stage 0",
                              kind="config")

    @classmethod
    def from_config(cls, config: RunConfig, device_bytes: tuple[int, ...] = (), num_machines: int = 1) -> "ScaleOut":
        """The scale-out of ``config.distributed`` on ``num_machines`` machines.

        ``device_bytes``: the memory of each of this machine's GPUs, which a layer
        split spreads the model over (without it, ``max_gpu_memory_gib`` sizes one device).
        """
        d = config.distributed
        if d.layer_split:
            limit = int(d.max_gpu_memory_gib * GIB)
            devices = tuple(device_bytes) or ((limit,) if limit else ())
            if not devices:
                raise StudioError("the layer split's estimate needs the GPUs' memory",
                                  "set distributed.max_gpu_memory_gib, or give the GPUs (--gpus and --gpu-memory)",
                                  kind="config")
            return cls(split_devices=devices, split_weight_limit=limit, split_offload_bytes=int(d.max_cpu_memory_gib * GIB))
        stage = 3 if d.sharding == "fsdp" else (d.deepspeed_stage or 0)
        return cls(num_gpus=d.num_processes * num_machines, zero_stage=stage,
                   offload_optimizer=d.offload_optimizer != "none", offload_params=d.offload_params != "none",
                   pipeline_stages=d.pipeline_stages)

    @property
    def uses_zero(self) -> bool:
        return self.zero_stage > 0

    @property
    def layer_split(self) -> bool:
        return bool(self.split_devices)


@dataclass(frozen=True)
class CudaOverheads:
    """What a CUDA process holds besides tensors: these defaults, or this machine's (``machine_overheads``)."""

    context_bytes: int = 500 * 1024**2  # CUDA context with lazy module loading: 0.3-0.7 GB
    allocator_fraction: float = 0.05  # caching-allocator rounding and fragmentation over the tensor peak
    nccl_bytes: int = 600 * 1024**2  # one NCCL communicator, when there are several GPUs
    # cuBLAS workspaces, taken from PyTorch's caching allocator (so in its allocated bytes) once per cuBLAS handle and
    # stream and kept for the process's life: torch's CublasHandlePool.cpp (parseChosenWorkspaceSize) makes each 32 MiB
    # on Hopper (sm_90) and 8.125 MiB (":4096:2:16:8") before it, unless CUBLAS_WORKSPACE_CONFIG says otherwise.
    # Handles are per thread: the forward and the optimizer step run on the main thread, the backward on autograd's
    # device thread, so two. The Hopper figure (the larger): on an H200 (torch 2.11, benchmarks/gpu_checks.py, December
    # 2026) every tiny-model check held exactly 64.0 MiB allocated beyond its model states after a step.
    blas_workspace_bytes: int = 2 * 32 * 1024**2
    measured: str = ""  # "GPU, date" when studio doctor measured the first two here; "" for the defaults

    @property
    def notes(self) -> tuple[str, ...]:
        if not self.measured:
            return ()
        return (f"CUDA context and allocator margin measured on this machine by studio doctor ({self.measured}): "
                f"{format_bytes(self.context_bytes)} outside the tensors, {self.allocator_fraction:.1%} over them",)


# ---------------------------------------------------------------- this machine's calibration

CALIBRATION_FILE = "gpu-calibration.json"  # in the user's data folder (studio.core.folders)
CALIBRATION_FORMAT = 1


def calibration_path() -> Path:
    return data_folder() / CALIBRATION_FILE


def save_calibration(measured: dict) -> Path:
    """Keep one GPU's figures from ``studio doctor`` as this machine's calibration for that GPU (keyed by its
    ``uuid``, else its ``name``), beside the other GPUs' entries; returns the file.

    The estimate reads ``context_bytes`` (the CUDA context and what libraries hold outside PyTorch's allocator),
    ``allocator_fraction`` (reserved over allocated bytes at a steady step, less one), ``name`` and
    ``measured_at``; the rest says how they were measured.
    """
    path = calibration_path()
    gpus = _calibrated_gpus(str(path))
    gpus = {**gpus, measured.get("uuid") or measured["name"]: measured}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"format": CALIBRATION_FORMAT, "gpus": gpus}, indent=2), encoding="utf-8")
    os.replace(partial, path)
    return path


def machine_overheads() -> CudaOverheads:
    """The overheads ``studio doctor`` measured on this machine, or the defaults when it has not (or the file
    cannot be read). Of several GPUs measured, the one with the most outside the tensors (the estimate cannot
    know which GPU a run will get)."""
    gpus = _calibrated_gpus(str(calibration_path()))
    if not gpus:
        return CudaOverheads()
    gpu = max(gpus.values(), key=lambda entry: (entry["context_bytes"], entry["allocator_fraction"]))
    return CudaOverheads(context_bytes=int(gpu["context_bytes"]), allocator_fraction=float(gpu["allocator_fraction"]),
                         measured=f"{gpu.get('name', 'a GPU')}, {str(gpu.get('measured_at', ''))[:10]}")


def _calibrated_gpus(path: str) -> dict[str, dict]:
    """The file's GPU entries with the two figures the estimate needs; read again only when the file changes
    (the window estimates on every toggle)."""
    try:
        modified = os.stat(path).st_mtime_ns
    except OSError:
        return {}
    return _read_calibration(path, modified)


@functools.lru_cache(maxsize=4)
def _read_calibration(path: str, modified: int) -> dict[str, dict]:
    try:
        gpus = json.loads(Path(path).read_text(encoding="utf-8")).get("gpus", {})
        return {key: entry for key, entry in gpus.items() if _is_count(entry.get("context_bytes"))
                and _is_count(entry.get("allocator_fraction"))}
    except (OSError, ValueError, AttributeError):
        return {}


def _is_count(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


def with_cuda_overheads(device: DeviceEstimate, overheads: CudaOverheads, scale_out: ScaleOut) -> DeviceEstimate:
    """The device with the CUDA context, cuBLAS's workspaces, the allocator's margin and (with several GPUs) NCCL's
    buffers."""
    parts = dict(device.parts)
    parts["cuda_context"] = overheads.context_bytes
    parts["allocator_margin"] = int(overheads.allocator_fraction * device.total_bytes)
    parts["blas_workspaces"] = overheads.blas_workspace_bytes
    if scale_out.num_gpus > 1:
        parts["communication"] += overheads.nccl_bytes
    extra = sum(parts.values()) - device.total_bytes
    return replace(device, parts=parts, phases={k: v + extra for k, v in device.phases.items()})


def sharded_devices(phases, device_type: str, block_parameters: int, states: ModelStates, scale_out: ScaleOut,
                    reduce_bucket: int):
    """Per-GPU shares under data parallelism and ZeRO, and the host RAM that offload needs (or None).

    ``block_parameters``: the parameters of one decoder block, which ZeRO-3 gathers (16-bit) to compute it;
    ``reduce_bucket``: the bytes of DeepSpeed's reduce bucket (``zero_reduce_bucket_bytes``).
    """
    if scale_out.num_gpus == 1 and not scale_out.uses_zero:
        return [DeviceEstimate.at_peak("cuda:0" if device_type == "cuda" else "cpu", phases)], None
    shares = zero_model_states(states, scale_out)
    communication = reduce_bucket if scale_out.uses_zero else _ddp_bucket_bytes(states, scale_out)
    gathered = 2 * 2 * block_parameters if scale_out.zero_stage == 3 else 0  # one layer's parameters, gathered
    per_gpu = {}
    for phase, parts in phases.items():
        sharded = {**parts, **{k: v for k, v in shares.items() if k != "gradients"}}
        if parts["gradients"]:  # gradients are alive in this phase
            sharded["gradients"] = shares["gradients"]
        if phase == "optimizer" and scale_out.uses_zero:
            sharded["temporaries"] = 0  # DeepSpeed's fused Adam updates the partition in place
        sharded["temporaries"] = sharded.get("temporaries", 0) + gathered
        sharded["communication"] = communication
        per_gpu[phase] = sharded
    devices = [DeviceEstimate.at_peak(f"{device_type}:{rank}", per_gpu) for rank in range(scale_out.num_gpus)]
    return devices, _offloaded(states, scale_out)


def zero_model_states(states: ModelStates, scale_out: ScaleOut) -> dict[str, int]:
    """Model states per GPU (ZeRO paper: K = 12 bytes of optimizer state and master weights per parameter).

    With ZeRO the trainable weights and their gradients are 16-bit and the
    optimizer keeps fp32 master weights; stage 1 shards the optimizer state,
    stage 2 also the gradients, stage 3 also the weights. Plain data
    parallelism (stage 0) replicates everything, as a single GPU has it.
    """
    n, stage = scale_out.num_gpus, scale_out.zero_stage
    if stage == 0:
        return {"gradients": states.gradients}
    trainable = states.trainable_parameters
    half = 2 * trainable  # 16-bit trainable weights, and as much for their gradients
    offloaded = scale_out.offload_optimizer
    frozen = 0 if states.full else states.weights
    trained_weights = 0 if scale_out.offload_params else (half // n if stage == 3 else half)
    shares = {
        "weights": frozen // n if stage == 3 else frozen,
        "adapter_weights": 0,
        "gradients": half // n if stage >= 2 else half,
        "master_weights": 0 if offloaded else 4 * trainable // n,
        "optimizer_state": 0 if offloaded else states.fp32_optimizer_state // n,
    }
    shares["weights" if states.full else "adapter_weights"] += trained_weights
    if scale_out.offload_params:
        shares["weights"] = 0
    return shares


def _offloaded(states: ModelStates, scale_out: ScaleOut) -> DeviceEstimate | None:
    """Host RAM of the whole node for ZeRO-Offload: fp32 master weights, optimizer state and fp32 gradients."""
    if not (scale_out.offload_optimizer or scale_out.offload_params):
        return None
    trainable = states.trainable_parameters
    parts = {"master_weights": 4 * trainable, "optimizer_state": states.fp32_optimizer_state, "gradients": 4 * trainable}
    if scale_out.offload_params:
        parts["weights"] = (0 if states.full else states.weights) + 2 * trainable
    return DeviceEstimate("host", complete_parts(parts), "optimizer")


def _ddp_bucket_bytes(states: ModelStates, scale_out: ScaleOut) -> int:
    """DDP copies every gradient into its buckets."""
    return states.gradients if scale_out.num_gpus > 1 else 0


DEEPSPEED_REDUCE_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size (elements) when its config gives none


def model_width(model_config: dict) -> int:
    """The language model's hidden size from a config.json mapping (its text_config's for a vision-language
    model); 0 where it names none of the usual fields."""
    text = model_config.get("text_config") or model_config
    return int(text.get("hidden_size") or text.get("n_embd") or text.get("d_model") or 0)


def zero_bucket_sizes(hidden: int, stage: int) -> dict[str, int]:
    """The bucket sizes studio gives DeepSpeed for a model of width ``hidden``, as the HF Trainer's "auto" does.
    DeepSpeed allocates its reduce bucket whole on every GPU however small the model: its default, 5e8 elements,
    is 2 GB in fp32 (the first GPU run's ZeRO checks held it beside a 28 MB model). {} for an unknown width
    (DeepSpeed's defaults)."""
    if hidden <= 0:
        return {}
    sizes = {"reduce_bucket_size": hidden * hidden}
    if stage == 3:
        sizes |= {"stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
                  "stage3_param_persistence_threshold": 10 * hidden}
    return sizes


def zero_reduce_bucket_bytes(hidden: int, config: RunConfig) -> int:
    """DeepSpeed's reduce bucket on each GPU (in the trained weights' dtype), as studio's DeepSpeed config sizes it
    (a user's distributed.deepspeed_config that sets reduce_bucket_size is not read)."""
    elements = zero_bucket_sizes(hidden, 2).get("reduce_bucket_size", DEEPSPEED_REDUCE_BUCKET)
    return elements * (4 if config.training.precision == "fp32" else 2)


def loading_per_process(states: ModelStates, scale_out: ScaleOut, sharded: str | None) -> tuple[LoadingEstimate, ...]:
    """What each of several processes holds while the model loads, by how it loads (``sharded``).

    None, whole (DDP, ZeRO-1/2, FSDP of 8-bit weights): every process reads the checkpoint and builds every weight.
    ``"zero3"`` (under zero.Init): each builds 1/N of the weights, and rank 0 alone reads the checkpoint (the others
    read only its names and shapes). ``"fsdp"`` (accelerate's cpu_ram_efficient_loading): rank 0 reads the checkpoint
    and builds the whole model in CPU RAM, which it holds beside its own shard until every shard is handed out; the
    others build it on the meta device and receive 1/N of the weights (one whole tensor at a time on the way).
    """
    n = scale_out.num_gpus
    if n == 1:
        return ()
    whole = states.weights + states.adapters
    if sharded is None:
        return (LoadingEstimate("every rank", whole, states.weights),)
    shard = -(-whole // n)
    others = "rank 1" if n == 2 else f"ranks 1-{n - 1}"
    rank0 = whole + shard if sharded == "fsdp" else shard
    return LoadingEstimate("rank 0", rank0, states.weights), LoadingEstimate(others, shard, 0)
