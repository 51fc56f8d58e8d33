"""How accurate is the memory estimate? Estimate vs measured peak for a matrix of real training steps.

    python benchmarks/memory_accuracy.py            # the full matrix (about 10-15 minutes on 2 CPU cores)
    python benchmarks/memory_accuracy.py --quick    # a few rows
    python benchmarks/memory_accuracy.py --markdown docs/memory-accuracy-table.md

Each row builds a random-weight model of one architecture with the worker's own
``build_model``, runs two optimizer steps the way the worker does (the first
allocates the optimizer state, the second is the steady state) at full
sequence length, and takes the peak of live tensor bytes from a dispatch-mode
tracker (``studio.train.measure.memtrack``). It compares that with the analytic
estimate (``studio.core.memory.estimate``, device type cpu) and with the simulated
one (the same steps on fake tensors, ``studio.train.measure.simulate``). The rows named
``derived:`` estimate from a traced step instead of the family's description
(``studio.core.memory.derived``, traced here in-process by ``studio.train.measure.trace``);
``--only derived:`` runs just those. Rows with ``activation_offload=True`` also compare the host memory
(the offloaded block inputs in CPU RAM, which the tracker counts apart from the device's), as do those with
``embedding_on_cpu`` or ``output_layer_on_cpu`` (the weights kept there); ``--only offload``
runs just those, ``--only tiled_mlp`` the tiled MLP's.

On a machine with a GPU (and without ``--cpu``) the steps run on CUDA and the
measured side is torch.cuda.max_memory_allocated / max_memory_reserved and
nvml's used memory; the analytic estimate is then the CUDA one (tensors, plus
context and allocator margin for the comparison with nvml).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MIB = 1024**2

# name: (family, config overrides); sizes from 7M to 112M parameters
MODELS = {
    "llama-7M": ("llama", dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=4, vocab_size=8192)),
    "llama-55M": ("llama", dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=2, vocab_size=32000)),
    "llama-112M": ("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=10, num_attention_heads=12,
                                 num_key_value_heads=4, vocab_size=32000)),
    "qwen2-16M": ("qwen2", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                                num_key_value_heads=2, vocab_size=16384, tie_word_embeddings=True)),
    "mistral-26M": ("mistral", dict(hidden_size=384, intermediate_size=1152, num_hidden_layers=8, num_attention_heads=6,
                                    num_key_value_heads=2, vocab_size=16384)),
    "gpt2-17M": ("gpt2", dict(n_embd=384, n_layer=6, n_head=6, vocab_size=16384, n_positions=1024)),
    "neox-36M": ("gpt_neox", dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                                  vocab_size=16384)),
    "phi-36M": ("phi", dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                            num_key_value_heads=8, vocab_size=16384, resid_pdrop=0.1)),
    # small vocabularies: the loss no longer dominates, the backward pass (recomputed blocks) does
    "gpt2-12M-v2k": ("gpt2", dict(n_embd=384, n_layer=6, n_head=6, vocab_size=2048, n_positions=1024)),
    "phi-21M-v2k": ("phi", dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                                num_key_value_heads=8, vocab_size=2048, resid_pdrop=0.1)),
    "gemma-14M": ("gemma", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                                num_key_value_heads=1, head_dim=64, vocab_size=32000)),
    "qwen3-16M": ("qwen3", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                                num_key_value_heads=2, head_dim=64, vocab_size=16384, tie_word_embeddings=True)),
    "qwen3moe-16M": ("qwen3_moe", dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
                                       num_experts=8, num_experts_per_tok=2, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=16384)),
    # windows shorter than the sequences: alternating sliding and full attention
    "gemma2-10M": ("gemma2", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, vocab_size=16384, sliding_window=128)),
    "gemma3-10M": ("gemma3_text", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=16384,
                                       sliding_window=128, sliding_window_pattern=2)),
    # a multimodal checkpoint: the causal-LM class loads a (small) vision tower that text training never runs
    "gemma3mm-10M": ("gemma3", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=16384,
                                    sliding_window=128, sliding_window_pattern=2)),
    "phi3-21M": ("phi3", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                              num_key_value_heads=2, vocab_size=16384, partial_rotary_factor=0.75, resid_pdrop=0.1)),
    "olmo2-22M": ("olmo2", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                                num_key_value_heads=2, vocab_size=16384)),
    "smollm3-16M": ("smollm3", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                    num_attention_heads=6, num_key_value_heads=2, vocab_size=16384)),
    "granite-22M": ("granite", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                    num_attention_heads=6, num_key_value_heads=2, vocab_size=16384,
                                    embedding_multiplier=12.0, residual_multiplier=0.22,
                                    attention_multiplier=0.015625, logits_scaling=8.0)),
    # deep and narrow, with a small vocabulary: at long sequences the end of the forward pass (every block's kept
    # input, the loss) is the peak, not the logits
    "llama-deep-19M": ("llama", dict(hidden_size=256, intermediate_size=704, num_hidden_layers=24, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=256, max_position_embeddings=8192)),
    # families no hand description covers: only the derived estimate (a traced step) applies
    "stablelm-20M": ("stablelm", dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                      num_attention_heads=6, num_key_value_heads=2, vocab_size=16384)),
    "starcoder2-24M": ("starcoder2", dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6,
                                          num_attention_heads=6, num_key_value_heads=2, vocab_size=16384)),
}


@dataclass(frozen=True)
class Case:
    model: str
    method: str
    precision: str
    micro_batch: int
    sequence: int
    checkpointing: bool = False
    optimizer: str = "adamw"
    accumulation: int = 1
    quick: bool = False
    changes: dict = field(default_factory=dict)  # further RunConfig sections, e.g. {"lora": {"r": 64}}
    derived: bool = False  # estimate from a traced step (studio.core.memory.derived), not the family's description
    # traced with these settings instead (RunConfig sections) and the case's own recounted from that trace with no
    # new trace: the toggles a pick-time trace answers (studio.core.memory.derived)
    traced_as: dict = field(default_factory=dict)
    objective: str = "sft"  # a preference objective's rows are pairs: micro_batch pairs of two sequences

    @property
    def name(self) -> str:
        parts = [self.model, self.method, self.precision, f"b{self.micro_batch}x{self.sequence}", self.optimizer]
        if self.objective != "sft":
            parts.insert(1, self.objective)
        if self.derived:
            parts.insert(0, "derived:")
        if self.traced_as:
            parts.append("traced as " + ", ".join(f"{k}={v}" for section in self.traced_as.values()
                                                  for k, v in section.items()))
        if self.checkpointing:
            parts.append("ckpt")
        if self.accumulation > 1:
            parts.append(f"accum{self.accumulation}")
        parts += [f"{k}={v}" for section in self.changes.values() for k, v in section.items()]
        return " ".join(parts)

    def run_config(self, model_folder: Path):
        from studio.core.config import RunConfig

        config = RunConfig(method=self.method, objective=self.objective).replace(
            model={"name_or_path": str(model_folder)}, data={"max_length": self.sequence},
            training={"precision": self.precision, "micro_batch_size": self.micro_batch, "optimizer": self.optimizer,
                      "gradient_checkpointing": self.checkpointing, "gradient_accumulation_steps": self.accumulation})
        return config.replace(**{section: dict(values) for section, values in self.changes.items()}) if self.changes else config


CASES = [
    Case("llama-7M", "lora", "bf16", 4, 256, quick=True),
    Case("llama-7M", "lora", "bf16", 4, 256, checkpointing=True),
    Case("llama-7M", "lora", "fp32", 2, 512),
    Case("llama-7M", "lora", "bf16", 1, 1024),
    Case("llama-7M", "lora", "bf16", 4, 256, accumulation=2),
    Case("llama-7M", "lora", "bf16", 2, 256, changes={"lora": {"r": 64, "dropout": 0.0}}),
    Case("llama-7M", "lora", "bf16", 2, 256, changes={"model": {"dtype": "float32"}}),
    Case("llama-7M", "lora", "bf16", 2, 256, changes={"model": {"attn_implementation": "eager"}}),
    Case("llama-7M", "lora", "bf16", 2, 256, changes={"lora": {"use_dora": True}}),
    Case("llama-7M", "adalora", "bf16", 2, 256),
    Case("llama-7M", "ia3", "bf16", 4, 256),
    Case("llama-7M", "loha", "bf16", 2, 256),
    Case("llama-7M", "lokr", "fp32", 2, 256),
    Case("llama-7M", "prefix_tuning", "bf16", 4, 256),
    Case("llama-7M", "prompt_tuning", "bf16", 4, 256),
    Case("llama-7M", "lora", "bf16", 2, 256, changes={"qat": {"weights": "int4"}}),
    Case("llama-7M", "lora", "fp32", 2, 256, changes={"qat": {"weights": "int4", "activations": "int8"}}),
    Case("llama-7M", "full", "fp32", 2, 128, changes={"qat": {"weights": "int8"}}),
    Case("llama-7M", "full", "fp32", 4, 128, quick=True),
    Case("llama-7M", "full", "bf16", 8, 128, checkpointing=True),
    Case("llama-7M", "full", "fp32", 2, 256, optimizer="sgd"),
    Case("llama-7M", "full", "fp32", 2, 128, optimizer="adafactor"),
    Case("llama-7M", "qlora", "bf16", 4, 256, quick=True),
    Case("llama-7M", "qlora", "bf16", 2, 512, checkpointing=True, optimizer="adamw_8bit"),
    Case("llama-7M", "qlora", "bf16", 2, 256, changes={"quantization": {"load_in": "8bit"}}),
    Case("llama-7M", "qlora", "bf16", 2, 256, checkpointing=True, changes={"quantization": {"load_in": "8bit"}}),
    Case("llama-55M", "lora", "bf16", 2, 256),
    Case("llama-55M", "lora", "fp32", 4, 256, changes={"model": {"dtype": "bfloat16"}}),  # 16-bit weights, fp32 LoRA
    Case("llama-55M", "lora", "bf16", 4, 256, checkpointing=True),
    Case("llama-55M", "qlora", "bf16", 2, 256, checkpointing=True, optimizer="adamw_8bit"),
    Case("llama-55M", "full", "bf16", 2, 128),
    Case("llama-55M", "full", "fp32", 2, 128, checkpointing=True, optimizer="adamw_8bit"),
    Case("llama-55M", "full", "fp32", 1, 64),
    Case("llama-112M", "lora", "bf16", 2, 256, checkpointing=True, quick=True),
    Case("llama-112M", "full", "bf16", 1, 256, checkpointing=True, optimizer="adamw_8bit"),
    Case("llama-112M", "qlora", "bf16", 2, 128),
    Case("qwen2-16M", "lora", "bf16", 4, 256),
    Case("qwen2-16M", "full", "fp32", 2, 256, optimizer="sgd"),
    Case("qwen2-16M", "qlora", "fp32", 4, 128, checkpointing=True),
    Case("mistral-26M", "lora", "bf16", 2, 512, checkpointing=True),
    Case("mistral-26M", "full", "bf16", 2, 256, optimizer="adamw_8bit"),
    Case("gpt2-17M", "lora", "bf16", 4, 256, quick=True),
    Case("gpt2-17M", "full", "fp32", 2, 256, checkpointing=True),
    Case("gpt2-17M", "qlora", "bf16", 2, 256),
    Case("gpt2-12M-v2k", "lora", "bf16", 2, 256, checkpointing=True),
    Case("neox-36M", "lora", "bf16", 4, 256),
    Case("neox-36M", "full", "bf16", 2, 256, checkpointing=True),
    Case("neox-36M", "qlora", "fp32", 2, 128, optimizer="sgd"),
    Case("phi-36M", "lora", "bf16", 2, 256),
    Case("phi-36M", "full", "fp32", 2, 128),
    Case("phi-36M", "qlora", "bf16", 4, 128, checkpointing=True),
    Case("phi-21M-v2k", "lora", "bf16", 2, 256, checkpointing=True),
    Case("gemma-14M", "lora", "bf16", 4, 256),
    Case("gemma-14M", "full", "bf16", 2, 256, checkpointing=True, optimizer="sgd"),
    Case("gemma-14M", "qlora", "bf16", 2, 512),
    Case("qwen3-16M", "lora", "bf16", 4, 256),
    Case("qwen3-16M", "full", "fp32", 2, 256, checkpointing=True),
    Case("qwen3moe-16M", "lora", "bf16", 4, 256),
    Case("qwen3moe-16M", "full", "bf16", 2, 256, optimizer="sgd"),
    Case("qwen3moe-16M", "qlora", "bf16", 2, 256, checkpointing=True),
    Case("qwen3moe-16M", "lora", "bf16", 2, 256, changes={"lora": {"target_modules": ["q_proj", "v_proj"]}}),
    Case("gemma2-10M", "lora", "bf16", 4, 256),
    Case("gemma2-10M", "full", "bf16", 2, 256, checkpointing=True),
    Case("gemma3-10M", "lora", "bf16", 4, 256),
    Case("gemma3-10M", "qlora", "bf16", 2, 256, checkpointing=True),
    Case("gemma3mm-10M", "lora", "bf16", 4, 256),
    Case("phi3-21M", "lora", "bf16", 4, 256),
    Case("phi3-21M", "full", "fp32", 2, 128),
    Case("olmo2-22M", "lora", "bf16", 4, 256),
    Case("olmo2-22M", "full", "bf16", 2, 256, checkpointing=True),
    Case("smollm3-16M", "lora", "bf16", 4, 256),
    Case("smollm3-16M", "qlora", "fp32", 2, 256),
    Case("granite-22M", "lora", "bf16", 4, 256),
    Case("granite-22M", "full", "fp32", 2, 128, checkpointing=True),
    # lean weights (the default above) against k-bit preparation's fp32 embedding and output layer
    Case("llama-55M", "qlora", "bf16", 2, 256, checkpointing=True, optimizer="adamw_8bit",
         changes={"training": {"lean_weights": False}}),
    Case("llama-7M", "qlora", "bf16", 4, 256, changes={"training": {"lean_weights": False}}),
    Case("llama-55M", "qlora", "bf16", 4, 256, quick=True),
    Case("llama-55M", "qlora", "fp16", 2, 256, checkpointing=True, changes={"quantization": {"load_in": "8bit"}}),
    Case("qwen3-16M", "qlora", "bf16", 2, 256, checkpointing=True),  # tied: the one weight stays 16-bit
    # the input embedding in CPU RAM: measured and estimated apart from the device's memory (host MiB)
    Case("llama-7M", "qlora", "bf16", 4, 256, quick=True, changes={"training": {"embedding_on_cpu": True}}),
    Case("llama-55M", "lora", "bf16", 2, 256, checkpointing=True, changes={"training": {"embedding_on_cpu": True}}),
    # the output layer in CPU RAM, on the device only while the chunked loss runs
    Case("llama-55M", "qlora", "bf16", 2, 256, checkpointing=True, changes={"training": {"output_layer_on_cpu": True}}),
    Case("llama-7M", "qlora", "bf16", 4, 256, changes={"training": {"embedding_on_cpu": True,
                                                                    "output_layer_on_cpu": True}}),
    Case("phi-36M", "lora", "bf16", 2, 256, checkpointing=True, changes={"training": {"output_layer_on_cpu": True}}),
]

# Offloaded activation checkpointing: the device and the host (CPU RAM) measured apart (studio.train.savers.host_memory.on_host).
OFFLOAD = {"training": {"activation_offload": True}}
OFFLOAD_CASES = [
    Case("llama-7M", "lora", "bf16", 4, 256, checkpointing=True, changes=OFFLOAD),
    Case("llama-55M", "qlora", "bf16", 2, 256, checkpointing=True, optimizer="adamw_8bit", changes=OFFLOAD),
    Case("llama-55M", "full", "bf16", 2, 256, checkpointing=True, changes=OFFLOAD),
    Case("gpt2-17M", "full", "fp32", 2, 256, checkpointing=True, changes=OFFLOAD),
    Case("neox-36M", "lora", "bf16", 4, 256, checkpointing=True, changes=OFFLOAD),
    Case("phi-36M", "qlora", "bf16", 4, 128, checkpointing=True, changes=OFFLOAD),
    Case("gemma-14M", "lora", "bf16", 2, 512, checkpointing=True, changes=OFFLOAD),
    Case("mistral-26M", "lora", "fp32", 2, 512, checkpointing=True, changes=OFFLOAD),
]

# The tiled MLP (studio.train.savers.tiled), alone and with checkpointing and its offload.
TILED = {"training": {"tiled_mlp": True}}
TILED_CASES = [
    Case("llama-7M", "lora", "bf16", 4, 256, changes=TILED),
    Case("llama-55M", "lora", "bf16", 2, 512, checkpointing=True, changes=TILED),
    Case("llama-55M", "qlora", "bf16", 2, 256, checkpointing=True, changes={"training": {"tiled_mlp": True,
                                                                                         "activation_offload": True}}),
    Case("gpt2-17M", "full", "fp32", 2, 256, checkpointing=True, changes=TILED),
    Case("neox-36M", "lora", "bf16", 4, 256, changes=TILED),
    Case("phi-36M", "full", "fp32", 2, 128, changes=TILED),
    Case("gemma-14M", "qlora", "bf16", 2, 512, checkpointing=True, changes=TILED),
    Case("phi3-21M", "lora", "bf16", 4, 256, checkpointing=True, changes=TILED),
]

# Each saver where the end of the forward pass dominates (deep model, long sequence): the forward's peak is
# compared apart; with activation offload the device keeps (almost) no block input (``--only deep``).
CKPT = {"training": {"gradient_checkpointing": True}}
FORWARD_END_CASES = [
    Case("llama-deep-19M", "lora", "bf16", 1, 4096, checkpointing=True),
    Case("llama-deep-19M", "lora", "bf16", 1, 4096, checkpointing=True, changes=OFFLOAD, quick=True),
    Case("llama-deep-19M", "qlora", "bf16", 1, 4096, checkpointing=True, changes=OFFLOAD),
    Case("llama-deep-19M", "lora", "bf16", 1, 4096, checkpointing=True, changes={"training": {
        "tiled_mlp": True, "activation_offload": True}}),
    Case("llama-deep-19M", "lora", "bf16", 1, 4096, changes=TILED),
    Case("llama-deep-19M", "qlora", "bf16", 1, 4096, checkpointing=True, changes={"training": {
        "embedding_on_cpu": True, "output_layer_on_cpu": True, "activation_offload": True}}),
    Case("llama-deep-19M", "full", "fp32", 1, 2048, checkpointing=True, changes=OFFLOAD),
]

# Preference steps (issue 27): pairs of sequences in one forward, the reference with the adapter off, a frozen copy
# (full fine-tuning) or precomputed; the per-token log-probabilities a chunk at a time (``--only dpo`` and so on).
PRECOMPUTED = {"preference": {"reference": "precomputed"}}
PREFERENCE_CASES = [
    Case("llama-7M", "lora", "bf16", 2, 256, objective="dpo", quick=True),
    Case("llama-7M", "lora", "bf16", 2, 256, checkpointing=True, objective="dpo"),
    Case("llama-7M", "full", "fp32", 2, 128, objective="dpo", quick=True),
    Case("llama-7M", "full", "fp32", 2, 128, objective="dpo", changes=PRECOMPUTED),
    Case("llama-7M", "qlora", "bf16", 2, 256, objective="dpo"),
    Case("llama-7M", "lora", "bf16", 2, 256, objective="orpo"),
    Case("llama-55M", "lora", "bf16", 1, 256, objective="simpo"),
    Case("llama-7M", "lora", "bf16", 4, 256, objective="kto"),
    Case("llama-7M", "full", "fp32", 4, 128, objective="kto", changes=PRECOMPUTED),
    Case("llama-55M", "lora", "bf16", 2, 256, checkpointing=True, accumulation=2, objective="dpo"),
    Case("llama-7M", "lora", "bf16", 2, 256, objective="dpo", derived=True),
    Case("llama-7M", "full", "fp32", 2, 128, objective="dpo", derived=True),
    Case("gpt2-17M", "lora", "bf16", 2, 256, checkpointing=True, objective="orpo", derived=True),
]

# The derived estimate: traced on 2- and 3-block copies at other batch sizes and lengths, then scaled. On
# described families too, so that its error is measured where the description's is known.
DERIVED_CASES = [
    Case("llama-7M", "lora", "bf16", 4, 256, derived=True, quick=True),
    Case("llama-55M", "lora", "bf16", 4, 256, checkpointing=True, derived=True, quick=True),
    Case("llama-7M", "full", "fp32", 4, 128, derived=True),
    Case("llama-55M", "qlora", "bf16", 2, 256, checkpointing=True, optimizer="adamw_8bit", derived=True),
    Case("llama-7M", "lora", "bf16", 2, 256, changes={"model": {"attn_implementation": "eager"}}, derived=True),
    Case("llama-7M", "lora", "bf16", 4, 256, accumulation=2, derived=True),
    Case("qwen2-16M", "full", "fp32", 2, 256, optimizer="sgd", derived=True),
    Case("mistral-26M", "lora", "bf16", 2, 512, checkpointing=True, derived=True),
    Case("gpt2-17M", "lora", "bf16", 4, 256, derived=True),
    Case("gpt2-17M", "full", "fp32", 2, 256, checkpointing=True, derived=True),
    Case("gpt2-12M-v2k", "lora", "bf16", 2, 256, checkpointing=True, derived=True),
    Case("neox-36M", "lora", "bf16", 4, 256, derived=True),
    Case("phi-36M", "full", "fp32", 2, 128, derived=True),
    Case("gemma-14M", "lora", "bf16", 4, 256, derived=True),
    Case("stablelm-20M", "lora", "bf16", 4, 256, derived=True, quick=True),
    Case("stablelm-20M", "full", "bf16", 2, 512, checkpointing=True, derived=True),
    Case("starcoder2-24M", "lora", "fp32", 2, 384, derived=True),
    Case("starcoder2-24M", "qlora", "bf16", 4, 256, checkpointing=True, derived=True),
    # a mixture of experts: all experts' weights, the routed tokens, LoRA on attention and (all-linear) the experts
    Case("qwen3moe-16M", "lora", "bf16", 4, 256, derived=True),
    Case("qwen3moe-16M", "qlora", "bf16", 2, 256, checkpointing=True, derived=True),
    Case("qwen3moe-16M", "lora", "bf16", 2, 256, changes={"lora": {"target_modules": ["q_proj", "v_proj"]}},
         derived=True),
]

# Toggles after the pick: a trace of the first settings (with its neighbours, as when a model is picked)
# estimates each row's own settings with no new trace: LoRA's rank, targets and dropout recounted from the block
# record, precision, checkpointing and 4/8-bit loading from the traced regimes.
_PICKED = {"training": {"precision": "bf16", "gradient_checkpointing": False},
           "lora": {"r": 16, "dropout": 0.05, "target_modules": ("all-linear",)}}
TOGGLE_CASES = [
    Case("stablelm-20M", "lora", "bf16", 4, 256, changes={"lora": {"r": 64}}, derived=True, traced_as=_PICKED,
         quick=True),
    Case("stablelm-20M", "lora", "bf16", 4, 256, changes={"lora": {"target_modules": ["q_proj", "v_proj"]}},
         derived=True, traced_as=_PICKED),
    Case("stablelm-20M", "lora", "bf16", 4, 256, changes={"lora": {"dropout": 0.0}}, derived=True, traced_as=_PICKED),
    Case("stablelm-20M", "lora", "fp32", 2, 384, derived=True, traced_as=_PICKED),
    Case("stablelm-20M", "lora", "bf16", 4, 256, checkpointing=True, derived=True, traced_as=_PICKED),
    Case("stablelm-20M", "qlora", "bf16", 4, 256, derived=True, traced_as=_PICKED),
    Case("stablelm-20M", "qlora", "bf16", 2, 512, checkpointing=True, changes={"lora": {"r": 8, "dropout": 0.0}},
         derived=True, traced_as=_PICKED),
    Case("stablelm-20M", "lora", "fp32", 4, 256, checkpointing=True, changes={"lora": {"r": 32}}, derived=True,
         traced_as=_PICKED),
    Case("llama-55M", "lora", "bf16", 2, 256, checkpointing=True,
         changes={"lora": {"r": 64, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}}, derived=True,
         traced_as=_PICKED),
    Case("llama-55M", "qlora", "bf16", 2, 256, changes={"quantization": {"load_in": "8bit"}}, derived=True,
         traced_as=_PICKED),
]


@dataclass
class Row:
    case: Case
    parameters: int
    measured: int
    analytic: int
    simulated: int | None
    seconds: float
    reserved: int = 0
    nvml_used: int = 0
    analytic_total: int = 0  # with CUDA context and allocator margin
    measured_host: int = 0  # host RAM beside the device's: the embedding kept there, offloaded activations
    analytic_host: int = 0
    measured_forward: int = 0  # the forward phase's peak (to the end of the loss)
    analytic_forward: int = 0

    @property
    def analytic_error(self) -> float:
        return self.analytic / self.measured - 1

    @property
    def simulated_error(self) -> float | None:
        return None if self.simulated is None else self.simulated / self.measured - 1

    @property
    def forward_error(self) -> float:
        return self.analytic_forward / self.measured_forward - 1

    @property
    def host_error(self) -> float | None:
        return self.analytic_host / self.measured_host - 1 if self.measured_host else None


def model_folder(name: str, cache: Path) -> Path:
    from model_factory import make_tiny_model

    folder = cache / name
    if not (folder / "config.json").is_file():
        family, overrides = MODELS[name]
        make_tiny_model(family, folder, **overrides)
    return folder


def run_case(case: Case, cache: Path, device, simulate: bool, nvml_baseline: int = 0) -> Row:
    import torch

    from studio.core.memory.derived import derived_estimate
    from studio.core.memory.estimate import estimate
    from studio.train.measure.simulate import measure_step

    started = time.perf_counter()
    folder = model_folder(case.model, cache)
    config = case.run_config(folder)
    model_config = json.loads((folder / "config.json").read_text())
    on_cuda = device.type == "cuda"
    analytic = derived_estimate(traced(case, config, folder), config, device.type) if case.derived \
        else estimate(model_config, config, device_type=device.type, images=())  # text rows: no images
    simulated = simulated_peak(config) if simulate else None
    measured = measure_step(config, device)
    # this process's context and the allocator's cache, still reserved after the step
    nvml_used = _nvml_used() - nvml_baseline if on_cuda else 0
    overheads = analytic.parts["cuda_context"] + analytic.parts["allocator_margin"]
    host = next((d.total_bytes for d in analytic.devices if d.device == "host"), 0)
    row = Row(case, parameters=analytic.parameters, measured=measured.peak_bytes,
              analytic=analytic.peak_bytes - overheads, simulated=simulated, seconds=time.perf_counter() - started,
              reserved=measured.peak_reserved_bytes, nvml_used=nvml_used, analytic_total=analytic.peak_bytes,
              measured_host=measured.host_peak_bytes, analytic_host=host,
              measured_forward=measured.phase_peaks.get("forward", 0),
              analytic_forward=analytic.devices[0].phases["forward"] - overheads)
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return row


_TRACES: dict = {}  # a toggle row's trace, by model and traced settings: rows that share it trace once


def traced(case: Case, config, folder: Path):
    """The derived rows' trace: of the row's own settings alone, or (``traced_as``) of other settings and their
    one-toggle neighbours, as when a model is picked in the window."""
    from studio.core.memory.derived import Trace
    from studio.train.measure.trace import trace_model

    if not case.traced_as:
        return Trace(trace_model(config, neighbours=False))
    picked = case.run_config(folder).replace(method="lora", quantization={"load_in": "auto"}, **case.traced_as)
    key = (case.model, json.dumps(case.traced_as, sort_keys=True))
    if key not in _TRACES:
        _TRACES[key] = Trace(trace_model(picked))
    return _TRACES[key]


def simulated_peak(config) -> int | None:
    """The fake-tensor step's peak, or None (a table's "n/a") where the method cannot run on fake tensors."""
    from studio.train.measure.simulate import simulate_step

    try:
        return simulate_step(config).peak_bytes
    except Exception as exc:  # e.g. peft's LoHa reads a tensor's value, which fake tensors do not have
        print(f"  simulation not possible: {type(exc).__name__}", file=sys.stderr)
        return None


def _nvml_used() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:  # no NVML (pynvml.NVMLError) or no package: report 0
        return 0


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2%}"


def table(rows: list[Row], on_cuda: bool) -> str:
    head = ["case", "params", "measured MiB", "analytic MiB", "error", "simulated MiB", "error",
            "forward measured MiB", "forward analytic MiB", "error"]
    if on_cuda:
        head += ["reserved MiB", "nvml used MiB", "analytic total MiB"]
    hosts = any(r.analytic_host for r in rows)
    if hosts:
        head += ["host measured MiB", "host analytic MiB", "error"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r.case.name, f"{r.parameters / 1e6:.1f}M", f"{r.measured / MIB:.1f}", f"{r.analytic / MIB:.1f}",
                 _percent(r.analytic_error), "n/a" if r.simulated is None else f"{r.simulated / MIB:.1f}",
                 _percent(r.simulated_error), f"{r.measured_forward / MIB:.1f}", f"{r.analytic_forward / MIB:.1f}",
                 _percent(r.forward_error)]
        if on_cuda:
            cells += [f"{r.reserved / MIB:.1f}", f"{r.nvml_used / MIB:.1f}", f"{r.analytic_total / MIB:.1f}"]
        if hosts:
            cells += [f"{r.measured_host / MIB:.1f}" if r.measured_host else "n/a", f"{r.analytic_host / MIB:.1f}",
                      _percent(r.host_error)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    lines = []
    for label, errors in (("analytic (described)", [r.analytic_error for r in rows if not r.case.derived]),
                          ("analytic (derived)", [r.analytic_error for r in rows if r.case.derived]),
                          ("analytic (derived, toggled after the trace)",
                           [r.analytic_error for r in rows if r.case.traced_as]),
                          ("simulated", [r.simulated_error for r in rows if r.simulated is not None]),
                          ("the forward pass's peak (described)", [r.forward_error for r in rows if not r.case.derived]),
                          ("host RAM (apart from the device's: weights kept there, offloaded activations)",
                           [r.host_error for r in rows if r.host_error is not None])):
        if errors:
            absolute = [abs(e) for e in errors]
            lines.append(f"{label}: median absolute error {statistics.median(absolute):.2%}, "
                         f"worst {max(absolute):.2%} over {len(errors)} configurations")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the rows marked quick")
    parser.add_argument("--only", help="only rows whose name contains this text (several: comma-separated)")
    parser.add_argument("--cpu", action="store_true", help="measure on the CPU even when a GPU is present")
    parser.add_argument("--no-simulate", action="store_true", help="skip the fake-tensor simulation")
    parser.add_argument("--models", type=Path, help="folder for the generated models (default: a temporary one)")
    parser.add_argument("--markdown", type=Path, help="also write the table and summary to this file")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    wanted = args.only.split(",") if args.only else []
    cases = [c for c in CASES + OFFLOAD_CASES + TILED_CASES + FORWARD_END_CASES + PREFERENCE_CASES + DERIVED_CASES
             + TOGGLE_CASES
             if (c.quick or not args.quick) and (not wanted or any(w in c.name for w in wanted))]
    cache = args.models or Path(tempfile.mkdtemp(prefix="studio-memory-models-"))
    print(f"{len(cases)} configurations on {device}; models in {cache}", file=sys.stderr)
    nvml_baseline = _nvml_used() if device.type == "cuda" else 0  # other processes, before our CUDA context exists
    rows = []
    for case in cases:
        row = run_case(case, cache, device, simulate=not args.no_simulate, nvml_baseline=nvml_baseline)
        rows.append(row)
        print(f"{case.name}: measured {row.measured / MIB:.1f} MiB, analytic {_percent(row.analytic_error)}, "
              f"simulated {_percent(row.simulated_error)} ({row.seconds:.0f} s)", file=sys.stderr)
    text = table(rows, device.type == "cuda") + "\n\n" + summary(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
