"""The architecture families the memory estimator knows, each described by hand.

A ``Family`` says which config fields hold a model's sizes (every family names
them its own way: ``n_embd`` in GPT-2, ``hidden_size`` elsewhere), the
transformers defaults for fields a config may omit, the module names of the
linear layers in one decoder block, and the block's forward pass written as a
recipe of operations.

The block recipes are written against the small vocabulary of operations that
``studio.core.memory.parts.tape`` interprets (``g.norm``, ``g.linear``, ``g.rope``,
``g.attention``, ``g.activation``, ``g.mul``, ``g.add``, ``g.dropout``,
``g.split``): the recipe says what the modeling code computes, the interpreter
knows what autograd keeps of each operation. ``studio.core.model.info`` resolves
a config into a ``ModelShape`` (the ``m`` and ``shape`` the recipes receive).

Pure Python: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# The resolved sizes a recipe receives: studio.core.model.info's ModelShape (modelinfo imports this module).
Shape = Any


LINEAR, ROUTER, EXPERTS = "linear", "router", "experts"  # the kinds of LinearLayer


@dataclass(frozen=True)
class LinearLayer:
    """One linear layer of a decoder block, named by its path inside the block (``self_attn.q_proj``).

    A mixture of experts adds two kinds that are plain parameters, not ``nn.Linear`` modules (bitsandbytes and
    torchao leave them alone; peft's LoRA wraps the parameter itself): the router, and ``experts`` stacked
    weights of one projection (``fused`` projections in one, as gate_up), each token going through a few.
    """

    path: str
    in_features: int
    out_features: int
    bias: bool
    kind: str = LINEAR
    experts: int = 1
    fused: int = 1

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]

    @property
    def weight_elements(self) -> int:
        return self.experts * self.in_features * self.out_features

    @property
    def parameter_name(self) -> str:
        return self.path if self.kind == EXPERTS else f"{self.path}.weight"

    @property
    def is_module(self) -> bool:
        """An ``nn.Linear``: what quantization, QAT and every adapter method but LoRA act on."""
        return self.kind == LINEAR

    def adapter_rank(self, rank: int) -> int:
        """The rank of the LoRA factors peft gives it: experts share one factor pair of rank experts x rank
        (doubled for gate_up, whose two projections were fused: peft keeps each one's rank)."""
        return rank * self.experts * self.fused



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
    embedding_module_scales: bool = False  # inside the embedding module, in the weight's dtype (Gemma's)
    position_embeddings: bool = False  # GPT-2 adds learned positions instead of rotary
    eager_softmax_fp32: bool = True  # eager attention asks softmax for fp32 (GPT-2 keeps the input dtype)
    sdpa: bool = True  # transformers runs it with sdpa (Gemma 2 does not: sdpa cannot soft-cap the scores)
    text_config: bool = False  # a multimodal checkpoint: the sizes are in config["text_config"]
    # activations the family's code runs in place of the one its config names (transformers corrects them)
    activation_aliases: tuple[tuple[str, str], ...] = ()
    # (name, shape) of the parameters of towers the causal-LM class loads but text training never runs
    attached: Callable[[dict], tuple[tuple[str, tuple[int, ...]], ...]] = lambda config: ()

    def weight_shape(self, layer: LinearLayer) -> tuple[int, ...]:
        if layer.kind == EXPERTS:
            return (layer.experts, layer.out_features, layer.in_features)
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
    """Llama, Qwen2, Mistral, Gemma: pre-norm attention and gated MLP, two residual adds (Qwen3 also
    RMS-norms q and k per head before rotary)."""
    normed = g.norm(x)
    q, k, v = _attention_inputs(g, m, normed)
    x = g.add(x, g.linear(g.attention(q, k, v), "self_attn.o_proj"))
    return g.add(x, _gated_mlp(g, g.norm(x)))


def _attention_inputs(g, m: Shape, normed):
    """q, k and v projected from the normed input, q and k normed per head (where the family does) and rotated."""
    q, k, v = (g.linear(normed, f"self_attn.{n}_proj") for n in "qkv")
    if m.qk_layernorm:
        q, k = g.norm(q, size=m.head_dim), g.norm(k, size=m.head_dim)
    q, k = g.rope(q, k)
    return q, k, v


def _gated_mlp(g, x):
    """The MLP module (g.mlp: what the tiled MLP saver tiles)."""
    return g.mlp(x, lambda x: g.linear(g.mul(g.activation(g.linear(x, "mlp.gate_proj")), g.linear(x, "mlp.up_proj")),
                                       "mlp.down_proj"))


def _sandwich_block(g, m: Shape, x):
    """Gemma 2 and 3: every sublayer normed before and after (Gemma 3 also norms q and k per head)."""
    normed = g.norm(x)
    q, k, v = _attention_inputs(g, m, normed)
    x = g.add(x, g.norm(g.linear(g.attention(q, k, v), "self_attn.o_proj")))
    return g.add(x, g.norm(_gated_mlp(g, g.norm(x))))


def _olmo2_block(g, m: Shape, x):
    """OLMo 2: norms after each sublayer only, q and k RMS-normed over all heads at once."""
    q, k, v = (g.linear(x, f"self_attn.{n}_proj") for n in "qkv")
    q, k = g.norm(q, size=m.q_width), g.norm(k, size=m.kv_width)
    q, k = g.rope(q, k)
    x = g.add(x, g.norm(g.linear(g.attention(q, k, v), "self_attn.o_proj")))
    return g.add(x, g.norm(_gated_mlp(g, x)))


def _granite_block(g, m: Shape, x):
    """Granite: Llama's block with each sublayer's output scaled by residual_multiplier."""
    normed = g.norm(x)
    q, k, v = _attention_inputs(g, m, normed)
    x = g.add(x, g.scale(g.linear(g.attention(q, k, v), "self_attn.o_proj")))
    return g.add(x, g.scale(_gated_mlp(g, g.norm(x))))


def _phi3_linears(shape: Shape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("self_attn.qkv_proj", h, shape.q_width + 2 * shape.kv_width, False),
        LinearLayer("self_attn.o_proj", shape.q_width, h, False),
        LinearLayer("mlp.gate_up_proj", h, 2 * i, False),
        LinearLayer("mlp.down_proj", i, h, False),
    )


def _phi3_block(g, m: Shape, x):
    """Phi-3 and Phi-4-mini: Llama's block with fused qkv and gate_up, dropout before each residual add."""
    q, k, v = g.split(g.linear(g.norm(x), "self_attn.qkv_proj"), (m.q_width, m.kv_width, m.kv_width))
    q, k = g.rope(q, k)
    attended = g.linear(g.attention(q, k, v), "self_attn.o_proj")
    x = g.add(x, g.dropout(attended, m.residual_dropout))
    mlp_out = g.mlp(g.norm(x), lambda x: _phi3_mlp(g, x))
    return g.add(x, g.dropout(mlp_out, m.residual_dropout))


def _phi3_mlp(g, x):
    gate, up = g.split(g.linear(x, "mlp.gate_up_proj"), 2)
    return g.linear(g.mul(up, g.activation(gate)), "mlp.down_proj")


def _moe_linears(shape: Shape) -> tuple[LinearLayer, ...]:
    h, i, e = shape.hidden, shape.expert_intermediate, shape.experts
    return _gated_linears(shape, shape.attention_bias, shape.attention_bias)[:4] + (
        LinearLayer("mlp.gate", h, e, False, kind=ROUTER),
        LinearLayer("mlp.experts.gate_up_proj", h, 2 * i, False, kind=EXPERTS, experts=e, fused=2),
        LinearLayer("mlp.experts.down_proj", i, h, False, kind=EXPERTS, experts=e),
    )


def _moe_block(g, m: Shape, x):
    """Qwen3-MoE: Qwen3's attention, then each token through the top few of many gated experts, weighted by
    the router's probabilities (transformers' grouped experts: the routed copies sorted by expert)."""
    normed = g.norm(x)
    q, k, v = _attention_inputs(g, m, normed)
    x = g.add(x, g.linear(g.attention(q, k, v), "self_attn.o_proj"))
    normed = g.norm(x)
    weights = g.route(normed, "mlp.gate")  # the top experts' probabilities, one per routed copy of a token
    routed = g.gather(normed, m.experts_per_token)
    gate, up = g.split(g.linear(routed, "mlp.experts.gate_up_proj"), 2)
    expert_out = g.linear(g.mul(g.activation(gate), up), "mlp.experts.down_proj")
    return g.add(x, g.combine(g.mul(expert_out, weights), m.experts_per_token))


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
    mlp_out = g.mlp(g.norm(x), lambda x: g.dropout(g.linear(g.activation(g.linear(x, "mlp.c_fc")), "mlp.c_proj"),
                                                   m.residual_dropout))  # GPT2MLP ends with its dropout
    return g.add(x, mlp_out)


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
    mlp_out = g.mlp(mlp_input, lambda x: g.linear(g.activation(g.linear(x, "mlp.dense_h_to_4h")), "mlp.dense_4h_to_h"))
    mlp_out = g.dropout(mlp_out, m.residual_dropout)
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
    q, k, v = _attention_inputs(g, m, normed)
    attended = g.dropout(g.linear(g.attention(q, k, v), "self_attn.dense"), m.residual_dropout)
    mlp_out = g.mlp(normed, lambda x: g.linear(g.activation(g.linear(x, "mlp.fc1")), "mlp.fc2"))
    mlp_out = g.dropout(mlp_out, m.residual_dropout)
    return g.add(attended, mlp_out, x)


def _two_norms(first: str, second: str):
    return lambda m: ((first, m.hidden), (second, m.hidden))


def _phi_norms(m: Shape) -> tuple[tuple[str, int], ...]:
    norms = (("input_layernorm", m.hidden),)
    if m.qk_layernorm:
        norms += (("self_attn.q_layernorm", m.head_dim), ("self_attn.k_layernorm", m.head_dim))
    return norms


def _norms(*names: str, per_head: tuple[str, ...] = (), all_heads: bool = False):
    """Block norms over the hidden size, then q/k norms per head (or, ``all_heads``, over all q and kv heads)."""
    def norms(m: Shape) -> tuple[tuple[str, int], ...]:
        sizes = (m.q_width, m.kv_width) if all_heads else (m.head_dim, m.head_dim)
        heads = tuple(zip(per_head, sizes)) if per_head and (all_heads or m.qk_layernorm) else ()
        return tuple((name, m.hidden) for name in names) + heads
    return norms


_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_SANDWICH_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm")
_GEMMA_DEFAULTS = {**_LLAMA_DEFAULTS, "head_dim": 256, "tie_embeddings": True, "activation": "gelu_pytorch_tanh"}


def _siglip_with_projector(config: dict) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Gemma 3's SigLIP vision tower and its projection into the text model (shapes as transformers builds them)."""
    vision = config.get("vision_config") or {}
    h, i = vision.get("hidden_size", 768), vision.get("intermediate_size", 3072)
    channels, patch = vision.get("num_channels", 3), vision.get("patch_size", 16)
    patches = (vision.get("image_size", 224) // patch) ** 2
    text_hidden = (config.get("text_config") or {}).get("hidden_size", 2304)

    def linear(name: str, out: int, inp: int):
        return ((f"{name}.weight", (out, inp)), (f"{name}.bias", (out,)))

    def layer_norm(name: str):
        return ((f"{name}.weight", (h,)), (f"{name}.bias", (h,)))

    def mlp(prefix: str):
        return linear(f"{prefix}.fc1", i, h) + linear(f"{prefix}.fc2", h, i)

    tower = "model.vision_tower."
    specs = ((f"{tower}embeddings.patch_embedding.weight", (h, channels, patch, patch)),
             (f"{tower}embeddings.patch_embedding.bias", (h,)),
             (f"{tower}embeddings.position_embedding.weight", (patches, h)))
    for n in range(vision.get("num_hidden_layers", 12)):
        layer = f"{tower}encoder.layers.{n}."
        specs += layer_norm(layer + "layer_norm1") + layer_norm(layer + "layer_norm2") + mlp(layer + "mlp")
        specs += sum((linear(f"{layer}self_attn.{p}", h, h) for p in ("q_proj", "k_proj", "v_proj", "out_proj")), ())
    specs += layer_norm(tower + "post_layernorm")
    if vision.get("vision_use_head", True):
        head = tower + "head."
        specs += ((head + "probe", (1, 1, h)), (head + "attention.in_proj_weight", (3 * h, h)),
                  (head + "attention.in_proj_bias", (3 * h,)))
        specs += linear(head + "attention.out_proj", h, h) + layer_norm(head + "layernorm") + mlp(head + "mlp")
    return specs + (("model.multi_modal_projector.mm_input_projection_weight", (h, text_hidden)),
                    ("model.multi_modal_projector.mm_soft_emb_norm.weight", (h,)))


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
    _llama_like("gemma", q_bias=False, norm="rms_gemma", embedding_scale=True, embedding_module_scales=True,
                defaults=_GEMMA_DEFAULTS, activation_aliases=(("gelu", "gelu_pytorch_tanh"),)),
    _llama_like("qwen3", q_bias=False,
                defaults={**_LLAMA_DEFAULTS, "kv_heads": 32, "head_dim": 128, "qk_layernorm": True},
                block_norms=_norms("input_layernorm", "post_attention_layernorm", per_head=_QK_NORMS)),
    _llama_like("smollm3", q_bias=False, defaults={**_LLAMA_DEFAULTS, "tie_embeddings": True}),
    _llama_like("granite", q_bias=False, block=_granite_block, embedding_scale=True,
                fields={**_LLAMA_FIELDS, "logits_scaling": ("logits_scaling",)}),
    _llama_like("olmo2", q_bias=False, block=_olmo2_block,
                block_norms=_norms("post_attention_layernorm", "post_feedforward_layernorm", per_head=_QK_NORMS,
                                   all_heads=True)),
    _llama_like("gemma2", q_bias=False, block=_sandwich_block, norm="rms_gemma", embedding_scale=True,
                embedding_module_scales=True, sdpa=False,
                defaults={**_GEMMA_DEFAULTS, "attention_softcap": 50.0, "logit_softcap": 30.0},
                block_norms=_norms(*_SANDWICH_NORMS),
                fields={**_LLAMA_FIELDS, "attention_softcap": ("attn_logit_softcapping",),
                        "logit_softcap": ("final_logit_softcapping",)}),
    _llama_like("gemma3_text", q_bias=False, block=_sandwich_block, norm="rms_gemma", embedding_scale=True,
                embedding_module_scales=True,
                defaults={**_GEMMA_DEFAULTS, "qk_layernorm": True},
                block_norms=_norms(*_SANDWICH_NORMS, per_head=_QK_NORMS),
                fields={**_LLAMA_FIELDS, "attention_softcap": ("attn_logit_softcapping",),
                        "logit_softcap": ("final_logit_softcapping",)}),
    _llama_like("qwen3_moe", q_bias=False, linears=_moe_linears, block=_moe_block,
                defaults={**_LLAMA_DEFAULTS, "qk_layernorm": True, "experts": 128,
                          "experts_per_token": 8, "expert_intermediate": 768},
                fields={**_LLAMA_FIELDS, "experts": ("num_experts", "num_local_experts"),
                        "experts_per_token": ("num_experts_per_tok",),
                        "expert_intermediate": ("moe_intermediate_size",)},
                block_norms=_norms("input_layernorm", "post_attention_layernorm", per_head=_QK_NORMS)),
    _llama_like("gemma3", q_bias=False, block=_sandwich_block, norm="rms_gemma", embedding_scale=True,
                embedding_module_scales=True,
                defaults={**_GEMMA_DEFAULTS, "qk_layernorm": True, "vocab": 262208},
                block_norms=_norms(*_SANDWICH_NORMS, per_head=_QK_NORMS), text_config=True,
                attached=_siglip_with_projector, block_prefix="model.language_model.layers.{}.",
                embeddings=(("model.language_model.embed_tokens.weight", _vocab),),
                final_norm="model.language_model.norm",
                fields={**_LLAMA_FIELDS, "attention_softcap": ("attn_logit_softcapping",),
                        "logit_softcap": ("final_logit_softcapping",)}),
    _llama_like("phi3", q_bias=False, linears=_phi3_linears, block=_phi3_block,
                fields={**_LLAMA_FIELDS, "residual_dropout": ("resid_pdrop",)}),
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
