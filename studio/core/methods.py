"""The training methods in one table: what each trains, what it allows, and what it adds to the model.

``METHOD_SPECS`` is keyed by the values of the config's ``method`` (``studio.core.choices.Method``). The config's
derived properties, validation, fit, the GUI and the export read their facts about a method here
instead of naming methods. Pure data and arithmetic: it imports nothing from studio, so that
config.py can read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Shape = tuple[int, ...]

# What a method trains.
EVERY_WEIGHT = "every weight"
LINEAR_LAYERS = "linear layers"
VIRTUAL_TOKENS = "virtual tokens"

# How an adapted linear layer computes (what the memory estimate's tape replays, studio.core.memory.parts.tape).
LOW_RANK = "low-rank"  # the input, dropped out, through A then B, added to the base layer's output
SCALING = "scaling"  # the output, or a feedforward layer's input, times a trained vector
REBUILT = "rebuilt"  # the full-size update is rebuilt from its factors, then applied to the input

# Where virtual tokens enter the model.
INPUT_TOKENS = "input"  # in front of the input embeddings: every layer runs over them
ATTENTION_TOKENS = "attention"  # as a key and a value in every layer's attention

# The adapter settings a method reads.
RANK = "rank"  # lora.r
ALPHA = "alpha"  # lora.alpha
DROPOUT = "dropout"  # lora.dropout
RSLORA = "rslora"  # lora.use_rslora
DORA = "dora"  # lora.use_dora
TARGET_MODULES = "target_modules"  # lora.target_modules
ADALORA_BUDGET = "adalora_budget"  # peft.adalora_target_r, _warmup_ratio, _final_ratio, _update_every
VIRTUAL_TOKEN_COUNT = "virtual_token_count"  # peft.num_virtual_tokens

LORA_SETTINGS = frozenset({RANK, ALPHA, DROPOUT, TARGET_MODULES})

# Whether a method trains on a bitsandbytes 4/8-bit base: peft has quantized layers for it, or leaves the
# linears untouched; LoHa and LoKr would adapt the packed weights, full fine-tuning would train them.
KbitBase = Literal["no", "allowed", "required"]

# (in_features, out_features, r, feedforward) -> the shapes of the trainable tensors (fp32) peft adds to one
# adapted linear layer; feedforward: the layer's input is the MLP's width (its output projection).
LinearShapes = Callable[[int, int, int, bool], tuple[Shape, ...]]
# (hidden, layers, kv_width) -> the shape of what one virtual token trains (fp32).
TokenShape = Callable[[int, int, int], Shape]


@dataclass(frozen=True)
class MethodSpec:
    name: str  # the config's value
    label: str  # as the GUI's method list shows it
    explanation: str  # the GUI's line under it: what it saves and what it costs
    trains: str  # EVERY_WEIGHT, LINEAR_LAYERS or VIRTUAL_TOKENS
    kbit_base: KbitBase
    mergeable: bool  # whether the export can merge it into the weights (virtual tokens are no weights)
    settings: frozenset[str] = frozenset()  # the adapter settings it reads
    # the title of the GUI's adapter group (greyed out for full fine-tuning, hidden for virtual tokens)
    group_title: str = "LoRA adapter"
    linear_shapes: LinearShapes | None = None  # for methods that adapt linear layers
    linear_form: str = ""  # LOW_RANK, SCALING or REBUILT, for methods that adapt linear layers
    token_shape: TokenShape | None = None  # for methods that train virtual tokens
    token_entry: str = ""  # INPUT_TOKENS or ATTENTION_TOKENS, for methods that train virtual tokens
    quantized_as: str = ""  # the method fit turns it into on a 4-bit base, if it is renamed (LoRA: QLoRA)
    # peft's LoRA itself: its adapter also wraps a mixture of experts' router and expert parameters, and the
    # derived estimate recounts its rank, targets and dropout from a record of one block
    peft_lora: bool = False

    @property
    def trains_every_weight(self) -> bool:
        return self.trains == EVERY_WEIGHT

    @property
    def uses_adapter(self) -> bool:
        return not self.trains_every_weight

    @property
    def adapts_linears(self) -> bool:
        return self.trains == LINEAR_LAYERS

    @property
    def trains_virtual_tokens(self) -> bool:
        return self.trains == VIRTUAL_TOKENS

    def linear_tensor_shapes(self, in_features: int, out_features: int, r: int, feedforward: bool = False,
                             dora: bool = False) -> tuple[Shape, ...]:
        """The trainable tensors of one adapted linear layer; DoRA adds a magnitude per output feature."""
        shapes = self.linear_shapes(in_features, out_features, r, feedforward)
        return shapes + ((out_features,),) if dora and DORA in self.settings else shapes


def _lora_shapes(n_in: int, n_out: int, r: int, feedforward: bool) -> tuple[Shape, ...]:
    return (r, n_in), (n_out, r)  # A and B


def _adalora_shapes(n_in: int, n_out: int, r: int, feedforward: bool) -> tuple[Shape, ...]:
    return _lora_shapes(n_in, n_out, r, feedforward) + ((r, 1),)  # and the singular values between them


def _ia3_shapes(n_in: int, n_out: int, r: int, feedforward: bool) -> tuple[Shape, ...]:
    return ((1, n_in),) if feedforward else ((n_out, 1),)  # a scaling vector of the input, else of the output


def _loha_shapes(n_in: int, n_out: int, r: int, feedforward: bool) -> tuple[Shape, ...]:
    return ((n_out, r), (r, n_in)) * 2  # two low-rank products, Hadamard-multiplied


def _lokr_shapes(n_in: int, n_out: int, r: int, feedforward: bool) -> tuple[Shape, ...]:
    """A small full matrix Kronecker-multiplied with a second one, low-rank when the rank is small."""
    in_small, in_large = _near_square_factors(n_in)
    out_small, out_large = _near_square_factors(n_out)
    if r < max(out_large, in_large) / 2:
        return (out_small, in_small), (out_large, r), (r, in_large)
    return (out_small, in_small), (out_large, in_large)


def _near_square_factors(dimension: int) -> tuple[int, int]:
    """peft's LoKr split of a dimension into two factors near its square root (smaller first).

    The first factor grows through the divisors while the sum of the two factors shrinks.
    """
    small, large = 1, dimension
    while small < large:
        divisor = small + 1
        while dimension % divisor:
            divisor += 1
        if divisor + dimension // divisor > 1 + dimension:
            break
        small, large = divisor, dimension // divisor
    return min(small, large), max(small, large)


def _prompt_token_shape(hidden: int, layers: int, kv_width: int) -> Shape:
    return (hidden,)  # an input embedding


def _prefix_token_shape(hidden: int, layers: int, kv_width: int) -> Shape:
    return (2 * layers * kv_width,)  # a key and a value in every layer


_LINEAR_ADAPTER = {"trains": LINEAR_LAYERS, "mergeable": True}
_VIRTUAL_TOKENS = {"trains": VIRTUAL_TOKENS, "mergeable": False, "kbit_base": "allowed",
                   "settings": frozenset({VIRTUAL_TOKEN_COUNT})}
_LORA = {**_LINEAR_ADAPTER, "settings": LORA_SETTINGS | {RSLORA, DORA}, "linear_shapes": _lora_shapes,
         "linear_form": LOW_RANK, "peft_lora": True}

# In the GUI's order.
METHOD_SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("full", "Full fine-tuning",
               "Trains every weight. Saves nothing: weights, gradients and AdamW state for every parameter "
               "(about 16 bytes each). The highest quality ceiling.",
               trains=EVERY_WEIGHT, kbit_base="no", mergeable=True),
    MethodSpec("lora", "LoRA",
               "Trains small low-rank adapters on a frozen base. Saves the base's gradients and optimizer state "
               "(most of the memory); costs a little quality on hard tasks.",
               kbit_base="allowed", quantized_as="qlora", **_LORA),
    MethodSpec("qlora", "QLoRA",
               "LoRA on a 4-bit base. Saves about 70 % of the weight memory on top of LoRA; costs speed "
               "(weights are dequantized every step) and a little accuracy.",
               kbit_base="required", **_LORA),
    MethodSpec("adalora", "AdaLoRA",
               "LoRA that moves rank to the layers that need it and prunes the rest to a budget while training. "
               "About LoRA's memory; a few more settings.",
               kbit_base="allowed", settings=LORA_SETTINGS | {ADALORA_BUDGET}, group_title="AdaLoRA adapter",
               linear_shapes=_adalora_shapes, linear_form=LOW_RANK, **_LINEAR_ADAPTER),
    MethodSpec("ia3", "IA3",
               "Learns one scaling vector per adapted layer: the fewest trainable parameters and the least optimizer "
               "memory; learns less than LoRA.",
               kbit_base="allowed", settings=frozenset({TARGET_MODULES}), group_title="IA3 adapter",
               linear_shapes=_ia3_shapes, linear_form=SCALING, **_LINEAR_ADAPTER),
    MethodSpec("loha", "LoHa",
               "Low-rank Hadamard product: more expressive than LoRA at the same rank; keeps a full-size update per "
               "layer in memory. Needs an unquantized base.",
               kbit_base="no", settings=LORA_SETTINGS, group_title="LoHa adapter", linear_shapes=_loha_shapes,
               linear_form=REBUILT, **_LINEAR_ADAPTER),
    MethodSpec("lokr", "LoKr",
               "Kronecker-product update: very few parameters for a full-rank update; keeps a full-size update per "
               "layer in memory. Needs an unquantized base.",
               kbit_base="no", settings=LORA_SETTINGS, group_title="LoKr adapter", linear_shapes=_lokr_shapes,
               linear_form=REBUILT, **_LINEAR_ADAPTER),
    MethodSpec("prefix_tuning", "Prefix tuning",
               "Trains keys and values of virtual tokens in every layer; changes no weight, so it cannot be merged. "
               "Longer attention costs a little activation memory.",
               token_shape=_prefix_token_shape, token_entry=ATTENTION_TOKENS, **_VIRTUAL_TOKENS),
    MethodSpec("prompt_tuning", "Prompt tuning",
               "Trains only the embeddings of virtual tokens in front of every example: the fewest parameters; "
               "cannot be merged. Every example grows by the virtual tokens.",
               token_shape=_prompt_token_shape, token_entry=INPUT_TOKENS, **_VIRTUAL_TOKENS),
)}


def trains_like(method: str) -> str:
    """The method whose training step ``method`` runs: a quantized form (QLoRA) trains as its method does
    (LoRA), on a base loaded another way."""
    return next((spec.name for spec in METHOD_SPECS.values() if spec.quantized_as == method), method)
