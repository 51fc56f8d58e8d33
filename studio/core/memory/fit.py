"""Find the fastest configuration that fits a GPU, keeping the effective batch size.

``fit(model_config, config, gpu_bytes)`` tries every combination of the memory
savers below on the run config, estimates each (``studio.core.memory.estimate``,
about a millisecond apiece) and returns the one with the shortest expected
step time among those that fit; each change it made is explained with the
bytes it saves, applied cheapest first. "Fit" means the estimate's verdict
"fits" (below 90 % of the GPU); a "tight" candidate is taken only when none
fits comfortably. When nothing fits it returns the closest candidate and says
what stands in the way.

The savers, cheapest first (``SAVERS``): a smaller micro-batch with more
gradient accumulation (the effective batch micro-batch x accumulation is kept),
gradient checkpointing, offloading its block inputs to CPU RAM, the 8-bit AdamW optimizer, the input embedding in
CPU RAM (adapters on one GPU), the output layer in CPU RAM (adapters, the chunked loss), a 4-bit base model (LoRA becomes QLoRA), the tiled MLP and, when allowed, ZeRO optimizer offload to CPU RAM. The
method (full or LoRA) and the sequence length are never changed: they change
what is trained; the explanation says when they are what would help.

Expected step time is relative and rule-of-thumb: each micro-step costs a fixed
overhead worth ``MICRO_STEP_OVERHEAD_TOKENS`` tokens, checkpointing recomputes
the forward pass (x1.33), its offloaded block inputs cost what their copies do not hide behind the compute
(x1.03: a block's input is 2·hidden bytes a token each way over PCIe, against about 8 x its parameters
in FLOPs a token; docs/memory-estimate.md), a 4-bit base dequantizes every weight (x1.25), the tiled MLP
runs the MLP's forward once more (about two thirds of a block's FLOPs, a sixth of a checkpointed step: x1.2), the
8-bit optimizer step is a little slower (x1.02), the embedding in CPU RAM adds a gather and a copy (x1.01), the
output layer in CPU RAM a copy of it to the GPU per micro-batch (x1.03) and offload moves the optimizer step to
the CPU (x1.5).

Pure Python, like the estimate: the GUI calls it directly. A model no family
describes is searched the same way from its trace (``studio.core.memory.derived``:
micro-batch, accumulation and optimizer are scaled, checkpointing and 4-bit loading
are regimes traced when the model was picked); fit never traces, so a candidate
whose settings the trace holds no step for is skipped and named in the explanation.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from studio.core.config import RunConfig, to_dict
from studio.core.errors import StudioError
from studio.core.memory.estimate import ScaleOut, TIGHT_FRACTION, Estimate, estimate, format_bytes
from studio.core.memory.derived import TRACED_SAVERS, TraceNeededError
from studio.core.memory.parts import PARTS
from studio.core.memory.regime import embedding_on_cpu_allowed, output_layer_on_cpu_allowed
from studio.core.memory.run_data import config_for_longest_row
from studio.core.memory.parts.tiled import tiles_its_mlp
from studio.core.model.info import ModelShape, UnknownArchitectureError, model_shape

MICRO_STEP_OVERHEAD_TOKENS = 256
CHECKPOINTING_SLOWDOWN = 1.33
FOUR_BIT_SLOWDOWN = 1.25
EIGHT_BIT_OPTIMIZER_SLOWDOWN = 1.02
EMBEDDING_ON_CPU_SLOWDOWN = 1.01  # a CPU gather and one copy of the rows per micro-batch (not measured on a GPU)
# the output layer copied to the GPU once per micro-batch (1 GiB of an 8B's at about 25 GB/s: some 40 ms against a
# second or more of compute for a 2,048-token micro-batch; not measured on a GPU)
OUTPUT_LAYER_ON_CPU_SLOWDOWN = 1.03
OFFLOAD_SLOWDOWN = 1.5
ACTIVATION_OFFLOAD_SLOWDOWN = 1.03
TILED_MLP_SLOWDOWN = 1.2


@dataclass(frozen=True)
class Candidate:
    """A run config and how it is spread over GPUs."""

    config: RunConfig
    scale_out: ScaleOut


@dataclass(frozen=True)
class Saver:
    """One way to trade speed for memory: its options for a candidate, and how to describe a change."""

    name: str
    options: Callable[[Candidate], list[Candidate]]  # the candidate itself first
    describe: Callable[[Candidate, Candidate], str]  # (before, after) -> what changed


def _micro_batches(c: Candidate) -> list[Candidate]:
    t = c.config.training
    effective = t.micro_batch_size * t.gradient_accumulation_steps
    sizes = [m for m in range(t.micro_batch_size, 0, -1) if effective % m == 0]
    return [replace(c, config=c.config.replace(training={"micro_batch_size": m, "gradient_accumulation_steps": effective // m}))
            for m in sizes]


def _checkpointing(c: Candidate) -> list[Candidate]:
    options = [c]
    if not c.config.training.gradient_checkpointing:
        options.append(replace(c, config=c.config.replace(training={"gradient_checkpointing": True})))
    return options


def _activation_offload(c: Candidate) -> list[Candidate]:
    options = [c]
    t = c.config.training
    if t.gradient_checkpointing and not t.activation_offload:
        options.append(replace(c, config=c.config.replace(training={"activation_offload": True})))
    return options


def _tiled_mlp(c: Candidate) -> list[Candidate]:
    options = [c]
    if not c.config.training.tiled_mlp:
        options.append(replace(c, config=c.config.replace(training={"tiled_mlp": True})))
    return options


def _eight_bit_optimizer(c: Candidate) -> list[Candidate]:
    options = [c]
    if c.config.training.optimizer == "adamw":
        options.append(replace(c, config=c.config.replace(training={"optimizer": "adamw_8bit"})))
    return options


def _four_bit_base(c: Candidate) -> list[Candidate]:
    options = [c]
    config = c.config
    spec = config.method_spec
    if spec.kbit_base != "no" and config.effective_load_in != "4bit" and not config.qat.enabled:
        method = spec.quantized_as or config.method
        options.append(replace(c, config=config.replace(method=method, quantization={"load_in": "4bit"})))
    return options


def _embedding_on_cpu(c: Candidate) -> list[Candidate]:
    options = [c]
    config = c.config
    alone = c.scale_out.num_gpus == 1 and not c.scale_out.uses_zero
    if not config.training.embedding_on_cpu and embedding_on_cpu_allowed(config) and alone:
        options.append(replace(c, config=config.replace(training={"embedding_on_cpu": True})))
    return options


def _output_layer_on_cpu(c: Candidate) -> list[Candidate]:
    options = [c]
    config = c.config
    whole_model = not c.scale_out.uses_zero and not c.scale_out.split_devices
    if not config.training.output_layer_on_cpu and output_layer_on_cpu_allowed(config) and whole_model:
        options.append(replace(c, config=config.replace(training={"output_layer_on_cpu": True})))
    return options


def _offload(c: Candidate) -> list[Candidate]:
    options = [c]
    t = c.config.training
    if not c.scale_out.offload_optimizer and not t.embedding_on_cpu and not t.output_layer_on_cpu:
        stage = max(c.scale_out.zero_stage, 2)
        options.append(replace(c, scale_out=replace(c.scale_out, zero_stage=stage, offload_optimizer=True)))
    return options


def _describe_micro_batch(before: Candidate, after: Candidate) -> str:
    b, a = before.config.training, after.config.training
    return (f"training.micro_batch_size {b.micro_batch_size} -> {a.micro_batch_size} with "
            f"gradient_accumulation_steps {b.gradient_accumulation_steps} -> {a.gradient_accumulation_steps}")


SAVERS: tuple[Saver, ...] = (
    Saver("micro_batch", _micro_batches, _describe_micro_batch),
    Saver("checkpointing", _checkpointing, lambda b, a: "training.gradient_checkpointing on"),
    Saver("activation_offload", _activation_offload,
          lambda b, a: "training.activation_offload on (the block inputs wait in CPU RAM)"),
    Saver("optimizer", _eight_bit_optimizer, lambda b, a: "training.optimizer adamw -> adamw_8bit"),
    Saver("embedding_on_cpu", _embedding_on_cpu, lambda b, a: "training.embedding_on_cpu on (the input embedding "
          "in CPU RAM)"),
    Saver("output_layer_on_cpu", _output_layer_on_cpu, lambda b, a: "training.output_layer_on_cpu on (the output "
          "layer in CPU RAM, on the GPU only for the loss)"),
    Saver("four_bit", _four_bit_base, lambda b, a: "4-bit base model (method qlora, quantization.load_in 4bit)"),
    Saver("tiled_mlp", _tiled_mlp, lambda b, a: "training.tiled_mlp on (each MLP recomputed a tile of tokens at a time)"),
    Saver("offload", _offload, lambda b, a: f"ZeRO stage {a.scale_out.zero_stage} with optimizer offload to CPU RAM"),
)


def relative_step_time(c: Candidate, reference: Candidate) -> float:
    """Expected time of one optimizer step of ``c``, relative to ``reference`` (rules of thumb above)."""
    return _step_cost(c) / _step_cost(reference)


def _step_cost(c: Candidate) -> float:
    t, config = c.config.training, c.config
    cost = t.gradient_accumulation_steps * (MICRO_STEP_OVERHEAD_TOKENS + t.micro_batch_size * config.data.max_length)
    if t.gradient_checkpointing:
        cost *= CHECKPOINTING_SLOWDOWN
    if t.gradient_checkpointing and t.activation_offload:
        cost *= ACTIVATION_OFFLOAD_SLOWDOWN
    if t.tiled_mlp:
        cost *= TILED_MLP_SLOWDOWN
    if config.effective_load_in == "4bit":
        cost *= FOUR_BIT_SLOWDOWN
    if t.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        cost *= EIGHT_BIT_OPTIMIZER_SLOWDOWN
    if t.embedding_on_cpu:
        cost *= EMBEDDING_ON_CPU_SLOWDOWN
    if t.output_layer_on_cpu:
        cost *= OUTPUT_LAYER_ON_CPU_SLOWDOWN
    if c.scale_out.offload_optimizer:
        cost *= OFFLOAD_SLOWDOWN
    return cost


@dataclass(frozen=True)
class Change:
    """One change the solver made, with the bytes it saves after the changes before it."""

    saver: str
    description: str
    saves_bytes: int
    mostly: str  # the part that shrank most

    def __str__(self) -> str:
        return f"{self.description}: saves {format_bytes(self.saves_bytes)} (mostly {self.mostly.replace('_', ' ')})"


@dataclass(frozen=True)
class FitResult:
    """The solver's answer: the configuration to use, its estimate and why."""

    fits: bool
    config: RunConfig
    scale_out: ScaleOut
    estimate: Estimate
    gpu_bytes: int
    changes: tuple[Change, ...]
    relative_step_time: float
    explanation: str

    def to_json(self) -> dict:
        return {
            "fits": self.fits, "gpu_bytes": self.gpu_bytes, "needed_bytes": self.estimate.peak_bytes,
            "verdict": self.estimate.verdict(self.gpu_bytes).status,
            "relative_step_time": round(self.relative_step_time, 3),
            "changes": [{"saver": c.saver, "description": c.description, "saves_bytes": c.saves_bytes, "mostly": c.mostly}
                        for c in self.changes],
            "scale_out": asdict(self.scale_out),
            "config": to_dict(self.config), "estimate": self.estimate.to_json(self.gpu_bytes),
            "explanation": self.explanation,
        }


def fit(model_config: dict | ModelShape, config: RunConfig, gpu_bytes: int, device_type: str = "cuda",
        scale_out: ScaleOut = ScaleOut(), allow_offload: bool = False, **estimate_options: Any) -> FitResult:
    """The fastest-expected configuration whose estimate fits in ``gpu_bytes`` (see the module docstring)."""
    if gpu_bytes <= 0:
        raise StudioError(f"GPU memory must be positive, got {gpu_bytes} bytes", "give it like 24GiB", kind="usage")
    try:
        shape = model_config if isinstance(model_config, ModelShape) else model_shape(model_config)
    except UnknownArchitectureError:
        shape = None  # no family describes it: each candidate is estimated from the model's trace

    def estimated(c: Candidate) -> Estimate:
        return estimate(shape or model_config, c.config, device_type, c.scale_out, **estimate_options)

    original = Candidate(config, scale_out)
    estimated(original)  # a model without a trace for these settings: TraceNeededError, as the estimate says
    # a model no family describes: issue 14's savers would each need a new trace (TRACED_SAVERS), so not offered
    savers = [s for s in SAVERS if (allow_offload or s.name != "offload") and (shape is not None or s.name not in
              TRACED_SAVERS) and (s.name != "tiled_mlp" or (shape is not None and tiles_its_mlp(shape)))]
    scored, untraced = _scored(_candidates(original, savers), estimated)
    comfortable = [(c, e) for c, e in scored if e.peak_bytes <= TIGHT_FRACTION * gpu_bytes]
    fitting = comfortable or [(c, e) for c, e in scored if e.peak_bytes <= gpu_bytes]
    if fitting:
        chosen, chosen_estimate = min(fitting, key=lambda ce: (relative_step_time(ce[0], original), ce[1].peak_bytes))
    else:
        chosen, chosen_estimate = min(scored, key=lambda ce: ce[1].peak_bytes)
    changes = _explain_changes(original, chosen, savers, estimated)
    result = FitResult(bool(fitting), chosen.config, chosen.scale_out, chosen_estimate, gpu_bytes, tuple(changes),
                       relative_step_time(chosen, original), "")
    parameters = shape.parameter_count if shape else result.estimate.parameters
    return replace(result, explanation=_explanation(result, parameters, estimated(original), untraced))


def _scored(candidates: list[Candidate], estimated) -> tuple[list[tuple[Candidate, Estimate]], list[str]]:
    """Each candidate with its estimate; a model no family describes skips the candidates whose settings its
    trace holds no step for (fit never traces: that takes seconds to minutes apiece), named in the second list."""
    scored, untraced = [], []
    for candidate in candidates:
        try:
            scored.append((candidate, estimated(candidate)))
        except TraceNeededError as exc:
            untraced.append(exc.regime)
    return scored, sorted(set(untraced))


def _candidates(original: Candidate, savers: list[Saver]) -> list[Candidate]:
    """Every combination of every saver's options (a few dozen: each saver has one to a handful)."""
    layer = [original]
    for saver in savers:
        layer = list(itertools.chain.from_iterable(saver.options(c) for c in layer))
    return layer


def _explain_changes(original: Candidate, chosen: Candidate, savers: list[Saver], estimated) -> list[Change]:
    """Apply the chosen candidate's changes one saver at a time, cheapest first, measuring each saving."""
    changes, current = [], original
    before = estimated(current)
    for saver in savers:
        target = _take(saver, current, chosen)
        if target == current:
            continue
        after = estimated(target)
        deltas = {part: before.parts[part] - after.parts[part] for part in PARTS}
        changes.append(Change(saver.name, saver.describe(current, target), before.peak_bytes - after.peak_bytes,
                              max(deltas, key=deltas.get)))
        current, before = target, after
    return changes


def _take(saver: Saver, current: Candidate, chosen: Candidate) -> Candidate:
    """The option of ``saver`` that matches what ``chosen`` has for it."""
    for option in saver.options(current):
        if _agrees(saver.name, option, chosen):
            return option
    return current


def _agrees(saver: str, option: Candidate, chosen: Candidate) -> bool:
    o, c = option.config, chosen.config
    return {
        "micro_batch": o.training.micro_batch_size == c.training.micro_batch_size,
        "checkpointing": o.training.gradient_checkpointing == c.training.gradient_checkpointing,
        "activation_offload": o.training.activation_offload == c.training.activation_offload,
        "optimizer": o.training.optimizer == c.training.optimizer,
        "embedding_on_cpu": o.training.embedding_on_cpu == c.training.embedding_on_cpu,
        "output_layer_on_cpu": o.training.output_layer_on_cpu == c.training.output_layer_on_cpu,
        "four_bit": o.effective_load_in == c.effective_load_in,
        "tiled_mlp": o.training.tiled_mlp == c.training.tiled_mlp,
        "offload": option.scale_out.offload_optimizer == chosen.scale_out.offload_optimizer,
    }[saver]


def _explanation(result: FitResult, parameters: int, original: Estimate, untraced: list[str]) -> str:
    gpu, needed = format_bytes(result.gpu_bytes), format_bytes(result.estimate.peak_bytes)
    skipped = [f"Not tried (the model's trace has no step for these settings): {', '.join(untraced)}."] if untraced else []
    if result.fits and not result.changes:
        return "\n".join([f"The configuration fits as it is: it needs {needed} of {gpu}."] + skipped)
    lines = []
    if result.fits:
        slower = f"; expected step time x{result.relative_step_time:.2f}" if result.relative_step_time > 1.005 else ""
        tight = ", tightly" if result.estimate.verdict(result.gpu_bytes).status == "tight" else ""
        lines.append(f"Fits in {gpu}{tight} with {needed} (it needed {format_bytes(original.peak_bytes)}){slower}. "
                     "Changes:")
    else:
        over = format_bytes(result.estimate.peak_bytes - result.gpu_bytes)
        lines.append(f"Nothing fits in {gpu}. The closest needs {needed}, {over} too much. Changes tried:")
    lines += [f"  - {change}" for change in result.changes]
    if any(change.saver == "activation_offload" for change in result.changes):
        host = next(d for d in result.estimate.devices if d.device == "host")
        lines.append(f"The offloaded activations need {format_bytes(host.parts['activations'])} of CPU RAM.")
    if not result.fits:
        lines.append(_what_stands_in_the_way(result, parameters))
    return "\n".join(lines + skipped)


def _what_stands_in_the_way(result: FitResult, parameters: int) -> str:
    parts = result.estimate.parts
    largest = max(parts, key=parts.get)
    reason = f"The largest part is {largest.replace('_', ' ')} at {format_bytes(parts[largest])}"
    if largest == "weights":
        reason += f": the {parameters / 1e9:.2f} B-parameter model itself"
    if not result.config.uses_adapter:
        reason += "; LoRA or QLoRA trains far fewer parameters and needs much less"
    elif largest in ("activations", "logits_loss"):
        reason += "; a shorter data.max_length shrinks it in proportion"
    return reason + "; or use a GPU with more memory."


def fit_own_data(model_config: dict | ModelShape, config: RunConfig, gpu_bytes: int, longest_row: int,
                 **options: Any) -> FitResult:
    """``fit`` for the run's own data rather than every row at ``data.max_length``: no micro-batch a fit may
    choose holds more than its size times the data's longest row. The run keeps its ``max_length``."""
    result = fit(model_config, config_for_longest_row(config, longest_row), gpu_bytes, **options)
    return replace(result, config=result.config.replace(data={"max_length": config.data.max_length}))
