"""The estimate of a model no family describes, derived from a traced training step of its own code.

``studio.train.trace`` builds copies of the model with ``TRACE_DEPTHS`` decoder
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
with ``states`` and ``sharding``: pure Python, well under a millisecond. Every
setting that changes what a step keeps (method, LoRA rank and targets,
precision, weight dtype, checkpointing, attention, loss, quantization, QAT) is
part of the trace's key instead: a new combination is traced anew.

The trace is a JSON file in the user's cache folder, named by ``trace_key``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.regime import CHUNKED_LOSS_BYTES, loss_impl_for
from studio.core.memory.results import Estimate
from studio.core.memory.sharding import CudaOverheads, ScaleOut, sharded_devices, with_cuda_overheads
from studio.core.memory.states import OPTIMIZERS, ModelStates, TensorGroup

TRACE_VERSION = 3
# The moments of a step whose peaks are traced apart, by phase: each grows smoothly with depth and sizes
# (a phase's peak alone moves from one moment to another as they change)
PHASE_MOMENTS = {"forward": ("forward", "forward_head"), "backward": ("backward", "backward_last", "backward_first")}
MOMENTS = tuple(moment for moments in PHASE_MOMENTS.values() for moment in moments)
TRACE_DEPTHS = (2, 3)  # block 1 differs (its input needs no gradient): 3 - 2 is a typical block
DERIVED = "derived"  # Estimate.kind of these estimates
# benchmarks/memory_accuracy.py against real steps (docs/memory-accuracy.md)
DESCRIBED_ACCURACY = "measured: median 0.34 %, worst 8.40 %"
DERIVED_ACCURACY = "measured: median 0.10 %, worst 2.89 %"


def trace_settings(config: RunConfig) -> dict:
    """The run settings that change what a training step keeps alive (not the sizes the trace scales)."""
    lora = asdict(config.lora)
    del lora["alpha"]  # a scale factor: no memory
    return {"method": config.method, "dtype": config.model.dtype, "attention": config.model.attn_implementation,
            "precision": config.training.precision, "checkpointing": config.training.gradient_checkpointing,
            "loss": loss_impl_for(config), "load_in": config.effective_load_in,
            "quantization": asdict(config.quantization), "lora": lora, "peft": asdict(config.peft),
            "qat": asdict(config.qat),
            # k-bit runs only, so that the other runs' traces keep their keys
            **({"lean_weights": config.training.lean_weights} if config.effective_load_in != "none" else {})}


def trace_key(model_config: dict, config: RunConfig) -> str:
    text = json.dumps({"version": TRACE_VERSION, "model": model_config, "settings": trace_settings(config)},
                      sort_keys=True, default=list)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def trace_cache_dir() -> Path:
    override = os.environ.get("STUDIO_TRACE_CACHE")
    return Path(override) if override else platformdirs.user_cache_path("finetune-studio") / "memory-traces"


def trace_path(model_config: dict, config: RunConfig) -> Path:
    return trace_cache_dir() / f"{model_config.get('model_type', 'model')}-{trace_key(model_config, config)}.json"


def trace_points(vocab: int, chunked: bool, positions: int = 0) -> tuple[tuple[int, int], ...]:
    """(micro-batch, length) of the traced steps: five at each of two scales (see ``Trace.excess``), none
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


@dataclass(frozen=True)
class Trace:
    """A traced model: its real depth and the measured steps of its few-block copies (see the module doc)."""

    data: dict

    @classmethod
    def load(cls, path: Path) -> "Trace":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StudioError(f"cannot read the memory trace {path}: {exc}", "delete it and trace the model again",
                              kind="model") from exc
        if data.get("version") != TRACE_VERSION:
            raise StudioError(f"the memory trace {path} is of an older version", "trace the model again", kind="model")
        return cls(data)

    @property
    def layers(self) -> int:
        return self.data["layers"]

    def _by_depth(self, depth: int) -> dict:
        return self.data["depths"][str(depth)]

    def once_and_per_block(self, value) -> tuple[float, float]:
        """(once, per block) of a quantity measured at both depths."""
        low, high = TRACE_DEPTHS
        a, b = value(self._by_depth(low)), value(self._by_depth(high))
        per_block = (b - a) / (high - low)
        return a - low * per_block, per_block

    def at_depth(self, value, layers: int) -> float:
        once, per_block = self.once_and_per_block(value)
        return once + layers * per_block

    def excess(self, moment: str, batch: int, length: int) -> tuple[int, int]:
        """(fixed, blocks) bytes a moment of the step holds over the model states, at the real depth."""
        points = [tuple(p) for p in self.data["points"]]
        size = len(_size_terms(1, 1))
        scores = self.data["scores"]
        scales = self._scales_like(batch * length, range(0, len(points), size))

        def fitted(depth_data):
            """The largest fit of the scales: a moment's peak is the largest of several instants, each of
            which grows by the terms, and each scale's fit follows the instants that dominate there."""
            values = [step[moment] for step in depth_data["steps"]]
            return max(value_at(fit_sizes(points[i:i + size], values[i:i + size], scores), batch, length)
                       for i in scales)

        once, per_block = self.once_and_per_block(fitted)
        return max(0, round(once)), max(0, round(per_block * self.layers))

    def _scales_like(self, tokens: int, starts) -> list[int]:
        """The scales (by first point) on the same side of a loss chunk as ``tokens`` (all if none is)."""
        chunk = loss_chunk_tokens(self.data["vocab"], self.data["chunked"])
        points = self.data["points"]
        alike = [i for i in starts if (points[i][0] * points[i][1] >= chunk) == (tokens >= chunk)]
        return alike or list(starts)

    def trainable_groups(self) -> tuple[TensorGroup, ...]:
        """The trainable tensors of the whole model: the outer ones once, a block's ``layers`` times."""
        low, high = TRACE_DEPTHS
        counts = [_group_counts(self._by_depth(depth)["trainable"]) for depth in (low, high)]
        groups = []
        for key in set(counts[0]) | set(counts[1]):
            per_block = (counts[1].get(key, 0) - counts[0].get(key, 0)) // (high - low)
            once = counts[0].get(key, 0) - low * per_block
            count = once + per_block * self.layers
            if count:
                groups.append(TensorGroup(tuple(key[0]), key[1], count))
        return tuple(sorted(groups, key=lambda g: (g.shape, g.dtype)))


def _group_counts(tensors) -> dict:
    counts: dict = {}
    for shape, dtype in tensors:
        key = (tuple(shape), dtype)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _states(trace: Trace, config: RunConfig, device_type: str) -> ModelStates:
    groups = trace.trainable_groups()
    optimizer = OPTIMIZERS[config.training.optimizer]
    trainable_bytes = sum(g.nbytes * g.count for g in groups)
    full = config.method_spec.trains_every_weight
    model_bytes = round(trace.at_depth(lambda d: d["model_bytes"], trace.layers))
    shared = optimizer.shared_state if groups else 0
    return ModelStates(
        weights=model_bytes - (0 if full else trainable_bytes), adapters=0 if full else trainable_bytes,
        gradients=trainable_bytes, optimizer_state=sum(optimizer.state(g) * g.count for g in groups) + shared,
        master_weights=0, optimizer_temporaries=optimizer.step_temporaries(groups, device_type),
        trainable_parameters=sum(g.elements * g.count for g in groups),
        fp32_optimizer_state=sum(optimizer.state(TensorGroup(g.shape, "fp32", 1)) * g.count for g in groups) + shared,
        full=full)


def derived_estimate(trace: Trace, config: RunConfig, device_type: str = "cuda", scale_out: ScaleOut = ScaleOut(),
                     overheads: CudaOverheads = CudaOverheads()) -> Estimate:
    """The estimate of ``config`` from the model's trace (see the module doc)."""
    if scale_out.layer_split:
        raise StudioError("a layer split needs a model family the estimate describes",
                          "estimate without distributed.layer_split", kind="config")
    t = config.training
    states = _states(trace, config, device_type)
    inputs = 3 * 8 * t.micro_batch_size * config.data.max_length * t.gradient_accumulation_steps
    persistent = {"weights": states.weights, "adapter_weights": states.adapters,
                  "optimizer_state": states.optimizer_state}
    accumulated = states.gradients if t.gradient_accumulation_steps > 1 else 0
    phases = {}
    for phase, moments in PHASE_MOMENTS.items():
        fixed, blocks = max((trace.excess(moment, t.micro_batch_size, config.data.max_length) for moment in moments),
                            key=sum)
        phases[phase] = {**persistent, "gradients": accumulated, "activations": inputs + blocks, "logits_loss": fixed}
    phases["optimizer"] = {**persistent, "gradients": states.gradients, "activations": inputs,
                           "temporaries": states.optimizer_temporaries}
    block_parameters = round(trace.once_and_per_block(lambda d: d["parameters"])[1])
    devices, host = sharded_devices(phases, device_type, block_parameters, states, scale_out)
    if device_type == "cuda":
        devices = [with_cuda_overheads(d, overheads, scale_out) for d in devices]
    peak_phase = max(devices, key=lambda d: d.total_bytes).peak_phase
    if host is not None:
        devices.append(host)
    # the base model's parameters, as a described estimate counts them (an adapter's are trained apart)
    adapter = 0 if states.full else states.trainable_parameters
    parameters = round(trace.at_depth(lambda d: d["parameters"], trace.layers)) - adapter
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

    def __init__(self, model_type: str, path: Path):
        super().__init__(
            f"the estimate does not describe '{model_type}' models and has not traced this one with these settings yet",
            "run `studio estimate CONFIG` once (it traces one training step of a small copy, about a minute), "
            "or wait for the window's measurement", kind="model")
        self.model_type = model_type
        self.path = path

