"""The architecture families the memory estimator knows, each described by hand.

A ``Family`` says which config fields hold a model's sizes (every family names
them its own way: ``n_embd`` in GPT-2, ``hidden_size`` elsewhere), the
transformers defaults for fields a config may omit, the module names of the
linear layers in one decoder block, and the block's forward pass written as a
recipe of operations.

The block recipes are written against the small vocabulary of operations that
``studio.core.memory.tape`` interprets (``g.norm``, ``g.linear``, ``g.rope``,
``g.attention``, ``g.activation``, ``g.mul``, ``g.add``, ``g.dropout``,
``g.split``): the recipe says what the modeling code computes, the interpreter
knows what autograd keeps of each operation. ``studio.core.modelinfo`` resolves
a config into a ``ModelShape`` (the ``m`` and ``shape`` the recipes receive).

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# The resolved sizes a recipe receives: studio.core.modelinfo's ModelShape (modelinfo imports this module).
Shape = Any


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer of a decoder block, named by its path inside the block (``self_attn.q_proj``)."""

    path: str
    in_features: int
    out_features: int
    bias: bool

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def weight_elements(self) -> int:
        return self.in_features * self.out_features



@dataclass(frozen=True, eq=False)
class Family:
    """An architecture family: where its config keeps each size and how its block computes.

    ``fields`` maps each ModelShape field to the config keys that may hold it
    (first present wins); ``defaults`` gives transformers' default for keys a
    config may omit (a callable receives the fields resolved so far).
    """

    name: str
    model_types: tuple[str, ...]
    fields: dict[str, tuple[str, ...]]
    defaults: dict[str, Any]
    linears: Callable[[Shape], tuple[LinearLayer, ...]]
    block: Callable  # block(g, shape, x) -> x: the decoder block as a recipe of operations
    norm: str  # "rms" (Llama: weight * normalized.to(input dtype)), "rms_gemma" (scaled in fp32), "layer"
    block_prefix: str
    block_norms: Callable[[Shape], tuple[tuple[str, int], ...]]
    embeddings: tuple[tuple[str, Callable[[Shape], int]], ...]
    final_norm: str
    head_bias: bool = False
    conv1d_weights: bool = False  # GPT-2 stores (in, out) weights (transformers' Conv1D)
    embedding_scale: bool = False  # Gemma multiplies the embeddings by sqrt(hidden)
    position_embeddings: bool = False  # GPT-2 adds learned positions instead of rotary
    eager_softmax_fp32: bool = True  # eager attention asks softmax for fp32 (GPT-2 keeps the input dtype)

    def weight_shape(self, layer: LinearLayer) -> tuple[int, int]:
        if self.conv1d_weights:
            return (layer.in_features, layer.out_features)
        return (layer.out_features, layer.in_features)


_LLAMA_FIELDS = {
    "hidden": ("hidden_size",), "layers": ("num_hidden_layers",), "heads": ("num_attention_heads",),
    "kv_heads": ("num_key_value_heads",), "head_dim": ("head_dim",), "intermediate": ("intermediate_size",),
    "vocab": ("vocab_size",), "positions": ("max_position_embeddings",), "tie_embeddings": ("tie_word_embeddings",),
    "activation": ("hidden_act", "hidden_activation"), "attention_bias": ("attention_bias",), "mlp_bias": ("mlp_bias",),
    "attention_dropout": ("attention_dropout",),
}
_LLAMA_DEFAULTS = {
    "kv_heads": lambda f: f["heads"], "head_dim": lambda f: f["hidden"] // f["heads"], "positions": 2048,
    "tie_embeddings": False, "activation": "silu", "attention_bias": False, "mlp_bias": False,
    "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0, "rotary_fraction": 1.0,
}


def _gated_linears(shape: Shape, q_bias: bool, o_bias: bool) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("self_attn.q_proj", h, shape.q_width, q_bias),
        LinearLayer("self_attn.k_proj", h, shape.kv_width, q_bias),
        LinearLayer("self_attn.v_proj", h, shape.kv_width, q_bias),
        LinearLayer("self_attn.o_proj", shape.q_width, h, o_bias),
        LinearLayer("mlp.gate_proj", h, i, shape.mlp_bias),
        LinearLayer("mlp.up_proj", h, i, shape.mlp_bias),
        LinearLayer("mlp.down_proj", i, h, shape.mlp_bias),
    )


def _llama_block(g, m: Shape, x):
    """Llama, Qwen2, Mistral, Gemma: pre-norm attention and gated MLP, two residual adds."""
    normed = g.norm(x)
    q, k, v = (g.linear(normed, f"self_attn.{n}_proj") for n in "qkv")
    q, k = g.rope(q, k)
    attended = g.linear(g.attention(q, k, v), "self_attn.o_proj")
    x = g.add(x, attended)
    normed = g.norm(x)
    gated = g.mul(g.activation(g.linear(normed, "mlp.gate_proj")), g.linear(normed, "mlp.up_proj"))
    return g.add(x, g.linear(gated, "mlp.down_proj"))


def _gpt2_linears(shape: Shape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("attn.c_attn", h, 3 * h, True),
        LinearLayer("attn.c_proj", h, h, True),
        LinearLayer("mlp.c_fc", h, i, True),
        LinearLayer("mlp.c_proj", i, h, True),
    )


def _gpt2_block(g, m: Shape, x):
    """GPT-2: fused qkv (Conv1D), learned positions, dropout after attention and MLP."""
    q, k, v = g.split(g.linear(g.norm(x), "attn.c_attn"), 3)
    attended = g.linear(g.attention(q, k, v), "attn.c_proj")
    x = g.add(g.dropout(attended, m.residual_dropout), x)
    hidden = g.activation(g.linear(g.norm(x), "mlp.c_fc"))
    return g.add(x, g.dropout(g.linear(hidden, "mlp.c_proj"), m.residual_dropout))


def _neox_linears(shape: Shape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("attention.query_key_value", h, 3 * h, shape.attention_bias),
        LinearLayer("attention.dense", h, h, shape.attention_bias),
        LinearLayer("mlp.dense_h_to_4h", h, i, True),
        LinearLayer("mlp.dense_4h_to_h", i, h, True),
    )


def _neox_block(g, m: Shape, x):
    """GPT-NeoX (Pythia): fused qkv, partial rotary, parallel (or sequential) residual."""
    q, k, v = g.split(g.linear(g.norm(x), "attention.query_key_value"), 3)
    q, k = g.rope(q, k)
    attended = g.dropout(g.linear(g.attention(q, k, v), "attention.dense"), m.residual_dropout)
    if not m.parallel_residual:
        attended = g.add(attended, x)
    mlp_input = g.norm(x if m.parallel_residual else attended)
    hidden = g.activation(g.linear(mlp_input, "mlp.dense_h_to_4h"))
    mlp_out = g.dropout(g.linear(hidden, "mlp.dense_4h_to_h"), m.residual_dropout)
    return g.add(mlp_out, attended, x) if m.parallel_residual else g.add(mlp_out, attended)


def _phi_linears(shape: Shape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("self_attn.q_proj", h, shape.q_width, True),
        LinearLayer("self_attn.k_proj", h, shape.kv_width, True),
        LinearLayer("self_attn.v_proj", h, shape.kv_width, True),
        LinearLayer("self_attn.dense", shape.q_width, h, True),
        LinearLayer("mlp.fc1", h, i, True),
        LinearLayer("mlp.fc2", i, h, True),
    )


def _phi_block(g, m: Shape, x):
    """Phi: one LayerNorm feeding attention and MLP in parallel, partial rotary."""
    normed = g.norm(x)
    q, k, v = (g.linear(normed, f"self_attn.{n}_proj") for n in "qkv")
    if m.qk_layernorm:
        q, k = g.norm(q, size=m.head_dim), g.norm(k, size=m.head_dim)
    q, k = g.rope(q, k)
    attended = g.dropout(g.linear(g.attention(q, k, v), "self_attn.dense"), m.residual_dropout)
    mlp_out = g.dropout(g.linear(g.activation(g.linear(normed, "mlp.fc1")), "mlp.fc2"), m.residual_dropout)
    return g.add(attended, mlp_out, x)


def _two_norms(first: str, second: str):
    return lambda m: ((first, m.hidden), (second, m.hidden))


def _phi_norms(m: Shape) -> tuple[tuple[str, int], ...]:
    norms = (("input_layernorm", m.hidden),)
    if m.qk_layernorm:
        norms += (("self_attn.q_layernorm", m.head_dim), ("self_attn.k_layernorm", m.head_dim))
    return norms


def _vocab(m: Shape) -> int:
    return m.vocab


def _llama_like(name: str, q_bias: bool, **overrides) -> Family:
    settings = dict(
        name=name, model_types=(name,), fields=_LLAMA_FIELDS, defaults=_LLAMA_DEFAULTS,
        linears=lambda shape: _gated_linears(shape, q_bias or shape.attention_bias, shape.attention_bias),
        block=_llama_block, norm="rms", block_prefix="model.layers.{}.",
        block_norms=_two_norms("input_layernorm", "post_attention_layernorm"),
        embeddings=(("model.embed_tokens.weight", _vocab),), final_norm="model.norm",
    )
    settings.update(overrides)
    return Family(**settings)


FAMILIES: tuple[Family, ...] = (
    _llama_like("llama", q_bias=False),
    _llama_like("mistral", q_bias=False),
    _llama_like("qwen2", q_bias=True),
    _llama_like("gemma", q_bias=False, norm="rms_gemma", embedding_scale=True,
                defaults={**_LLAMA_DEFAULTS, "head_dim": 256, "tie_embeddings": True, "activation": "gelu_pytorch_tanh"}),
    Family(
        name="gpt2", model_types=("gpt2",),
        fields={"hidden": ("n_embd", "hidden_size"), "layers": ("n_layer", "num_hidden_layers"),
                "heads": ("n_head", "num_attention_heads"), "intermediate": ("n_inner",), "vocab": ("vocab_size",),
                "positions": ("n_positions", "max_position_embeddings"), "tie_embeddings": ("tie_word_embeddings",),
                "activation": ("activation_function",), "attention_dropout": ("attn_pdrop",),
                "residual_dropout": ("resid_pdrop",), "embedding_dropout": ("embd_pdrop",)},
        defaults={"kv_heads": lambda f: f["heads"], "head_dim": lambda f: f["hidden"] // f["heads"],
                  "intermediate": lambda f: 4 * f["hidden"], "positions": 1024, "tie_embeddings": True,
                  "activation": "gelu_new", "attention_dropout": 0.1, "residual_dropout": 0.1,
                  "embedding_dropout": 0.1, "rotary_fraction": 0.0, "attention_bias": True, "mlp_bias": True},
        linears=_gpt2_linears, block=_gpt2_block, norm="layer", block_prefix="transformer.h.{}.",
        block_norms=_two_norms("ln_1", "ln_2"),
        embeddings=(("transformer.wte.weight", _vocab), ("transformer.wpe.weight", lambda m: m.positions)),
        final_norm="transformer.ln_f", conv1d_weights=True, position_embeddings=True, eager_softmax_fp32=False,
    ),
    Family(
        name="gpt_neox", model_types=("gpt_neox",),
        fields={**_LLAMA_FIELDS, "residual_dropout": ("hidden_dropout",), "embedding_dropout": ("hidden_dropout",),
                "parallel_residual": ("use_parallel_residual",)},
        defaults={**_LLAMA_DEFAULTS, "kv_heads": lambda f: f["heads"], "head_dim": lambda f: f["hidden"] // f["heads"],
                  "activation": "gelu", "attention_bias": True, "rotary_fraction": 0.25, "parallel_residual": True},
        linears=_neox_linears, block=_neox_block, norm="layer", block_prefix="gpt_neox.layers.{}.",
        block_norms=_two_norms("input_layernorm", "post_attention_layernorm"),
        embeddings=(("gpt_neox.embed_in.weight", _vocab),), final_norm="gpt_neox.final_layer_norm",
    ),
    Family(
        name="phi", model_types=("phi",),
        fields={**_LLAMA_FIELDS, "residual_dropout": ("resid_pdrop",), "embedding_dropout": ("embd_pdrop",),
                "qk_layernorm": ("qk_layernorm",)},
        defaults={**_LLAMA_DEFAULTS, "activation": "gelu_new", "rotary_fraction": 0.5, "qk_layernorm": False},
        linears=_phi_linears, block=_phi_block, norm="layer", block_prefix="model.layers.{}.",
        block_norms=_phi_norms, embeddings=(("model.embed_tokens.weight", _vocab),),
        final_norm="model.final_layernorm", head_bias=True,
    ),
)
