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
  ``studio.core.modelinfo``) with the saving rules of every operation:
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
``backward`` (all gradients, one recomputed block), ``optimizer`` (the update).
The peak is the largest phase; its parts are reported and sum to the total.
Under ZeRO stages, offload and several GPUs the model states (weights,
gradients, fp32 master weights and optimizer state) are split as the ZeRO
paper and DeepSpeed's estimators do; activations stay per GPU.

Pure Python (no torch): the GUI recomputes it on every toggle (well under 5 ms).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory_parts import PARTS, PHASES
from studio.core.modelinfo import LinearLayer, ModelShape, model_shape

GIB = 1024**3


DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "bool": 1}
_CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# The estimate never says "fits" closer than this to the GPU's size.
TIGHT_FRACTION = 0.90


# ---------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ScaleOut:
    """How the run is spread over devices; ``ScaleOut.from_config`` reads it from the distributed section.

    ``zero_stage`` 0 is plain data parallelism; 1, 2, 3 shard optimizer state,
    then gradients, then parameters over ``num_gpus`` (DeepSpeed ZeRO, mixed
    precision: 16-bit weights and gradients, fp32 master weights; FSDP's full
    sharding is counted as stage 3). ``split_devices`` holds the memory of each
    device of a layer split (one process, blocks spread over them, see
    studio.core.placement), ``split_weight_limit`` the configured weight bytes
    per device (0: the device's memory minus room for the rest) and
    ``split_offload_bytes`` the CPU RAM that may hold the blocks that do not fit.
    """

    num_gpus: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    split_devices: tuple[int, ...] = ()
    split_weight_limit: int = 0
    split_offload_bytes: int = 0

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
                   offload_optimizer=d.offload_optimizer != "none", offload_params=d.offload_params != "none")

    @property
    def uses_zero(self) -> bool:
        return self.zero_stage > 0

    @property
    def layer_split(self) -> bool:
        return bool(self.split_devices)


@dataclass(frozen=True)
class CudaOverheads:
    """What a CUDA process holds besides tensors: measure ``context_bytes`` once per machine when possible."""

    context_bytes: int = 500 * 1024**2  # CUDA context with lazy module loading: 0.3-0.7 GB
    allocator_fraction: float = 0.05  # caching-allocator rounding and fragmentation over the tensor peak
    nccl_bytes: int = 600 * 1024**2  # one NCCL communicator, when there are several GPUs


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class DeviceEstimate:
    """The peak on one device: bytes by part (they sum to ``total_bytes``)."""

    device: str
    parts: dict[str, int]
    peak_phase: str
    phases: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(self.parts.values())

    def to_json(self) -> dict:
        return {"device": self.device, "parts": dict(self.parts), "total_bytes": self.total_bytes,
                "peak_phase": self.peak_phase, "phases": dict(self.phases)}


@dataclass(frozen=True)
class Verdict:
    """Whether the estimate fits a GPU: fits, tight (within 10 % of its size) or does not fit."""

    status: str
    gpu_bytes: int
    needed_bytes: int

    @property
    def headroom_bytes(self) -> int:
        return self.gpu_bytes - self.needed_bytes

    def to_json(self) -> dict:
        return {"status": self.status, "gpu_bytes": self.gpu_bytes, "needed_bytes": self.needed_bytes,
                "headroom_bytes": self.headroom_bytes}


def format_bytes(count: int) -> str:
    """``21.30 GiB``: binary units, as GPU tools report memory."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


_UNITS = {"": 1024**3, "b": 1, "kb": 10**3, "kib": 1024, "mb": 10**6, "mib": 1024**2, "gb": 10**9, "gib": 1024**3,
          "tb": 10**12, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """``24GiB``, ``24GB``, ``16000MiB`` or a bare number of GiB, as bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise StudioError(f"cannot read the memory size {text!r}", "write it like 24GiB, 24GB or 16000MiB", kind="usage")
    return int(float(match.group(1)) * _UNITS[unit])


def verdict_for(needed_bytes: int, gpu_bytes: int) -> Verdict:
    if needed_bytes > gpu_bytes:
        status = "does not fit"
    elif needed_bytes > TIGHT_FRACTION * gpu_bytes:
        status = "tight"
    else:
        status = "fits"
    return Verdict(status, gpu_bytes, needed_bytes)


@dataclass(frozen=True)
class Estimate:
    """The estimate of one run: the peak per device and where it happens.

    ``devices[0]`` is the first GPU (or the CPU when ``device_type`` is cpu);
    with several GPUs each gets an entry; with offload a ``host`` entry holds
    the CPU RAM the offloaded state needs.
    """

    devices: tuple[DeviceEstimate, ...]
    peak_phase: str
    parameters: int
    trainable_parameters: int
    tokens_per_micro_batch: int
    notes: tuple[str, ...] = ()
    placement: Any = None  # a layer split's studio.core.placement.Placement

    @property
    def peak_device(self) -> DeviceEstimate:
        """The fullest device that computes (a layer split fills its devices unevenly; the host is not one)."""
        return max((d for d in self.devices if d.device != "host"), key=lambda d: d.total_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.peak_device.total_bytes

    @property
    def parts(self) -> dict[str, int]:
        return self.peak_device.parts

    def verdict(self, gpu_bytes: int) -> Verdict:
        return verdict_for(self.peak_bytes, gpu_bytes)

    def to_json(self, gpu_bytes: int | None = None) -> dict:
        out: dict[str, Any] = {
            "devices": [device.to_json() for device in self.devices],
            "peak_phase": self.peak_phase, "peak_bytes": self.peak_bytes,
            "parameters": self.parameters, "trainable_parameters": self.trainable_parameters,
            "tokens_per_micro_batch": self.tokens_per_micro_batch, "notes": list(self.notes),
        }
        if self.placement is not None:
            out["placement"] = self.placement.to_json()
        if gpu_bytes:
            out["verdict"] = self.verdict(gpu_bytes).to_json()
        return out


# ---------------------------------------------------------------- the run's numeric settings


@dataclass(frozen=True)
class Regime:
    """Everything about a run the memory depends on, resolved from a RunConfig and a device type."""

    device_type: str  # "cuda" or "cpu"
    compute: str  # dtype of matmuls: the autocast dtype, or the weights' dtype without autocast
    autocast: bool
    base_dtype: str  # loaded dtype of the non-quantized weights
    quantization: str  # "none", "4bit", "8bit"
    double_quant: bool
    full: bool  # every weight trains
    adapted: tuple[LinearLayer, ...]  # block linears with an adapter (LoRA, AdaLoRA, IA3, LoHa, LoKr)
    rank: int
    lora_dropout: float
    dora: bool
    checkpointing: bool
    attention: str  # "sdpa" or "eager"
    optimizer: str
    micro_batch: int
    accumulation: int
    sequence: int
    loss_impl: str
    method: str = "lora"
    virtual_tokens: int = 0  # prefix / prompt tuning
    feedforward_width: int = 0  # IA3 scales the input of linears this wide (the MLP's output projection)
    qat: bool = False  # torchao fake-quantizes the block linears' weights
    qat_activations: bool = False  # and their inputs

    @property
    def kbit_prepared(self) -> bool:
        return self.quantization != "none"

    @property
    def outer_dtype(self) -> str:
        """Dtype of every non-quantized weight: k-bit preparation upcasts 16-bit ones to fp32."""
        return "fp32" if self.kbit_prepared else self.base_dtype

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.sequence

    @property
    def embedding_output_needs_grad(self) -> bool:
        # full fine-tuning trains the embeddings; LoRA with checkpointing calls enable_input_require_grads;
        # prompt tuning's trained tokens are part of the input
        return self.full or self.checkpointing or self.method == "prompt_tuning"


LOSS_IMPLS = ("full_fp32", "chunked")
CHUNKED_LOSS_BYTES = 64 * 2**20  # fp32 logits of one chunk of the chunked loss (studio.train.loss)


def loss_impl_for(config: RunConfig) -> str:
    """The loss the worker computes: chunked unless switched off, or the weights are sharded (then they are
    only gathered inside the model's own forward, not for a separate output layer)."""
    chunked = config.training.chunked_loss and config.distributed.sharding not in ("zero3", "fsdp")
    return "chunked" if chunked else "full_fp32"


def regime_for(config: RunConfig, shape: ModelShape, device_type: str = "cuda", loss_impl: str | None = None) -> Regime:
    training = config.training
    precision = training.precision  # the config's names are the estimate's dtype names
    if config.model.dtype != "auto":
        base = _CONFIG_DTYPES[config.model.dtype]
    else:  # studio.train.model.weight_dtype
        base = "fp32" if config.method == "full" else precision
    loss_impl = loss_impl or loss_impl_for(config)
    if loss_impl not in LOSS_IMPLS:
        raise StudioError(f"unknown loss implementation {loss_impl!r}", "use " + " or ".join(LOSS_IMPLS), kind="config")
    autocast = precision != "fp32"
    virtual = config.peft.num_virtual_tokens if config.method in ("prefix_tuning", "prompt_tuning") else 0
    prompt = virtual if config.method == "prompt_tuning" else 0  # the virtual tokens run through the whole model
    return Regime(
        device_type=device_type, compute=precision if autocast else base, autocast=autocast, base_dtype=base,
        quantization=config.effective_load_in, double_quant=config.quantization.double_quant,
        full=config.method == "full",
        adapted=shape.resolve_targets(config.lora.target_modules) if config.adapts_linears else (),
        rank=config.lora.r, lora_dropout=config.lora.dropout, dora=config.lora.use_dora,
        checkpointing=training.gradient_checkpointing, attention=config.model.attn_implementation,
        optimizer=training.optimizer, micro_batch=training.micro_batch_size,
        accumulation=training.gradient_accumulation_steps, sequence=config.data.max_length + prompt,
        loss_impl=loss_impl, method=config.method, virtual_tokens=virtual, feedforward_width=shape.intermediate,
        qat=config.qat.enabled, qat_activations=config.qat.activations != "none",
    )


# ---------------------------------------------------------------- activations: the block interpreter


class _Storage:
    """One allocation; views share it. Identity is the object."""

    __slots__ = ("nbytes", "kind")

    def __init__(self, nbytes: int, kind: str = "activation"):
        self.nbytes = nbytes
        self.kind = kind  # "activation" or "weight_copy"


@dataclass(eq=False)
class _Tensor:
    storage: _Storage
    elements: int
    dtype: str
    requires_grad: bool
    heads_major: bool = False  # laid out (batch, heads, sequence, head_dim) in memory

    @property
    def nbytes(self) -> int:
        return self.elements * DTYPE_BYTES[self.dtype]


@dataclass(eq=False)
class _Node:
    """One autograd node: what backward hands it, what it produces and what it frees."""

    outputs: tuple[_Tensor, ...]
    inputs: tuple[_Tensor, ...]  # operands that need a gradient
    saved: tuple[_Storage, ...]
    temporary: int = 0  # bytes its backward allocates besides the input gradients
    parameter_grad: int = 0  # bytes it adds to the parameters' .grad
    operands: tuple[_Tensor, ...] = ()  # every operand, for the forward pass's liveness
    held: tuple[_Storage, ...] = ()  # kept as plain attributes of its context: checkpointing cannot drop them
    forward_temporary: int = 0  # bytes its forward allocates and frees inside (a dequantized weight)

    @property
    def kept(self) -> tuple[_Storage, ...]:
        return self.saved + self.held


def _promote(*dtypes: str) -> str:
    floats = [d for d in dtypes if d in ("fp32", "bf16", "fp16")]
    if "fp32" in floats or len(set(floats)) > 1:
        return "fp32"
    return floats[0] if floats else dtypes[0]


# Operations autocast runs in fp32 regardless of the input, per device (torch's autocast op lists).
_FP32_UNDER_AUTOCAST = {"cuda": frozenset({"layer_norm", "pow", "softmax"}), "cpu": frozenset()}


class ActivationTape:
    """Runs a block recipe symbolically and records the autograd graph it would build.

    The recipe calls the operations below with ``_Tensor`` values that carry
    element count, dtype, storage and requires-grad. Each operation creates its
    outputs, marks what the real operation saves for backward and records a
    node, so that ``saved_bytes`` can count what the forward pass keeps and
    ``simulate_backward`` can replay the backward pass of a block.
    """

    def __init__(self, shape: ModelShape, regime: Regime):
        self.shape = shape
        self.regime = regime
        self.tokens = regime.tokens
        self.nodes: list[_Node] = []
        self.position_dtype = "fp32"  # rotary cos/sin follow the embeddings' dtype
        self._saving: list[_Storage] = []
        self._holding: list[_Storage] = []
        self._adapted = {layer.path for layer in regime.adapted}

    # ----------------------------------------------------------- bookkeeping
    def new(self, elements: int, dtype: str, requires_grad: bool, kind: str = "activation") -> _Tensor:
        return _Tensor(_Storage(elements * DTYPE_BYTES[dtype], kind), elements, dtype, requires_grad)

    def save(self, tensor: _Tensor) -> None:
        self._saving.append(tensor.storage)

    def hold(self, tensor: _Tensor) -> None:
        """Kept for backward outside autograd's saved tensors (a custom Function's ``ctx.A = A``)."""
        self._holding.append(tensor.storage)

    def record(self, outputs, inputs, temporary: int = 0, parameter_grad: int = 0, forward_temporary: int = 0) -> None:
        """Close the operation whose saves were just marked."""
        saved, self._saving = tuple(dict.fromkeys(self._saving)), []
        held, self._holding = tuple(dict.fromkeys(self._holding)), []
        operands = tuple(inputs)
        inputs = tuple(t for t in operands if t.requires_grad)
        if inputs or parameter_grad:  # autograd builds no node when nothing needs a gradient
            self.nodes.append(_Node(tuple(outputs), inputs, saved, temporary, parameter_grad, operands, held,
                                    forward_temporary))

    def unary(self, tensor: _Tensor, dtype: str | None = None, elements: int | None = None) -> _Tensor:
        """A new tensor computed from one operand, saving nothing (a cast, a copy, a scaling)."""
        out = self.new(elements or tensor.elements, dtype or tensor.dtype, tensor.requires_grad)
        self.record([out], [tensor])
        return out

    def cast(self, tensor: _Tensor, dtype: str) -> _Tensor:
        return tensor if tensor.dtype == dtype else self.unary(tensor, dtype)

    def _autocast(self, tensor: _Tensor, op: str = "matmul") -> _Tensor:
        """The operand an autocast-eligible op really computes with."""
        if not self.regime.autocast:
            return tensor
        if op in _FP32_UNDER_AUTOCAST[self.regime.device_type]:
            return self.cast(tensor, "fp32")
        return self.cast(tensor, self.regime.compute) if op == "matmul" else tensor

    def _weight_copy(self, elements: int, dtype: str, trainable: bool) -> _Tensor | None:
        """Autocast's 16-bit copy of a weight (cached once per step for trainable leaves, per call otherwise)."""
        if not self.regime.autocast or dtype == self.regime.compute:
            return None
        return self.new(elements, self.regime.compute, trainable, kind="weight_copy")

    # ----------------------------------------------------------- elementwise
    def add(self, *tensors: _Tensor) -> _Tensor:
        out = self.new(max(t.elements for t in tensors), _promote(*(t.dtype for t in tensors)),
                       any(t.requires_grad for t in tensors))
        self.record([out], tensors)
        return out

    def mul(self, a: _Tensor, b: _Tensor) -> _Tensor:
        if a.requires_grad:
            self.save(b)
        if b.requires_grad:
            self.save(a)
        return self.add(a, b)

    def scale(self, tensor: _Tensor) -> _Tensor:
        """Multiply or shift by a Python number: nothing saved."""
        return self.unary(tensor)

    def split(self, tensor: _Tensor, parts: int) -> tuple[_Tensor, ...]:
        """Views into one storage (a fused qkv output split in three)."""
        views = tuple(_Tensor(tensor.storage, tensor.elements // parts, tensor.dtype, tensor.requires_grad)
                      for _ in range(parts))
        self.record(views, [tensor])
        return views

    def dropout(self, tensor: _Tensor, p: float) -> _Tensor:
        if p <= 0:
            return tensor
        # CUDA's fused kernel keeps a bool mask; the CPU path multiplies by a noise tensor of the input's dtype.
        mask_dtype = "bool" if self.regime.device_type == "cuda" else tensor.dtype
        if tensor.requires_grad:
            self.save(self.new(tensor.elements, mask_dtype, False))
        return self.unary(tensor)

    def saving_input(self, tensor: _Tensor) -> _Tensor:
        """A pointwise function whose backward needs its input (SiLU, GELU)."""
        if tensor.requires_grad:
            self.save(tensor)
        return self.unary(tensor)

    def saving_output(self, tensor: _Tensor) -> _Tensor:
        """A pointwise function whose backward needs its output (tanh, ReLU)."""
        out = self.new(tensor.elements, tensor.dtype, tensor.requires_grad)
        if tensor.requires_grad:
            self.save(out)
        self.record([out], [tensor])
        return out

    def power(self, tensor: _Tensor) -> _Tensor:
        return self.saving_input(self._autocast(tensor, "pow"))

    # ----------------------------------------------------------- layers
    def activation(self, tensor: _Tensor) -> _Tensor:
        name = self.shape.activation
        if name == "gelu_new":  # transformers' NewGELU: 0.5·x·(1 + tanh(c·(x + 0.044715·x³)))
            half = self.scale(tensor)
            inner = self.add(tensor, self.scale(self.power(tensor)))
            return self.mul(half, self.scale(self.saving_output(self.scale(inner))))
        if name == "relu":
            return self.saving_output(tensor)
        return self.saving_input(tensor)  # silu, gelu, gelu_pytorch_tanh and the other fused ones

    def norm(self, x: _Tensor, size: int | None = None) -> _Tensor:
        size = size or self.shape.hidden
        kind, regime = self.shape.family.norm, self.regime
        trainable = regime.full
        rows = x.elements // size
        weight_grad = (2 if kind == "layer" else 1) * size * DTYPE_BYTES[regime.outer_dtype] if trainable else 0
        if kind == "layer":  # native_layer_norm keeps input, mean and rstd
            x_in = self._autocast(x, "layer_norm")
            if x_in.requires_grad or trainable:
                stats_dtype = x_in.dtype if regime.device_type == "cpu" else "fp32"
                for tensor in (x_in, self.new(rows, stats_dtype, False), self.new(rows, stats_dtype, False)):
                    self.save(tensor)
            out = self.new(x.elements, _promote(x_in.dtype, regime.outer_dtype), x.requires_grad or trainable)
            self.record([out], [x_in], parameter_grad=weight_grad)
            return out
        x32 = self.cast(x, "fp32")
        if x32.requires_grad:  # the fp32 input (pow and mul keep it) and rsqrt of the variance
            self.save(x32)
            self.save(self.new(rows, "fp32", False))
        normalized = self.new(x.elements, "fp32", x.requires_grad)
        self.record([normalized], [x32], temporary=2 * x32.nbytes)  # the composite's backward, in fp32
        if kind == "rms":  # Llama: weight * normalized.to(input dtype)
            normalized = self.cast(normalized, x.dtype)
            out_dtype = _promote(regime.outer_dtype, x.dtype)
        else:  # Gemma: normalized * (1 + weight) in fp32, then back to the input dtype
            out_dtype = "fp32"
        if trainable:
            self.save(normalized)
        out = self.new(x.elements, out_dtype, x.requires_grad or trainable)
        self.record([out], [normalized], parameter_grad=weight_grad)
        return self.cast(out, x.dtype) if kind == "rms_gemma" else out

    def rope(self, q: _Tensor, k: _Tensor) -> tuple[_Tensor, _Tensor]:
        if self.shape.rotary_fraction <= 0:
            return q, k
        # q·cos + rotate(q)·sin keeps only cos and sin, which all layers share
        dtypes = [_promote(t.dtype, self.position_dtype) for t in (q, k)]
        out = tuple(self.new(t.elements, d, t.requires_grad) for t, d in zip((q, k), dtypes))
        for tensor in out:  # partial rotary concatenates the rotated and the passed dims: heads-major
            tensor.heads_major = self.shape.rotary_fraction < 1
        self.record(out, [q, k], temporary=sum(t.nbytes for t in out))
        return out

    def attention(self, q: _Tensor, k: _Tensor, v: _Tensor) -> _Tensor:
        shape, regime = self.shape, self.regime
        q, k, v = (self._autocast(t) for t in (q, k, v))
        # prefix tuning's trained keys and values join every layer's attention
        grad = q.requires_grad or k.requires_grad or v.requires_grad or regime.method == "prefix_tuning"
        scores = self.tokens * shape.heads * regime.sequence
        dropout = shape.attention_dropout
        if regime.attention == "sdpa" and not (dropout > 0 and regime.device_type == "cpu"):
            out = self.new(q.elements, q.dtype, grad)
            if grad:  # flash / memory-efficient kernels: q, k, v, output and the log-sum-exp
                for tensor in (q, k, v, out, self.new(self.tokens * shape.heads, "fp32", False)):
                    self.save(tensor)
            self.record([out], [q, k, v])
            # the CPU kernel lays its output out like q; transpose(1, 2).contiguous() then copies it
            return self.unary(out) if q.heads_major and regime.device_type == "cpu" else out
        if regime.attention == "sdpa":  # dropout on the CPU: the math fallback, upcast to fp32
            return self._math_attention(q, k, v, scores, grad)
        return self._eager_attention(q, k, v, scores, dropout, grad)

    def _math_attention(self, q, k, v, scores: int, grad: bool) -> _Tensor:
        expanded = self.tokens * self.shape.q_width
        if grad:  # scaled q and k, v (fp32, all heads), softmax output, dropout noise, dropped probabilities
            for elements in (expanded, expanded, expanded, scores, scores, scores):
                self.save(self.new(elements, "fp32", False))
        out = self.new(q.elements, "fp32", grad)
        self.record([out], [q, k, v], temporary=2 * scores * 4 + 3 * expanded * 4)
        return self.unary(self.cast(out, q.dtype))  # back to the input dtype, then made contiguous

    def _eager_attention(self, q, k, v, scores: int, dropout: float, grad: bool) -> _Tensor:
        expanded = self.tokens * self.shape.q_width
        if k.elements != expanded:  # repeat_kv materializes the shared key/value heads
            k, v = self.unary(k, elements=expanded), self.unary(v, elements=expanded)
        if grad:
            self.save(q)
            self.save(k)
        raw = self.new(scores, q.dtype, grad)
        self.record([raw], [q, k])
        # most families ask softmax for fp32; GPT-2 does not, but CUDA's autocast runs softmax in fp32 anyway
        raw = self.cast(raw, "fp32") if self.shape.family.eager_softmax_fp32 else self._autocast(raw, "softmax")
        probabilities = self.saving_output(raw)
        probabilities = self.dropout(self.cast(probabilities, q.dtype), dropout)
        if grad:
            self.save(probabilities)
            self.save(v)
        out = self.new(q.elements, q.dtype, grad)
        self.record([out], [probabilities, v])
        return self.unary(out)  # transpose(1, 2).contiguous() copies it

    def linear(self, x: _Tensor, path: str) -> _Tensor:
        layer = self.shape.linear(path)
        if path in self._adapted and self.regime.method == "ia3" and layer.in_features == self.regime.feedforward_width:
            # IA3 scales a feedforward layer's input in the vector's dtype (fp32), then casts it back
            x = self.cast(self.mul(self.cast(x, "fp32"), self.new(layer.in_features, "fp32", True)), x.dtype)
        out = self._base_linear(x, layer)
        if path not in self._adapted:
            return out
        method = self.regime.method
        if method == "ia3":
            if layer.in_features == self.regime.feedforward_width:
                return out
            return self.cast(self.mul(out, self.new(layer.out_features, "fp32", True)), out.dtype)  # back to out's dtype
        if method in ("loha", "lokr"):
            return self._rebuilt_update(x, layer, out)
        return self._lora(x, layer, out)

    def _base_linear(self, x: _Tensor, layer: LinearLayer) -> _Tensor:
        regime = self.regime
        elements = self.tokens * layer.out_features
        if regime.quantization == "4bit":  # bnb casts to its compute dtype and keeps only the packed weight
            x_in = self.cast(x, regime.compute)
            out = self.new(elements, regime.compute, x.requires_grad)
            dequantized = layer.weight_elements * DTYPE_BYTES[regime.compute]  # backward dequantizes again
            self.record([out], [x_in], temporary=dequantized)
            return self.cast(out, x.dtype)
        if regime.quantization == "8bit":  # bnb keeps its input as ctx.A (ctx.tensors on CUDA)
            if x.requires_grad:
                self.hold(x)
            out = self.new(elements, self._autocast(x).dtype, x.requires_grad)
            # it dequantizes the weight to the input's dtype, which autocast copies again for the matmul
            dequantized = layer.weight_elements * (DTYPE_BYTES[x.dtype] + DTYPE_BYTES[out.dtype])
            self.record([out], [x], temporary=layer.weight_elements * DTYPE_BYTES[x.dtype], forward_temporary=dequantized)
            return out
        bias = layer.out_features if layer.bias else 0
        if regime.qat_activations:  # torchao fake-quantizes the input into a new tensor, which the matmul keeps
            x = self._fake_quantize(x)
        return self._dense(x, layer.weight_elements, regime.base_dtype, regime.full, elements, bias, regime.qat)

    def _dense(self, x: _Tensor, weight_elements: int, weight_dtype: str, trainable: bool, out_elements: int,
               bias: int = 0, fake_quantized: bool = False) -> _Tensor:
        x_in = self._autocast(x)
        weight = self._weight_copy(weight_elements, weight_dtype, trainable)
        if fake_quantized:  # the fake-quantized weight is a new tensor (fp32 work inside), kept for the input's gradient
            if trainable:  # its rounding graph keeps an fp32 copy for the straight-through gradient
                self._fake_quantize(self.new(weight_elements, weight_dtype, True))
            weight = self.new(weight_elements, x_in.dtype if self.regime.autocast else weight_dtype, trainable,
                              kind="weight_copy")
        if trainable:
            self.save(x_in)
        if x_in.requires_grad and weight is not None:
            self.save(weight)
        out = self.new(out_elements, x_in.dtype, x.requires_grad or trainable)
        parameter = (weight_elements + bias) * DTYPE_BYTES[weight_dtype] if trainable else 0
        # the gradient of an autocast copy is cast to the weight's dtype before it is accumulated
        transient = weight_elements * DTYPE_BYTES[x_in.dtype] if trainable and weight is not None else 0
        if fake_quantized and trainable:  # the straight-through gradient reaches the weight through an fp32 copy
            transient += weight_elements * 4
        self.record([out], [x_in], temporary=transient, parameter_grad=parameter)
        return out

    def _fake_quantize(self, tensor: _Tensor) -> _Tensor:
        """torchao's fake quantization (scale, round, clamp, rescale): when a gradient flows through it,
        its graph keeps about one fp32 copy of the tensor (measured, benchmarks/memory_accuracy.py)."""
        if tensor.requires_grad:
            self.save(self.new(tensor.elements, "fp32", False))
        return self.unary(tensor)

    def _rebuilt_update(self, x: _Tensor, layer: LinearLayer, base_out: _Tensor) -> _Tensor:
        """LoHa / LoKr rebuild the whole weight update (fp32) from their factors every forward and
        apply it with a second matmul, which keeps the update (or its autocast copy) and the input."""
        update = self.new(layer.weight_elements, "fp32", True)
        x_in = self._autocast(self.dropout(x, 0.0))
        weight = self.cast(update, x_in.dtype) if self.regime.autocast else update
        self.save(x_in)
        if x_in.requires_grad:
            self.save(weight)
        out = self.new(base_out.elements, x_in.dtype, True)
        factors = sum(g.nbytes for g in adapter_groups(layer, self.regime))
        self.record([out], [x_in], temporary=2 * update.nbytes, parameter_grad=factors)
        return self.add(base_out, out)

    def _lora(self, x: _Tensor, layer: LinearLayer, base_out: _Tensor) -> _Tensor:
        regime, rank = self.regime, self.regime.rank
        adapter_input = self.dropout(self.cast(x, "fp32"), regime.lora_dropout)  # peft casts to the adapter dtype
        a_out = self._dense(adapter_input, rank * layer.in_features, "fp32", True, self.tokens * rank)
        b_out = self._dense(a_out, rank * layer.out_features, "fp32", True, base_out.elements)
        if regime.dora:  # the magnitude rescaling keeps the base and the adapter results
            self.save(base_out)
            self.save(b_out)
        return self.add(base_out, self.scale(b_out))

    # ----------------------------------------------------------- the model
    def embeddings(self) -> _Tensor:
        shape, regime = self.shape, self.regime
        x = self.new(self.tokens * shape.hidden, regime.outer_dtype, regime.embedding_output_needs_grad)
        if shape.family.embedding_scale or shape.family.position_embeddings:
            x = self.scale(x)
        self.position_dtype = x.dtype
        return self.dropout(x, shape.embedding_dropout)

    def block(self, x: _Tensor) -> _Tensor:
        return self.shape.family.block(self, self.shape, x)

    def head(self, x: _Tensor) -> _Tensor:
        """Final norm and output projection; returns the logits."""
        regime = self.regime
        x = self.norm(x)
        bias = self.shape.vocab if self.shape.family.head_bias else 0
        return self._dense(x, self.shape.head_elements, regime.outer_dtype, regime.full,
                           self.tokens * self.shape.vocab, bias)


def saved_bytes(nodes: list[_Node], kind: str | None = None) -> int:
    """Bytes the nodes keep for backward (each storage once)."""
    storages = dict.fromkeys(s for node in nodes for s in node.kept)
    return sum(s.nbytes for s in storages if kind is None or s.kind == kind)


def held_bytes(nodes: list[_Node]) -> int:
    """Bytes the nodes keep outside autograd's saved tensors, which checkpointing cannot drop."""
    return sum(s.nbytes for s in dict.fromkeys(s for node in nodes for s in node.held))


@dataclass(frozen=True)
class BackwardMoment:
    """The largest moment of one block's backward pass, above what was alive before it began."""

    saved: int  # the block's saved (or recomputed) tensors still alive
    in_flight: int  # activation gradients and the backward's own temporaries
    parameter_grads: int  # .grad bytes the block has produced so far

    @property
    def total(self) -> int:
        return self.saved + self.in_flight + self.parameter_grads


def forward_transient(nodes: list[_Node]) -> int:
    """The most a block's forward pass holds at once besides what it saves.

    A tensor made inside the block lives from the operation that makes it to
    the last one that reads it (Python may hold it a little longer).
    """
    saved = {s for node in nodes for s in node.kept}
    born, last_use = {}, {}
    for index, node in enumerate(nodes):
        for tensor in node.operands:
            last_use[tensor.storage] = index
        for tensor in node.outputs:
            born.setdefault(tensor.storage, index)
            last_use.setdefault(tensor.storage, index)
    live = [(born[s], last_use[s], s.nbytes) for s in born if s not in saved]
    return max((node.forward_temporary + sum(nbytes for start, end, nbytes in live if start <= index <= end)
                for index, node in enumerate(nodes)), default=0)


def simulate_backward(nodes: list[_Node], output: _Tensor, recomputed: bool) -> tuple[BackwardMoment, int]:
    """Replay a block's backward: returns its largest moment and all the .grad bytes it produces.

    A ``recomputed`` (checkpointed) block first reruns its forward pass. Then
    nodes run in reverse; each turns its outputs' gradients into its inputs'
    (accumulated in place when an input feeds several nodes) and then frees
    the tensors it saved, unless a node still to run saved them too.
    """
    references = Counter(s for node in nodes for s in node.kept)
    saved = sum(s.nbytes for s in references)
    pending: dict[_Tensor, int] = {output: output.nbytes}
    parameters = 0
    worst = BackwardMoment(saved, output.nbytes + (forward_transient(nodes) if recomputed else 0), 0)
    for node in reversed(nodes):
        incoming = [pending.pop(t) for t in node.outputs if t in pending]
        if incoming:
            produced = sum(t.nbytes for t in node.inputs)
            moment = BackwardMoment(saved, sum(pending.values()) + sum(incoming) + produced + node.temporary, parameters)
            worst = max(worst, moment, key=lambda m: m.total)
            for tensor in node.inputs:
                pending[tensor] = tensor.nbytes
        parameters += node.parameter_grad
        for storage in dict.fromkeys(node.kept):
            references[storage] -= 1
            if references[storage] == 0:
                saved -= storage.nbytes
    return worst, parameters


@dataclass(frozen=True)
class Activations:
    """What one micro-batch's forward pass leaves for backward, and its backward's worst moments."""

    saved: int  # all blocks and the head, autocast weight copies included
    weight_copies: int  # the autocast weight copies among them
    autocast_cache: int  # weight copies alive only until autocast exits (checkpointed blocks)
    before_last_block: int  # kept by earlier blocks while the model's last block runs backward
    before_first_block: int  # kept outside the first block while it runs backward
    last_block: BackwardMoment  # the first block backward meets (the model's last)
    first_block: BackwardMoment  # the last one it meets (the model's first)
    block_grads: int  # .grad bytes one block produces
    head_grads: int  # .grad bytes of the final norm and the output head
    logits_dtype: str


def activations(shape: ModelShape, regime: Regime) -> Activations:
    """Run the recipe for the embeddings, two blocks and the head; scale the second block to the others."""
    tape = ActivationTape(shape, regime)
    x = tape.embeddings()
    if regime.checkpointing:  # each block keeps its input; backward recomputes one block at a time
        x = _Tensor(_Storage(x.nbytes), x.elements, x.dtype, True)
    marks, inputs, outputs = [len(tape.nodes)], [], []
    for _ in range(2):
        inputs.append(x)
        x = tape.block(x)
        outputs.append(x)
        marks.append(len(tape.nodes))
    logits = tape.head(x)
    first, later, head = tape.nodes[marks[0]:marks[1]], tape.nodes[marks[1]:marks[2]], tape.nodes[marks[2]:]
    first_moment, _ = simulate_backward(first, outputs[0], regime.checkpointing)
    last_moment, block_grads = simulate_backward(later, outputs[1], regime.checkpointing)
    layers, block_saved = shape.layers, saved_bytes(later)
    if layers == 1:  # the second block was only there to be scaled away
        last_moment = first_moment
    if regime.checkpointing:
        # each block keeps its input, and what its nodes hold outside autograd (while the block is
        # recomputed too); a recomputed block may save its own input: that is the kept tensor, not a copy
        held = held_bytes(later)
        kept = x.nbytes + held
        unsaved_input = 0 if any(inputs[1].storage in node.kept for node in later) else x.nbytes
        saved = layers * kept + saved_bytes(head)
        before_last, before_first = (layers - 1) * kept + held + unsaved_input, held + unsaved_input
        copies = saved_bytes(head, "weight_copy")
        cache = layers * saved_bytes(later, "weight_copy") if regime.full else 0
    else:
        saved = saved_bytes(tape.nodes) + (layers - 2) * block_saved
        before_last, before_first = (saved_bytes(first) + (layers - 2) * block_saved if layers > 1 else 0), 0
        copies = saved_bytes(tape.nodes, "weight_copy") + (layers - 2) * saved_bytes(later, "weight_copy")
        cache = 0
    return Activations(saved=saved, weight_copies=copies, autocast_cache=cache, before_last_block=before_last,
                       before_first_block=before_first, last_block=last_moment, first_block=first_moment,
                       block_grads=block_grads, head_grads=sum(node.parameter_grad for node in head),
                       logits_dtype=logits.dtype)


# ---------------------------------------------------------------- logits and loss


def logits_loss_bytes(shape: ModelShape, regime: Regime, logits_dtype: str) -> tuple[int, int]:
    """(forward, backward) peak bytes of the logits and the fp32 cross-entropy (the worker's token_loss_sum).

    Forward: the logits, their fp32 copy (none for fp32 logits: the labels are
    shifted, not the logits) and the log-softmax output. Backward (log-softmax
    backward): the saved log-softmax, the incoming gradient and the outgoing one,
    all fp32, for every position.
    """
    b, s, v = regime.micro_batch, regime.sequence, shape.vocab
    width = DTYPE_BYTES[logits_dtype]
    if regime.loss_impl == "chunked":
        positions = b * (s - 1)  # the last position of a row predicts nothing
        return _chunked_loss_bytes(shape, regime, positions, 8 * positions)
    positions = b * s
    targets = 8 * positions  # int64 labels, shifted (a copy)
    fp32_copy = 0 if width == 4 else 4 * positions * v
    return width * positions * v + fp32_copy + 4 * positions * v + targets, 12 * positions * v + targets


def _chunked_loss_bytes(shape: ModelShape, regime: Regime, positions: int, targets: int) -> tuple[int, int]:
    """The chunked loss: at worst every position a target; the logits of one chunk at a time.

    Forward (each chunk's gradients are computed there): the gathered hidden
    states, their fp32 gradient being filled, a trainable output layer's fp32
    gradient, and one chunk's fp32 log-softmax with the gradients of its backward.
    Backward: the kept fp32 gradient, its scaled copy and that copy cast back.
    """
    v, h = shape.vocab, shape.hidden
    chunk = min(positions, max(1, CHUNKED_LOSS_BYTES // (4 * v)))
    outer = DTYPE_BYTES[regime.outer_dtype]
    kept = 4 * positions * h + (4 * v * h if regime.full else 0)
    forward = positions * h * outer + kept + 12 * chunk * v
    backward = 2 * kept + outer * positions * h
    return forward + targets, backward + targets


# ---------------------------------------------------------------- weights, gradients, optimizer


@dataclass(frozen=True)
class TensorGroup:
    """``count`` trainable tensors of one shape and dtype."""

    shape: tuple[int, ...]
    dtype: str
    count: int

    @property
    def elements(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.elements * DTYPE_BYTES[self.dtype]


def trainable_tensors(shape: ModelShape, regime: Regime) -> tuple[TensorGroup, ...]:
    if regime.full:
        groups = [TensorGroup(p.shape, regime.base_dtype, 1) for p in shape.outer_parameters]
        groups += [TensorGroup(p.shape, regime.base_dtype, shape.layers) for p in shape.block_parameters]
        return tuple(groups)
    layers = shape.layers
    if regime.method == "prompt_tuning":  # one embedding row per virtual token
        return (TensorGroup((regime.virtual_tokens, shape.hidden), "fp32", 1),)
    if regime.method == "prefix_tuning":  # a key and a value row per virtual token and layer
        return (TensorGroup((regime.virtual_tokens, 2 * layers * shape.kv_width), "fp32", 1),)
    return tuple(replace(group, count=group.count * layers) for layer in regime.adapted
                 for group in adapter_groups(layer, regime))


def adapter_groups(layer: LinearLayer, regime: Regime) -> tuple[TensorGroup, ...]:
    """The trainable tensors peft adds to one linear layer (fp32), per method."""
    r, n_in, n_out = regime.rank, layer.in_features, layer.out_features
    if regime.method == "ia3":  # a scaling vector: of the input for feedforward layers, else of the output
        return (TensorGroup((1, n_in) if n_in == regime.feedforward_width else (n_out, 1), "fp32", 1),)
    if regime.method == "loha":  # two Hadamard-multiplied low-rank products
        return tuple(TensorGroup(s, "fp32", 2) for s in ((n_out, r), (r, n_in)))
    if regime.method == "lokr":
        return _lokr_groups(n_in, n_out, r)
    groups = [TensorGroup((r, n_in), "fp32", 1), TensorGroup((n_out, r), "fp32", 1)]
    if regime.method == "adalora":  # and the singular values
        groups.append(TensorGroup((r, 1), "fp32", 1))
    if regime.dora:
        groups.append(TensorGroup((n_out,), "fp32", 1))
    return tuple(groups)


def _factorization(dimension: int) -> tuple[int, int]:
    """peft's LoKr split of a dimension into two factors near its square root (smaller first)."""
    m, n = 1, dimension
    while m < n:
        candidate = m + 1
        while dimension % candidate:
            candidate += 1
        if candidate + dimension // candidate > 1 + dimension:
            break
        m, n = candidate, dimension // candidate
    return min(m, n), max(m, n)


def _lokr_groups(n_in: int, n_out: int, r: int) -> tuple[TensorGroup, ...]:
    """LoKr: a small full matrix Kronecker-multiplied with a second one, low-rank when the rank is small."""
    in_m, in_n = _factorization(n_in)
    out_l, out_k = _factorization(n_out)
    groups = [TensorGroup((out_l, in_m), "fp32", 1)]
    if r < max(out_k, in_n) / 2:
        groups += [TensorGroup((out_k, r), "fp32", 1), TensorGroup((r, in_n), "fp32", 1)]
    else:
        groups.append(TensorGroup((out_k, in_n), "fp32", 1))
    return tuple(groups)


def _total(groups, per_tensor) -> int:
    return sum(per_tensor(g) * g.count for g in groups)


def _quantized_weight_bytes(layer: LinearLayer, regime: Regime) -> int:
    """A bitsandbytes weight with its quantization state (absmax, codebooks), as stored."""
    n = layer.weight_elements
    if regime.quantization == "8bit":
        return n + 4 * layer.out_features  # int8 weights and an fp32 scale per row
    blocks = math.ceil(n / 64)
    code = 16 * 4  # the NF4/FP4 lookup table
    if regime.double_quant:  # 8-bit absmax, their own fp32 absmax per 256 blocks, a 256-entry code, an offset
        return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 256 * 4 + 4 + code
    return n // 2 + 4 * blocks + code


def block_weight_bytes(shape: ModelShape, regime: Regime) -> int:
    """One decoder block as loaded and prepared (adapters excluded)."""
    block = sum(p.elements * _block_parameter_width(p, regime) for p in shape.block_parameters)
    if regime.quantization != "none":
        block += sum(_quantized_weight_bytes(layer, regime) for layer in shape.block_linears)
    return block


def outer_weight_bytes(shape: ModelShape, regime: Regime) -> dict[str, int]:
    """The weights outside the blocks by module (``model.embed_tokens``, ``model.norm``, ``lm_head``)."""
    modules: dict[str, int] = {}
    for p in shape.outer_parameters:
        module = p.name.rsplit(".", 1)[0]
        modules[module] = modules.get(module, 0) + p.elements * DTYPE_BYTES[regime.outer_dtype]
    return modules


def weight_bytes(shape: ModelShape, regime: Regime) -> int:
    """The base model as loaded and prepared, with its buffers (adapters excluded)."""
    rotary_buffers = 4 * int(shape.head_dim * shape.rotary_fraction)  # inv_freq and its original copy, fp32
    return sum(outer_weight_bytes(shape, regime).values()) + shape.layers * block_weight_bytes(shape, regime) + rotary_buffers


def _block_parameter_width(p, regime: Regime) -> int:
    """Bytes per element of a block parameter that stays unquantized (0 for quantized weights)."""
    if p.kind == "linear" and regime.quantization != "none":
        return 0
    if p.kind == "bias" and regime.quantization == "4bit":
        return DTYPE_BYTES[regime.compute]  # bnb's Linear4bit moves its bias to the compute dtype at the first forward
    return DTYPE_BYTES[regime.outer_dtype]


@dataclass(frozen=True)
class OptimizerModel:
    """Bytes an optimizer keeps per trainable tensor, and the temporaries of its step."""

    state: Callable[[TensorGroup], int]  # bytes kept per tensor
    shared_state: int  # bytes kept once per optimizer
    step_temporaries: Callable[[tuple[TensorGroup, ...], str], int]  # (groups, device_type) -> bytes


_BNB_BLOCK = 256
_BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps smaller tensors' state in 32 bits


def _adam_state(group: TensorGroup) -> int:
    return 2 * group.nbytes + 4  # exp_avg, exp_avg_sq and the step counter


def _adam8bit_state(group: TensorGroup) -> int:
    n = group.elements
    if n < _BNB_MIN_8BIT_SIZE:
        return 8 * n
    return 2 * n + 2 * 4 * math.ceil(n / _BNB_BLOCK)  # two uint8 states and their fp32 absmax per block


def _adafactor_state(group: TensorGroup) -> int:
    if len(group.shape) >= 2:  # factored second moment: one fp32 value per row and per column
        rows = math.prod(group.shape[:-1])
        cols = math.prod(group.shape[:-2]) * group.shape[-1]
        return 4 * (rows + cols)
    return 4 * group.elements


def _largest(groups) -> int:
    return max((g.nbytes for g in groups), default=0)


def _adam_step_temporaries(groups, device_type: str) -> int:
    if device_type == "cuda":  # foreach: sqrt(exp_avg_sq) for every tensor at once
        return _total(groups, lambda g: g.nbytes)
    return 2 * _largest(groups)  # one tensor at a time: sqrt(exp_avg_sq) and its division


def _adafactor_step_temporaries(groups, device_type: str) -> int:
    """grad² and grad² + eps, then the update, one tensor at a time in fp32 (16-bit weights add fp32 copies)."""
    largest = max(groups, key=lambda g: g.elements, default=None)
    if largest is None:
        return 0
    return (2 if largest.dtype == "fp32" else 4) * largest.elements * 4


OPTIMIZERS: dict[str, OptimizerModel] = {
    "adamw": OptimizerModel(_adam_state, 0, _adam_step_temporaries),
    "adamw_8bit": OptimizerModel(_adam8bit_state, 2 * 256 * 4, lambda groups, device: 0),
    "paged_adamw_8bit": OptimizerModel(_adam8bit_state, 2 * 256 * 4, lambda groups, device: 0),
    "sgd": OptimizerModel(lambda g: g.nbytes, 0, lambda groups, device: 0),
    "adafactor": OptimizerModel(_adafactor_state, 0, _adafactor_step_temporaries),
}


@dataclass(frozen=True)
class ModelStates:
    """Weights, gradients and optimizer state of the whole model on one GPU (before any sharding)."""

    weights: int
    adapters: int
    gradients: int
    optimizer_state: int
    master_weights: int
    optimizer_temporaries: int
    trainable_parameters: int
    fp32_optimizer_state: int  # the state if the trainable weights were fp32 (as ZeRO's master copies are)
    full: bool


def model_states(shape: ModelShape, regime: Regime) -> ModelStates:
    groups = trainable_tensors(shape, regime)
    optimizer = OPTIMIZERS[regime.optimizer]
    state = _total(groups, optimizer.state) + (optimizer.shared_state if groups else 0)
    return ModelStates(
        weights=weight_bytes(shape, regime),
        adapters=0 if regime.full else _total(groups, lambda g: g.nbytes),
        gradients=_total(groups, lambda g: g.nbytes),
        optimizer_state=state,
        master_weights=0,  # the worker trains fp32 weights directly: autocast makes 16-bit copies
        optimizer_temporaries=optimizer.step_temporaries(groups, regime.device_type),
        trainable_parameters=_total(groups, lambda g: g.elements),
        fp32_optimizer_state=_total([replace(g, dtype="fp32") for g in groups], optimizer.state)
        + (optimizer.shared_state if groups else 0),
        full=regime.full,
    )


# ---------------------------------------------------------------- phases and the peak


def _phases(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations) -> dict[str, dict[str, int]]:
    """Every part at each phase's peak moment, on one device."""
    inputs = 3 * 8 * regime.tokens * regime.accumulation  # input_ids, attention_mask, labels (int64), all micro-batches
    inputs += prefix_bytes(shape, regime)
    persistent = {"weights": states.weights, "adapter_weights": states.adapters,
                  "optimizer_state": states.optimizer_state, "master_weights": states.master_weights}
    return {
        "forward": {**persistent, **_loss_moment(shape, regime, states, acts, inputs)},
        "backward": {**persistent, **_backward_moment(shape, regime, states, acts, inputs)},
        "optimizer": {**persistent, "gradients": states.gradients, "activations": inputs,
                      "temporaries": states.optimizer_temporaries},
    }


def _loss_moment(shape: ModelShape, regime: Regime, states: ModelStates, acts: Activations, inputs: int) -> dict:
    """The end of the forward pass: every saved activation, and the logits and loss at their largest."""
    loss_forward, loss_backward = logits_loss_bytes(shape, regime, acts.logits_dtype)
    # autocast's cache (checkpointed blocks' weight copies) lives until the forward pass leaves autocast
    in_forward = loss_forward + acts.autocast_cache > loss_backward
    return {"gradients": states.gradients if regime.accumulation > 1 else 0,
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


def prefix_bytes(shape: ModelShape, regime: Regime) -> int:
    """Prefix tuning's keys and values for one micro-batch: the fp32 prefix, and every layer's
    attention keeping keys and values longer by the virtual tokens (compute dtype)."""
    if regime.method != "prefix_tuning":
        return 0
    elements = regime.micro_batch * regime.virtual_tokens * 2 * shape.layers * shape.kv_width
    return elements * (4 + DTYPE_BYTES[regime.compute])


def _complete(parts: dict[str, int]) -> dict[str, int]:
    return {name: int(parts.get(name, 0)) for name in PARTS}


def estimate(model_config: dict | ModelShape, config: RunConfig, device_type: str = "cuda",
             scale_out: ScaleOut = ScaleOut(), loss_impl: str | None = None,
             overheads: CudaOverheads = CudaOverheads()) -> Estimate:
    """The itemized peak memory of ``config`` on ``model_config`` (a config.json mapping).

    ``device_type`` "cuda" adds the CUDA context and the allocator margin;
    "cpu" predicts the live tensor bytes a CPU run reaches. Raises StudioError
    for architectures and LoRA targets it does not know.
    """
    shape = model_config if isinstance(model_config, ModelShape) else model_shape(model_config)
    regime = regime_for(config, shape, device_type, loss_impl)
    states = model_states(shape, regime)
    if scale_out.uses_zero and regime.full:  # DeepSpeed trains 16-bit weights: autocast has no copies to make
        regime = replace(regime, base_dtype=regime.compute)
    acts = activations(shape, regime)
    phases = _phases(shape, regime, states, acts)
    if scale_out.layer_split:
        from studio.core.placement import split_devices

        devices, host, placement = split_devices(phases, shape, regime, scale_out, overheads)
    else:
        placement = None
        devices, host = _scale_out(phases, shape, regime, states, scale_out)
    if device_type == "cuda":
        devices = [_with_cuda_overheads(d, overheads, scale_out) for d in devices]
    peak_phase = max(devices, key=lambda d: d.total_bytes).peak_phase
    if host is not None:
        devices.append(host)
    notes = _notes(shape, regime)
    if placement is not None and placement.offloaded_layers and not regime.checkpointing:
        notes += ("the offloaded blocks stay on the first device from their forward to their backward: "
                  "turn on gradient checkpointing to fetch one at a time",)
    return Estimate(devices=tuple(devices), peak_phase=peak_phase, parameters=shape.parameter_count,
                    trainable_parameters=states.trainable_parameters, tokens_per_micro_batch=regime.tokens,
                    notes=notes, placement=placement)


def _peak(device: str, phases: dict[str, dict[str, int]]) -> DeviceEstimate:
    totals = {name: sum(parts.values()) for name, parts in phases.items()}
    peak = max(PHASES, key=lambda name: totals[name])
    return DeviceEstimate(device, _complete(phases[peak]), peak, totals)


def _with_cuda_overheads(device: DeviceEstimate, overheads: CudaOverheads, scale_out: ScaleOut) -> DeviceEstimate:
    parts = dict(device.parts)
    parts["cuda_context"] = overheads.context_bytes
    parts["allocator_margin"] = int(overheads.allocator_fraction * device.total_bytes)
    if scale_out.num_gpus > 1:
        parts["communication"] += overheads.nccl_bytes
    extra = sum(parts.values()) - device.total_bytes
    return replace(device, parts=parts, phases={k: v + extra for k, v in device.phases.items()})


# ---------------------------------------------------------------- ZeRO, offload, several GPUs


def _scale_out(phases, shape: ModelShape, regime: Regime, states: ModelStates, scale_out: ScaleOut):
    """Per-GPU shares under data parallelism and ZeRO, and the host RAM that offload needs."""
    if scale_out.num_gpus == 1 and not scale_out.uses_zero:
        return [_peak("cuda:0" if regime.device_type == "cuda" else "cpu", phases)], None
    shares = zero_model_states(states, scale_out)
    communication = _bucket_bytes(states, scale_out)
    gathered = 2 * _largest_block_bytes(shape) if scale_out.zero_stage == 3 else 0  # one layer's parameters, gathered
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
    devices = [_peak(f"{regime.device_type}:{rank}", per_gpu) for rank in range(scale_out.num_gpus)]
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
    return DeviceEstimate("host", _complete(parts), "optimizer")


def _bucket_bytes(states: ModelStates, scale_out: ScaleOut) -> int:
    if scale_out.num_gpus == 1:
        return 0
    if scale_out.zero_stage == 0:  # DDP copies every gradient into its buckets
        return states.gradients
    return min(states.gradients, 2 * 500_000_000 * 2)  # reduce and allgather buckets of 5e8 16-bit elements


def _largest_block_bytes(shape: ModelShape) -> int:
    return 2 * sum(p.elements for p in shape.block_parameters)


def _notes(shape: ModelShape, regime: Regime) -> tuple[str, ...]:
    notes = []
    known = {"silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "gelu_fast", "quick_gelu"}
    if shape.activation not in known:
        notes.append(f"activation {shape.activation} is modelled as keeping its input")
    if regime.dora:
        notes.append("DoRA is modelled approximately (its weight-norm temporaries are not counted)")
    if regime.loss_impl == "chunked":
        notes.append("lean loss: logits are computed for at most "
                     f"{max(1, CHUNKED_LOSS_BYTES // (4 * shape.vocab)):,} tokens at a time")
    if regime.method == "prefix_tuning":
        notes.append("prefix tuning's longer keys and values are modelled approximately")
    if regime.qat:
        notes.append("QAT: each fake-quantized weight is a new tensor kept for backward (fp32 work while it is made)")
    return tuple(notes)
