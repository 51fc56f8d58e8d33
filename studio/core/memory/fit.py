"""Find the fastest configuration that fits a GPU, keeping the effective batch size.

``fit(model_config, config, gpu_bytes)`` tries every combination of the memory
savers below on the run config, estimates each (``studio.core.memory.estimate``,
about a millisecond apiece) and returns the one with the shortest expected
step time among those that fit; each change it made is explained with the
bytes it saves, applied in the steps' order. "Fit" means the estimate's verdict
"fits" (below 90 % of the GPU); a "tight" candidate is taken only when none
fits comfortably, and never closer than ``FIT_MARGIN`` to the GPU's size (the
estimate's allocator margin is a rule of thumb until a GPU measures it). When
nothing fits it returns the closest candidate and says what stands in the way.

Fit's steps, in the order it tries and explains them (``FIT_STEPS``): a layer split over several GPUs to a
pipeline of as many stages, faster as every GPU computes, or N data-parallel processes to S stages x N/S replicas,
each GPU holding 1/S of the blocks (GPipe or 1F1B, where the config and the model allow one:
studio.core.memory.placement); another micro-batch size with the accumulation that keeps the effective batch
(micro-batch x accumulation); then, ranked among them, the switches
of the table of memory savers (``studio.core.memory.savers``: checkpointing, its block inputs in CPU RAM, the
input embedding and the output layer in CPU RAM, the tiled MLP), the 8-bit AdamW optimizer, a 4-bit base model
(LoRA becomes QLoRA), when allowed, ZeRO optimizer offload to CPU RAM, and for a vision-language model, last, a
lower image resolution (vision.max_pixels: fewer patches and tokens an image, said). Each step goes both ways: a saver
the run has on is tried off too, so that where there is room fit finds the faster configuration, not only a
smaller one. A switch is turned on only where validation allows it and the candidate's GPUs can hold it. The
method (full or LoRA) and the sequence length are never changed: they change what is trained; the explanation
says when they are what would help.

Expected step time is relative and rule-of-thumb, from the savers' module: each micro-step costs a fixed
overhead worth ``STEP_COSTS["micro_step_tokens"]`` tokens, and each step in force multiplies the time by its
slowdown (a switch's from its row; a 4-bit base, the 8-bit optimizer and offload from ``STEP_COSTS``; a
pipeline's from its bubble, ``studio.core.memory.placement.step_time_factor``: against data parallelism, whose
processes each run the accumulation the pipeline's replicas run S times, 1 / (1 - bubble)). ZeRO-3's gathering of
the weights is not priced.

Pure Python, like the estimate: the GUI calls it directly. A model no family
describes is searched the same way from its trace (``studio.core.memory.derived``:
micro-batch, accumulation and optimizer are scaled, checkpointing and 4-bit loading
are regimes traced when the model was picked); fit never traces, so a candidate
whose settings the trace holds no step for is skipped and named in the explanation.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from studio.core.config import DistributedConfig, RunConfig, to_dict
from studio.core.errors import StudioError
from studio.core.memory.derived import TraceNeededError
from studio.core.memory.estimate import ScaleOut, TIGHT_FRACTION, Estimate, estimate
from studio.core.memory.parts import PARTS
from studio.core.memory.parts.vision import image_rule, load_preprocessor_config
from studio.core.memory.placement import (WeightsDoNotFitError, bubble, pipeline_refusals, runs_micro_batches,
                                          step_time_factor)
from studio.core.memory.run_data import config_for_longest_row
from studio.core.memory.savers import SAVER_SPECS, STEP_COSTS, ZERO, SaverSpec
from studio.core.methods import METHOD_SPECS, trains_like
from studio.core.model.info import ModelShape, UnknownArchitectureError, model_shape
from studio.core.model.stages import pipeline_family_refusal
from studio.core.sizes import format_bytes

FIT_MARGIN = 0.02  # of the GPU's memory fit always leaves free


@dataclass(frozen=True)
class Candidate:
    """A run config and how it is spread over GPUs."""

    config: RunConfig
    scale_out: ScaleOut


@dataclass(frozen=True)
class FitStep:
    """One way to trade speed for memory: its options for a candidate, and how to describe and price a change."""

    name: str
    rank: int  # fit tries the steps in this order (the savers' table ranks its switches among these)
    options: Callable[[Candidate], list[Candidate]]  # the candidate itself first
    describe: Callable[[Candidate, Candidate], str]  # (before, after) -> what changed
    agrees: Callable[[Candidate, Candidate], bool]  # whether an option has what the chosen candidate has for it
    slowdown: Callable[[Candidate], float]  # its factor on the candidate's step time (1.0 where not in force)
    saver: SaverSpec | None = None  # the switch it turns on, for the table's switches


def _micro_batches(c: Candidate) -> list[Candidate]:
    """Every micro-batch size that divides the effective batch, smaller and larger (fewer micro-steps cost less;
    a pipeline's schedule runs only some micro-batch counts)."""
    t = c.config.training
    effective = t.micro_batch_size * t.gradient_accumulation_steps
    d = c.config.distributed

    def runs(count: int) -> bool:
        return not d.pipeline_stages or runs_micro_batches(d.pipeline_schedule, d.pipeline_stages, count)

    sizes = [t.micro_batch_size] + [m for m in range(effective, 0, -1) if effective % m == 0 and m != t.micro_batch_size
                                    and runs(effective // m)]
    return [replace(c, config=c.config.replace(training={"micro_batch_size": m, "gradient_accumulation_steps": effective // m}))
            for m in sizes]


def _describe_micro_batch(before: Candidate, after: Candidate) -> str:
    b, a = before.config.training, after.config.training
    return (f"training.micro_batch_size {b.micro_batch_size} -> {a.micro_batch_size} with "
            f"gradient_accumulation_steps {b.gradient_accumulation_steps} -> {a.gradient_accumulation_steps}")


def _eight_bit(optimizer: str) -> bool:
    return optimizer in ("adamw_8bit", "paged_adamw_8bit")


def _optimizer(c: Candidate) -> list[Candidate]:
    """AdamW to its 8-bit states, or 8-bit AdamW back to AdamW where there is room."""
    other = {"adamw": "adamw_8bit", "adamw_8bit": "adamw", "paged_adamw_8bit": "adamw"}.get(c.config.training.optimizer)
    return [c] if other is None else [c, replace(c, config=c.config.replace(training={"optimizer": other}))]


def _describe_optimizer(before: Candidate, after: Candidate) -> str:
    return f"training.optimizer {before.config.training.optimizer} -> {after.config.training.optimizer}"


def _four_bit_base(c: Candidate) -> list[Candidate]:
    """A 16-bit base to a 4-bit one (LoRA becomes QLoRA, whose own loading is 4-bit), or a 4-bit base back to
    16 bits (QLoRA becomes LoRA) where there is room."""
    config = c.config
    spec = config.method_spec
    if config.effective_load_in == "4bit":
        method = trains_like(config.method)
        if METHOD_SPECS[method].kbit_base == "required":
            return [c]
        return [c, replace(c, config=config.replace(method=method, quantization={"load_in": "auto"}))]
    if spec.kbit_base == "no" or config.qat.enabled:
        return [c]
    renamed = spec.quantized_as  # its own loading is 4-bit: choosing the plain method later unquantizes again
    four_bit = config.replace(method=renamed, quantization={"load_in": "auto"}) if renamed else \
        config.replace(quantization={"load_in": "4bit"})
    return [c, replace(c, config=four_bit)]


def _describe_four_bit(before: Candidate, after: Candidate) -> str:
    if after.config.effective_load_in == "4bit":
        return f"4-bit base model (method {after.config.method}, quantization.load_in 4bit)"
    return f"16-bit base model (method {after.config.method}, quantization.load_in none)"


def _offload(c: Candidate) -> list[Candidate]:
    """ZeRO optimizer offload to CPU RAM, or off again where there is room."""
    if c.scale_out.offload_optimizer:
        return [c, replace(c, scale_out=replace(c.scale_out, offload_optimizer=False))]
    if c.scale_out.layer_split or c.scale_out.pipeline_stages:  # they hold their blocks whole, unsharded
        return [c]
    t = c.config.training
    whole_model_savers = any(getattr(t, spec.name) and ZERO in spec.not_with for spec in SAVER_SPECS.values())
    if whole_model_savers:  # offload is a ZeRO stage they cannot run in
        return [c]
    stage = max(c.scale_out.zero_stage, 2)
    return [c, replace(c, scale_out=replace(c.scale_out, zero_stage=stage, offload_optimizer=True))]


def _describe_offload(before: Candidate, after: Candidate) -> str:
    if after.scale_out.offload_optimizer:
        return f"ZeRO stage {after.scale_out.zero_stage} with optimizer offload to CPU RAM"
    return "no optimizer offload (the optimizer state back on the GPU)"


IMAGE_AREA_STEPS = (4, 16, 64)  # fit's lower pixel limits: a quarter of the area (half of each side) at a time


def _image_resolution(model_config: dict | ModelShape) -> FitStep | None:
    """For a vision-language model: the processor's pixel limit (vision.max_pixels) lowered, each image fewer
    patches and tokens, or back to the processor's own where there is room. Fit lowers it last: it changes what
    the model sees (``_speed`` ranks a higher resolution first). None for a family whose processor gives every image
    one size (Gemma 3, LLaVA: the limit changes nothing)."""
    rule = image_rule(model_config) if isinstance(model_config, dict) else None
    if rule is None or rule.fixed_resolution:
        return None

    def limits(config: RunConfig) -> tuple[dict, int, int]:
        preprocessor = load_preprocessor_config(config.model.name_or_path, config.model.revision)
        own = rule.pixel_limits(preprocessor)[1]
        return preprocessor, own, config.vision.max_pixels or own

    def options(c: Candidate) -> list[Candidate]:
        _, own, current = limits(c.config)
        lower = [current // area for area in IMAGE_AREA_STEPS if current // area]
        back = [0] if c.config.vision.max_pixels and current < own else []
        return [c] + [replace(c, config=c.config.replace(vision={"max_pixels": value})) for value in back + lower]

    def describe(before: Candidate, after: Candidate) -> str:
        preprocessor, own, current = limits(after.config)
        largest = rule.largest(preprocessor, current)
        was = f"{before.config.vision.max_pixels:,}" if before.config.vision.max_pixels else f"the processor's {own:,}"
        return (f"vision.max_pixels {was} -> {after.config.vision.max_pixels or own:,} (an image at most "
                f"{largest.tokens:,} tokens, {largest.patches:,} patches)")

    return FitStep("image_resolution", 95, options, describe,
                   lambda o, c: o.config.vision.max_pixels == c.config.vision.max_pixels, lambda c: 1.0)


def _stage_counts(c: Candidate) -> list[int]:
    """The pipelines fit tries for a candidate, by their stages: a pipeline's own, a layer split's GPUs, or each
    divisor above 1 of the data-parallel processes (S stages x N/S replicas keep the N processes)."""
    d = c.config.distributed
    if d.pipeline_stages or c.scale_out.layer_split:
        stages = d.pipeline_stages or len(c.scale_out.split_devices)
        return [stages] if stages >= 2 else []
    return [s for s in range(2, d.num_processes + 1) if d.num_processes % s == 0]


def _pipeline(c: Candidate) -> list[Candidate]:
    """A layer split over several GPUs to a pipeline of as many stages, or N data-parallel processes (DDP, ZeRO,
    FSDP) to S stages x N/S replicas, each replica running S times the accumulation (the same effective batch: R
    replicas of a pipeline train like one process with R times the accumulation); GPipe, and 1F1B where the step
    has a micro-batch per stage, where a pipeline can run this config; a pipeline to its other schedule."""
    options = [c]
    d, accumulation, split = c.config.distributed, c.config.training.gradient_accumulation_steps, c.scale_out.layer_split
    data_parallel = not split and not d.pipeline_stages
    padded = {"packing": "none"} if c.config.data.packing == "padding_free" else {}  # the stages exchange one shape
    for stages, schedule in itertools.product(_stage_counts(c), ("gpipe", "1f1b")):
        # every machine's processes (a scale-out of the processes' GPUs), or this machine's where none was given
        processes, gpus = (stages, stages) if split else (d.num_processes, max(c.scale_out.num_gpus, d.num_processes))
        piped = c.config.replace(
            distributed={"layer_split": False, "pipeline_stages": stages, "num_processes": processes,
                         "pipeline_schedule": schedule, "sharding": "none", "offload_optimizer": "none",
                         "offload_params": "none"},
            training={"gradient_accumulation_steps": accumulation * stages if data_parallel else accumulation},
            data=padded)
        if piped != c.config and not pipeline_refusals(piped):
            options.append(Candidate(piped, ScaleOut(num_gpus=gpus, pipeline_stages=stages)))
    return options


def _describe_pipeline(before: Candidate, after: Candidate) -> str:
    d, m = after.config.distributed, after.config.training.gradient_accumulation_steps
    b = before.config.distributed
    padded = (", data.packing none: its micro-batches are padded to data.max_length"
              if before.config.data.packing != after.config.data.packing else "")
    idle = f"idle {bubble(d.pipeline_stages, m, d.chunks_per_process):.0%} of the step"
    if b.pipeline_stages:
        return f"a pipeline of {d.pipeline_stages} stages ({d.pipeline_schedule}) instead of {b.pipeline_schedule}: {idle}"
    if before.scale_out.layer_split:
        return f"a pipeline of {d.pipeline_stages} stages ({d.pipeline_schedule}) instead of the layer split{padded}: " \
               f"every GPU computes, {idle}"
    replicas = d.num_processes // d.pipeline_stages
    accumulation = (f", training.gradient_accumulation_steps {before.config.training.gradient_accumulation_steps} -> "
                    f"{m} (a replica's share of the same effective batch)")
    return (f"a pipeline of {d.pipeline_stages} stages x {replicas} replica{'s' if replicas > 1 else ''} "
            f"({d.pipeline_schedule}) instead of {_data_parallel_words(b)} over {b.num_processes} GPUs{accumulation}"
            f"{padded}: each GPU holds 1/{d.pipeline_stages} of the blocks"
            + (", no weights gathered over the links at every micro-batch" if b.shards_weights else "")
            + f", {idle}")


def _data_parallel_words(d: DistributedConfig) -> str:
    return {"none": "data parallelism (DDP)", "fsdp": "FSDP"}.get(d.sharding, f"ZeRO-{d.deepspeed_stage}")


def _pipeline_slowdown(c: Candidate) -> float:
    stages = c.scale_out.pipeline_stages
    return (step_time_factor(stages, c.config.training.gradient_accumulation_steps,
                             c.config.distributed.chunks_per_process) if stages else 1.0)


def _slowdown_when(factor: float, in_force: Callable[[Candidate], bool]) -> Callable[[Candidate], float]:
    return lambda c: factor if in_force(c) else 1.0


_OWN_STEPS = (
    FitStep("micro_batch", 10, _micro_batches, _describe_micro_batch,
            lambda o, c: o.config.training.micro_batch_size == c.config.training.micro_batch_size, lambda c: 1.0),
    FitStep("pipeline", 5, _pipeline, _describe_pipeline,
            lambda o, c: (o.scale_out.pipeline_stages, o.config.distributed.pipeline_schedule)
            == (c.scale_out.pipeline_stages, c.config.distributed.pipeline_schedule), _pipeline_slowdown),
    FitStep("optimizer", 40, _optimizer, _describe_optimizer,
            lambda o, c: o.config.training.optimizer == c.config.training.optimizer,
            _slowdown_when(STEP_COSTS["eight_bit_optimizer"], lambda c: _eight_bit(c.config.training.optimizer))),
    FitStep("four_bit", 70, _four_bit_base, _describe_four_bit,
            lambda o, c: o.config.effective_load_in == c.config.effective_load_in,
            _slowdown_when(STEP_COSTS["four_bit_base"], lambda c: c.config.effective_load_in == "4bit")),
    FitStep("offload", 90, _offload, _describe_offload,
            lambda o, c: o.scale_out.offload_optimizer == c.scale_out.offload_optimizer,
            _slowdown_when(STEP_COSTS["optimizer_offload"], lambda c: c.scale_out.offload_optimizer)),
)


def _switch(spec: SaverSpec) -> FitStep:
    """The step that switches a saver: on where validation allows it and the candidate's GPUs hold it, or off
    where there is room (what acts through it goes off with it)."""

    def options(c: Candidate) -> list[Candidate]:
        if getattr(c.config.training, spec.name):
            dependents = {other.name: False for other in SAVER_SPECS.values() if other.needs == spec.name}
            return [c, replace(c, config=c.config.replace(training={spec.name: False, **dependents}))]
        on = replace(c, config=c.config.replace(training={spec.name: True}))
        if spec.refused(on.config) or not spec.spreads_as(c.scale_out):
            return [c]
        return [c, on]

    def describe(before: Candidate, after: Candidate) -> str:
        if not getattr(after.config.training, spec.name):
            return f"{spec.field} off"
        return f"{spec.field} on" + (f" ({spec.fit_note})" if spec.fit_note else "")

    return FitStep(spec.fit_name or spec.name, spec.fit_rank, options, describe,
                   lambda o, c: getattr(o.config.training, spec.name) == getattr(c.config.training, spec.name),
                   _slowdown_when(spec.slowdown, lambda c: spec.is_on(c.config)), spec)


FIT_STEPS: tuple[FitStep, ...] = tuple(sorted(
    [*_OWN_STEPS, *(_switch(spec) for spec in SAVER_SPECS.values() if spec.fit_rank is not None)],
    key=lambda step: step.rank))


def relative_step_time(c: Candidate, reference: Candidate) -> float:
    """Expected time of one optimizer step of ``c``, relative to ``reference`` (rules of thumb above)."""
    return _step_cost(c) / _step_cost(reference)


def step_time_words(relative: float) -> str:
    """A step's expected time against the original's, in words ("" when about the same)."""
    if relative > 1.005:
        return f"steps about {relative:.2f}x as long"
    if relative < 0.995:
        return f"steps about {1 / relative:.2f}x as fast"
    return ""


def _step_cost(c: Candidate) -> float:
    t, config = c.config.training, c.config
    cost = t.gradient_accumulation_steps * (STEP_COSTS["micro_step_tokens"] + t.micro_batch_size * config.data.max_length)
    for step in FIT_STEPS:
        cost *= step.slowdown(c)
    return cost


@dataclass(frozen=True)
class Change:
    """One change the solver made, with the bytes it saves after the changes before it."""

    saver: str
    description: str
    saves_bytes: int  # negative for a change that takes memory where there is room, to be faster
    mostly: str  # the part that shrank most (grew most, for a change that takes memory)

    def __str__(self) -> str:
        amount = format_bytes(abs(self.saves_bytes))
        effect = f"saves {amount}" if self.saves_bytes >= 0 else f"takes {amount} more"
        return f"{self.description}: {effect} (mostly {self.mostly.replace('_', ' ')})"


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
    host_bytes: int | None = None  # the machine's CPU RAM the run may take, when fit was told it
    # the estimate of the fastest configuration that fits the GPU, where the CPU RAM excluded it
    ram_bound: Estimate | None = None

    def to_json(self) -> dict:
        ram = {} if self.host_bytes is None else {"host_bytes": self.host_bytes,
                                                  "needed_host_bytes": self.estimate.host_bytes,
                                                  "ram_bound": self.ram_bound is not None}
        return {**ram,
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
        scale_out: ScaleOut = ScaleOut(), allow_offload: bool = False, host_bytes: int | None = None,
        **estimate_options: Any) -> FitResult:
    """The fastest-expected configuration whose estimate fits in ``gpu_bytes`` (see the module docstring) and, given
    ``host_bytes`` (the machine's available RAM), whose CPU RAM fits in that."""
    if gpu_bytes <= 0:
        raise StudioError(f"GPU memory must be positive, got {gpu_bytes} bytes", "give it like 24GiB", kind="usage")
    try:
        shape = model_config if isinstance(model_config, ModelShape) else model_shape(model_config)
    except UnknownArchitectureError:
        shape = None  # no family describes it: each candidate is estimated from the model's trace

    def estimated(c: Candidate, compare: bool = False) -> Estimate:
        return estimate(shape or model_config, c.config, device_type, c.scale_out, compare=compare, **estimate_options)

    original = Candidate(config, scale_out)
    estimated(original)  # a model without a trace for these settings: TraceNeededError, as the estimate says
    steps = [step for step in FIT_STEPS if (allow_offload or step.name != "offload") and _offered(step, shape)
             and (step.name != "pipeline" or _cuttable(model_config, shape, config, scale_out))]
    steps += [step for step in (_image_resolution(model_config),) if step is not None]
    scored, untraced = _scored(_candidates(original, steps), estimated)
    held = [(c, e) for c, e in scored if host_bytes is None or e.host_bytes <= host_bytes]
    fitting, ram_bound = _fitting(held, gpu_bytes), None
    if fitting:
        chosen, chosen_estimate = min(fitting, key=lambda ce: _speed(ce, original))
        fastest = min(_fitting(scored, gpu_bytes), key=lambda ce: _speed(ce, original))
        ram_bound = fastest[1] if _speed(fastest, original) < _speed((chosen, chosen_estimate), original) else None
    else:
        chosen, chosen_estimate = min(held or scored, key=lambda ce: ce[1].peak_bytes)
    changes = _explain_changes(original, chosen, steps, estimated)
    if chosen.config.distributed.pipeline_stages:  # with its comparison against the other ways over its GPUs
        chosen_estimate = estimated(chosen, compare=True)
    result = FitResult(bool(fitting), chosen.config, chosen.scale_out, chosen_estimate, gpu_bytes, tuple(changes),
                       relative_step_time(chosen, original), "", host_bytes, ram_bound)
    parameters = shape.parameter_count if shape else result.estimate.parameters
    return replace(result, explanation=_explanation(result, parameters, estimated(original), untraced))


def _fitting(scored: list[tuple[Candidate, Estimate]], gpu_bytes: int) -> list[tuple[Candidate, Estimate]]:
    """The candidates that fit comfortably (below TIGHT_FRACTION of the GPU), else those that fit tightly, within
    FIT_MARGIN of it."""
    comfortable = [(c, e) for c, e in scored if e.peak_bytes <= TIGHT_FRACTION * gpu_bytes]
    return comfortable or [(c, e) for c, e in scored if e.peak_bytes <= (1 - FIT_MARGIN) * gpu_bytes]


def _speed(scored: tuple[Candidate, Estimate], original: Candidate) -> tuple[float, float, int]:
    """How fit ranks a fitting candidate: its images' resolution (the highest: a lower one changes what the
    model sees), its expected step time, then its memory."""
    candidate, estimated = scored
    resolution = candidate.config.vision.max_pixels or math.inf  # 0: the processor's own limit
    return -resolution, relative_step_time(candidate, original), estimated.peak_bytes


def _scored(candidates: list[Candidate], estimated) -> tuple[list[tuple[Candidate, Estimate]], list[str]]:
    """Each candidate with its estimate; a model no family describes skips the candidates whose settings its
    trace holds no step for (fit never traces: that takes seconds to minutes apiece), named in the second list; a
    layer split that cannot hold the weights is no candidate."""
    scored, untraced = [], []
    for candidate in candidates:
        try:
            scored.append((candidate, estimated(candidate)))
        except TraceNeededError as exc:
            untraced.append(exc.regime)
        except WeightsDoNotFitError:  # a layer split whose GPUs this candidate leaves no room for the weights
            continue
    return scored, sorted(set(untraced))


def _offered(step: FitStep, shape: ModelShape | None) -> bool:
    """Whether fit tries ``step`` on this model: a model no family describes (``shape`` None) is estimated from
    its trace, which a saver that keeps other tensors would need anew (fit never traces)."""
    spec = step.saver
    if spec is None:
        return True
    if shape is None:
        return not spec.retraced and spec.model_refusal is None
    return spec.model_refusal is None or spec.model_refusal(shape) is None


def _cuttable(model_config: dict | ModelShape, shape: ModelShape | None, config: RunConfig, scale_out: ScaleOut) -> bool:
    """Whether the pipelines fit tries for this spread can cut this model: a family studio.core.model.info
    describes, none its config.json rules out (studio.core.model.stages: a mixture of experts, a sliding window),
    a block per stage at least of the most stages tried."""
    stages = max(_stage_counts(Candidate(config, scale_out)), default=0)
    if isinstance(model_config, dict) and pipeline_family_refusal(model_config.get("text_config") or model_config):
        return False
    return shape is not None and not shape.experts and shape.layers >= stages


def _candidates(original: Candidate, steps: list[FitStep]) -> list[Candidate]:
    """Every combination of every step's options (a few dozen: each step has one to a handful)."""
    layer = [original]
    for step in steps:
        layer = list(itertools.chain.from_iterable(step.options(c) for c in layer))
    return layer


def _explain_changes(original: Candidate, chosen: Candidate, steps: list[FitStep], estimated) -> list[Change]:
    """Apply the chosen candidate's changes one step at a time, in the steps' order, measuring each saving (a change
    after which a layer split cannot hold the weights is measured together with the next)."""
    changes, current, pending = [], original, []
    before = estimated(current)
    for step in steps:
        target = _take(step, current, chosen)
        if target == current:
            continue
        pending.append((step.name, step.describe(current, target)))
        current = target
        try:
            after = estimated(target)
        except WeightsDoNotFitError:
            continue
        saved = before.peak_bytes - after.peak_bytes
        deltas = {part: (before.parts[part] - after.parts[part]) * (1 if saved >= 0 else -1) for part in PARTS}
        changes.append(Change(" + ".join(name for name, _ in pending), " and ".join(words for _, words in pending),
                              saved, max(deltas, key=deltas.get)))
        before, pending = after, []
    return changes


def _take(step: FitStep, current: Candidate, chosen: Candidate) -> Candidate:
    """The option of ``step`` that matches what ``chosen`` has for it."""
    for option in step.options(current):
        if step.agrees(option, chosen):
            return option
    return current


def _explanation(result: FitResult, parameters: int, original: Estimate, untraced: list[str]) -> str:
    gpu, needed = format_bytes(result.gpu_bytes), format_bytes(result.estimate.peak_bytes)
    skipped = [f"Not tried (the model's trace has no step for these settings): {', '.join(untraced)}."] if untraced else []
    if result.fits and not result.changes:
        return "\n".join([f"The configuration fits as it is: it needs {needed} of {gpu}."] + _ram_lines(result)
                         + skipped)
    lines = []
    if result.fits:
        speed = step_time_words(result.relative_step_time)
        speed = f"; {speed}" if speed else ""
        tight = f", tightly (leaving {FIT_MARGIN:.0%} free)" if result.estimate.verdict(result.gpu_bytes).status == "tight" else ""
        lines.append(f"Fits in {gpu}{tight} with {needed} (it needed {format_bytes(original.peak_bytes)}){speed}. "
                     "Changes:")
    else:
        over = format_bytes(result.estimate.peak_bytes - result.gpu_bytes)
        lines.append(f"Nothing fits in {gpu}. The closest needs {needed}, {over} too much. Changes tried:")
    lines += [f"  - {change}" for change in result.changes]
    changed = {change.saver for change in result.changes}
    offloading = any(step.saver.host_activations and step.saver.is_on(result.config)
                     for step in FIT_STEPS if step.saver and step.name in changed)
    host = next((d for d in result.estimate.devices if d.device == "host"), None)
    if offloading and host is not None:
        lines.append(f"The offloaded activations need {format_bytes(host.parts['activations'])} of CPU RAM.")
    if not result.fits:
        lines.append(_what_stands_in_the_way(result, parameters))
    return "\n".join(lines + _ram_lines(result) + skipped)


def _ram_lines(result: FitResult) -> list[str]:
    """What the machine's CPU RAM allows, when fit was told it: the chosen configuration's need, and whether the
    RAM ruled out a faster one."""
    if result.host_bytes is None:
        return []
    available = format_bytes(result.host_bytes)
    lines = []
    if result.estimate.host_bytes:
        lines.append(f"It needs {format_bytes(result.estimate.host_bytes)} of CPU RAM; this machine has {available} "
                     "available.")
    if result.ram_bound is not None:
        lines.append(f"The CPU RAM bound the choice: a faster configuration that fits the GPU needs "
                     f"{format_bytes(result.ram_bound.host_bytes)} of CPU RAM, more than the {available} available.")
    if not result.fits and result.estimate.host_bytes > result.host_bytes:
        lines.append(f"Every configuration tried needs more CPU RAM than the {available} available.")
    return lines


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
