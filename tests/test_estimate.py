"""The analytic memory estimate (studio.core.memory.estimate, studio.core.model.info): pure Python, fast."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_factory import FAMILIES, tiny_config
from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.derived import TraceNeededError
from studio.core.memory.estimate import ScaleOut, estimate, verdict_for
from studio.core.memory.parts import PARTS
from studio.core.memory.parts.states import model_states, quantized_weight_bytes
from studio.core.memory.regime import regime_for
from studio.core.memory.sharding import zero_model_states
from studio.core.model.info import UnknownArchitectureError, load_model_config, model_shape
from studio.core.presets import DEMO_MODEL, demo_config

# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B), the fields that matter, written out: no download.
LLAMA_31_8B = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
# Hub configs written by older transformers, in each family's own field names.
GPT2_SMALL = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024, "vocab_size": 50257}
PYTHIA_160M = {"model_type": "gpt_neox", "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "vocab_size": 50304, "max_position_embeddings": 2048, "rotary_pct": 0.25,
               "tie_word_embeddings": False, "use_parallel_residual": True}
QWEN25_05B = {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
              "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768}
GEMMA_2B = {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384, "num_hidden_layers": 18,
            "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 256000}
PHI_2 = {"model_type": "phi", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 32,
         "num_attention_heads": 32, "vocab_size": 51200, "partial_rotary_factor": 0.4, "resid_pdrop": 0.1}
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000}
# Current families' published configs (Qwen/Qwen3-0.6B and -8B, Qwen/Qwen3-30B-A3B, google/gemma-2-2b,
# google/gemma-3-1b-pt and -4b-pt (its vision tower loads too),
# microsoft/Phi-4-mini-instruct, HuggingFaceTB/SmolLM3-3B, allenai/OLMo-2-0425-1B, ibm-granite/granite-3.3-2b-base,
# meta-llama/Llama-3.2-1B with its Llama 3 rope scaling), the fields that matter, written out.
QWEN3_06B = {"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "tie_word_embeddings": True, "max_position_embeddings": 40960, "rope_theta": 1000000}
QWEN3_8B = {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
            "tie_word_embeddings": False, "max_position_embeddings": 40960}
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
GEMMA2_2B = {"model_type": "gemma2", "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
             "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 256000,
             "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096,
             "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"}
GEMMA3_1B = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
             "sliding_window": 512, "query_pre_attn_scalar": 256, "rope_theta": 1000000, "rope_local_base_freq": 10000,
             "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh"}
GEMMA3_4B = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256,
             "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                             "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
                             "head_dim": 256, "sliding_window": 1024,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
             "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                               "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
                               "vision_use_head": False}}
PHI4_MINI = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
             "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064, "tie_word_embeddings": True,
             "partial_rotary_factor": 0.75, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0}
SMOLLM3_3B = {"model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
              "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 128256, "tie_word_embeddings": True,
              "max_position_embeddings": 65536, "no_rope_layer_interval": 4}
OLMO2_1B = {"model_type": "olmo2", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
            "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 100352, "tie_word_embeddings": False,
            "max_position_embeddings": 4096, "rope_theta": 500000}
GRANITE_33_2B = {"model_type": "granite", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 40,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 49159, "tie_word_embeddings": True,
                 "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.015625,
                 "logits_scaling": 8.0, "max_position_embeddings": 131072}
LLAMA_32_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
               "tie_word_embeddings": True, "max_position_embeddings": 131072, "rope_theta": 500000.0,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}

# Published parameter counts, from the configs alone (the newer ones also checked against transformers' own
# models built on the meta device).
ANCHORS = [(LLAMA_31_8B, 8_030_261_248), (GPT2_SMALL, 124_439_808), (PYTHIA_160M, 162_322_944),
           (QWEN25_05B, 494_032_768), (GEMMA_2B, 2_506_172_416), (PHI_2, 2_779_683_840), (MISTRAL_7B, 7_241_732_096),
           (QWEN3_06B, 596_049_920), (QWEN3_8B, 8_190_735_360), (QWEN3_30B_A3B, 30_532_122_624),
           (GEMMA2_2B, 2_614_341_888),
           (GEMMA3_1B, 999_885_952), (GEMMA3_4B, 4_300_079_472), (PHI4_MINI, 3_836_021_760), (SMOLLM3_3B, 3_075_098_624),
           (OLMO2_1B, 1_484_916_736), (GRANITE_33_2B, 2_533_539_840), (LLAMA_32_1B, 1_235_814_400)]


def run(**sections) -> RunConfig:
    config = RunConfig()
    return config.replace(**sections) if sections else config


# ---------------------------------------------------------------- the model from its config


@pytest.mark.parametrize("model_config, count", ANCHORS, ids=lambda v: v.get("model_type") if isinstance(v, dict) else "")
def test_parameter_counts_match_the_published_ones(model_config, count):
    assert model_shape(model_config).parameter_count == count


def test_llama_31_8b_anchor():
    shape = model_shape(LLAMA_31_8B)
    assert round(shape.parameter_count / 1e9, 2) == 8.03
    quantized = shape.layers * sum(layer.weight_elements for layer in shape.block_linears if layer.is_module)
    assert round(quantized / 1e9, 2) == 6.98  # what bitsandbytes quantizes (experts and routers are no nn.Linear)


def test_parameter_names_follow_transformers():
    names = {p.name for p in model_shape(GPT2_SMALL).parameters()}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.11.attn.c_attn.weight",
            "transformer.h.0.mlp.c_proj.bias", "transformer.ln_f.bias"} <= names
    assert "lm_head.weight" not in names  # tied to wte
    neox = {p.name for p in model_shape(PYTHIA_160M).parameters()}
    assert {"gpt_neox.embed_in.weight", "gpt_neox.layers.3.attention.query_key_value.weight", "lm_head.weight"} <= neox


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_is_named_and_shaped_as_transformers_builds_it(family):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = tiny_config(family)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
    built = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert {p.name: p.shape for p in model_shape(fields).parameters()} == built


def test_soft_capped_gemma2_runs_eager_attention_and_the_full_loss():
    shape = model_shape(GEMMA2_2B)
    config = run(training={"chunked_loss": True})
    regime = regime_for(config, shape)
    assert (regime.attention, regime.loss_impl) == ("eager", "full_fp32")
    result = estimate(GEMMA2_2B, config)
    assert any("soft-capped logits" in note for note in result.notes)
    uncapped = estimate({**GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None}, config)
    assert result.peak_bytes > uncapped.peak_bytes  # tanh keeps the capped scores and logits for backward
    unwritten = {k: v for k, v in GEMMA2_2B.items() if not k.endswith("softcapping")}
    assert estimate(unwritten, config).peak_bytes == result.peak_bytes  # transformers' defaults: capped


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
                                    "granite"])
def test_fields_a_config_omits_take_transformers_defaults(family):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from studio.train.objectives.next_token import lean_output_layer

    sizes = {"model_type": family, "vocab_size": 200_000, "hidden_size": 256, "num_attention_heads": 4,
             "num_hidden_layers": 2, "intermediate_size": 512}  # everything else left to transformers
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**sizes))
    shape = model_shape(sizes)
    assert shape.parameter_count == sum(p.numel() for p in model.parameters())
    assert shape.transformed_logits == (lean_output_layer(model) is None)


def test_dense_blocks_between_experts_are_reported_not_guessed():
    with pytest.raises(StudioError, match="mlp_only_layers"):
        model_shape({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]})


def test_unknown_architecture_is_traced_not_guessed(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_TRACE_CACHE", str(tmp_path))
    with pytest.raises(UnknownArchitectureError, match="falcon"):
        model_shape({"model_type": "falcon", "hidden_size": 4544})
    with pytest.raises(TraceNeededError, match="falcon"):  # studio.core.memory.derived: tests/test_derived.py
        estimate({"model_type": "falcon", "hidden_size": 4544}, run())
    with pytest.raises(StudioError, match="no model_type"):
        estimate({"hidden_size": 64}, run())


def test_missing_size_is_reported():
    config = dict(LLAMA_31_8B)
    del config["num_hidden_layers"]
    with pytest.raises(StudioError, match="num_hidden_layers"):
        model_shape(config)


def test_unknown_lora_target_is_reported():
    with pytest.raises(StudioError, match="c_attn"):
        estimate(LLAMA_31_8B, run(lora={"target_modules": ("q_proj", "c_attn")}))
    adapted = regime_for(run(lora={"target_modules": ("q_proj", "v_proj")}), model_shape(LLAMA_31_8B)).adapted
    assert [layer.name for layer in adapted] == ["q_proj", "v_proj"]


def test_config_is_read_from_a_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    assert load_model_config(str(tmp_path)) == LLAMA_31_8B
    with pytest.raises(StudioError, match="does not exist"):
        load_model_config(str(tmp_path / "missing") + "/")


# ---------------------------------------------------------------- bytes per parameter


def test_full_fine_tuning_model_states_are_16_bytes_per_parameter():
    config = run(method="full", training={"precision": "fp32"})
    shape = model_shape(LLAMA_31_8B)
    states = model_states(shape, regime_for(config, shape))
    psi = shape.parameter_count
    assert states.trainable_parameters == psi
    assert states.gradients == 4 * psi
    assert states.weights == pytest.approx(4 * psi, abs=4096)  # and the rotary buffers
    assert states.optimizer_state == pytest.approx(8 * psi, rel=1e-6)  # plus a step counter per tensor


def test_lora_adapters_are_fp32():
    shape = model_shape(LLAMA_31_8B)
    regime = regime_for(run(lora={"r": 16}), shape)
    per_layer = sum(16 * (layer.in_features + layer.out_features) for layer in shape.block_linears)
    states = model_states(shape, regime)
    assert states.trainable_parameters == 32 * per_layer
    assert states.adapters == states.gradients == 4 * states.trainable_parameters


@pytest.mark.parametrize("double_quant, bytes_per_parameter", [(True, 0.516), (False, 0.5625)])
def test_four_bit_weights_match_the_qlora_paper(double_quant, bytes_per_parameter):
    shape = model_shape(LLAMA_31_8B)
    regime = regime_for(run(method="qlora", quantization={"double_quant": double_quant}), shape)
    layer = shape.linear("mlp.down_proj")
    assert quantized_weight_bytes(layer, regime) / layer.weight_elements == pytest.approx(bytes_per_parameter, abs=2e-3)


def test_qlora_upcasts_what_it_does_not_quantize():
    shape = model_shape(LLAMA_31_8B)
    lora = model_states(shape, regime_for(run(), shape)).weights
    qlora = model_states(shape, regime_for(run(method="qlora"), shape)).weights
    embeddings_and_head = 2 * shape.vocab * shape.hidden
    assert qlora > 4 * embeddings_and_head  # in fp32 after prepare_model_for_kbit_training
    assert qlora < lora / 2


def test_eight_bit_adam_keeps_small_tensors_in_32_bits():
    shape = model_shape(tiny_config("llama", hidden_size=64))  # LoRA matrices of 16 x 64 < 4096 elements
    small = model_states(shape, regime_for(run(training={"optimizer": "adamw_8bit"}), shape))
    assert small.optimizer_state >= 8 * small.trainable_parameters
    big = model_states(model_shape(LLAMA_31_8B), regime_for(run(training={"optimizer": "adamw_8bit"}), model_shape(LLAMA_31_8B)))
    assert big.optimizer_state == pytest.approx(2 * big.trainable_parameters, rel=0.05)


# ---------------------------------------------------------------- the estimate


CONFIGS = [
    run(),
    run(method="full", training={"gradient_checkpointing": True}),
    run(method="qlora", training={"optimizer": "adamw_8bit", "gradient_accumulation_steps": 4}),
    run(method="full", training={"precision": "fp32", "optimizer": "sgd"}),
    run(model={"attn_implementation": "eager"}, lora={"dropout": 0.0, "use_dora": True}),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("config", CONFIGS, ids=range(len(CONFIGS)))
@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_parts_sum_to_the_total(family, config, device_type):
    result = estimate(tiny_config(family), config, device_type)
    for device in result.devices:
        assert set(device.parts) == set(PARTS)
        assert all(value >= 0 for value in device.parts.values())
        assert sum(device.parts.values()) == device.total_bytes
        assert device.phases[device.peak_phase] == device.total_bytes == max(device.phases.values())
    assert (result.parts["cuda_context"] > 0) == (device_type == "cuda")


def test_json_has_devices_parts_totals_phase_and_verdict():
    out = estimate(LLAMA_31_8B, run()).to_json(gpu_bytes=24 * 1024**3)
    assert out["peak_phase"] in ("forward", "backward", "optimizer")
    device = out["devices"][0]
    assert sum(device["parts"].values()) == device["total_bytes"]
    assert out["verdict"]["status"] in ("fits", "tight", "does not fit")
    assert "verdict" not in estimate(LLAMA_31_8B, run()).to_json()
    json.dumps(out)


def test_verdict_bands():
    assert verdict_for(80, 100).status == "fits"
    assert verdict_for(95, 100).status == "tight"
    assert verdict_for(101, 100).status == "does not fit"


def test_logits_of_a_large_vocabulary_are_itemized():
    result = estimate(LLAMA_31_8B, run(training={"micro_batch_size": 4, "gradient_checkpointing": True,
                                                 "chunked_loss": False}, data={"max_length": 2048}))
    # three fp32 copies of the logits at the loss's backward: 12 bytes x 4 x 2047 positions x 128256
    assert result.parts["logits_loss"] >= 12 * 4 * 2047 * 128256
    assert result.peak_phase == "forward"


def test_the_chunked_loss_needs_a_fraction_of_the_logits_memory():
    config = run(training={"micro_batch_size": 4, "gradient_checkpointing": True}, data={"max_length": 2048})
    full = estimate(LLAMA_31_8B, config.replace(training={"chunked_loss": False}))
    chunked = estimate(LLAMA_31_8B, config)
    assert chunked.parts["logits_loss"] * 10 < full.parts["logits_loss"]
    assert chunked.peak_bytes < full.peak_bytes
    assert any("lean loss" in note for note in chunked.notes)


# ---------------------------------------------------------------- ZeRO and several GPUs


@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
def test_zero_model_states_per_gpu_follow_the_zero_paper(gpus):
    """ZeRO paper, mixed-precision Adam (K = 12): 4Ψ+KΨ/N, 2Ψ+(2+K)Ψ/N, (4+K)Ψ/N."""
    shape = model_shape(LLAMA_31_8B)
    states = model_states(shape, regime_for(run(method="full"), shape))
    psi = states.trainable_parameters
    expected = {1: 4 * psi + 12 * psi / gpus, 2: 2 * psi + 14 * psi / gpus, 3: 16 * psi / gpus}
    for stage, bytes_per_gpu in expected.items():
        shares = zero_model_states(states, ScaleOut(gpus, stage))
        total = shares["weights"] + shares["gradients"] + shares["master_weights"] + shares["optimizer_state"]
        assert total == pytest.approx(bytes_per_gpu, rel=1e-6)


def test_offload_moves_optimizer_state_to_host_ram():
    result = estimate(LLAMA_31_8B, run(method="full"), scale_out=ScaleOut(4, 2, offload_optimizer=True))
    gpus = [d for d in result.devices if d.device.startswith("cuda")]
    host = next(d for d in result.devices if d.device == "host")
    assert len(gpus) == 4 and all(d.parts["optimizer_state"] == 0 for d in gpus)
    psi = result.trainable_parameters
    assert host.total_bytes == pytest.approx(16 * psi, rel=1e-6)  # fp32 master, Adam moments, fp32 gradients


def test_more_gpus_never_need_more_per_gpu_under_zero():
    config = run(method="full", training={"gradient_checkpointing": True})
    peaks = [estimate(LLAMA_31_8B, config, scale_out=ScaleOut(n, 3)).peak_bytes for n in (2, 4, 8, 16)]
    assert peaks == sorted(peaks, reverse=True)


def test_invalid_scale_out_is_refused():
    with pytest.raises(StudioError):
        ScaleOut(2, 1, offload_params=True)
    with pytest.raises(StudioError):
        ScaleOut(0)


# ---------------------------------------------------------------- monotonicity (hypothesis)


configs = st.builds(
    lambda method, precision, checkpointing, optimizer, dropout: run(
        method=method, training={"precision": precision, "gradient_checkpointing": checkpointing, "optimizer": optimizer},
        lora={"dropout": dropout}),
    st.sampled_from(["full", "lora", "qlora"]), st.sampled_from(["fp32", "bf16"]), st.booleans(),
    st.sampled_from(["adamw", "adamw_8bit", "sgd", "adafactor"]), st.sampled_from([0.0, 0.05]))
models = st.builds(lambda family, layers: tiny_config(family, **_layers(family, layers)),
                   st.sampled_from(FAMILIES), st.integers(2, 6))


def _layers(family: str, layers: int) -> dict:
    return {"n_layer": layers} if family == "gpt2" else {"num_hidden_layers": layers}


def _peak(model, config, batch, length, device_type) -> int:
    return estimate(model, config.replace(training={"micro_batch_size": batch}, data={"max_length": length}),
                    device_type).peak_bytes


@settings(max_examples=60, deadline=None)
@given(models, configs, st.integers(1, 8), st.integers(8, 512), st.sampled_from(["cuda", "cpu"]))
def test_more_batch_or_longer_sequences_never_need_less(model, config, batch, length, device_type):
    peak = _peak(model, config, batch, length, device_type)
    assert _peak(model, config, batch + 1, length, device_type) >= peak
    assert _peak(model, config, batch, length + 16, device_type) >= peak


@settings(max_examples=60, deadline=None)
@given(models, configs, st.integers(1, 8), st.integers(64, 512), st.sampled_from(["cuda", "cpu"]))
def test_checkpointing_never_needs_more(model, config, batch, length, device_type):
    # (At toy sizes, a few tokens, LoRA with checkpointing can need a few KB more, and really does: its
    # enable_input_require_grads makes the first block compute gradients it otherwise would not.)
    on = config.replace(training={"gradient_checkpointing": True})
    off = config.replace(training={"gradient_checkpointing": False})
    assert _peak(model, on, batch, length, device_type) <= _peak(model, off, batch, length, device_type)


# ---------------------------------------------------------------- speed, layering, CLI


def test_core_modules_import_no_ml_stack():
    code = ("import sys, studio.core.memory.estimate, studio.core.memory.fit, studio.core.model.info, studio.cli_memory; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'PySide6') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _cli(argv: list[str]) -> argparse.Namespace:
    from studio.cli_memory import add_estimate, add_fit

    parser = argparse.ArgumentParser(prog="studio")
    commands = parser.add_subparsers(dest="command")
    add_estimate(commands)
    add_fit(commands)
    return parser.parse_args(argv)


def _write_run(tmp_path, model_config: dict, **training) -> str:
    from studio.core.config import save_config

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model_config))
    config = run(model={"name_or_path": str(folder)}, data={"max_length": 1024}, training=training)
    path = tmp_path / "run.yaml"
    save_config(config, path)
    return str(path)


def test_estimate_command_prints_the_table_and_verdict(tmp_path, capsys):
    args = _cli(["estimate", _write_run(tmp_path, LLAMA_31_8B), "--gpu-memory", "24GiB"])
    assert args.handler(args) == 0
    out = capsys.readouterr().out
    assert "\n  weights " in out and "\n  total " in out and "on 24.00 GiB:" in out
    assert "kind: described (the model's family, by hand; measured: median" in out


def test_estimate_command_json(tmp_path, capsys):
    args = _cli(["estimate", _write_run(tmp_path, LLAMA_31_8B), "--json", "--gpu-memory", "80GB"])
    args.handler(args)
    out = json.loads(capsys.readouterr().out)
    assert out["verdict"]["gpu_bytes"] == 80 * 10**9
    assert sum(out["devices"][0]["parts"].values()) == out["devices"][0]["total_bytes"]


@pytest.mark.parametrize("text, size", [("24GiB", 24 * 1024**3), ("24GB", 24 * 10**9), ("16000MiB", 16000 * 1024**2),
                                        ("24", 24 * 1024**3), ("7.5 GiB", int(7.5 * 1024**3))])
def test_memory_sizes_are_parsed(text, size):
    from studio.core.sizes import parse_size

    assert parse_size(text) == size


def test_bad_memory_size_is_a_usage_error():
    from studio.core.sizes import parse_size

    with pytest.raises(StudioError, match="24 gigs"):
        parse_size("24 gigs")
    assert math.isfinite(parse_size("1b"))


# ---------------------------------------------------------------- PEFT methods and QAT

_TINY = json.loads((DEMO_MODEL / "config.json").read_text())
_GQA = {**_TINY, "num_key_value_heads": 2, "hidden_size": 96, "intermediate_size": 264, "head_dim": 24}


@pytest.mark.parametrize("model_config", [_TINY, _GQA], ids=["tiny", "gqa"])
@pytest.mark.parametrize("method", ["lora", "adalora", "ia3", "loha", "lokr", "prefix_tuning", "prompt_tuning"])
@pytest.mark.parametrize("rank", [8, 64])
def test_trainable_parameters_agree_exactly_with_peft(model_config, method, rank):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from studio.train.model.build import attach_adapter, count_parameters

    config = demo_config().replace(method=method, lora={"r": rank}, peft={"adalora_target_r": 4})
    model = AutoModelForCausalLM.from_config(LlamaConfig(**model_config))
    real = count_parameters(attach_adapter(model, config, total_steps=100))[0]
    assert estimate(model_config, config, "cpu").trainable_parameters == real


@pytest.mark.parametrize("method, precision", [("full", "fp32"), ("lora", "bf16"), ("lora", "fp32")])
@pytest.mark.parametrize("activations", ["none", "int8"])
def test_qat_costs_more_than_no_qat(method, precision, activations):
    config = demo_config().replace(method=method, training={"precision": precision})
    qat = config.replace(qat={"weights": "int4", "activations": activations})
    plain, fake_quantized = (estimate(_TINY, c, "cpu") for c in (config, qat))
    # the fake-quantized weight copies (and inputs) live through forward and backward
    assert fake_quantized.devices[0].phases["forward"] > plain.devices[0].phases["forward"]
    assert fake_quantized.peak_bytes >= plain.peak_bytes
    assert fake_quantized.trainable_parameters == plain.trainable_parameters


def test_virtual_tokens_cost_activation_memory():
    base = demo_config().replace(method="prompt_tuning", peft={"num_virtual_tokens": 1})
    for method in ("prompt_tuning", "prefix_tuning"):
        few, many = (estimate(_TINY, base.replace(method=method, peft={"num_virtual_tokens": n}), "cpu")
                     for n in (1, 64))
        assert many.parts["activations"] > few.parts["activations"]
