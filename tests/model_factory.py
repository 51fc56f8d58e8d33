"""Tiny random-weight causal LMs of every architecture family the studio supports.

``make_tiny_model("llama", folder)`` writes ``folder/config.json`` and random
weights (safetensors) that ``AutoModelForCausalLM.from_pretrained(folder)``
loads; keyword arguments override config fields (``hidden_size=128``). No
network and no tokenizer: tests that need text bring their own tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES = ("llama", "qwen2", "mistral", "gpt2", "gpt_neox", "phi", "gemma", "qwen3", "smollm3", "granite", "olmo2",
            "gemma2", "gemma3_text", "phi3", "qwen3_moe", "gemma3")

_LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512}

# Small enough to build in milliseconds; every family keeps its own field names.
TINY_CONFIGS: dict[str, dict] = {
    "llama": {**_LLAMA_LIKE},
    "qwen2": {**_LLAMA_LIKE},
    "mistral": {**_LLAMA_LIKE, "sliding_window": None},
    "gemma": {**_LLAMA_LIKE, "head_dim": 32},
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 512},
    "gpt_neox": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "max_position_embeddings": 512},
    "qwen3": {**_LLAMA_LIKE, "head_dim": 16},
    "smollm3": {**_LLAMA_LIKE, "no_rope_layer_interval": 2},  # the second layer has no rotary
    "granite": {**_LLAMA_LIKE, "embedding_multiplier": 4.0, "residual_multiplier": 0.5, "attention_multiplier": 0.0625,
                "logits_scaling": 2.0},
    "olmo2": {**_LLAMA_LIKE},
    # windows shorter than the test examples, so that packing must keep them
    "gemma2": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 8},
    "gemma3_text": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2},
    "phi3": {**_LLAMA_LIKE, "partial_rotary_factor": 0.5, "resid_pdrop": 0.1},
    # a multimodal checkpoint: the causal-LM class loads the vision tower too (text training never runs it)
    "gemma3": {"text_config": {**_LLAMA_LIKE, "head_dim": 16, "sliding_window": 8, "sliding_window_pattern": 2,
                               "vocab_size": 512},
               "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                                 "vision_use_head": False},
               "mm_tokens_per_image": 4},
    "qwen3_moe": {**_LLAMA_LIKE, "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2},
    "phi": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512},
}
# Families the estimate does not describe: it derives theirs from a traced step (studio.core.memory.derived).
UNDESCRIBED = ("stablelm", "starcoder2")
TINY_CONFIGS.update({
    "stablelm": {**_LLAMA_LIKE},
    "starcoder2": {**_LLAMA_LIKE, "intermediate_size": 256},
})
_MULTIMODAL_FIELDS = {"model_type", "text_config", "vision_config", "mm_tokens_per_image", "image_token_index",
                      "boi_token_index", "eoi_token_index"}
_COMMON = {"vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def tiny_config(family: str, **overrides) -> dict:
    """The config.json fields of a tiny model (plain data; no transformers needed)."""
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(TINY_CONFIGS)}")
    fields = {"model_type": family, **_COMMON, **TINY_CONFIGS[family], **overrides}
    if "text_config" not in fields:
        return fields
    # a multimodal checkpoint: the sizes (and the overrides) belong to its text model
    top = {k: v for k, v in fields.items() if k in _MULTIMODAL_FIELDS}
    text = {**fields["text_config"], **{k: v for k, v in fields.items() if k not in top}}
    vocab = text["vocab_size"]  # the image tokens at the top of the vocabulary, as in real checkpoints
    marks = {"boi_token_index": vocab - 3, "eoi_token_index": vocab - 2, "image_token_index": vocab - 1}
    return {**marks, **top, "text_config": text}


def make_tiny_model(family: str, folder: Path, weights: bool = True, seed: int = 0, **overrides) -> Path:
    """Write a tiny random model of ``family`` to ``folder``; ``weights=False`` writes config.json only."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fields = tiny_config(family, **overrides)
    if not weights:
        (folder / "config.json").write_text(json.dumps(fields, indent=2), encoding="utf-8")
        return folder
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return folder
