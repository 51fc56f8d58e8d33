"""LoRA's rank, targets and dropout, recounted from a traced block's record instead of traced anew.

``studio.train.measure.trace`` records the first and a typical decoder block of the model with
LoRA on every linear layer (rank ``RECORD_RANK``), once with adapter dropout and once
without:
for each linear, its input and output width, which linears receive the same input
tensor (a group, such as the attention's query, key and value), and the bytes per
token of the tensors its adapter alone saves for backward, split three ways:

* ``rank``: its rank-wide intermediate (the output of ``lora_A``), per token and per rank;
* ``own``: what only this adapter keeps of its input (the dropout's output and noise,
  autocast's copy of the input in the compute dtype);
* ``groups``: the input tensor itself, when an adapter keeps it (no dropout and no
  cast): shared by every adapted linear of the group, so counted once per group;

and, per rank, what does not grow with the tokens (``weights``: its factors, cast to
the compute dtype by autocast and kept for backward).

``lora_block_bytes`` adds these up for any rank, set of targets and dropout; the
estimate moves each moment of the traced step by the difference between the run's
settings and the traced ones (for each block that holds it). The
adapter's own tensors (``lora_A`` rank x in, ``lora_B`` out x rank) are recounted
with ``adapter_tensors``.

Not recounted (part of the trace's key instead): DoRA (its weight norm's temporaries
depend on the rank and the weight), the other PEFT methods, and models where peft
wraps parameters rather than linear modules (a mixture of experts' router and
experts under all-linear): there the trace records no block and each LoRA setting
is traced as its own regime.
"""

from __future__ import annotations

import math

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.regime import DTYPE_BYTES

RECORD_RANK = 7  # a rank no layer width equals, so the rank-wide tensors are told apart by their width
RECORD_LENGTH = 97  # and a length none equals either, so what grows with the tokens is told apart from weights


def recounts_lora(config: RunConfig) -> bool:
    """Whether the run's rank, targets and dropout can be recounted from a record (see the module doc)."""
    return config.method_spec.peft_lora and not config.lora.use_dora


def lora_settings(config: RunConfig) -> dict:
    """The LoRA settings a record recounts: rank, targets, and whether dropout is on (its rate costs nothing)."""
    return {"r": config.lora.r, "target_modules": list(config.lora.target_modules), "dropout": config.lora.dropout > 0}


def adapted_linears(record: dict, targets) -> list[str]:
    """The block's linears that ``targets`` (peft's rule: a name, or the end of a dotted path) adapt."""
    names = list(record["linears"])
    if list(targets) == ["all-linear"]:
        return names
    adapted = [name for name in names if any(name == t or name.endswith("." + t) for t in targets)]
    unmatched = [t for t in targets if not any(name == t or name.endswith("." + t) for name in names)]
    if unmatched:
        raise StudioError(f"lora.target_modules: {', '.join(unmatched)} names no linear layer of this model's "
                          f"decoder blocks", f"its blocks' linear layers: {', '.join(names)}; or use all-linear",
                          kind="config")
    return adapted


def lora_block_bytes(record: dict, settings: dict, tokens: int, block: str = "typical",
                     weights_only: bool = False) -> float:
    """Bytes a block's adapters save for backward with these settings, at ``tokens`` tokens per micro-batch:
    the ``first`` block's (its input needs no gradient, so dropout keeps no noise there) or a ``typical`` one's;
    ``weights_only``: only their weights cast for autocast (which autocast's cache holds through a checkpointed
    forward pass too)."""
    costs = record["costs"][block]["dropout" if settings["dropout"] else "none"]
    adapted = adapted_linears(record, settings["target_modules"])
    weights = sum(settings["r"] * costs["weights"][name] for name in adapted)
    if weights_only:
        return weights
    groups = {record["linears"][name]["group"] for name in adapted}
    per_token = sum(settings["r"] * costs["rank"][name] + costs["own"][name] for name in adapted)
    per_token += sum(costs["groups"].get(str(group), 0.0) for group in groups)
    return per_token * tokens + weights


def adapter_bytes(record: dict, settings: dict) -> int:
    """One block's adapter tensors' bytes (and so their gradients')."""
    return sum(math.prod(shape) * DTYPE_BYTES[dtype] * count
               for (shape, dtype), count in adapter_tensors(record, settings).items())


def adapter_tensors(record: dict, settings: dict) -> dict[tuple[tuple[int, ...], str], int]:
    """One block's trainable adapter tensors, counted by (shape, dtype): lora_A and lora_B of each target."""
    counts: dict = {}
    r, dtype = settings["r"], record["adapter_dtype"]
    for name in adapted_linears(record, settings["target_modules"]):
        linear = record["linears"][name]
        for shape in ((r, linear["in"]), (linear["out"], r)):
            counts[(shape, dtype)] = counts.get((shape, dtype), 0) + 1
    return counts
