"""Model states: the trainable tensors, the base weights as loaded, gradients and the optimizer's state."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

from studio.core.config import RunConfig
from studio.core.memory.regime import DTYPE_BYTES, Regime, pinned_bytes
from studio.core.model.families import LinearLayer
from studio.core.model.info import ModelShape


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
    if regime.method.trains_virtual_tokens:
        token = regime.method.token_shape(shape.hidden, shape.layers, shape.kv_width)
        return (TensorGroup((regime.virtual_tokens, *token), "fp32", 1),)
    return tuple(replace(group, count=group.count * shape.layers) for layer in regime.adapted
                 for group in adapter_groups(layer, regime))


def adapter_groups(layer: LinearLayer, regime: Regime) -> tuple[TensorGroup, ...]:
    """The trainable tensors peft adds to one linear layer (fp32), as the method's table entry shapes them."""
    feedforward = layer.in_features == regime.feedforward_width
    shapes = regime.method.linear_tensor_shapes(layer.in_features, layer.out_features, layer.adapter_rank(regime.rank),
                                                feedforward, regime.dora)
    return tuple(TensorGroup(shape, "fp32", 1) for shape in shapes)


def _total(groups, per_tensor) -> int:
    return sum(per_tensor(g) * g.count for g in groups)


def quantized_weight_bytes(layer: LinearLayer, regime: Regime) -> int:
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
        block += sum(quantized_weight_bytes(layer, regime) for layer in shape.block_linears if layer.is_module)
    return block


def outer_weight_bytes(shape: ModelShape, regime: Regime) -> dict[str, int]:
    """The weights outside the blocks by module (``model.embed_tokens``, ``model.norm``, ``lm_head``), and
    those of towers text training never runs (Gemma 3's vision tower)."""
    input_embedding = shape.family.embeddings[0][0]
    modules: dict[str, int] = {}
    for p in shape.outer_parameters + shape.attached:
        module = ".".join(p.name.split(".")[:2]) if p.kind == "attached" else p.name.rsplit(".", 1)[0]
        if p.name == input_embedding:
            dtype = regime.embedding_dtype
        else:
            dtype = regime.head_dtype if p.kind in ("head", "head_bias") else regime.outer_dtype
        modules[module] = modules.get(module, 0) + p.elements * DTYPE_BYTES[dtype]
    return modules


def weight_bytes(shape: ModelShape, regime: Regime) -> int:
    """The base model as loaded and prepared on the device, with its buffers (adapters excluded)."""
    rotary_buffers = 4 * int(shape.head_dim * shape.rotary_fraction)  # inv_freq and its original copy, fp32
    device = sum(outer_weight_bytes(shape, regime).values()) - host_weight_bytes(shape, regime)
    return device + shape.layers * block_weight_bytes(shape, regime) + rotary_buffers


def host_weight_bytes(shape: ModelShape, regime: Regime) -> int:
    """The weights kept in CPU RAM: the input embedding (training.embedding_on_cpu) and the output layer
    (training.output_layer_on_cpu)."""
    embedding = 0
    if regime.embedding_on_host:
        _, rows = shape.family.embeddings[0]
        embedding = rows(shape) * shape.hidden * DTYPE_BYTES[regime.embedding_dtype]
    return embedding + host_head_bytes(shape, regime)


def host_head_bytes(shape: ModelShape, regime: Regime) -> int:
    """The output layer kept in CPU RAM (training.output_layer_on_cpu), else 0: its weight and any bias, which
    the loss copies to the device while it runs."""
    return sum(_host_head_tensors(shape, regime))


def host_weight_ram(shape: ModelShape, regime: Regime) -> int:
    """The CPU RAM the weights kept there take: the embedding as it is, the output layer pinned (on CUDA, in
    blocks rounded up to a power of two: regime.pinned_bytes) for its copies to the device."""
    head = sum(pinned_bytes(nbytes, regime.device_type) for nbytes in _host_head_tensors(shape, regime))
    return host_weight_bytes(shape, regime) - host_head_bytes(shape, regime) + head


def _host_head_tensors(shape: ModelShape, regime: Regime) -> list[int]:
    if not regime.head_on_host:
        return []
    return [p.elements * DTYPE_BYTES[regime.head_dtype] for p in shape.outer_parameters if p.kind in ("head", "head_bias")]


def host_weight_notes(shape: ModelShape, regime: Regime, config: RunConfig) -> list[str]:
    """What the estimate says of the weights asked to stay in CPU RAM: that they do, or why they cannot here."""
    notes = []
    if regime.embedding_on_host:
        notes.append("the input embedding stays in CPU RAM (host); only the looked-up rows reach the GPU")
    elif config.training.embedding_on_cpu and shape.tie_embeddings:
        notes.append("training.embedding_on_cpu has no effect here: the output layer shares the embedding's weight")
    if regime.head_on_host:
        notes.append("the output layer stays in CPU RAM (host); it is copied to the GPU only while the loss is computed")
    elif config.training.output_layer_on_cpu and shape.tie_embeddings:
        notes.append("training.output_layer_on_cpu has no effect here: the output layer shares the embedding's weight")
    elif config.training.output_layer_on_cpu and shape.transformed_logits:
        notes.append("training.output_layer_on_cpu has no effect here: the full loss over these logits needs the "
                     "output layer on the GPU")
    return notes


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
        weights=weight_bytes(shape, regime) * (2 if regime.frozen_reference else 1),
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

