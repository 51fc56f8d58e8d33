"""Saved activations, counted by interpreting each decoder block's recipe (studio.core.model.families)
with autograd's saving rules, and the backward pass replayed block by block (the logits and the
loss: studio.core.memory.parts.logits)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from studio.core.memory.parts.states import adapter_groups
from studio.core.memory.regime import DTYPE_BYTES, Regime
from studio.core.methods import ATTENTION_TOKENS, REBUILT, SCALING
from studio.core.model.families import ROUTER, LinearLayer
from studio.core.model.info import ModelShape


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

    def __init__(self, shape: ModelShape, regime: Regime, feedforward=None):
        self.shape = shape
        self.feedforward = feedforward  # feedforward(tape, x, compute) runs each MLP instead, if given
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

    def held_by_caller(self, tensor: _Tensor) -> None:
        """A module's input lives until the module returns: the caller's frame holds it (peft's LoRA reads it
        after the base layer; an MLP's input outlives its last projection)."""
        if self.nodes:
            self.nodes[-1].operands += (tensor,)

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

    def split(self, tensor: _Tensor, parts: int | tuple[int, ...]) -> tuple[_Tensor, ...]:
        """Views into one storage: a fused output split in ``parts`` equal parts, or in parts of these widths."""
        sizes = (tensor.elements // parts,) * parts if isinstance(parts, int) else [self.tokens * w for w in parts]
        views = tuple(_Tensor(tensor.storage, size, tensor.dtype, tensor.requires_grad) for size in sizes)
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

    def rotary_tables(self) -> int:
        """Bytes of the rotary cos and sin the model computes once for all layers (the embeddings' dtype):
        every block's forward and recomputation reads them, so they live through forward and backward."""
        if self.shape.rotary_fraction <= 0:
            return 0
        width = round(self.shape.head_dim * self.shape.rotary_fraction)
        return 2 * self.tokens * width * DTYPE_BYTES[self.position_dtype]

    def attention(self, q: _Tensor, k: _Tensor, v: _Tensor) -> _Tensor:
        shape, regime = self.shape, self.regime
        q, k, v = (self._autocast(t) for t in (q, k, v))
        # prefix tuning's trained keys and values join every layer's attention
        grad = q.requires_grad or k.requires_grad or v.requires_grad or regime.method.token_entry == ATTENTION_TOKENS
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
        if self.shape.attention_softcap:  # cap * tanh(scores / cap): tanh keeps its output
            raw = self.scale(self.saving_output(self.scale(raw)))
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
        if not layer.is_module:
            return self._parameter_linear(x, layer)
        form = self.regime.method.linear_form if path in self._adapted else ""
        scales_input = form == SCALING and layer.in_features == self.regime.feedforward_width
        if scales_input:  # IA3 scales a feedforward layer's input in the vector's dtype (fp32), then casts it back
            x = self.cast(self.mul(self.cast(x, "fp32"), self.new(layer.in_features, "fp32", True)), x.dtype)
        out = self._base_linear(x, layer)
        if not form or scales_input:
            return out
        if form == SCALING:  # the output times the vector, back in the output's dtype
            return self.cast(self.mul(out, self.new(layer.out_features, "fp32", True)), out.dtype)
        out = self._rebuilt_update(x, layer, out) if form == REBUILT else self._lora(x, layer, out)
        self.held_by_caller(x)
        return out

    def _base_linear(self, x: _Tensor, layer: LinearLayer) -> _Tensor:
        regime = self.regime
        elements = x.elements // layer.in_features * layer.out_features
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

    def _parameter_linear(self, x: _Tensor, layer: LinearLayer) -> _Tensor:
        """A router or a stack of experts: a parameter, not an nn.Linear, so never quantized.

        The router is F.linear (autocast applies); the experts are grouped_mm, which autocast skips: the
        input is cast to the weights' dtype. LoRA on them (peft's ParamWrapper) folds its factors into a new
        weight every forward, W + B·A, which the matmul keeps; backward computes that weight's whole
        gradient before the factors' (the same for a trained stack's own gradient).
        """
        regime = self.regime
        folded = layer.path in self._adapted
        trainable = regime.full or folded
        dtype = regime.outer_dtype
        x_in = self._autocast(x) if layer.kind == ROUTER else self.cast(x, dtype)
        weight = None
        if folded:
            weight = self.new(layer.weight_elements, dtype, True)
            self.record([weight], [], parameter_grad=sum(g.nbytes for g in adapter_groups(layer, regime)))
            if x_in.dtype != dtype:  # the router's folded weight, copied by autocast at every call
                weight = self.cast(weight, x_in.dtype)
        elif layer.kind == ROUTER:
            weight = self._weight_copy(layer.weight_elements, dtype, trainable)
        if trainable:
            self.save(x_in)
        if x_in.requires_grad and weight is not None:
            self.save(weight)
        out = self.new(x.elements // layer.in_features * layer.out_features, x_in.dtype, x.requires_grad or trainable)
        gradient = layer.weight_elements * DTYPE_BYTES[x_in.dtype] if trainable else 0
        own = layer.weight_elements * DTYPE_BYTES[dtype] if regime.full else 0
        self.record([out], [x_in] + ([weight] if folded else []), temporary=gradient, parameter_grad=own)
        return out

    def route(self, x: _Tensor, path: str) -> _Tensor:
        """The router: its logits, their fp32 softmax (kept), the top experts' probabilities (their indices
        kept), cast back and reordered with the routed copies of the tokens."""
        logits = self.linear(x, path)
        probabilities = self.saving_output(self.cast(logits, "fp32"))
        copies = self.tokens * self.shape.experts_per_token
        top = self.new(copies, "fp32", probabilities.requires_grad)
        if top.requires_grad:
            self.save(self.new(copies, "int64", False))
        self.record([top], [probabilities])
        return self.gather(self.cast(top, logits.dtype), 1)

    def gather(self, x: _Tensor, copies: int) -> _Tensor:
        """Rows picked by an index (each token ``copies`` times): a new tensor; backward needs only the index."""
        out = self.new(x.elements * copies, x.dtype, x.requires_grad)
        if x.requires_grad:
            self.save(self.new(self.tokens * self.shape.experts_per_token, "int64", False))
        self.record([out], [x])
        return out

    def combine(self, x: _Tensor, copies: int) -> _Tensor:
        """The routed copies back in token order, each token's ``copies`` summed."""
        return self.unary(self.gather(x, 1), elements=x.elements // copies)

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
        # peft adds in the wider dtype, then casts the sum back to the base layer's output dtype
        return self.cast(self.add(base_out, self.scale(b_out)), base_out.dtype)

    def mlp(self, x: _Tensor, compute) -> _Tensor:
        """A block's MLP module, ``compute(x)``, or what ``feedforward`` makes of it (a tiled MLP)."""
        out = compute(x) if self.feedforward is None else self.feedforward(self, x, compute)
        self.held_by_caller(x)
        return out

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
        return self._dense(x, self.shape.head_elements, regime.head_dtype, regime.full,
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


def forward_transient(nodes: list[_Node], saving: bool = True) -> int:
    """The most a block's forward pass holds at once besides what it saves; ``saving=False``: the forward of a
    checkpointed block, which saves nothing (its saved tensors die after their last use, as the others do).

    A tensor made inside the block lives from the operation that makes it to
    the last one that reads it (Python may hold it a little longer).
    """
    saved = {s for node in nodes for s in node.kept} if saving else set()
    born, last_use = {}, {}
    for index, node in enumerate(nodes):
        for tensor in node.operands:
            last_use[tensor.storage] = index
        for storage in [tensor.storage for tensor in node.outputs] + ([] if saving else list(node.kept)):
            born.setdefault(storage, index)  # a tensor only saved (a dropout mask) lives while its node runs
            last_use.setdefault(storage, index)
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
    block_input: int = 0  # bytes of the input each checkpointed block keeps (0 without checkpointing)
    # the worst moment of the last block's forward pass: what every block keeps by then and what the block holds
    # while it computes (a deep model with a small vocabulary peaks here, not at the loss)
    forward_block: int = 0
    shared: int = 0  # what every block reads, alive through forward and backward (the rotary cos and sin)
    embedding_saved: int = 0  # what the embeddings keep (GPT-2's dropout mask), among ``saved``
    head_saved: int = 0  # what the final norm and the output head keep, among ``saved``

    def blocks_saved(self, layers: int, blocks: int) -> int:
        """What ``blocks`` of the model's ``layers`` blocks keep for backward (a pipeline stage's)."""
        return (self.saved - self.embedding_saved - self.head_saved) * blocks // max(layers, 1)


def activations(shape: ModelShape, regime: Regime, feedforward=None) -> Activations:
    """Run the recipe for the embeddings, two blocks and the head; scale the second block to the others.
    ``feedforward``: see ActivationTape."""
    tape = ActivationTape(shape, regime, feedforward)
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
    embedding, head_saved = saved_bytes(tape.nodes[:marks[0]]), saved_bytes(head)
    if layers == 1:  # the second block was only there to be scaled away
        last_moment = first_moment
    if regime.checkpointing:
        # each block keeps its input, and what its nodes hold outside autograd (while the block is
        # recomputed too); a recomputed block may save its own input: that is the kept tensor, not a copy
        held = held_bytes(later)
        kept = x.nbytes + held
        unsaved_input = 0 if any(inputs[1].storage in node.kept for node in later) else x.nbytes
        # what the embeddings keep (GPT-2's dropout mask) stays until the very end of backward
        saved = layers * kept + head_saved + embedding
        before_last = (layers - 1) * kept + held + unsaved_input + embedding
        before_first = held + unsaved_input + embedding
        copies = saved_bytes(head, "weight_copy")
        cache = layers * saved_bytes(later, "weight_copy")
        forward_block = layers * kept + embedding + forward_transient(later, saving=False)
    else:
        saved = saved_bytes(tape.nodes) + (layers - 2) * block_saved
        before_last, before_first = (saved_bytes(first) + (layers - 2) * block_saved if layers > 1 else 0), 0
        copies = saved_bytes(tape.nodes, "weight_copy") + (layers - 2) * saved_bytes(later, "weight_copy")
        cache = 0
        forward_block = saved - head_saved + forward_transient(later)
    return Activations(saved=saved, weight_copies=copies, autocast_cache=cache, before_last_block=before_last,
                       before_first_block=before_first, last_block=last_moment, first_block=first_moment,
                       block_grads=block_grads, head_grads=sum(node.parameter_grad for node in head),
                       logits_dtype=logits.dtype, block_input=x.nbytes if regime.checkpointing else 0,
                       forward_block=forward_block, shared=tape.rotary_tables(), embedding_saved=embedding,
                       head_saved=head_saved)
