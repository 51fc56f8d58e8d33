"""What the memory estimator knows about a model, read from its ``config.json`` alone.

Each architecture family the engine supports is one ``Family`` entry in
``FAMILIES``: which config fields hold its sizes (every family names them its own
way: ``n_embd`` in GPT-2, ``hidden_size`` elsewhere), the transformers defaults
for fields a config may omit, the module names of the linear layers in one
decoder block, and the block's forward pass written as a recipe of operations.
``model_shape(config)`` turns a config into a ``ModelShape`` with the resolved
sizes and the full parameter list (names and shapes exactly as transformers
names them); a model type that is not in the registry raises
``UnknownArchitectureError`` instead of being guessed.

The block recipes are written against the small vocabulary of operations that
``studio.core.memory.tape`` interprets (``g.norm``, ``g.linear``, ``g.rope``,
``g.attention``, ``g.activation``, ``g.mul``, ``g.add``, ``g.dropout``,
``g.split``): the recipe says what the modeling code computes, the interpreter
knows what autograd keeps of each operation.

Pure Python: no torch, no transformers (the GUI calls this on every toggle).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from studio.core.errors import StudioError

# ---------------------------------------------------------------- shapes


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


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter: its full name and shape, and what kind of weight it is."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "embedding", "linear", "bias", "norm", "head", "head_bias"

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelShape:
    """A model's sizes and layout, resolved from its config by its family."""

    family: "Family"
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    positions: int
    tie_embeddings: bool
    activation: str
    rotary_fraction: float
    attention_bias: bool
    mlp_bias: bool
    attention_dropout: float
    residual_dropout: float
    embedding_dropout: float
    parallel_residual: bool = False
    qk_layernorm: bool = False

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @cached_property
    def block_linears(self) -> tuple[LinearLayer, ...]:
        return self.family.linears(self)

    def linear(self, path: str) -> LinearLayer:
        for layer in self.block_linears:
            if layer.path == path:
                return layer
        raise KeyError(path)

    @cached_property
    def block_parameters(self) -> tuple[ParameterSpec, ...]:
        """The parameters of decoder block 0 (every block has the same)."""
        prefix = self.family.block_prefix.format(0)
        specs = []
        for layer in self.block_linears:
            specs.append(ParameterSpec(f"{prefix}{layer.path}.weight", self.family.weight_shape(layer), "linear"))
            if layer.bias:
                specs.append(ParameterSpec(f"{prefix}{layer.path}.bias", (layer.out_features,), "bias"))
        for norm, size in self.family.block_norms(self):
            specs += _norm_parameters(f"{prefix}{norm}", size, self.family.norm)
        return tuple(specs)

    @cached_property
    def outer_parameters(self) -> tuple[ParameterSpec, ...]:
        """The parameters outside the decoder blocks: embeddings, final norm, output head."""
        family = self.family
        specs = [ParameterSpec(name, (rows(self), self.hidden), "embedding") for name, rows in family.embeddings]
        specs += _norm_parameters(family.final_norm, self.hidden, family.norm)
        if not self.tie_embeddings:
            specs.append(ParameterSpec("lm_head.weight", (self.vocab, self.hidden), "head"))
        if family.head_bias:
            specs.append(ParameterSpec("lm_head.bias", (self.vocab,), "head_bias"))
        return tuple(specs)

    def parameters(self) -> list[ParameterSpec]:
        """Every parameter, named as transformers names it (a tied head is not listed twice)."""
        first = self.family.block_prefix.format(0)
        blocks = [ParameterSpec(self.family.block_prefix.format(index) + spec.name[len(first):], spec.shape, spec.kind)
                  for index in range(self.layers) for spec in self.block_parameters]
        return list(self.outer_parameters) + blocks

    @cached_property
    def parameter_count(self) -> int:
        block = sum(spec.elements for spec in self.block_parameters)
        return sum(spec.elements for spec in self.outer_parameters) + self.layers * block

    @property
    def linear_parameter_count(self) -> int:
        """Weights of the block linears: what bitsandbytes quantizes."""
        return self.layers * sum(layer.weight_elements for layer in self.block_linears)

    @property
    def head_elements(self) -> int:
        return self.vocab * self.hidden

    def resolve_targets(self, targets: tuple[str, ...]) -> tuple[LinearLayer, ...]:
        """The block linears a LoRA ``target_modules`` list adapts (peft matches by name suffix).

        Raises StudioError for names that match no module of this family.
        """
        if tuple(targets) == ("all-linear",):
            return self.block_linears
        known = {layer.path for layer in self.block_linears}
        unknown = [t for t in targets if not any(_suffix_match(path, t) for path in known)]
        if unknown:
            names = ", ".join(sorted({layer.name for layer in self.block_linears}))
            raise StudioError(
                f"lora.target_modules names {', '.join(unknown)}, which is not a linear layer of a {self.family.name} "
                f"block (the estimate models LoRA on these: {names})",
                "use all-linear or the module names above", kind="config")
        return tuple(layer for layer in self.block_linears if any(_suffix_match(layer.path, t) for t in targets))


def _suffix_match(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def _norm_parameters(name: str, size: int, norm: str) -> list[ParameterSpec]:
    specs = [ParameterSpec(f"{name}.weight", (size,), "norm")]
    if norm == "layer":
        specs.append(ParameterSpec(f"{name}.bias", (size,), "norm"))
    return specs


# ---------------------------------------------------------------- families


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
    linears: Callable[[ModelShape], tuple[LinearLayer, ...]]
    block: Callable  # block(g, shape, x) -> x: the decoder block as a recipe of operations
    norm: str  # "rms" (Llama: weight * normalized.to(input dtype)), "rms_gemma" (scaled in fp32), "layer"
    block_prefix: str
    block_norms: Callable[[ModelShape], tuple[tuple[str, int], ...]]
    embeddings: tuple[tuple[str, Callable[[ModelShape], int]], ...]
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


def _rotary_fraction(config: dict) -> float | None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    for value in (rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"), config.get("rotary_pct")):
        if value is not None:
            return float(value)
    return None


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


def _gated_linears(shape: ModelShape, q_bias: bool, o_bias: bool) -> tuple[LinearLayer, ...]:
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


def _llama_block(g, m: ModelShape, x):
    """Llama, Qwen2, Mistral, Gemma: pre-norm attention and gated MLP, two residual adds."""
    normed = g.norm(x)
    q, k, v = (g.linear(normed, f"self_attn.{n}_proj") for n in "qkv")
    q, k = g.rope(q, k)
    attended = g.linear(g.attention(q, k, v), "self_attn.o_proj")
    x = g.add(x, attended)
    normed = g.norm(x)
    gated = g.mul(g.activation(g.linear(normed, "mlp.gate_proj")), g.linear(normed, "mlp.up_proj"))
    return g.add(x, g.linear(gated, "mlp.down_proj"))


def _gpt2_linears(shape: ModelShape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("attn.c_attn", h, 3 * h, True),
        LinearLayer("attn.c_proj", h, h, True),
        LinearLayer("mlp.c_fc", h, i, True),
        LinearLayer("mlp.c_proj", i, h, True),
    )


def _gpt2_block(g, m: ModelShape, x):
    """GPT-2: fused qkv (Conv1D), learned positions, dropout after attention and MLP."""
    q, k, v = g.split(g.linear(g.norm(x), "attn.c_attn"), 3)
    attended = g.linear(g.attention(q, k, v), "attn.c_proj")
    x = g.add(g.dropout(attended, m.residual_dropout), x)
    hidden = g.activation(g.linear(g.norm(x), "mlp.c_fc"))
    return g.add(x, g.dropout(g.linear(hidden, "mlp.c_proj"), m.residual_dropout))


def _neox_linears(shape: ModelShape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("attention.query_key_value", h, 3 * h, shape.attention_bias),
        LinearLayer("attention.dense", h, h, shape.attention_bias),
        LinearLayer("mlp.dense_h_to_4h", h, i, True),
        LinearLayer("mlp.dense_4h_to_h", i, h, True),
    )


def _neox_block(g, m: ModelShape, x):
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


def _phi_linears(shape: ModelShape) -> tuple[LinearLayer, ...]:
    h, i = shape.hidden, shape.intermediate
    return (
        LinearLayer("self_attn.q_proj", h, shape.q_width, True),
        LinearLayer("self_attn.k_proj", h, shape.kv_width, True),
        LinearLayer("self_attn.v_proj", h, shape.kv_width, True),
        LinearLayer("self_attn.dense", shape.q_width, h, True),
        LinearLayer("mlp.fc1", h, i, True),
        LinearLayer("mlp.fc2", i, h, True),
    )


def _phi_block(g, m: ModelShape, x):
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


def _phi_norms(m: ModelShape) -> tuple[tuple[str, int], ...]:
    norms = (("input_layernorm", m.hidden),)
    if m.qk_layernorm:
        norms += (("self_attn.q_layernorm", m.head_dim), ("self_attn.k_layernorm", m.head_dim))
    return norms


def _vocab(m: ModelShape) -> int:
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

_BY_MODEL_TYPE = {model_type: family for family in FAMILIES for model_type in family.model_types}
SUPPORTED_MODEL_TYPES = tuple(_BY_MODEL_TYPE)


class UnknownArchitectureError(StudioError):
    """The config's model_type is not a family the estimator knows; it refuses to guess."""

    def __init__(self, model_type: str):
        super().__init__(
            f"the memory estimate does not know the architecture '{model_type}' "
            f"(known: {', '.join(SUPPORTED_MODEL_TYPES)})",
            "choose a model of a supported family; an estimate from another family's layout would be a guess",
            kind="model")
        self.model_type = model_type


def family_of(config: dict) -> Family:
    model_type = config.get("model_type")
    if not model_type:
        raise StudioError("the model config has no model_type", "point model.name_or_path at a transformers model folder",
                          kind="model")
    if model_type not in _BY_MODEL_TYPE:
        raise UnknownArchitectureError(model_type)
    return _BY_MODEL_TYPE[model_type]


_SHAPE_FIELDS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "positions",
                 "tie_embeddings", "activation", "rotary_fraction", "attention_bias", "mlp_bias",
                 "attention_dropout", "residual_dropout", "embedding_dropout", "parallel_residual", "qk_layernorm")


def model_shape(config: dict) -> ModelShape:
    """Resolve a config.json mapping into a ModelShape; unknown families and missing sizes raise StudioError."""
    family = family_of(config)
    resolved: dict[str, Any] = {}
    rotary = _rotary_fraction(config)
    if rotary is not None:
        resolved["rotary_fraction"] = rotary
    for name in _SHAPE_FIELDS:
        if name in resolved:
            continue
        value = next((config[key] for key in family.fields.get(name, ()) if config.get(key) is not None), None)
        if value is None and name in family.defaults:
            default = family.defaults[name]
            value = default(resolved) if callable(default) else default
        if value is None and name in ("parallel_residual", "qk_layernorm"):
            value = False
        if value is None:
            keys = " or ".join(family.fields.get(name, (name,)))
            raise StudioError(f"the {family.name} config lacks {keys}", "use the model's complete config.json", kind="model")
        resolved[name] = value
    if resolved["activation"] == "gelu" and family.name == "gemma":
        resolved["activation"] = "gelu_pytorch_tanh"  # transformers' own correction for Gemma configs
    return ModelShape(family=family, model_type=config["model_type"], **resolved)


# ---------------------------------------------------------------- reading config.json


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def looks_like_path(name_or_path: str) -> bool:
    """A folder path rather than a Hub id (``owner/name``): absolute, relative with ./ or ~, or deeper."""
    return name_or_path.startswith((".", "/", "~")) or "\\" in name_or_path or name_or_path.count("/") > 1 \
        or Path(name_or_path).is_absolute()


def load_model_config(name_or_path: str, revision: str = "", allow_network: bool = True) -> dict:
    """A model's config.json: from a local folder, or through huggingface_hub for a Hub id (its cache first,
    then the Hub at ``HF_ENDPOINT`` with the token ``huggingface-cli login`` saved; that file alone).

    ``allow_network=False`` (the window, on every keystroke) and ``HF_HUB_OFFLINE=1`` read the cache only.
    """
    if not name_or_path:
        raise StudioError("no model chosen", "set model.name_or_path", kind="config")
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return _read_json(local / "config.json")
    if looks_like_path(name_or_path):
        raise StudioError(f"model folder {name_or_path} does not exist", "check model.name_or_path", kind="model")
    cached = cached_config(name_or_path, revision)
    if cached is not None:
        return _read_json(cached)
    if not allow_network or _offline():
        why = " and HF_HUB_OFFLINE forbids asking the Hub" if _offline() else ""
        raise StudioError(f"the config.json of '{name_or_path}' is not in the Hugging Face cache ({hub_cache_dir()})"
                          + why, f"fetch it once online (`huggingface-cli download {name_or_path} config.json`, or "
                          "`studio estimate` with the network), or point model.name_or_path at a local folder",
                          kind="model")
    return _read_json(_download_config(name_or_path, revision))


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StudioError(f"{path} does not exist", "a model folder needs its config.json", kind="model") from None
    except (OSError, ValueError) as exc:
        raise StudioError(f"cannot read {path}: {exc}", "check the model folder", kind="model") from exc


def cached_config(repo_id: str, revision: str) -> Path | None:
    """The config.json of a Hub model in the local Hugging Face cache, if it is there."""
    from huggingface_hub import try_to_load_from_cache  # not at import: the window starts without it

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir(), revision=revision or None)
    except ValueError:  # not a valid repo id
        return None
    return Path(found) if isinstance(found, str) else None


def _download_config(repo_id: str, revision: str) -> Path:
    """config.json alone, into the Hugging Face cache (where transformers finds it later)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    where = f"'{repo_id}'" + (f" at revision {revision}" if revision else "")
    try:
        return Path(hf_hub_download(repo_id, "config.json", revision=revision or None, cache_dir=hub_cache_dir()))
    except GatedRepoError as exc:
        raise StudioError(f"{where} is gated: its config.json needs an account that accepted its license",
                          "accept the license on the model's Hub page, then `huggingface-cli login` (or set HF_TOKEN)",
                          kind="model") from exc
    except RepositoryNotFoundError as exc:
        raise StudioError(f"the Hub has no model {where} (or it is private)",
                          "check the model id; for a private model, `huggingface-cli login` (or set HF_TOKEN)",
                          kind="model") from exc
    except RevisionNotFoundError as exc:
        raise StudioError(f"the Hub has no revision '{revision}' of '{repo_id}'", "check model.revision",
                          kind="model") from exc
    except LocalEntryNotFoundError as exc:  # the Hub did not answer, and the cache has no copy
        raise StudioError(f"cannot reach the Hub ({exc.__class__.__name__}) for the config.json of {where}",
                          "check the network (and HF_ENDPOINT), or point model.name_or_path at a local folder",
                          kind="model") from exc
    except EntryNotFoundError as exc:
        raise StudioError(f"{where} has no config.json", "is it a transformers model?", kind="model") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:  # network down, HF_ENDPOINT unreachable, bad id
        raise StudioError(f"cannot get the config.json of {where} from the Hub: {exc}",
                          "check the network (and HF_ENDPOINT), or point model.name_or_path at a local folder",
                          kind="model") from exc
