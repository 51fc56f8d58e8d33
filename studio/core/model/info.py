"""What the memory estimator knows about a model, read from its ``config.json`` alone.

Each architecture family the engine supports is one ``Family`` entry in
``studio.core.model.families.FAMILIES``. ``model_shape(config)`` turns a config into a
``ModelShape`` with the resolved sizes and the full parameter list (names and
shapes exactly as transformers names them); a model type that is not in the
registry raises ``UnknownArchitectureError`` instead of being guessed.

Pure Python: no torch, no transformers (the GUI calls this on every toggle).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from studio.core.errors import StudioError
from studio.core.model.families import FAMILIES, Family, LinearLayer

# ---------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ParameterSpec:
    """One parameter: its full name and shape, and what kind of weight it is."""

    name: str
    shape: tuple[int, ...]
    kind: str  # "embedding", "linear", "router", "experts", "bias", "norm", "head", "head_bias"

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
    attention_softcap: float = 0.0  # Gemma 2: scores become cap * tanh(scores / cap)
    logit_softcap: float = 0.0  # Gemma 2: the same for the logits
    logits_scaling: float = 1.0  # Granite divides its logits by this
    experts: int = 0  # a mixture of experts: how many per block,
    experts_per_token: int = 0  # how many each token goes through,
    expert_intermediate: int = 0  # and each one's MLP width
    # parameters of towers the causal-LM class loads but text training never runs (Gemma 3's vision tower):
    # frozen weights, never quantized or trained by the estimate
    attached: tuple[ParameterSpec, ...] = ()

    @property
    def transformed_logits(self) -> bool:
        """Logits that are not plainly the output layer's: the worker's lean loss cannot compute them."""
        return bool(self.logit_softcap) or self.logits_scaling != 1.0

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
            kind = "linear" if layer.is_module else layer.kind
            specs.append(ParameterSpec(f"{prefix}{layer.parameter_name}", self.family.weight_shape(layer), kind))
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
        return list(self.outer_parameters) + list(self.attached) + blocks

    @cached_property
    def parameter_count(self) -> int:
        block = sum(spec.elements for spec in self.block_parameters)
        outer = sum(spec.elements for spec in self.outer_parameters + self.attached)
        return outer + self.layers * block

    @property
    def head_elements(self) -> int:
        return self.vocab * self.hidden

    def resolve_targets(self, targets: tuple[str, ...], parameters: bool = True) -> tuple[LinearLayer, ...]:
        """The block linears a LoRA ``target_modules`` list adapts (peft matches by name suffix).

        ``parameters``: the method also adapts a mixture of experts' router and expert weights, which are
        parameters rather than modules (peft's LoRA wraps them; its other methods leave them alone).
        Raises StudioError for names that match no module of this family.
        """
        candidates = tuple(layer for layer in self.block_linears if parameters or layer.is_module)
        if tuple(targets) == ("all-linear",):
            return candidates
        known = {layer.path for layer in candidates}
        unknown = [t for t in targets if not any(_suffix_match(path, t) for path in known)]
        if unknown:
            names = ", ".join(sorted({layer.name for layer in self.block_linears}))
            raise StudioError(
                f"lora.target_modules names {', '.join(unknown)}, which is not a linear layer of a {self.family.name} "
                f"block (the estimate models LoRA on these: {names})",
                "use all-linear or the module names above", kind="config")
        return tuple(layer for layer in candidates if any(_suffix_match(layer.path, t) for t in targets))


def _suffix_match(path: str, target: str) -> bool:
    return path == target or path.endswith("." + target)


def _norm_parameters(name: str, size: int, norm: str) -> list[ParameterSpec]:
    specs = [ParameterSpec(f"{name}.weight", (size,), "norm")]
    if norm == "layer":
        specs.append(ParameterSpec(f"{name}.bias", (size,), "norm"))
    return specs


# ---------------------------------------------------------------- resolving a config


def _rotary_fraction(config: dict) -> float | None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    for value in (rope.get("partial_rotary_factor"), config.get("partial_rotary_factor"), config.get("rotary_pct")):
        if value is not None:
            return float(value)
    return None


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
                 "attention_dropout", "residual_dropout", "embedding_dropout")
# Fields only some families have: absent, they take ModelShape's default.
_OPTIONAL_FIELDS = ("parallel_residual", "qk_layernorm", "attention_softcap", "logit_softcap", "logits_scaling",
                    "experts", "experts_per_token", "expert_intermediate")


def model_shape(config: dict) -> ModelShape:
    """Resolve a config.json mapping into a ModelShape; unknown families and missing sizes raise StudioError."""
    family = family_of(config)
    attached = tuple(ParameterSpec(name, shape, "attached") for name, shape in family.attached(config))
    if family.text_config:
        config = {**(config.get("text_config") or {}), "model_type": config["model_type"]}
    resolved: dict[str, Any] = {}
    rotary = _rotary_fraction(config)
    if rotary is not None:
        resolved["rotary_fraction"] = rotary
    for name in _SHAPE_FIELDS + _OPTIONAL_FIELDS:
        if name in resolved:
            continue
        keys = family.fields.get(name, ())
        value = next((config[key] for key in keys if config.get(key) is not None), None)
        if value is None and name in _OPTIONAL_FIELDS and any(key in config for key in keys):
            continue  # switched off (Gemma 2's soft-capping set to null)
        if value is None and name in family.defaults:
            default = family.defaults[name]
            value = default(resolved) if callable(default) else default
        if value is None and name in _OPTIONAL_FIELDS:
            continue
        if value is None:
            raise StudioError(f"the {family.name} config lacks {' or '.join(keys or (name,))}",
                              "use the model's complete config.json", kind="model")
        resolved[name] = value
    if resolved.get("experts") and (config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1):
        raise StudioError(f"the {family.name} config has dense MLP blocks between its experts (mlp_only_layers, "
                          "decoder_sparse_step), which the estimate does not model",
                          "the estimate describes checkpoints with experts in every block", kind="model")
    resolved["activation"] = dict(family.activation_aliases).get(resolved["activation"], resolved["activation"])
    return ModelShape(family=family, model_type=config["model_type"], attached=attached, **resolved)


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
    then the Hub at ``HF_ENDPOINT`` with the token ``hf auth login`` saved; that file alone).

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
                          + why, f"fetch it once online (`hf download {name_or_path} config.json`, or "
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


def cached_config(repo_id: str, revision: str, filename: str = "config.json") -> Path | None:
    """The config.json (or another file) of a Hub model in the local Hugging Face cache, if it is there."""
    from huggingface_hub import try_to_load_from_cache  # not at import: the window starts without it

    try:
        found = try_to_load_from_cache(repo_id, filename, cache_dir=hub_cache_dir(), revision=revision or None)
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
                          "accept the license on the model's Hub page, then `hf auth login` (or set HF_TOKEN)",
                          kind="model") from exc
    except RepositoryNotFoundError as exc:
        raise StudioError(f"the Hub has no model {where} (or it is private)",
                          "check the model id; for a private model, `hf auth login` (or set HF_TOKEN)",
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
