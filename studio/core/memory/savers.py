"""The memory savers in one table: what each switch saves and costs, and what it cannot be combined with.

``SAVER_SPECS`` is keyed by the savers' switches in the config's ``training`` section, in the order the
techniques panel shows them and validation checks them. Validation (``refusal``), fit (``slowdown``,
``fit_rank``), the derived estimate's trace key (``retraced``), the techniques panel (``label``,
``explanation``, ``needs``, ``panel_group``) and the reference in docs/config.md read their facts about a
saver here instead of naming savers. Each saver's worker code lives in ``studio.train.savers`` and its part
of the estimate in ``studio.core.memory``; how the estimate resolves a switch is in
``studio.core.memory.regime``.

Adding a saver is its switch in ``config.TrainingConfig``, a row here, its worker code and its estimate part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from studio.core.config import RunConfig
from studio.core.memory.parts.tiled import tiled_mlp_refusal, untiled_model_refusal
from studio.core.memory.regime import embedding_on_cpu_refusal, output_layer_refusal
from studio.core.memory.sharding import ScaleOut
from studio.core.model.info import ModelShape

# How a run may spread that a saver cannot run in (``SaverSpec.not_with``); its refusal says why, in config terms.
ZERO = "ZeRO or FSDP sharding"
SHARDED_WEIGHTS = "ZeRO-3 or FSDP (sharded weights)"
LAYER_SPLIT = "a layer split"
DATA_PARALLEL = "several processes"

# What fit's other steps cost (studio.core.memory.fit): the step time x this where they are in force, or, for the
# micro-batch, the fixed cost of one micro-step in tokens. Rules of thumb, like the switches' slowdowns: a GPU
# measurement (benchmarks/gpu_checks.py, docs/gpu-results.md) replaces the number here.
STEP_COSTS = {
    "micro_step_tokens": 256,  # a micro-step's fixed overhead (kernel launches, the optimizer's bookkeeping)
    "four_bit_base": 1.25,  # every weight dequantized at every use
    "eight_bit_optimizer": 1.02,  # the 8-bit state's quantization in the optimizer step
    "optimizer_offload": 1.5,  # ZeRO's optimizer step on the CPU
}

# The techniques panel's groups a saver's switch sits in.
SAVERS_GROUP = "savers"  # "Precision and memory savers"
BASE_WEIGHTS_GROUP = "base weights"  # beside the base model's quantization
SPEED_GROUP = "speed"  # beside the batch layout and torch.compile


@dataclass(frozen=True)
class SaverSpec:
    name: str  # the switch: training.<name>
    label: str  # as the techniques panel shows it
    explanation: str  # the panel's line under it: what it saves and what it costs
    # expected step time x this where it acts (fit's rule of thumb, docs/memory-estimate.md; 1.0 costs nothing)
    slowdown: float = 1.0
    refusal: Callable[[RunConfig], str | None] | None = None  # why a config cannot have it on; None: it can
    hint: str = ""  # what validation suggests when it is refused (default: switch it off)
    needs: str = ""  # the switch it acts through: off while that one is off (the panel greys it out)
    # whether a traced step keeps other tensors with it: part of the derived estimate's trace key, so that a
    # model no family describes is traced anew when it changes (studio.core.memory.derived)
    retraced: bool = False
    model_refusal: Callable[[ModelShape], str | None] | None = None  # models it cannot act on (fit skips them)
    # ZERO, SHARDED_WEIGHTS, LAYER_SPLIT, DATA_PARALLEL: the spreads over GPUs it cannot run in (fit's candidates)
    not_with: frozenset[str] = frozenset()
    host_activations: bool = False  # whether it moves activations to CPU RAM (fit says how much RAM they take)
    # where fit tries switching it on among its steps, which it tries and explains in order (fit.FIT_STEPS);
    # None: fit leaves it as it is
    fit_rank: int | None = None
    fit_note: str = ""  # fit's words for what switching it on does
    fit_name: str = ""  # its name in fit's changes (``studio fit --json``) where that is not the switch's
    panel_group: str = SAVERS_GROUP

    @property
    def field(self) -> str:
        return f"training.{self.name}"

    def is_on(self, config: RunConfig) -> bool:
        """Switched on, and so is what it acts through."""
        training = config.training
        return getattr(training, self.name) and (not self.needs or getattr(training, self.needs))

    def spreads_as(self, scale_out: ScaleOut) -> bool:
        """Whether it can act in a run spread over GPUs as ``scale_out`` says."""
        # a pipeline places the blocks as a layer split does
        placed = scale_out.layer_split or scale_out.pipeline_stages > 0
        spread = {ZERO: scale_out.uses_zero, SHARDED_WEIGHTS: scale_out.zero_stage == 3, LAYER_SPLIT: placed,
                  DATA_PARALLEL: scale_out.num_gpus > 1}
        return not any(spread[way] for way in self.not_with)

    def refused(self, config: RunConfig) -> str | None:
        """Why ``config`` cannot have this saver on, whether or not it is on; None when it can."""
        return self.refusal(config) if self.refusal else None

    @property
    def validation_hint(self) -> str:
        return self.hint or f"turn {self.field} off"


def _checkpointing_off(config: RunConfig) -> str | None:
    if config.training.gradient_checkpointing:
        return None
    return "offloads the block inputs that gradient checkpointing keeps, and gradient checkpointing is off"


# In the order the techniques panel shows them and validation checks them.
SAVER_SPECS: dict[str, SaverSpec] = {spec.name: spec for spec in (
    SaverSpec("gradient_checkpointing", "Gradient checkpointing",
              "Keeps only each layer's input and recomputes the rest in the backward pass: saves most activation "
              "memory, costs about 30 % more time.",
              slowdown=1.33, fit_rank=20, fit_name="checkpointing"),
    SaverSpec("embedding_on_cpu", "Embedding in CPU RAM",
              "Looks the tokens up in CPU RAM and moves only their rows to the GPU: the same numbers, the "
              "embedding's memory (1 GiB for a 128k-vocabulary 8B) moves to CPU RAM. Adapters on one GPU; not "
              "with a tied output layer.",
              # a CPU gather and one copy of the rows per micro-batch (not measured on a GPU)
              slowdown=1.01, refusal=embedding_on_cpu_refusal, not_with=frozenset({ZERO, LAYER_SPLIT, DATA_PARALLEL}),
              retraced=True, fit_rank=50,
              fit_note="the input embedding in CPU RAM"),
    SaverSpec("output_layer_on_cpu", "Output layer in CPU RAM",
              "Copies the output layer to the GPU only while the lean loss runs (it computes all its gradients "
              "there): the same numbers, the layer's memory (1 GiB for a 128k-vocabulary 8B) off the GPU for the "
              "backward pass. Adapters with the lean loss, no ZeRO; not with a tied layer.",
              # the layer copied to the GPU once per micro-batch (1 GiB of an 8B's at about 25 GB/s: some 40 ms
              # against a second or more of compute for a 2,048-token micro-batch; not measured on a GPU)
              slowdown=1.03, refusal=output_layer_refusal, needs="chunked_loss",
              not_with=frozenset({ZERO, LAYER_SPLIT}), retraced=True, fit_rank=60,
              fit_note="the output layer in CPU RAM, on the GPU only for the loss"),
    SaverSpec("activation_offload", "Offload layer inputs to CPU RAM",
              "Keeps the layer inputs that checkpointing saves in CPU RAM, copied while the GPU computes: same "
              "results, less GPU memory, a little more time (the estimate shows the CPU RAM).",
              # a block's input is 2·hidden bytes a token each way over PCIe, against about 8 x its parameters in
              # FLOPs a token (docs/memory-estimate.md)
              slowdown=1.03, refusal=_checkpointing_off, needs="gradient_checkpointing",
              hint="turn training.gradient_checkpointing on, or training.activation_offload off",
              retraced=True, host_activations=True, fit_rank=30, fit_note="the block inputs wait in CPU RAM"),
    SaverSpec("tiled_mlp", "Tiled MLP (long sequences)",
              "Recomputes each layer's MLP a slice of the tokens at a time in the backward pass, so its wide "
              "intermediate is never whole: same results, about 20 % more time. Not for mixtures of experts.",
              # the MLP's forward once more: about two thirds of a block's FLOPs, a sixth of a checkpointed step
              slowdown=1.2, refusal=tiled_mlp_refusal, model_refusal=untiled_model_refusal,
              not_with=frozenset({SHARDED_WEIGHTS}),
              hint="turn training.tiled_mlp off, or use distributed.sharding zero2 or none", retraced=True,
              fit_rank=80, fit_note="each MLP recomputed a tile of tokens at a time"),
    SaverSpec("lean_weights", "Lean 16-bit embedding and head",
              "Keeps the frozen embedding and output layer 16-bit instead of fp32: the same losses and gradients, "
              "about 2 GiB less for an 8B model with a 128k vocabulary.",
              retraced=True, panel_group=BASE_WEIGHTS_GROUP),
    SaverSpec("chunked_loss", "Lean loss (chunked, targets only)",
              "Projects only the tokens that carry a loss to the vocabulary, a chunk at a time: same loss and "
              "gradients, 3.8-4.4x less logits memory (measured at a 32k vocabulary) and less compute with prompt "
              "masking (docs/performance.md).",
              panel_group=SPEED_GROUP),
)}


def savers_reference() -> str:
    """The table as the config reference's last section (docs/config.md)."""
    out = ["", "## Memory savers", "",
           "The switches of `training` that trade time for memory, from `studio/core/memory/savers.py`: what each "
           "costs in step time (fit's rule of thumb), what it acts through, where it cannot run, and whether a model "
           "no family describes is traced anew when it changes (docs/memory-estimate.md).", "",
           "| switch | saver | step time | acts through | not with | traced anew |", "|---|---|---|---|---|---|"]
    for spec in SAVER_SPECS.values():
        needs = f"`training.{spec.needs}`" if spec.needs else ""
        out.append(f"| `{spec.field}` | {spec.label}: {spec.explanation} | x{spec.slowdown:g} | {needs} | "
                   f"{', '.join(sorted(spec.not_with))} | {'yes' if spec.retraced else ''} |")
    return "\n".join(out) + "\n"
