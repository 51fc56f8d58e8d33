"""The estimate of a model no family describes, derived from a traced training step of its own code.

``studio.train.measure.trace`` builds copies of the model with ``TRACE_DEPTHS`` decoder
blocks on fake tensors and runs the worker's training step at the
``trace_points`` (micro-batch, length). Each step records, over the model
states live when it starts (weights, adapters, optimizer state, inputs), the
peak of each of its ``MOMENTS`` (the blocks' forward, the head's forward, the
head's backward, the last and the first block's backward), and the model's
trainable tensors. Two depths separate what one more block adds from what the
model adds once (embeddings' output, head, logits, loss); five points at each
of two scales separate the terms that grow with the length (rotary tables),
with length² (a causal mask shared by the rows), with the tokens, and with
batch x length² (attention probabilities, where the trace says they are kept).

``derived_estimate`` scales the trace to the real depth, micro-batch and length
and recounts the model states for the chosen optimizer, accumulation and ZeRO
with ``states`` and ``sharding``: pure Python, well under a millisecond.

The common toggles need no new trace either:

* LoRA's rank, targets and dropout are recounted from a record of one block
  (``recount``): what each linear's adapter saves, per token.
* Precision, gradient checkpointing and 4/8-bit loading change which kernels run
  (autocast's op lists and casts, bitsandbytes' own saved tensors, k-bit
  preparation's fp32 copies, a recomputed block): they are not recounted from a
  record but traced as regimes, in the same subprocess when the model is picked:
  the picked settings, each precision and weight loading one toggle away, and
  each of those with checkpointing flipped (``neighbour_configs``). Regimes are
  not added up (``Trace.step``): a combination the pick-time trace lacks (a new
  precision together with a new loading) is traced anew, into the same file.

What else changes a step (method, weight dtype, attention, loss, quantization
type, PEFT settings, QAT; LoRA settings where they are not recounted) is part of
the trace's key: a new combination is traced anew.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.parts.states import OPTIMIZERS, ModelStates, TensorGroup
from studio.core.memory.parts.vision import VisionMemory, with_images
from studio.core.memory.recount import adapter_bytes, adapter_tensors, lora_block_bytes, lora_settings, recounts_lora
from studio.core.memory.regime import CHUNKED_LOSS_BYTES, DTYPE_BYTES, loss_impl_for
from studio.core.memory.results import Estimate
from studio.core.memory.savers import SAVER_SPECS
from studio.core.memory.sharding import (CudaOverheads, ScaleOut, sharded_devices, with_cuda_overheads,
                                         zero_reduce_bucket_bytes)
from studio.core.methods import trains_like

TRACE_VERSION = 5  # 5: the chunked loss keeps only the final hidden state (no output_hidden_states)
# The moments of a step whose peaks are traced apart, by phase: each grows smoothly with depth and sizes
# (a phase's peak alone moves from one moment to another as they change)
PHASE_MOMENTS = {"forward": ("forward", "forward_head"), "backward": ("backward", "backward_last", "backward_first")}
MOMENTS = tuple(moment for moments in PHASE_MOMENTS.values() for moment in moments)
TRACE_DEPTHS = (2, 3)  # block 1 differs (its input needs no gradient): 3 - 2 is a typical block
DERIVED = "derived"  # Estimate.kind of these estimates
# benchmarks/memory_accuracy.py against real steps (docs/memory-accuracy.md)
DESCRIBED_ACCURACY = "measured: median 0.34 %, worst 8.40 %"
DERIVED_ACCURACY = "measured: median 0.19 %, worst 2.89 %; after a toggle median 0.31 %, worst 0.49 %"


def trace_settings(config: RunConfig) -> dict:
    """The run settings that change what a training step keeps alive, other than the sizes the trace scales,
    the regimes it traces side by side (``regime_axes``) and the LoRA settings it recounts."""
    scales = ("alpha", "use_rslora")  # scale factors cost no memory
    lora = {key: value for key, value in asdict(config.lora).items()
            if key not in scales and not (recounts_lora(config) and key in ("r", "target_modules", "dropout"))}
    quantization = {key: value for key, value in asdict(config.quantization).items() if key != "load_in"}
    # a quantized method trains as its method does: the base's loading is a regime (regime_axes)
    return {"method": trains_like(config.method), "dtype": config.model.dtype,
            "attention": config.model.attn_implementation, "loss": loss_impl_for(config),
            "quantization": quantization, "lora": lora, "peft": asdict(config.peft), "qat": asdict(config.qat),
            # savers that change what a step keeps: traced as set, never recounted (the trace counts the device's
            # memory only, so the CPU RAM they take is not in a derived estimate)
            "memory_savers": {spec.name: getattr(config.training, spec.name) for spec in SAVER_SPECS.values()
                              if spec.retraced},
            # which parts of a vision-language model train (a text model's key is as before)
            **({"vision": [config.vision.train_vision_tower, config.vision.train_projector]}
               if config.vision.train_vision_tower or config.vision.train_projector else {})}



def regime_axes(config: RunConfig, lora_axis: bool = False) -> dict:
    """The settings traced as regimes of one trace; with ``lora_axis`` (a model whose LoRA is not recounted,
    see ``recount``) the LoRA settings too."""
    axes = {"precision": config.training.precision, "checkpointing": config.training.gradient_checkpointing,
            "load_in": config.effective_load_in}
    return {**axes, "lora": lora_settings(config)} if lora_axis else axes


def regime_id(axes: dict) -> str:
    return json.dumps(axes, sort_keys=True)


PRECISIONS = ("bf16", "fp32")  # the precisions traced at pick time, besides the picked one (fp16 only when picked)
LOAD_INS = {"no": ("none",), "allowed": ("none", "4bit", "8bit"), "required": ("4bit", "8bit")}


def neighbour_configs(config: RunConfig) -> list[RunConfig]:
    """What a pick-time trace covers: ``config``, each precision and weight loading one toggle away, and each of
    these with checkpointing flipped (the commonest toggle, and one that does not add up with the others: see
    ``Trace.step``)."""
    t = config.training
    flips = [config] + [config.replace(training={"precision": p}) for p in PRECISIONS if p != t.precision]
    flips += [config.replace(quantization={"load_in": load_in})
              for load_in in LOAD_INS[config.method_spec.kbit_base] if load_in != config.effective_load_in]
    checkpointing = [c.replace(training={"gradient_checkpointing": not t.gradient_checkpointing}) for c in flips]
    return [config, checkpointing[0], *flips[1:], *checkpointing[1:]]


def trace_key(model_config: dict, config: RunConfig) -> str:
    text = json.dumps({"version": TRACE_VERSION, "model": model_config, "settings": trace_settings(config)},
                      sort_keys=True, default=list)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def trace_cache_dir() -> Path:
    override = os.environ.get("STUDIO_TRACE_CACHE")
    if override:
        return Path(override)
    import platformdirs  # here, not at the top: a process given its folders needs no platformdirs

    return platformdirs.user_cache_path("finetune-studio") / "memory-traces"


def trace_path(model_config: dict, config: RunConfig) -> Path:
    return trace_cache_dir() / f"{model_config.get('model_type', 'model')}-{trace_key(model_config, config)}.json"


def trace_points(vocab: int, chunked: bool, positions: int = 0) -> tuple[tuple[int, int], ...]:
    """(micro-batch, length) of the traced steps: five at each of two scales (see ``TracedStep.excess``), none
    longer than the model's ``positions`` (0: no limit).

    The chunked loss computes the logits of at most ``chunk_tokens`` at a time: no scale's points straddle
    that, so each fit sees one behaviour. The larger scale spans whole chunks when real runs of this
    vocabulary do (about 4,000 tokens a chunk or fewer), with as many rows as that takes.
    """
    longest = positions // 3 if positions else 1 << 20
    chunk_tokens = loss_chunk_tokens(vocab, chunked)
    large_length = min(512, longest)
    large_rows = -(-chunk_tokens // large_length) if chunk_tokens <= 4096 else 1
    scales = []
    for rows, length in ((1, min(128, longest)), (large_rows, large_length)):
        tokens = [b * s for b, s in scale_points(length, rows)]
        straddles = min(tokens) < chunk_tokens < max(tokens)
        if not straddles and (rows, length) not in scales:
            scales.append((rows, length))
    return tuple(point for rows, length in scales for point in scale_points(length, rows))


def loss_chunk_tokens(vocab: int, chunked: bool) -> int:
    """Tokens whose logits the loss computes at once (all of them for the full loss)."""
    return max(1, CHUNKED_LOSS_BYTES // (4 * vocab)) if chunked else 1 << 40


def scale_points(length: int, rows: int = 1) -> tuple[tuple[int, int], ...]:
    return ((rows, length), (rows, 2 * length), (rows, 3 * length), (2 * rows, length), (2 * rows, 2 * length))


def _size_terms(batch: int, length: int, scores: bool = True) -> tuple[int, ...]:
    """What a step's bytes grow with: once, per position (rotary tables), per position² (a mask shared by the
    rows), per token, and with ``scores`` per row x position² (attention probabilities, where the traced
    step keeps them: without them that term would only pick up the CPU kernels' block sizes and extrapolate
    them)."""
    terms = (1, length, length * length, batch * length)
    return terms + (batch * length * length,) if scores else terms


def fit_sizes(points, values, scores: bool = True) -> list[float]:
    """The coefficients of ``_size_terms`` through the trace points, by least squares (exact with as many
    points as terms): normal equations on columns scaled to 1, solved by Gaussian elimination."""
    columns = list(zip(*(_size_terms(*point, scores) for point in points)))
    scales = [float(max(column)) for column in columns]
    matrix = [[x / scale for x, scale in zip(_size_terms(*point, scores), scales)] for point in points]
    n = len(scales)
    rows = [[sum(m[i] * m[j] for m in matrix) for j in range(n)] + [sum(m[i] * v for m, v in zip(matrix, values))]
            for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(n):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col])]
    return [rows[i][n] / rows[i][i] / scales[i] for i in range(n)]


def value_at(coefficients, batch: int, length: int) -> float:
    return sum(c * term for c, term in zip(coefficients, _size_terms(batch, length, len(coefficients) == 5)))


def record_id(axes: dict) -> str:
    """A block record serves every regime of its precision and weight loading (checkpointing recomputes the
    same block)."""
    return f"{axes['precision']}/{axes['load_in']}"


@dataclass(frozen=True)
class Trace:
    """A traced model: its real depth, and per regime the measured steps of its few-block copies and the
    LoRA settings they ran with; per precision and weight loading a block's record (see the module doc)."""

    data: dict
    path: Path | None = None

    @classmethod
    def load(cls, path: Path) -> "Trace":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StudioError(f"cannot read the memory trace {path}: {exc}", "delete it and trace the model again",
                              kind="model") from exc
        if data.get("version") != TRACE_VERSION:
            raise StudioError(f"the memory trace {path} is of an older version", "trace the model again", kind="model")
        return cls(data, path)

    @property
    def layers(self) -> int:
        return self.data["layers"]

    def axes_of(self, config: RunConfig) -> dict:
        return regime_axes(config, lora_axis=recounts_lora(config) and not self.data["lora_recount"])

    def regime(self, axes: dict) -> dict | None:
        """A traced regime (``None`` if not traced; a failed one raises its error)."""
        regime = self.data["regimes"].get(regime_id(axes))
        if regime is not None and "error" in regime:
            raise StudioError(f"the model's code failed in the traced step with {regime_id(axes)}: {regime['error']}",
                              "these settings have no estimate", kind="model")
        return regime

    def record(self, axes: dict) -> dict:
        return self.data["records"][record_id(axes)]

    def step(self, config: RunConfig) -> "TracedStep":
        """The step of ``config`` from its traced regime (``TraceNeededError`` when it is not traced).

        Regimes are not added up: toggles that change the same tensors do not add (fp32 and checkpointing,
        each traced alone, added up to 75 % over a trace of both; fp32 and a 4-bit base to 27 % over a real
        step), so a combination the pick-time trace lacks is traced, into the same file."""
        axes = self.axes_of(config)
        regime = self.regime(axes)
        if regime is None:
            raise TraceNeededError(self.data["model_type"], self.path, regime_id(axes))
        lora = lora_settings(config) if recounts_lora(config) and self.data["lora_recount"] else None
        return TracedStep(self, regime, axes, lora)


@dataclass(frozen=True)
class TracedStep:
    """The traced step of one configuration: its regime (traced with ``regime["lora"]``) and, where LoRA is
    recounted, the run's LoRA settings (``lora``)."""

    trace: Trace
    regime: dict
    axes: dict
    lora: dict | None

    @property
    def layers(self) -> int:
        return self.trace.layers

    def once_and_per_block(self, value) -> tuple[float, float]:
        """(once, per block) of a quantity measured at both depths."""
        low, high = TRACE_DEPTHS
        a, b = value(self.regime["depths"][str(low)]), value(self.regime["depths"][str(high)])
        per_block = (b - a) / (high - low)
        return a - low * per_block, per_block

    def at_depth(self, value, layers: int) -> float:
        once, per_block = self.once_and_per_block(value)
        return once + layers * per_block

    def excess(self, moment: str, batch: int, length: int) -> tuple[int, int]:
        """(fixed, blocks) bytes a moment of the step holds over the model states, at the real depth."""
        points = [tuple(p) for p in self.trace.data["points"]]
        size = len(_size_terms(1, 1))
        scores = self.trace.data["scores"]
        scales = self._scales_like(batch * length, range(0, len(points), size))

        def fitted(depth_data):
            """The largest fit of the scales: a moment's peak is the largest of several instants, each of
            which grows by the terms, and each scale's fit follows the instants that dominate there."""
            values = [step[moment] for step in depth_data["steps"]]
            return max(value_at(fit_sizes(points[i:i + size], values[i:i + size], scores), batch, length)
                       for i in scales)

        once, per_block = self.once_and_per_block(fitted)
        blocks = per_block * self.layers + self._lora_change(moment, batch * length)
        return max(0, round(once)), max(0, round(blocks))

    def _scales_like(self, tokens: int, starts) -> list[int]:
        """The scales (by first point) on the same side of a loss chunk as ``tokens`` (all if none is)."""
        chunk = loss_chunk_tokens(self.trace.data["vocab"], self.trace.data["chunked"])
        points = self.trace.data["points"]
        alike = [i for i in starts if (points[i][0] * points[i][1] >= chunk) == (tokens >= chunk)]
        return alike or list(starts)

    def _lora_change(self, moment: str, tokens: int) -> float:
        """What the adapters hold at a moment with the run's LoRA settings, less with the traced ones.

        Their saved tensors (S, of the first block and of typical ones) live in every block until each block's
        backward; the gradients of their tensors (G a block) gather from the last block to the first; with
        checkpointing only the recomputed block saves anything, but autocast's cache keeps every block's cast
        weights (W) through the forward pass. As measured on traced steps, a moment's peak holds:

        ======================================  ================================  =======================
        moment                                  without checkpointing             with checkpointing
        ======================================  ================================  =======================
        forward, forward_head                   S_first + (L - 1) S               W_first + (L - 1) W
        backward (the head's)                   S_first + (L - 1) S               nothing
        backward_last (its start / its end)     S_first + (L - 1) S               S + (L - 2) G
        backward_first (all gradients but one)  S_first + (L - 1) G               S + (L - 1) G
        ======================================  ================================  =======================
        """
        if self.lora is None:
            return 0.0
        record, layers, checkpointing = self.trace.record(self.axes), self.layers, self.axes["checkpointing"]

        def held(settings: dict) -> float:
            def saved(block: str, weights_only: bool = False) -> float:
                return lora_block_bytes(record, settings, tokens, block, weights_only)

            gradients = adapter_bytes(record, settings)
            if not checkpointing:
                if moment == "backward_first":
                    return saved("first") + (layers - 1) * gradients
                return saved("first") + (layers - 1) * saved("typical")
            return {"forward": saved("first", True) + (layers - 1) * saved("typical", True),
                    "forward_head": saved("first", True) + (layers - 1) * saved("typical", True),
                    "backward": 0.0,
                    "backward_last": saved("typical") + (layers - 2) * gradients,
                    "backward_first": saved("typical") + (layers - 1) * gradients}[moment]

        return held(self.lora) - held(self.regime["lora"])

    def adapter_change(self) -> tuple[dict, int, int]:
        """The whole model's adapter tensors with the run's LoRA settings less the traced ones: counts by
        (shape, dtype), and their bytes and elements."""
        counts: dict = {}
        if self.lora is not None:
            record = self.trace.record(self.axes)
            for sign, settings in ((1, self.lora), (-1, self.regime["lora"])):
                for key, count in adapter_tensors(record, settings).items():
                    counts[key] = counts.get(key, 0) + sign * count * self.layers
        elements = sum(math.prod(shape) * count for (shape, _), count in counts.items())
        nbytes = sum(math.prod(shape) * DTYPE_BYTES[dtype] * count for (shape, dtype), count in counts.items())
        return counts, nbytes, elements

    def trainable_groups(self) -> tuple[TensorGroup, ...]:
        """The trainable tensors of the whole model: the outer ones once, a block's ``layers`` times."""
        low, high = TRACE_DEPTHS
        totals = self.adapter_change()[0]
        counts = [_group_counts(self.regime["depths"][str(depth)]["trainable"]) for depth in (low, high)]
        for key in set(counts[0]) | set(counts[1]):
            per_block = (counts[1].get(key, 0) - counts[0].get(key, 0)) // (high - low)
            once = counts[0].get(key, 0) - low * per_block
            totals[key] = totals.get(key, 0) + once + per_block * self.layers
        groups = [TensorGroup(tuple(shape), dtype, count) for (shape, dtype), count in totals.items() if count]
        return tuple(sorted(groups, key=lambda g: (g.shape, g.dtype)))


def _group_counts(tensors) -> dict:
    counts: dict = {}
    for shape, dtype in tensors:
        key = (tuple(shape), dtype)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _states(step: TracedStep, config: RunConfig, device_type: str) -> ModelStates:
    groups = step.trainable_groups()
    optimizer = OPTIMIZERS[config.training.optimizer]
    trainable_bytes = sum(g.nbytes * g.count for g in groups)
    full = config.method_spec.trains_every_weight
    model_bytes = round(step.at_depth(lambda d: d["model_bytes"], step.layers)) + step.adapter_change()[1]
    shared = optimizer.shared_state if groups else 0
    frozen_copy = model_bytes if config.frozen_reference else 0  # DPO's reference of full fine-tuning
    return ModelStates(
        weights=model_bytes - (0 if full else trainable_bytes) + frozen_copy, adapters=0 if full else trainable_bytes,
        gradients=trainable_bytes, optimizer_state=sum(optimizer.state(g) * g.count for g in groups) + shared,
        master_weights=0, optimizer_temporaries=optimizer.step_temporaries(groups, device_type),
        trainable_parameters=sum(g.elements * g.count for g in groups),
        fp32_optimizer_state=sum(optimizer.state(TensorGroup(g.shape, "fp32", 1)) * g.count for g in groups) + shared,
        full=full)


def derived_estimate(trace: Trace, config: RunConfig, device_type: str = "cuda", scale_out: ScaleOut = ScaleOut(),
                     overheads: CudaOverheads = CudaOverheads(), vision: VisionMemory | None = None,
                     width: int = 0) -> Estimate:
    """The estimate of ``config`` from the model's trace (see the module doc); ``vision``: what a
    vision-language model's images hold (the trace runs on text), added to every phase; ``width``: the model's
    hidden size (``sharding.model_width``), which sizes ZeRO's buckets."""
    if scale_out.layer_split:
        raise StudioError("a layer split needs a model family the estimate describes",
                          "estimate without distributed.layer_split", kind="config")
    step = trace.step(config)
    t = config.training
    states = _states(step, config, device_type)
    sequences = t.micro_batch_size * config.sequences_per_row  # a traced next-token step of as many sequences
    inputs = 3 * 8 * sequences * config.data.max_length * t.gradient_accumulation_steps
    persistent = {"weights": states.weights, "adapter_weights": states.adapters,
                  "optimizer_state": states.optimizer_state}
    accumulated = states.gradients if t.gradient_accumulation_steps > 1 else 0
    phases = {}
    for phase, moments in PHASE_MOMENTS.items():
        fixed, blocks = max((step.excess(moment, sequences, config.data.max_length) for moment in moments),
                            key=sum)
        phases[phase] = {**persistent, "gradients": accumulated, "activations": inputs + blocks, "logits_loss": fixed}
    phases["optimizer"] = {**persistent, "gradients": states.gradients, "activations": inputs,
                           "temporaries": states.optimizer_temporaries}
    if vision is not None:
        phases = with_images(phases, vision, {**persistent, "gradients": states.gradients})
    block_parameters = round(step.once_and_per_block(lambda d: d["parameters"])[1])
    devices, host = sharded_devices(phases, device_type, block_parameters, states, scale_out,
                                    zero_reduce_bucket_bytes(width, config))
    if device_type == "cuda":
        devices = [with_cuda_overheads(d, overheads, scale_out) for d in devices]
    peak_phase = max(devices, key=lambda d: d.total_bytes).peak_phase
    if host is not None:
        devices.append(host)
    # the base model's parameters, as a described estimate counts them (an adapter's are trained apart)
    adapter = 0 if states.full else states.trainable_parameters
    parameters = round(step.at_depth(lambda d: d["parameters"], step.layers)) + step.adapter_change()[2] - adapter
    note = ("traced estimate: activations are what the decoder blocks add, logits and loss what the model adds "
            "once (embeddings' output, head, loss)")
    return Estimate(devices=tuple(devices), peak_phase=peak_phase, parameters=parameters,
                    trainable_parameters=states.trainable_parameters,
                    tokens_per_micro_batch=t.micro_batch_size * config.data.max_length, notes=(note,), kind=DERIVED)


def cached_trace(model_config: dict, config: RunConfig) -> Trace | None:
    path = trace_path(model_config, config)
    return Trace.load(path) if path.is_file() else None


def kind_text(estimate: Estimate) -> str:
    """Which kind of estimate this is, and how close that kind came to measured steps."""
    if estimate.kind == DERIVED:
        return f"derived from a traced training step of the model's own code ({DERIVED_ACCURACY})"
    return f"described (the model's family, by hand; {DESCRIBED_ACCURACY})"


class TraceNeededError(StudioError):
    """The model's family is not described and its step has not been traced for these settings yet."""

    def __init__(self, model_type: str, path: Path, regime: str = ""):
        super().__init__(
            f"the estimate does not describe '{model_type}' models and has not traced this one with these settings yet",
            "run `studio estimate CONFIG` once (it traces a training step of a small copy and of the settings one "
            "toggle away, a minute or a few), "
            "or wait for the window's measurement", kind="model")
        self.model_type = model_type
        self.path = path
        self.regime = regime  # regime_id of the settings, or "" when the model has no trace at all
