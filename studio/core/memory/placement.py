"""Layer split and pipeline: which device holds each part of the model.

The layer split (model parallel in one process): the decoder blocks are spread over the GPUs in order, each GPU taking as many as
its weight budget allows; the embeddings go with the first block and the final
norm and output head with the last one on a GPU. Blocks that fit on no GPU are
offloaded: kept in CPU RAM and fetched to the first GPU for each forward pass
(accelerate's offload hooks). A model that fits neither is refused with the
number of GiB missing.

Pure Python: the estimator, the GUI and the worker all call ``plan_placement``.

The pipeline (one process per stage, all computing at once; its part is below the layer split's): a stage is one
process (studio.train.distributed.pipeline): its consecutive blocks (``stage_blocks``), the
embeddings on the first, the final norm and the output layer on the last; a tied output layer is the embedding's
weight, which the first and the last stage both keep. Under the interleaved schedule the model is cut into
stages x chunks chunks, and process p holds chunks p, p + stages, ... (``process_chunks``): the first chunk (the
embeddings) on the first process, the last (norm, output layer) on the last. Its adapters, their gradients and
optimizer state are its blocks' share. Its activations are those of the micro-batches it holds in flight: GPipe
runs every forward before any backward, so each stage holds all of the step's micro-batches; 1F1B starts with
``stages - stage`` forwards (torch.distributed.pipelining's Schedule1F1B) and then alternates, so stage s holds at
most that many; the interleaved schedule holds its warm-up's chunk forwards and one more (``in_flight``). Each
micro-batch in flight also keeps the chunk's output for its backward (not the last chunk's: its loss has run);
the last stage's chunked loss keeps its hidden states' fp32 gradient for each micro-batch in flight besides the
one it computes. Every chunk keeps a receive buffer per micro-batch of the step for what it is sent (the hidden
states forward, their gradients backward), allocated once, and the step's whole padded batch. ``WayCost``
compares a pipeline with the layer split, ZeRO-3 and FSDP on its GPUs: memory per GPU, idle share, link bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from studio.core.config import RunConfig
from studio.core.errors import Problem, StudioError
from studio.core.memory.parts.logits import chunked_loss_kept, logits_loss_bytes
from studio.core.memory.parts.states import ModelStates, block_weight_bytes, outer_weight_bytes
from studio.core.memory.parts.tape import Activations
from studio.core.memory.regime import DTYPE_BYTES, Regime
from studio.core.memory.results import DeviceEstimate, complete_parts
from studio.core.memory.sharding import CudaOverheads, ScaleOut
from studio.core.model.info import ModelShape
from studio.core.sizes import format_bytes

OFFLOAD = "offload"  # kept in CPU RAM, run on the first device


class WeightsDoNotFitError(StudioError):
    """The layer split's devices and CPU RAM cannot hold the model's weights (fit skips such a candidate)."""


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
            parts.append(f"{name}: {ranges_in_words(self.layers_on(device))} ({format_bytes(self.bytes_on(device))})")
        return "; ".join(parts)

    def to_json(self) -> dict:
        return {"device_map": self.device_map, "summary": self.summary(),
                "layers": {device: self.layers_on(device) for device in self.devices},
                "weight_bytes": {device: self.bytes_on(device) for device in self.devices}}


def ranges_in_words(indices: list[int], noun: str = "layer") -> str:
    """``layers 0-13, 28``: ascending indices as their runs."""
    if not indices:
        return f"no {noun}s"
    spans, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1 if current is not None else True:
            spans.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return f"{noun}{'' if len(indices) == 1 else 's'} " + ", ".join(spans)


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
    raise WeightsDoNotFitError(
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


# ---------------------------------------------------------------- the pipeline

def pipeline_refusals(config: RunConfig) -> list[Problem]:
    """What keeps ``config`` from running as a pipeline: one process per stage of each data replica (num_processes a
    multiple of the stages; stage s of replica r is rank r x stages + s), each holding its blocks whole,
    training an adapter on padded batches, in micro-batch counts its schedule runs (validation adds a block per
    chunk by the model's files)."""
    d, where = config.distributed, "distributed.pipeline_stages"
    if d.pipeline_stages < 0:
        return [Problem(where, "must be 0 (off) or a number of stages")]
    if d.pipeline_stages == 0:
        return []
    micro_batches = config.training.gradient_accumulation_steps
    refusals = [
        (d.pipeline_stages < 2, "a pipeline needs 2 stages or more", "set 2 or more, or 0 to turn it off"),
        (d.pipeline_stages >= 2 and d.num_processes % d.pipeline_stages != 0, f"each stage is one process, in one "
         f"or more data replicas of the pipeline: {d.pipeline_stages} stages need a multiple of {d.pipeline_stages} "
         f"processes, not {d.num_processes}", f"set distributed.num_processes to {_multiples(d.pipeline_stages)}"),
        (d.sharding != "none", f"a pipeline's stages hold their own blocks whole; {d.sharding} shards them",
         "set distributed.sharding to none"),
        (d.layer_split, "a pipeline and a layer split both place the blocks", "turn layer_split off"),
        (not config.uses_adapter or config.method_spec.trains_virtual_tokens, "a pipeline trains an adapter on the "
         "blocks' layers (virtual tokens would change every stage's inputs)", "use method lora, qlora, dora, ia3, "
         "loha or lokr"),
        (config.objective != "sft", f"a pipeline computes the next-token loss on its last stage; {config.objective} "
         "needs the whole model's outputs", "use objective sft, or turn the pipeline off"),
        (config.data.packing == "padding_free", "the stages exchange tensors of one shape: micro-batches are padded "
         "to data.max_length", "set data.packing to none or length_grouped"),
        (config.training.torch_compile, "a pipeline's stages are not compiled yet", "turn training.torch_compile off"),
        (config.schedule.sample_every > 0, "sample answers need the whole model in one process; each stage holds "
         "its own blocks", "set schedule.sample_every to 0 (export the adapter and try it instead)"),
        (config.method == "adalora", "AdaLoRA reallocates its ranks from every block's gradients, which the stages "
         "hold apart", "use method lora"),
        (d.pipeline_schedule == "1f1b" and micro_batches < d.pipeline_stages,
         f"1F1B runs at least as many micro-batches per step as stages ({d.pipeline_stages})",
         f"set training.gradient_accumulation_steps to {d.pipeline_stages} or more, or use gpipe"),
    ]
    problems = [Problem(where, message, hint) for refused, message, hint in refusals if refused]
    if d.pipeline_schedule == "interleaved":
        problems += _interleaved_refusals(d.pipeline_stages, d.pipeline_chunks, micro_batches)
    return problems


def _interleaved_refusals(stages: int, chunks: int, micro_batches: int) -> list[Problem]:
    """What torch's ScheduleInterleaved1F1B cannot run: fewer than 2 chunks per process (1F1B's), or a step whose
    micro-batches do not make whole rounds."""
    problems = []
    if chunks < 2:
        problems.append(Problem("distributed.pipeline_chunks", f"the interleaved schedule runs 2 or more chunks of "
                                f"blocks per process, not {chunks}", "set 2 or more, or use schedule 1f1b"))
    if not runs_micro_batches("interleaved", stages, micro_batches):
        rounds = interleaved_rounds(stages, micro_batches)
        fewer = next(m for m in range(micro_batches - 1, 0, -1) if runs_micro_batches("interleaved", stages, m))
        more = next(m for m in range(micro_batches + 1, 2 * micro_batches + 1)
                    if runs_micro_batches("interleaved", stages, m))
        problems.append(Problem("distributed.pipeline_stages", f"the interleaved schedule runs a step's "
                                f"micro-batches in max(1, micro-batches // stages) rounds of equal size: "
                                f"{micro_batches} do not make {rounds} rounds",
                                f"set training.gradient_accumulation_steps to {fewer} or {more}, or use 1f1b"))
    return problems


def interleaved_rounds(stages: int, micro_batches: int) -> int:
    """The rounds torch's ScheduleInterleaved1F1B runs a step's micro-batches in, each chunk taking a round's
    micro-batches in turn."""
    return max(1, micro_batches // stages)


def runs_micro_batches(schedule: str, stages: int, micro_batches: int) -> bool:
    """Whether torch's schedule runs a step of ``micro_batches``: 1F1B at least one per stage; the interleaved
    schedule whole rounds of them; GPipe any number."""
    if schedule == "1f1b":
        return micro_batches >= stages
    if schedule == "interleaved":
        return micro_batches % interleaved_rounds(stages, micro_batches) == 0
    return True


def too_few_blocks(blocks: int, stages: int, chunks: int) -> Problem | None:
    """The refusal of a model of ``blocks`` blocks too few for a chunk of one or more in each of stages x chunks."""
    if blocks >= stages * chunks:
        return None
    if chunks == 1:
        return Problem("distributed.pipeline_stages", f"the model has {blocks} blocks, fewer than {stages} stages",
                       f"set distributed.pipeline_stages to {blocks} or fewer")
    fits = blocks // stages
    return Problem("distributed.pipeline_chunks", f"the model has {blocks} blocks, fewer than {stages} stages x "
                   f"{chunks} chunks", f"set distributed.pipeline_chunks to {fits} or fewer" if fits >= 2
                   else "use fewer stages, or schedule 1f1b")


def _multiples(stages: int) -> str:
    """The first process counts that run ``stages`` stages, in words."""
    counts = [str(stages * replicas) for replicas in (1, 2, 3)]
    return f"{', '.join(counts)} (1, 2 or 3 replicas) or another multiple of {stages}"


def pipeline_replicas(config: RunConfig) -> int:
    """How many data replicas of the pipeline the config's processes make (1 without a pipeline; a count that is
    not a multiple of the stages, which validation refuses, as many as it holds whole)."""
    stages = config.distributed.pipeline_stages
    return max(config.distributed.num_processes // stages, 1) if stages > 0 else 1


def pipeline_layout(stages: int, processes: int) -> str:
    """A pipeline's ``processes`` in words: its replicas and their stages."""
    replicas = processes // stages
    return f"{replicas} pipeline replica{'s' if replicas > 1 else ''} of {stages} stages"


def stage_blocks(blocks: int, stages: int, stage: int) -> range:
    """The blocks of ``stage``: consecutive, as even as they divide (the first stages take one more)."""
    size, extra = divmod(blocks, stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


def chunk_indices(stages: int, stage: int, chunks: int = 1) -> list[int]:
    """The places in the model of pipeline process ``stage``'s chunks: stage, stage + stages, ... (the order torch's
    interleaved schedule runs them in); under GPipe and 1F1B its one chunk, the stage."""
    return [stage + chunk * stages for chunk in range(chunks)]


def process_chunks(blocks: int, stages: int, stage: int, chunks: int = 1) -> list[range]:
    """The blocks pipeline process ``stage`` runs, chunk by chunk: those of its ``chunk_indices`` of the model cut
    into stages x chunks (``stage_blocks``); under GPipe and 1F1B one chunk, its consecutive blocks."""
    return [stage_blocks(blocks, stages * chunks, index) for index in chunk_indices(stages, stage, chunks)]


def in_flight(schedule: str, stages: int, stage: int, micro_batches: int, chunks: int = 1) -> list[int]:
    """The micro-batches whose activations each chunk of ``stage`` holds at its peak: all of them (GPipe), the
    forwards 1F1B runs before its first backward, or the interleaved schedule's warm-up forwards and the first
    forward after them (its steady state then takes one backward for each forward). ScheduleInterleaved1F1B's
    warm-up (torch's _get_warmup_ops) is (chunks - 1) rounds' micro-batches and 2 more per stage after this one,
    at most every forward; the chunks take a round's micro-batches each in turn."""
    if schedule == "gpipe":
        return [micro_batches]
    if schedule == "1f1b":
        return [min(micro_batches, stages - stage)]
    per_round = micro_batches // interleaved_rounds(stages, micro_batches)
    forwards = min((chunks - 1) * per_round + 2 * (stages - 1 - stage) + 1, micro_batches * chunks)
    return [sum(1 for op in range(forwards) if op // per_round % chunks == chunk) for chunk in range(chunks)]


def bubble(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """The idle share of each stage's step: (stages - 1) / (micro-batches + stages - 1) for GPipe and 1F1B; with
    ``chunks`` per process (interleaved), whose forward and backward each take 1/chunks of a stage's, the fill and
    drain of (stages - 1) chunk slots is over chunks x micro-batches slots of work, (stages - 1) / (chunks x
    micro-batches + stages - 1) (Narayanan et al. 2021, arXiv 2104.04473, section 2.2.2, which torch's
    ScheduleInterleaved1F1B follows). Fewer micro-batches than stages cannot fill the loop of chunks: the step is
    then the chunks x stages slots of the first micro-batch's way through them and one more for each other, of which
    chunks x micro-batches are busy. tests/test_pipeline.py runs torch's own interleaved order against both."""
    slots = chunks * max(micro_batches, stages) + min(micro_batches, stages) - 1
    return 1 - chunks * micro_batches / slots


def step_time_factor(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """A pipeline's step time against a layer split's over as many GPUs (which computes on one at a time): each
    stage runs 1/stages of the work and idles the bubble, 1 / (stages x (1 - bubble)) ((micro-batches + stages - 1)
    / (micro-batches x stages) for GPipe and 1F1B). A rule of thumb like fit's others: the transfers overlap, the
    stages are even."""
    return 1 / (stages * (1 - bubble(stages, micro_batches, chunks)))


def boundary_bytes(shape: ModelShape, regime: Regime) -> int:
    """The hidden states one micro-batch sends across a stage boundary (and as many bytes of their gradient back)."""
    return regime.tokens * shape.hidden * DTYPE_BYTES[regime.compute]


def stage_weights(shape: ModelShape, regime: Regime, blocks: Sequence[int], first: bool, last: bool) -> int:
    """A stage's weights: its blocks (of every chunk), the embeddings on the first, the final norm and output layer
    on the last (a tied output layer: the embedding's weight, on the last stage too)."""
    head, block_list, tail = model_modules(shape, regime)
    embeddings = sum(size for _, size in head)
    weights = sum(block_list[index][1] for index in blocks) + (embeddings if first else 0)
    if last:
        weights += sum(size for _, size in tail) + (embeddings if shape.tie_embeddings and not first else 0)
    return weights


def stage_devices(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations, inputs: int,
                  stages: int, schedule: str, chunks: int = 1) -> list[DeviceEstimate]:
    """Each stage's peak (one process, one GPU each), from its phases: the forward's end (every micro-batch in
    flight; on the last stage its loss at its largest), a backward in the middle of them, and the optimizer step.
    ``chunks``: the chunks of blocks each process holds (the interleaved schedule's; 1 otherwise)."""
    micro_batches, boundary = regime.accumulation, boundary_bytes(shape, regime)
    loss_forward, _ = logits_loss_bytes(shape, regime, acts.logits_dtype)
    recompute = acts.last_block.saved if regime.checkpointing else 0  # a checkpointed block, run again
    first_chunk, last_chunk = 0, stages * chunks - 1
    devices = []
    for stage in range(stages):
        own = process_chunks(shape.layers, stages, stage, chunks)
        blocks = [index for chunk in own for index in chunk]
        indices = chunk_indices(stages, stage, chunks)
        first, last = stage == 0, stage == stages - 1
        held = in_flight(schedule, stages, stage, micro_batches, chunks)
        share = len(blocks) / shape.layers

        def part(value: int) -> int:
            return int(value * share)

        # what each chunk receives of a micro-batch, and sends: its input's hidden states and their gradient
        exchanged = boundary * micro_batches * sum((index != first_chunk) + (index != last_chunk) for index in indices)
        persistent = {"weights": stage_weights(shape, regime, blocks, first, last),
                      "adapter_weights": part(states.adapters), "optimizer_state": part(states.optimizer_state),
                      "master_weights": part(states.master_weights), "communication": exchanged}
        saved = [acts.blocks_saved(shape.layers, len(chunk)) + (acts.embedding_saved if index == first_chunk else 0)
                 + (acts.head_saved if index == last_chunk else 0) + (0 if index == last_chunk else boundary)
                 for chunk, index in zip(own, indices)]
        activations = inputs + acts.shared + sum(count * size for count, size in zip(held, saved))
        kept_loss = held[-1] * chunked_loss_kept(shape, regime) if last else 0
        # torch's runtime for several chunks a process (_PipelineScheduleRuntime) waits for its sends at the step's
        # end alone, so what it sent stays alive: all of it counted beside the backward's activations (a bound: the
        # sends pile up as the activations drain), less the outputs in flight already counted
        sent = exchanged - boundary * sum(count for count, index in zip(held, indices) if index != last_chunk) \
            if chunks > 1 else 0
        gradients = part(states.gradients)
        phases = {
            # 1F1B's backwards begin while later micro-batches are still held: the gradients are alive by then
            "forward": {**persistent, "gradients": gradients if sum(held) < micro_batches * chunks else 0,
                        "activations": activations,
                        "logits_loss": loss_forward + kept_loss - chunked_loss_kept(shape, regime) if last else 0},
            "backward": {**persistent, "gradients": gradients, "activations": activations + sent,
                         "logits_loss": kept_loss, "temporaries": acts.last_block.in_flight + recompute},
            "optimizer": {**persistent, "gradients": gradients, "activations": inputs,
                          "temporaries": part(states.optimizer_temporaries)},
        }
        devices.append(DeviceEstimate.at_peak(f"{regime.device_type}:{stage}", phases))
    return devices


@dataclass(frozen=True)
class WayCost:
    """One way to spread the model over the GPUs: its peak per GPU, the idle share of each GPU's step, and the
    bytes that cross the links between the GPUs in one optimizer step (all links together)."""

    way: str
    peak_bytes: int
    idle: float
    link_bytes: int
    overlapped: bool  # whether the transfers overlap computation
    replica_link_bytes: int = 0
    """A pipeline's data replicas: the bytes between them a step (the others' figures are of one replica)."""

    def to_json(self) -> dict:
        return {"way": self.way, "peak_bytes": self.peak_bytes, "idle": round(self.idle, 4),
                "link_bytes": self.link_bytes, "overlapped": self.overlapped,
                "replica_link_bytes": self.replica_link_bytes}


def boundary_traffic(shape: ModelShape, regime: Regime, boundaries: int) -> int:
    """A step's bytes across ``boundaries`` stage (or device) boundaries: each micro-batch's hidden states forward
    and their gradients backward."""
    return 2 * boundaries * regime.accumulation * boundary_bytes(shape, regime)


def replica_traffic(states: ModelStates, replicas: int) -> int:
    """A step's bytes across the links between a pipeline's ``replicas`` (all links together): each stage's trained
    gradients all-reduced over its replicas, a ring sending 2 (R - 1) / R of them from each of the R."""
    return 2 * (replicas - 1) * states.gradients


def sharded_traffic(states: ModelStates, regime: Regime, gpus: int) -> int:
    """A step's bytes across the links under ZeRO-3 or FSDP on ``gpus`` GPUs, for the same effective batch (each GPU
    runs its share of the micro-batches): for each micro-batch every GPU gathers the (N-1)/N of the 16-bit weights
    it lacks in the forward and again in the backward, and the 16-bit gradients are reduce-scattered."""
    weights, gradients = states.weights + 2 * states.trainable_parameters, 2 * states.trainable_parameters
    micro_batches = -(-regime.accumulation // gpus)
    return (gpus - 1) * micro_batches * (2 * weights + gradients)
