"""Peak memory of a fine-tuning run, itemized, from the model's config.json and the run config.

The model of memory
-------------------
The estimate predicts the peak of live tensor bytes during a steady training step
(the second and every later one: optimizer state allocated) of the worker in
``studio.train``, plus, on CUDA, the context and the caching allocator's margin.
Live tensors at any moment are

* persistent: base weights (in their dtype, or 4/8-bit with bitsandbytes'
  quantization state; k-bit preparation upcasts everything it does not quantize
  to fp32), LoRA adapters (fp32, as peft keeps them), optimizer state, and the
  inputs;
* gradients, in the trainable parameters' dtype (alive from backward to
  ``zero_grad``; with gradient accumulation also through the next forward);
* saved activations: what autograd keeps for the backward pass. They are
  counted by interpreting each architecture's decoder block (a recipe in
  ``studio.core.model.info``) with the saving rules of every operation:
  a linear layer keeps its input when its weight trains and its (autocast)
  weight copy when its input needs a gradient; RMSNorm keeps an fp32 copy of
  its input; SiLU keeps its input; SDPA keeps q, k, v, output and log-sum-exp;
  dropout keeps a mask; peft's LoRA keeps its own copy of every adapted input.
  Views share their storage and a tensor saved twice counts once. With
  gradient checkpointing only each block's input is kept, and one block is
  recomputed during backward;
* logits and loss: the worker's loss upcasts the logits to fp32 for every
  position, so at its peak (log-softmax backward) three fp32 copies of the
  logits live together;
* temporaries: autocast's 16-bit weight copies, optimizer-step buffers.

Each phase of a step sums these parts at its own peak moment: ``forward`` (the
end of the forward pass and the start of backward, where the loss is),
``backward`` (all gradients, one recomputed block), ``optimizer`` (the update), and
for GRPO ``generation`` (sampling a group between steps: studio.core.memory.parts.generation).
The peak is the largest phase; its parts are reported and sum to the total.
Under ZeRO stages, offload and several GPUs the model states (weights,
gradients, fp32 master weights and optimizer state) are split as the ZeRO
paper and DeepSpeed's estimators do; activations stay per GPU.

This module puts together the parts in ``studio.core.memory`` (see its list)
and, for a layer split, ``studio.core.memory.placement``: the phases of a step, their
peak on each device, and the notes.

Pure Python (no torch): the GUI recomputes it on every toggle (well under 5 ms).
"""

from __future__ import annotations

from dataclasses import replace

from studio.core.config import SAMPLE_NEW_TOKENS, SAMPLED_HELD_OUT_ROWS, RunConfig
from studio.core.memory.derived import (TraceNeededError, cached_trace, derived_estimate, regime_axes, regime_id,
                                        trace_path)
from studio.core.memory.parts.generation import generation_parts, kv_cache_bytes
from studio.core.memory.parts.logits import logits_loss_bytes
from studio.core.memory.parts.offload import offloaded_activations, with_host_activations
from studio.core.memory.parts.states import (OPTIMIZERS, ModelStates, TensorGroup, host_head_bytes,
                                             host_weight_notes, host_weight_ram, model_states, weight_bytes)
from studio.core.memory.parts.tape import Activations, activations
from studio.core.memory.parts.tiled import feedforward_for
from studio.core.memory.parts.vision import VisionMemory, image_rule, vision_memory, with_images, worst_case_images
from studio.core.memory.placement import (WayCost, boundary_traffic, bubble, pipeline_replicas, replica_traffic,
                                          sharded_traffic, split_devices, stage_devices)
from studio.core.memory.regime import CHUNKED_LOSS_BYTES, DTYPE_BYTES, Regime, regime_for
from studio.core.memory.results import TIGHT_FRACTION, DeviceEstimate, Estimate, Verdict, complete_parts, verdict_for
from studio.core.memory.sharding import (CudaOverheads, ScaleOut, loading_per_process, machine_overheads,
                                         model_width, sharded_devices, with_cuda_overheads, zero_reduce_bucket_bytes)
from studio.core.methods import ATTENTION_TOKENS
from studio.core.model.info import ModelShape, UnknownArchitectureError, family_of, model_shape
from studio.core.model.vision import is_vision_language
from studio.core.sizes import format_bytes

# What callers of the estimate use; the parts of the model live in studio.core.memory.
__all__ = ["estimate", "Estimate", "DeviceEstimate", "Verdict", "verdict_for", "ScaleOut", "CudaOverheads",
           "TIGHT_FRACTION"]


def _phases(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations) -> dict[str, dict[str, int]]:
    """Every part at each phase's peak moment, on one device."""
    inputs = step_inputs(shape, regime)
    persistent = {"weights": states.weights, "adapter_weights": states.adapters,
                  "optimizer_state": states.optimizer_state, "master_weights": states.master_weights}
    in_step = inputs + acts.shared
    backward = _backward_moment(shape, regime, states, acts, in_step)
    if regime.token_logps:  # the loss's gradients come in the backward pass, beside every saved activation
        backward = max(backward, _loss_end(shape, regime, states, acts, in_step, in_forward=False),
                       key=lambda parts: sum(parts.values()))
    phases = {
        "forward": {**persistent, **_forward_moment(shape, regime, states, acts, in_step)},
        "backward": {**persistent, **backward},
        "optimizer": {**persistent, "gradients": states.gradients, "activations": inputs,
                      "temporaries": states.optimizer_temporaries},
    }
    if regime.sampled_group:  # the gradients of the last step are zeroed, not freed, when the next one samples
        phases["generation"] = {**persistent, "gradients": states.gradients, **generation_parts(shape, regime)}
    return phases


def _forward_moment(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations, inputs: int) -> dict:
    """The forward phase's largest moment: the end of the forward pass (every saved activation, and the logits and
    loss at their largest), or the last block's forward (what the blocks keep by then and what it computes)."""
    gradients = states.gradients if regime.accumulation > 1 else 0
    loss_forward, loss_backward = logits_loss_bytes(shape, regime, acts.logits_dtype)
    # autocast's cache (checkpointed blocks' weight copies) lives until the forward pass leaves autocast; the
    # per-token log-probabilities' backward is the backward pass's (_phases)
    in_forward = regime.token_logps or loss_forward + acts.autocast_cache > loss_backward
    loss_end = _loss_end(shape, regime, states, acts, inputs, in_forward)
    last_block = {"weights": states.weights, "gradients": gradients, "activations": acts.forward_block + inputs,
                  "logits_loss": 0, "temporaries": acts.autocast_cache}
    return max(loss_end, last_block, key=lambda parts: sum(parts.values()))


def _loss_end(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations, inputs: int,
              in_forward: bool) -> dict:
    """The moment the loss is at its largest, every saved activation alive: in its forward (with autocast's
    cache), or in its backward."""
    loss_forward, loss_backward = logits_loss_bytes(shape, regime, acts.logits_dtype)
    # an output layer kept in CPU RAM is on the device while the loss runs
    return {"weights": states.weights + host_head_bytes(shape, regime),
            "gradients": states.gradients if regime.accumulation > 1 else 0,
            "activations": acts.saved - acts.weight_copies + inputs,
            "logits_loss": loss_forward if in_forward else loss_backward,
            "temporaries": acts.weight_copies + (acts.autocast_cache if in_forward else 0)}


def _backward_moment(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations, inputs: int) -> dict:
    """The largest of: the last block's backward, the first block's, and the embeddings' gradient at the end."""
    earlier_grads = acts.head_grads + (shape.layers - 1) * acts.block_grads
    candidates = [
        {"gradients": acts.head_grads + acts.last_block.parameter_grads,
         "activations": inputs + acts.before_last_block + acts.last_block.saved,
         "temporaries": acts.last_block.in_flight},
        {"gradients": earlier_grads + acts.first_block.parameter_grads,
         "activations": inputs + acts.before_first_block + acts.first_block.saved,
         "temporaries": acts.first_block.in_flight},
        {"gradients": states.gradients, "activations": inputs,
         # a tied embedding's gradient is computed apart, then added to the head's
         "temporaries": shape.head_elements * DTYPE_BYTES[regime.base_dtype] if regime.full and shape.tie_embeddings else 0},
    ]
    return max(candidates, key=lambda parts: sum(parts.values()))


def step_inputs(shape: ModelShape, regime: Regime) -> int:
    """input_ids, attention_mask, labels (int64) of all the step's micro-batches, and prefix tuning's prefix."""
    return 3 * 8 * regime.tokens * regime.accumulation + prefix_bytes(shape, regime)


def prefix_bytes(shape: ModelShape, regime: Regime) -> int:
    """Prefix tuning's keys and values for one micro-batch: the fp32 prefix, and every layer's
    attention keeping keys and values longer by the virtual tokens (compute dtype)."""
    if regime.method.token_entry != ATTENTION_TOKENS:
        return 0
    elements = regime.micro_batch * regime.virtual_tokens * 2 * shape.layers * shape.kv_width
    return elements * (4 + DTYPE_BYTES[regime.compute])


def estimate(model_config: dict | ModelShape, config: RunConfig, device_type: str = "cuda",
             scale_out: ScaleOut = ScaleOut(), loss_impl: str | None = None,
             overheads: CudaOverheads | None = None, compare: bool = True,
             images: tuple[int, ...] | None = None) -> Estimate:
    """The itemized peak memory of ``config`` on ``model_config`` (a config.json mapping).

    A pipeline's estimate compares it with the other ways over its GPUs (``Estimate.comparison``, and a note)
    unless ``compare`` is False (fit's candidates: two more estimates apiece).

    ``images``: for a vision-language model, each image's patches in the micro-batch (the run's own data); None
    for the worst case, each row's image at the largest resolution (``parts.vision.worst_case_images``).

    ``device_type`` "cuda" adds the CUDA context and the allocator margin: ``overheads``, or by default this
    machine's as ``studio doctor`` measured them (``sharding.machine_overheads``), which a note then says;
    "cpu" predicts the live tensor bytes a CPU run reaches. A model of a family
    ``studio.core.model.info`` does not describe is estimated from its traced
    step (``studio.core.memory.derived``); without a trace for these settings
    it raises TraceNeededError. Raises StudioError for LoRA targets it does not know.
    """
    if overheads is None:
        overheads = machine_overheads() if device_type == "cuda" else CudaOverheads()
    if isinstance(model_config, dict) and not _described(model_config):
        return _derived(model_config, config, device_type, scale_out, overheads, images)
    shape = model_config if isinstance(model_config, ModelShape) else model_shape(model_config)
    if config.distributed.pipeline_stages:  # the last stage's loss is the chunked one (StepLoss)
        loss_impl = "chunked"
    regime = regime_for(config, shape, device_type, loss_impl)
    vision = _images_of(model_config, config, images)
    states = _with_trained_vision(model_states(shape, regime), vision, model_config, config, regime)
    if scale_out.uses_zero and regime.full:  # DeepSpeed trains 16-bit weights: autocast has no copies to make
        regime = replace(regime, base_dtype=regime.compute)
    acts = offloaded_activations(activations(shape, regime, feedforward_for(shape, regime)), shape, regime)
    phases = _phases(shape, regime, states, acts)
    if vision is not None:
        phases = with_images(phases, vision, {"weights": states.weights, "adapter_weights": states.adapters,
                                              "optimizer_state": states.optimizer_state,
                                              "master_weights": states.master_weights, "gradients": states.gradients})
    stages = config.distributed.pipeline_stages
    if stages:
        placement, host = None, None
        devices = stage_devices(shape, regime, states, acts, step_inputs(shape, regime), stages,
                                config.distributed.pipeline_schedule, config.distributed.chunks_per_process)
    elif scale_out.layer_split:
        devices, host, placement = split_devices(phases, shape, regime, scale_out, overheads)
    else:
        placement = None
        block_parameters = sum(p.elements for p in shape.block_parameters)
        devices, host = sharded_devices(phases, regime.device_type, block_parameters, states, scale_out,
                                        zero_reduce_bucket_bytes(shape.hidden, config))
        kept = host_weight_ram(shape, regime) * scale_out.num_gpus  # never with a split (regime); one per process
        if kept:
            parts = dict(host.parts) if host is not None else complete_parts({})
            host = DeviceEstimate("host", {**parts, "weights": parts["weights"] + kept},
                                  host.peak_phase if host is not None else "forward")
    if device_type == "cuda":
        devices = [with_cuda_overheads(d, overheads, scale_out) for d in devices]
    peak_phase = max(devices, key=lambda d: d.total_bytes).peak_phase
    host = with_host_activations(host, acts, shape, regime)
    if host is not None:
        devices.append(host)
    notes = _notes(shape, regime, config, vision is not None) + (vision_notes(model_config, config, vision) if vision else ())
    notes += overheads.notes if device_type == "cuda" else ()
    if placement is not None and placement.offloaded_layers and not regime.checkpointing:
        notes += ("the offloaded blocks stay on the first device from their forward to their backward: "
                  "turn on gradient checkpointing to fetch one at a time",)
    comparison = (_pipeline_comparison(shape, config, device_type, overheads, regime, states, devices)
                  if stages and compare else ())
    notes += (comparison_note(config, comparison),) if comparison else ()
    loading = loading_per_process(states, scale_out, config.sharded_loading)
    return Estimate(devices=tuple(devices), peak_phase=peak_phase, parameters=shape.parameter_count,
                    trainable_parameters=states.trainable_parameters, tokens_per_micro_batch=regime.tokens,
                    notes=notes, placement=placement, loading=loading, comparison=comparison)


def _images_of(model_config: dict | ModelShape, config: RunConfig,
               images: tuple[int, ...] | None) -> VisionMemory | None:
    """What the images of a described vision-language family (Gemma 3) hold: ``images``, or the worst case."""
    if not isinstance(model_config, dict) or image_rule(model_config) is None:
        return None
    return vision_memory(model_config, config, worst_case_images(model_config, config) if images is None else images)


def _with_trained_vision(states: ModelStates, vision: VisionMemory | None, model_config: dict | ModelShape,
                         config: RunConfig, regime: Regime) -> ModelStates:
    """The model states with a trained tower's or projector's gradients and optimizer state (they load as the
    language model's weights outside the blocks, and train whole)."""
    v = config.vision
    if vision is None or not (v.train_vision_tower or v.train_projector):
        return states
    group = TensorGroup((image_rule(model_config).parameters(v.train_vision_tower, v.train_projector),),
                        regime.outer_dtype, 1)
    optimizer = OPTIMIZERS[regime.optimizer]
    fp32 = optimizer.state(TensorGroup(group.shape, "fp32", 1))
    return replace(states, gradients=states.gradients + group.nbytes,
                   optimizer_state=states.optimizer_state + optimizer.state(group),
                   trainable_parameters=states.trainable_parameters + group.elements,
                   fp32_optimizer_state=states.fp32_optimizer_state + fp32)


def _described(model_config: dict) -> bool:
    """Whether a family of studio.core.model.info describes the model (a config without model_type is refused there)."""
    try:
        family_of(model_config)
    except UnknownArchitectureError:
        return False
    return True


def _derived(model_config: dict, config: RunConfig, device_type: str, scale_out: ScaleOut,
             overheads: CudaOverheads, images: tuple[int, ...] | None) -> Estimate:
    """A model no family describes: scale its traced step, or say that it needs tracing."""
    trace = cached_trace(model_config, config)
    if trace is None:
        raise TraceNeededError(model_config["model_type"], trace_path(model_config, config),
                               regime_id(regime_axes(config)))
    if images is None:
        images = worst_case_images(model_config, config)
    vision = vision_memory(model_config, config, images)
    result = derived_estimate(trace, config, device_type, scale_out, overheads, vision, model_width(model_config))
    result = replace(result, notes=result.notes + vision_notes(model_config, config, vision))
    return replace(result, notes=result.notes + overheads.notes) if device_type == "cuda" else result


def vision_notes(model_config: dict, config: RunConfig, vision: VisionMemory | None) -> tuple[str, ...]:
    """What the estimate of a vision-language model counts for its images, and what it leaves out."""
    if not is_vision_language(model_config):
        return ()
    if vision is None:
        return ("vision-language model: the vision tower's weights are counted, its activations on images are not "
                "yet (the estimate has no image rule for this family: studio.core.memory.parts.vision)",)
    trained = [part for part, on in (("the vision tower", config.vision.train_vision_tower),
                                     ("the projector", config.vision.train_projector)) if on]
    saved = (f"{' and '.join(trained)} train: their weights' gradients and optimizer state, and what they keep for "
             f"backward, {format_bytes(vision.saved)} (counted)" if trained else
             "the vision tower and projector are frozen: no gradients, no optimizer state, nothing kept for backward; "
             f"training both would add {_training_the_tower(model_config, config, vision)}")
    patches = f"{sum(vision.images):,} patches" if vision.images else "no images"
    notes = (f"vision-language model: {len(vision.images)} image(s) a micro-batch, {patches}, "
             f"{vision.tokens:,} image tokens in the language model's sequence (counted in its length); {saved}; "
             f"the images' pixel values and grids {format_bytes(vision.inputs)}",)
    rule = image_rule(model_config)
    if rule.fixed_resolution and config.vision.max_pixels:
        size = rule.largest({})
        notes += (f"vision.max_pixels {config.vision.max_pixels:,} changes nothing here: {rule.resolution_note} "
                  f"({size.patches:,} patches, {size.tokens:,} token{'s' * (size.tokens != 1)} {rule.largest_label}); "
                  "set it to 0",)
    return notes


def _training_the_tower(model_config: dict, config: RunConfig, frozen: VisionMemory) -> str:
    """What training the tower and the projector would add to a frozen tower's step: their fp32 gradients and
    optimizer state, and what they keep for backward on the same images."""
    trained = vision_memory(model_config, config.replace(vision={"train_vision_tower": True, "train_projector": True}),
                            frozen.images)
    group = TensorGroup((image_rule(model_config).parameters(True, True),), "fp32", 1)
    states = group.nbytes + OPTIMIZERS[config.training.optimizer].state(group)
    kept = trained.saved + trained.sequence - frozen.sequence
    return (f"the gradients and optimizer state of {group.elements:,} parameters ({format_bytes(states)}) and "
            f"{format_bytes(kept)} kept for backward on these images")


def _notes(shape: ModelShape, regime: Regime, config: RunConfig, images: bool = False) -> tuple[str, ...]:
    notes = []
    known = {"silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "gelu_fast", "quick_gelu"}
    if shape.activation not in known:
        notes.append(f"activation {shape.activation} is modelled as keeping its input")
    if regime.dora:
        notes.append("DoRA is modelled approximately (its weight-norm temporaries are not counted)")
    if regime.loss_impl == "chunked":
        notes.append("lean loss: logits are computed for at most "
                     f"{max(1, CHUNKED_LOSS_BYTES // (4 * shape.vocab)):,} tokens at a time")
    elif config.training.chunked_loss and config.distributed.shards_weights:
        notes.append(f"no lean loss with {config.distributed.sharding}: its sharded output layer is gathered only "
                     "inside the model's forward, so the whole logits and their loss are counted; zero2 or no "
                     "sharding computes them a chunk at a time")
    if any(not layer.is_module for layer in regime.adapted):
        notes.append("LoRA adapts the router and every expert: peft folds the factors into a new copy of each "
                     "weight at every forward, kept for backward (counted), and trains without dropout")
    if shape.attached and not images:  # a tower with an image rule: vision_notes says what it counts
        notes.append(f"{sum(p.elements for p in shape.attached):,} parameters of a vision tower load with the model "
                     "(counted as weights); text training never runs, trains or adapts them")
    if shape.transformed_logits:
        capped = "soft-capped" if shape.logit_softcap else "scaled"
        notes.append(f"{capped} logits: the lean loss needs plain output-layer logits, so this model computes "
                     "the full fp32 loss over every position (counted)")
    if regime.method.token_entry == ATTENTION_TOKENS:
        notes.append("prefix tuning's longer keys and values are modelled approximately")
    if regime.qat:
        notes.append("QAT: each fake-quantized weight is a new tensor kept for backward (fp32 work while it is made)")
    notes += host_weight_notes(shape, regime, config)
    if config.schedule.sample_every:
        notes.append(_samples_note(shape, regime, config))
    if config.learns_preferences:
        notes.append(_preference_note(shape, regime, config))
    if config.objective == "grpo":
        notes.append(_generation_note(shape, regime, config))
    return tuple(notes)


def _pipeline_comparison(shape: ModelShape, config: RunConfig, device_type: str, overheads: CudaOverheads,
                         regime: Regime, states: ModelStates, devices: list[DeviceEstimate]) -> tuple[WayCost, ...]:
    """The pipeline against the other ways to spread the model over its GPUs (one replica's, with replicas): the
    layer split cut where the stages are (each GPU's weight budget the largest stage's), and ZeRO-3 or FSDP
    (estimated alike) over as many GPUs keeping the replica's batch. A CPU estimate compares them as GPUs
    without CUDA's overheads (a layer split on the CPU has one device)."""
    if device_type == "cpu":
        device_type, overheads = "cuda", CudaOverheads(context_bytes=0, allocator_fraction=0.0, nccl_bytes=0,
                                                   blas_workspace_bytes=0)
    gpus, micro_batches = config.distributed.pipeline_stages, regime.accumulation
    chunks = config.distributed.chunks_per_process  # every boundary between chunks crosses to another GPU
    pipeline = WayCost(f"pipeline ({config.distributed.pipeline_schedule})", max(d.total_bytes for d in devices),
                       bubble(gpus, micro_batches, chunks), boundary_traffic(shape, regime, gpus * chunks - 1), True,
                       replica_traffic(states, pipeline_replicas(config)))
    largest = max(device.parts["weights"] for device in devices)
    alone = {"pipeline_stages": 0, "pipeline_schedule": "gpipe"}
    split_config = config.replace(distributed={**alone, "num_processes": 1, "layer_split": True})
    split = estimate(shape, split_config, device_type, ScaleOut(split_devices=(largest,) * gpus,
                                                                split_weight_limit=largest), overheads=overheads)
    used = len(split.placement.devices)
    per_gpu = -(-micro_batches // gpus)
    zero_config = config.replace(distributed={**alone, "num_processes": gpus, "sharding": "zero3"},
                                 training={"gradient_accumulation_steps": per_gpu})
    zero = estimate(shape, zero_config, device_type, ScaleOut(num_gpus=gpus, zero_stage=3), overheads=overheads)
    return (pipeline,
            WayCost("layer split", split.peak_bytes, (used - 1) / used, boundary_traffic(shape, regime, used - 1), False),
            WayCost("ZeRO-3 or FSDP", zero.peak_bytes, 0.0, sharded_traffic(states, regime, gpus), True))


def comparison_note(config: RunConfig, comparison: tuple[WayCost, ...]) -> str:
    """The comparison in words: the bubble, then each way's memory per GPU, idle share and traffic per step (the
    window shows the ways as a table under the bubble's words instead)."""
    ways = "; ".join(f"{way.way} {format_bytes(way.peak_bytes)} per GPU, idle {way.idle:.0%}, "
                     f"{format_bytes(way.link_bytes)} over the links" + ("" if way.overlapped else " (not overlapped)")
                     for way in comparison)
    return f"{bubble_words(config, comparison)}. On {config.distributed.pipeline_stages} GPUs: {ways}"


def bubble_words(config: RunConfig, comparison: tuple[WayCost, ...]) -> str:
    """What the pipeline's bubble costs each stage (the comparison's first way is the pipeline)."""
    stages, micro_batches = config.distributed.pipeline_stages, config.training.gradient_accumulation_steps
    chunks = config.distributed.chunks_per_process
    interleaved = f", {chunks} chunks of blocks per stage" if chunks > 1 else ""
    formula = f"(stages - 1) / ({'chunks x ' if chunks > 1 else ''}micro-batches + stages - 1)"
    words = (f"pipeline of {stages} stages{interleaved}, {micro_batches} micro-batches a step: each stage idles "
             f"{comparison[0].idle:.0%} of the step (the bubble: {formula}; more gradient_accumulation_steps "
             f"shrink it)")
    replicas = pipeline_replicas(config)
    if replicas > 1:
        words += (f"; its {replicas} replicas, each on its share of every batch, all-reduce the trained gradients "
                  f"once a step ({format_bytes(comparison[0].replica_link_bytes)} over the links between them); "
                  f"the ways below are on one replica's {stages} GPUs")
    return words


def _preference_note(shape: ModelShape, regime: Regime, config: RunConfig) -> str:
    """What a preference step holds beside an SFT step's, and what its reference costs."""
    rows = config.training.micro_batch_size
    pairs = (f"{config.objective}: each micro-batch's {rows} pairs are {regime.micro_batch} sequences in one forward "
             "(counted)" if config.sequences_per_row == 2 else
             f"{config.objective}: each micro-batch's {rows} completions, and as many mismatched ones (its KL term) "
             "in a forward without gradients before the model's, which never adds to the peak")
    if not config.uses_reference:
        return pairs + "; no reference model"
    if config.preference.reference == "precomputed":
        return pairs + ("; the reference's log-probabilities are computed once before the first step: no copy, "
                        "no reference forward while training")
    if regime.frozen_reference:
        copy = format_bytes(weight_bytes(shape, regime))
        return pairs + (f"; the reference is a frozen copy of the weights, {copy} (counted as weights); "
                        "preference.reference precomputed needs no copy")
    return pairs + ("; the reference is the base with the adapter off: no second copy, its forward runs without "
                    "gradients before the model's and never adds to the peak")


def _generation_note(shape: ModelShape, regime: Regime, config: RunConfig) -> str:
    """What the generation phase counts, and what it does not."""
    group = config.grpo.group_size
    if not regime.sampled_group:
        return (f"grpo samples with vllm, which takes {config.grpo.vllm_memory_fraction:.0%} of the GPU when it "
                "starts for its own copy of the base model and its KV cache: not counted here, the training must "
                "fit in the rest")
    cache = kv_cache_bytes(shape, regime, group * config.data.max_length)
    return (f"grpo samples {group} completions of a prompt at a time between steps, beside the weights, gradients "
            f"and optimizer state: their KV cache (at most {format_bytes(cache)}) and one block's work at a time are "
            "counted as the generation phase; the sampling model's and the reference's log-probabilities run "
            "without gradients, a block at a time, and never add to the step's peak")


def _samples_note(shape: ModelShape, regime: Regime, config: RunConfig) -> str:
    """Samples while training answer between steps, when the step's activations are freed: their KV cache (the
    prompts at most data.max_length long) is said, not added to the step's peak."""
    prompts = len(config.data.sample_prompts) or SAMPLED_HELD_OUT_ROWS
    cache = kv_cache_bytes(shape, regime, prompts * (config.data.max_length + SAMPLE_NEW_TOKENS))
    return (f"samples every {config.schedule.sample_every} steps: {prompts} prompts answered between steps, their KV "
            f"cache at most {format_bytes(cache)} (not in the step's peak: its activations are freed by then)")
