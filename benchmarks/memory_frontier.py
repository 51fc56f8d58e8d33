"""The longest sequence that fits, by our estimate, beside the figures Unsloth publishes for the same setup.

    python benchmarks/memory_frontier.py            # the tables (markdown), in about a second
    python benchmarks/memory_frontier.py --json     # the same numbers as JSON

Llama-3.1-8B and Llama-3.3-70B, QLoRA (4-bit NF4, double quantization) r32 on every linear layer of the
blocks, micro-batch 1, gradient checkpointing, bf16: the setup of Unsloth's published context-length
tables. For each card size, the longest ``data.max_length`` whose estimated peak (``studio.core.memory.estimate``
for CUDA: tensors, the CUDA context and the allocator margin) fits on a card of that size as the card reports
its memory (``studio.gui.state.hardware.COMMON_CARDS``: an "8 GB" card has 8,188 MiB), less what a desktop's
display keeps on a GeForce card, less the margin fit leaves free (``studio.core.memory.fit.FIT_MARGIN``), with

* before: the defaults before lean weights (k-bit preparation's fp32 embedding and output layer);
* after: ``LEAN_SETTINGS``, the leanest settings the config allows (GPU memory; the CPU RAM they take,
  the embedding and output layer kept there and the offloaded block inputs, is printed apart).

The models' shapes come from their published config.json files (written out below: no network).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from studio.core.config import RunConfig  # noqa: E402
from studio.core.memory.estimate import estimate  # noqa: E402
from studio.core.memory.fit import FIT_MARGIN  # noqa: E402
from studio.core.sizes import GIB  # noqa: E402
from studio.gui.state.hardware import COMMON_CARDS  # noqa: E402

_LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
# config.json of meta-llama/Llama-3.1-8B and meta-llama/Llama-3.3-70B-Instruct, as published on their model cards
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
LLAMA_33_70B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "head_dim": 128, "hidden_act": "silu", "hidden_size": 8192,
    "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": _LLAMA3_ROPE, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128256,
}
MODELS = {"Llama-3.1-8B": LLAMA_31_8B, "Llama-3.3-70B": LLAMA_33_70B}

# Each size of Unsloth's tables, as a card of that size reports it: GB -> the card
CARDS = {8: "GeForce RTX 4060 8 GB", 12: "GeForce RTX 3060", 16: "GeForce RTX 4060 Ti 16 GB", 24: "GeForce RTX 4090",
         48: "NVIDIA RTX A6000", 80: "NVIDIA H100 80 GB"}
CARDS_GIB = tuple(CARDS)


def card_bytes(card_gb: int) -> int:
    """The memory of the card of that size as it reports it, less what a desktop's display keeps on it."""
    return next(gpu for gpu in COMMON_CARDS if gpu.name == CARDS[card_gb]).usable_bytes


def usable_gib(card_gb: int) -> float:
    """What a run may take on the card of that size, less the margin fit leaves free."""
    return card_bytes(card_gb) * (1 - FIT_MARGIN) / GIB
# Unsloth's published longest sequences, same model and setup (unsloth.ai/blog/llama3-3): Unsloth, HF + FA2.
# None: not published for that card; 0: out of memory.
PUBLISHED = {
    "Llama-3.1-8B": {8: (2_900, 0), 80: (342_000, 28_000)},
    "Llama-3.3-70B": {48: (12_106, 0), 80: (89_389, 6_916)},
}

# The benchmark's setup, the same before and after.
SETUP = {"method": "qlora", "lora": {"r": 32, "target_modules": ("all-linear",)},
         "training": {"micro_batch_size": 1, "gradient_checkpointing": True, "precision": "bf16"}}
BEFORE = {"training": {"lean_weights": False}}  # the defaults before lean weights
# The leanest settings the config allows: every memory saver a run can switch on. Exact ones first (losses and
# gradients unchanged); the last two change the training as Unsloth's own setup does (its notebooks train with
# no LoRA dropout and 8-bit AdamW).
LEAN_SETTINGS = {
    "training": {"lean_weights": True, "chunked_loss": True, "embedding_on_cpu": True, "output_layer_on_cpu": True,
                 "optimizer": "adamw_8bit", "activation_offload": True, "tiled_mlp": True},
    "lora": {"dropout": 0.0},
}


def config_with(*changes: dict) -> RunConfig:
    config = RunConfig()
    for change in (SETUP, *changes):
        config = config.replace(**change)
    return config


def peak_gib(model: dict, config: RunConfig, length: int) -> float:
    return estimate(model, config.replace(data={"max_length": length})).peak_bytes / GIB


def host_gib(model: dict, config: RunConfig) -> float:
    """CPU RAM the run keeps beside the GPU's memory (the embedding and output layer kept there, offloaded inputs)."""
    return sum(d.total_bytes for d in estimate(model, config).devices if d.device == "host") / GIB


def longest_fitting(model: dict, config: RunConfig, card_gib: float, ceiling: int = 1 << 21) -> int:
    """The longest max_length whose estimated peak is at most ``card_gib`` (0: not even 1 token fits)."""
    low, high = 0, ceiling
    while low < high:
        middle = (low + high + 1) // 2
        if peak_gib(model, config, middle) <= card_gib:
            low = middle
        else:
            high = middle - 1
    return low


def frontier() -> dict:
    before, after = config_with(BEFORE), config_with(LEAN_SETTINGS)
    result = {}
    for name, model in MODELS.items():
        rows = []
        for card in CARDS_GIB:
            unsloth, hf = PUBLISHED[name].get(card, (None, None))
            usable = usable_gib(card)
            rows.append({"card_gib": card, "usable_gib": round(usable, 2), "before": longest_fitting(model, before, usable),
                         "after": longest_fitting(model, after, usable), "unsloth": unsloth, "hf_fa2": hf})
        result[name] = {"rows": rows, "minimum_gib": {"before": round(peak_gib(model, before, 1), 2),
                                                       "after": round(peak_gib(model, after, 1), 2)},
                        "host_gib_after": round(host_gib(model, after), 2)}
    r16 = {"lora": {"r": 16}}
    result["8B QLoRA r16 at 2,048 tokens (GiB)"] = {
        "before": round(peak_gib(LLAMA_31_8B, config_with(BEFORE, r16), 2048), 2),
        "after": round(peak_gib(LLAMA_31_8B, config_with(LEAN_SETTINGS, r16), 2048), 2)}
    return result


def _tokens(value: int | None) -> str:
    if value is None:
        return ""
    return f"{value:,}" if value else "does not fit"


def markdown(result: dict) -> str:
    lines = []
    for name in MODELS:
        minimum = result[name]["minimum_gib"]
        lines += [f"{name}, QLoRA r32 all linear layers, micro-batch 1, gradient checkpointing "
                  f"(smallest card: {minimum['before']} GiB before, {minimum['after']} GiB after, with "
                  f"{result[name]['host_gib_after']} GiB of CPU RAM beside it):", "",
                  "| card (what a run may take) | ours before | ours after | Unsloth | HF + FlashAttention 2 |",
                  "|---|---|---|---|---|"]
        for row in result[name]["rows"]:
            hf = "out of memory" if row["hf_fa2"] == 0 else _tokens(row["hf_fa2"])
            lines.append(f"| {row['card_gib']} GB ({row['usable_gib']} GiB) | {_tokens(row['before'])} | "
                         f"{_tokens(row['after'])} | {_tokens(row['unsloth'])} | {hf} |")
        lines.append("")
    total = result["8B QLoRA r16 at 2,048 tokens (GiB)"]
    lines.append(f"Llama-3.1-8B QLoRA r16 at 2,048 tokens: {total['before']} GiB before, {total['after']} GiB after.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    result = frontier()
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
