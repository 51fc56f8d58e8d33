"""The memory frontier on a real GPU: each card of benchmarks/memory_frontier.py emulated on one big GPU.

For each row (Llama-3.1-8B at 8, 12, 24 and 80 GiB; Llama-3.3-70B at 48 and 80 GiB), QLoRA r32 with the lean
settings at the longest sequence our estimate fits in that card, the worker's optimizer step (the model
``studio.train.model.build.build_model`` makes, the weights ``keep_weights_on_cpu`` keeps in CPU RAM, the
optimizer, ``run_optimizer_steps``) runs on the GPU with ``torch.cuda.set_per_process_memory_fraction`` holding
the process to the card's size less the CUDA context. The weights are random: the model is built on the meta
device from config.json (as ``studio.train.measure.simulate`` builds it) and each tensor is then made on the
GPU, the 4-bit ones quantized to NF4 there, so nothing is written to disk.

A row whose whole step would take longer than ``WHOLE_DEPTH_SECONDS`` (``step_flops`` at ``ASSUMED_FLOPS``, or
the more a row before reached) is measured at ``SCALED_DEPTHS`` blocks and scaled by depth: with checkpointing,
what a step holds grows linearly with the blocks (weights, adapters and optimizer state, gradients, one kept
input per block), so two depths give the line (``scaled_to_depth``), phase by phase. Not from one block: with
activation offload a model of two blocks or more also holds the next block's input, fetched back ahead during
backward (``studio.core.memory.parts.offload``), which one block never does; a line through one and two blocks
counts that input once per block (the first GPU run scaled 2.8 to 4 times over). From two blocks on, each
block adds the same. The allocator's reserved bytes and NVML's do not follow a line (the allocator's cache
depends on the order of its blocks, not on the depth): scaled, they are the scaled allocated bytes plus what
they measured beyond the allocated ones at the deepest depth measured. A whole row that runs out
of the card's memory is measured so too, without the card's limit: how much it needed. A row that would not
finish within the part's time is skipped, with the reason. Measured: the allocator's peak allocated and reserved bytes,
NVML's used bytes (this process's: over what the GPU used before it started) and the pinned host bytes of
torch's caching host allocator; beside each, what the estimate predicts for it (``predicted``).

benchmarks/gpu_checks.py runs this in a process of its own (``run_rows``), and reads its rows as they come.
"""

from __future__ import annotations

import gc
import json
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from memory_frontier import LEAN_SETTINGS, MODELS, card_bytes, config_with, longest_fitting, usable_gib
from studio.core.memory.estimate import estimate
from studio.core.memory.regime import pinned_bytes
from studio.core.validation import raise_if_invalid
from studio.train.measure.memtrack import LiveTensorTracker, tracker_for
from studio.train.measure.simulate import _base_model_on_meta, full_length_batches, run_optimizer_steps, target_tokens
from studio.train.model.build import build_model
from studio.train.optim import build_optimizer
from studio.train.savers.host_weights import host_weights, keep_weights_on_cpu

GIB = 2**30
# (model, card size in GB) cheapest first: when time runs short, the longest row (8B at 80 GB) is the one skipped.
ROWS = (("Llama-3.1-8B", 8), ("Llama-3.1-8B", 12), ("Llama-3.1-8B", 24), ("Llama-3.3-70B", 48),
        ("Llama-3.3-70B", 80), ("Llama-3.1-8B", 80))
# What one step reaches on an H200, NF4 dequantization and offload copies included (a row that measures more
# raises it).
ASSUMED_FLOPS = 250e12
WHOLE_DEPTH_SECONDS = 20.0  # a longer whole step is measured at SCALED_DEPTHS and scaled by depth
SCALED_DEPTHS = (2, 3)  # not 1: one block has no input fetched ahead (see above)
WARM_UP_TOKENS = 256  # the step that makes the optimizer state: its size does not depend on the length
SETUP_SECONDS = 6.0  # building, quantizing and freeing one model and its warm-up step, beside the measured step


@dataclass(frozen=True)
class Row:
    model: str
    card_gb: int  # the card's nominal size (memory_frontier.CARDS: emulated as it reports its memory)
    tokens: int
    layers: int
    depths: tuple[int, ...]  # (layers,): the whole model; else the depths measured and scaled

    @property
    def name(self) -> str:
        depth = "whole" if self.depths == (self.layers,) else f"{' and '.join(map(str, self.depths))} blocks, scaled"
        return f"{self.model}, {self.card_gb} GB card, {self.tokens:,} tokens ({depth})"


def step_flops(model: dict, tokens: int, layers: int) -> float:
    """Floating-point operations of one optimizer step with checkpointing and a frozen base: per block the
    forward, its recomputation and the backward to the inputs (6 per weight and token) and causal attention
    (about 9 T^2 d); and the output layer's forward and backward to its input."""
    hidden, heads = model["hidden_size"], model["num_attention_heads"]
    head_dim = model.get("head_dim") or hidden // heads
    kv_width = model["num_key_value_heads"] * head_dim
    block_weights = hidden * (2 * heads * head_dim + 2 * kv_width) + 3 * hidden * model["intermediate_size"]
    per_block = 6 * block_weights * tokens + 9 * tokens**2 * heads * head_dim
    return layers * per_block + 4 * tokens * hidden * model["vocab_size"]


def plan_row(model_name: str, card_gb: int, flops_per_second: float = ASSUMED_FLOPS) -> Row:
    """The row at the frontier's longest sequence: whole when its step takes at most WHOLE_DEPTH_SECONDS."""
    model = MODELS[model_name]
    tokens = longest_fitting(model, config_with(LEAN_SETTINGS), usable_gib(card_gb))
    layers = model["num_hidden_layers"]
    whole = step_flops(model, tokens, layers) / flops_per_second <= WHOLE_DEPTH_SECONDS
    return Row(model_name, card_gb, tokens, layers, (layers,) if whole else SCALED_DEPTHS)


def row_seconds(row: Row, flops_per_second: float) -> float:
    """About how long measuring ``row`` takes: each depth built, warmed up and stepped once."""
    model = MODELS[row.model]
    return sum(SETUP_SECONDS + step_flops(model, row.tokens, depth) / flops_per_second for depth in row.depths)


def scaled_to_depth(at_depths: dict[int, int], layers: int) -> int:
    """A quantity measured at one or two depths, at ``layers`` blocks: itself, or the line through the two."""
    if len(at_depths) == 1:
        ((depth, value),) = at_depths.items()
        if depth != layers:
            raise ValueError(f"measured at {depth} blocks only: a line needs two depths to reach {layers}")
        return value
    (low, at_low), (high, at_high) = sorted(at_depths.items())
    return round(at_low + (layers - low) * (at_high - at_low) / (high - low))


def scaled_measurement(at_depths: dict[int, dict], layers: int) -> dict:
    """The measured quantities at ``layers`` blocks: each phase's peak scaled apart (the peak is their largest),
    the host bytes scaled; the reserved and NVML-used bytes are the scaled allocated bytes plus what each measured
    beyond the allocated ones at the deepest depth (what the allocator caches does not follow the depth)."""
    first = next(iter(at_depths.values()))
    phases = {phase: scaled_to_depth({d: m["phases"][phase] for d, m in at_depths.items()}, layers)
              for phase in first["phases"] if all(phase in m["phases"] for m in at_depths.values())}
    peak_phase = max(phases, key=phases.get)
    allocated, deepest = phases[peak_phase], at_depths[max(at_depths)]
    beyond = {key: allocated + deepest[key] - deepest["allocated"] for key in ("reserved", "nvml_used")
              if deepest.get(key) is not None}
    host = {key: scaled_to_depth({d: m[key] for d, m in at_depths.items()}, layers)
            for key in ("host", "host_allocator") if all(m.get(key) is not None for m in at_depths.values())}
    return {"allocated": allocated, "peak_phase": peak_phase, "phases": phases, **beyond, **host}


def with_layers(model: dict, layers: int) -> dict:
    return {**model, "num_hidden_layers": layers}


def row_config(tokens: int, folder: Path):
    """The frontier's lean QLoRA config for the model in ``folder`` (its config.json) at ``tokens``."""
    data = {"max_length": tokens, "train_files": (str(folder / "rows.jsonl"),)}  # never read: the batches are random
    config = config_with(LEAN_SETTINGS).replace(model={"name_or_path": str(folder)}, data=data)
    raise_if_invalid(config, check_files=False)
    return config


def predicted(model: dict, config, layers: int) -> dict:
    """What the estimate says each measured quantity reaches: the tensors (the allocator's allocated bytes),
    the tensors and the allocator's margin (reserved), all of it with the CUDA context (NVML's used), and the
    CPU RAM beside the GPU (host)."""
    found = estimate(with_layers(model, layers), config)
    margin = found.parts["allocator_margin"]
    tensors = found.peak_bytes - found.parts["cuda_context"] - margin
    return {"allocated": tensors, "reserved": tensors + margin, "nvml_used": found.peak_bytes,
            "host": sum(d.total_bytes for d in found.devices if d.device == "host")}


# ---------------------------------------------------------------- random NF4 weights, made on the device


def random_model(config, device: torch.device, layers: int):
    """The worker's model (build_model) with ``layers`` blocks and random weights made on ``device``: built on
    the meta device from config.json, then each tensor made there, the 4-bit ones quantized there."""
    with _base_model_on_meta(layers):
        model = build_model(config, torch.device("meta"))
    made: dict[int, tuple] = {}  # a parameter shared by several modules stays shared
    for module in model.modules():
        _materialize(module, device, made)
    return model


def _materialize(module: torch.nn.Module, device: torch.device, made: dict[int, tuple]) -> None:
    """``module``'s own meta parameters and buffers as tensors on ``device``: random (norms: ones), rotary
    embeddings' frequencies computed again there."""
    if type(module).__name__.endswith("RotaryEmbedding"):
        with device:  # transformers makes the frequencies on the default device
            module._buffers.update(type(module)(module.config)._buffers)
        return
    norm = "Norm" in type(module).__name__
    for name, param in list(module._parameters.items()):
        if param is None or not param.is_meta:
            continue
        if id(param) not in made:
            values = torch.empty(param.shape, dtype=param.dtype, device=device)
            values = values.fill_(1.0) if norm else values.normal_(0.0, 0.02)
            quantized = type(param).__name__ == "Params4bit"
            made[id(param)] = param, (_nf4(param, values, module) if quantized
                                      else torch.nn.Parameter(values, requires_grad=param.requires_grad))
        module._parameters[name] = made[id(param)][1]
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and buffer.is_meta:
            module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)


def _nf4(meta, values: torch.Tensor, module: torch.nn.Module):
    """``values`` as the 4-bit weight ``meta`` describes, quantized by bitsandbytes where they are."""
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(values, requires_grad=False, blocksize=meta.blocksize,
                             compress_statistics=meta.compress_statistics, quant_type=meta.quant_type,
                             quant_storage=meta.quant_storage, module=module).to(values.device)


# ---------------------------------------------------------------- NVML


def nvml_used_by_uuid() -> dict[str, int]:
    """NVML's used bytes of every GPU, by UUID ({} without NVML): read before this process makes its context."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return {str(pynvml.nvmlDeviceGetUUID(h)): int(pynvml.nvmlDeviceGetMemoryInfo(h).used) for h in handles}
    except Exception:  # no NVML or no driver
        return {}


def device_uuid(device: torch.device) -> str:
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


def nvml_handle(device: torch.device):
    """The NVML handle of the GPU torch uses (by its UUID, not its index; the only GPU when NVML does not know
    the UUID), or None without NVML."""
    try:
        import pynvml

        try:
            return pynvml.nvmlDeviceGetHandleByUUID(device_uuid(device))
        except pynvml.NVMLError:
            return pynvml.nvmlDeviceGetHandleByIndex(0) if pynvml.nvmlDeviceGetCount() == 1 else None
    except Exception:  # no NVML
        return None


def used_bytes(handle) -> int:
    import pynvml

    return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)


class NvmlPeak:
    """The peak of NVML's used bytes of one GPU while inside, sampled every 10 ms from a thread (none: 0)."""

    def __init__(self, handle):
        self.handle, self.peak = handle, 0

    def __enter__(self) -> "NvmlPeak":
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="nvml-peak")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        while self.handle is not None:
            self.peak = max(self.peak, used_bytes(self.handle))
            if self._done.wait(0.01):
                return


# ---------------------------------------------------------------- host RAM


class HostTensorCount(LiveTensorTracker):
    """The host RAM of a step as the CPU measurement counts it (``add_module``'s host weights, the offloaded block
    inputs made ``on_host``), each pinned one as the block torch's caching host allocator gives it (a power of
    two, as the estimate counts it). On CUDA the allocator's own peak is no count of this: torch sums each block
    size's peak however far apart in time they were, and a freed block stays counted until a later pinned
    allocation finds its copy done (``host_allocator_peak``)."""

    def __init__(self):
        super().__init__("cpu")

    def counted_bytes(self, storage) -> int:
        return pinned_bytes(storage.nbytes(), "cuda") if storage.is_pinned() else storage.nbytes()


def host_allocator_peak() -> int | None:
    """The peak of the pinned bytes torch's caching host allocator had handed out since its peak was reset (None
    where torch does not say); see HostTensorCount for why it overstates."""
    stats = torch.cuda.host_memory_stats()
    return stats.get("active_bytes.peak", stats.get("allocated_bytes.peak"))


# ---------------------------------------------------------------- measuring


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_depth(config, model: dict, layers: int, device: torch.device, nvml=None, nvml_before: int = 0) -> dict:
    """One steady optimizer step of the model at ``layers`` blocks on ``device``, after one at WARM_UP_TOKENS that
    makes the optimizer state: the peak allocated (per phase), and on CUDA reserved, NVML's used over
    ``nvml_before`` and the pinned host bytes; on the CPU the tracker's host bytes (counted apart)."""
    cuda = device.type == "cuda"
    left_before = torch.cuda.memory_allocated(device) if cuda else 0  # tensors of a row before: never counted as ours
    torch.manual_seed(config.training.seed)
    trained = random_model(config, device, layers)
    keep_weights_on_cpu(trained, config, device)
    optimizer = build_optimizer(config, [p for p in trained.parameters() if p.requires_grad])
    short = config.replace(data={"max_length": WARM_UP_TOKENS})
    warm_up = full_length_batches(short, model["vocab_size"], device)
    run_optimizer_steps(trained, optimizer, warm_up, short, tracker_for(device), 1, target_tokens(warm_up))
    del warm_up
    batches = full_length_batches(config, model["vocab_size"], device)
    if cuda:
        torch.cuda.reset_peak_host_memory_stats()  # torch 2.5 and later, as host_memory_stats
    started = time.perf_counter()
    with NvmlPeak(nvml) as sampled, tracker_for(device) as tracker, HostTensorCount() as host_count:
        for counter in (tracker, host_count):
            counter.add_module(trained, host=host_weights(trained))
        tracker.add(batches)
        run_optimizer_steps(trained, optimizer, batches, config, tracker, 1, target_tokens(batches))
    measured = {"allocated": tracker.report.peak_bytes, "peak_phase": tracker.report.peak_phase,
                "phases": dict(tracker.report.phase_peaks), "seconds": round(time.perf_counter() - started, 2),
                "host": host_count.host_report.peak_bytes}
    if cuda:
        measured.update(reserved=tracker.peak_reserved_bytes, allocated_before=left_before,
                        nvml_used=sampled.peak - nvml_before if nvml is not None else None,
                        host_allocator=host_allocator_peak())
    del trained, optimizer, batches, tracker
    release(device)
    return measured


def emulate_card(card_gb: int, device: torch.device, context_bytes: int) -> dict:
    """Hold this process's allocator to the card (as it reports its memory, less the display's) less the CUDA
    context; and whether the allocator refuses more."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = (card_bytes(card_gb) - context_bytes) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        probe = torch.empty(card_bytes(card_gb), dtype=torch.uint8, device=device)
        del probe
        enforced = False
    except torch.OutOfMemoryError:
        enforced = True
    release(device)
    return {"fraction": round(fraction, 5), "fraction_enforced": enforced}


def measure_row(row: Row, model: dict, folder: Path, device: torch.device, nvml=None, nvml_before: int = 0,
                context_bytes: int = 0) -> dict:
    """One frontier row of ``model`` (its config.json) on ``device``: measured (scaled to the whole depth when
    measured at fewer blocks) and predicted, or the depth at which it ran out of memory."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model), encoding="utf-8")
    config = row_config(row.tokens, folder)
    result = {"part": "frontier", "check": row.name, **asdict(row), "context_bytes": context_bytes,
              "predicted": predicted(model, config, row.layers)}
    if device.type == "cuda":
        result.update(emulate_card(row.card_gb, device, context_bytes))
    started = time.perf_counter()
    at_depths, failure = measure_depths(config, model, row.depths, device, nvml, nvml_before)
    result["status"] = failure or "completed"
    out_of_memory = failure is not None
    if out_of_memory and row.depths == (row.layers,) and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        at_depths, again = measure_depths(config, model, SCALED_DEPTHS, device, nvml, nvml_before)
        result["status"] = (f"does not fit: {failure}; what it needs measured at "
                            f"{' and '.join(map(str, SCALED_DEPTHS))} blocks without the card's limit")
        failure = again
    result["at_depths"] = at_depths
    if failure is None:
        result["measured"] = scaled_measurement(at_depths, row.layers)
        if out_of_memory:  # whatever the scaled need says: the card's limit refused it
            result["fits"] = False
        elif result["measured"].get("nvml_used") is not None:
            result["fits"] = result["measured"]["nvml_used"] <= card_bytes(row.card_gb)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def measure_depths(config, model: dict, depths: tuple[int, ...], device: torch.device, nvml=None,
                   nvml_before: int = 0) -> tuple[dict[int, dict], str | None]:
    """``measure_depth`` at each of ``depths``, with what the estimate predicts there; and where it ran out of
    memory (None: it did not)."""
    at_depths: dict[int, dict] = {}
    for depth in depths:
        try:
            at_depths[depth] = measure_depth(config, model, depth, device, nvml, nvml_before)
        except torch.OutOfMemoryError as exc:
            failure = f"out of memory at {depth} blocks: {str(exc).splitlines()[0][:160]}"
        else:
            at_depths[depth]["predicted"] = predicted(model, config, depth)
            continue
        # only now, the exception gone: its traceback held the step's frames (the model, its tensors), which the
        # first GPU run's next depth then measured as its own (the 8 GB row's 1 block above its 2 blocks)
        release(device)
        return at_depths, failure
    return at_depths, None


def cuda_context(device: torch.device) -> tuple[object, int, int]:
    """Make this process's CUDA context, cuBLAS and bitsandbytes loaded: (the NVML handle, NVML's used bytes
    before, the context's bytes: what NVML adds beyond the allocator's reserved)."""
    import bitsandbytes as bnb

    before = nvml_used_by_uuid()
    square = torch.randn(64, 64, device=device, dtype=torch.bfloat16)
    bnb.functional.quantize_4bit(square @ square)
    torch.cuda.synchronize(device)
    del square
    release(device)
    nvml = nvml_handle(device)
    if nvml is None:
        return None, 0, 0
    nvml_before = before.get(device_uuid(device), 0)
    return nvml, nvml_before, used_bytes(nvml) - nvml_before - torch.cuda.memory_reserved(device)


def measured_rate(result: dict, model: dict) -> float | None:
    """The FLOP/s the steady steps of a completed row reached (None for a row that did not complete)."""
    if result["status"] != "completed":
        return None
    stepped = sum(m["seconds"] for m in result["at_depths"].values())
    if stepped <= 0:
        return None
    return sum(step_flops(model, result["tokens"], depth) for depth in result["depths"]) / stepped


def run_rows(rows_file: Path, work: Path, until: float) -> None:
    """Every frontier row that can be done by ``until`` (a time.time), each appended to ``rows_file`` as one
    JSON line when done."""
    from studio.train.worker import use_expandable_segments

    use_expandable_segments()  # as the worker does, before CUDA allocates
    device = torch.device("cuda", 0)
    nvml, nvml_before, context = cuda_context(device)
    flops_per_second = ASSUMED_FLOPS
    for model_name, card in ROWS:
        row = plan_row(model_name, card, flops_per_second)
        expected, left = row_seconds(row, flops_per_second), until - time.time()
        if expected > left:
            result = {"part": "frontier", "check": row.name, **asdict(row),
                      "status": f"skipped: would take about {expected:.0f} s, {max(left, 0):.0f} s of the part left"}
        else:
            try:
                result = measure_row(row, MODELS[model_name], work / model_name, device, nvml, nvml_before, context)
            except Exception as exc:  # said in its row: the rows after it still run
                release(device)
                result = {"part": "frontier", "check": row.name, **asdict(row), "status": f"failed: {exc!r}"[:300],
                          "error": traceback.format_exc()[-1500:]}
                torch.cuda.set_per_process_memory_fraction(1.0, device)
            rate = measured_rate(result, MODELS[model_name])
            if rate:  # a short row's rate understates a long one's (attention's share grows): only ever raised
                result["flops_per_second"] = round(rate)
                flops_per_second = max(flops_per_second, rate)
        with open(rows_file, "a", encoding="utf-8") as out:
            out.write(json.dumps(result) + "\n")
