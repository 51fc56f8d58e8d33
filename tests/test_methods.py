"""The table of training methods (studio.core.methods) against the schema and the behaviour users see."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest

from studio.core.choices import Method
from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.methods import DORA, METHOD_SPECS, RSLORA, VIRTUAL_TOKEN_COUNT
from studio.core.model.info import model_shape
from studio.core.run.directory import COMPLETE_MARKER, RunDir
from studio.core.validation import validate

LINEAR_METHODS = [name for name, spec in METHOD_SPECS.items() if spec.adapts_linears]
VIRTUAL_TOKEN_METHODS = [name for name, spec in METHOD_SPECS.items() if spec.trains_virtual_tokens]


def config_for(method: str, **sections) -> RunConfig:
    return RunConfig(method=method, model=dataclasses.replace(RunConfig().model, name_or_path="some/model"),
                     data=dataclasses.replace(RunConfig().data, train_files=("train.jsonl",))).replace(**sections)


def quantization_problems(config: RunConfig) -> list[str]:
    return [p.message for p in validate(config, check_files=False) if p.where == "quantization.load_in"]


def test_the_table_has_every_method_of_the_schema_under_its_own_name():
    assert set(METHOD_SPECS) == set(get_args(Method))
    assert all(spec.name == name for name, spec in METHOD_SPECS.items())


def test_what_a_method_trains_decides_which_shapes_it_describes():
    for spec in METHOD_SPECS.values():
        assert spec.trains in ("every weight", "linear layers", "virtual tokens")
        assert (spec.linear_shapes is not None) == spec.adapts_linears, spec.name
        assert (spec.token_shape is not None) == spec.trains_virtual_tokens, spec.name
        assert (VIRTUAL_TOKEN_COUNT in spec.settings) == spec.trains_virtual_tokens, spec.name
        assert spec.mergeable == (not spec.trains_virtual_tokens), spec.name  # virtual tokens are no weights


def peft_model(method: str, **sections):
    """A tiny llama with the method's adapter attached by the worker's own code, and the run config."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from studio.train.model.build import attach_adapter

    config = config_for(method, peft={"adalora_target_r": 1, "num_virtual_tokens": 7}).replace(**sections)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**PEFT_MODEL))
    return attach_adapter(model, config, total_steps=100), config


# A prime feedforward width (LoKr splits it 1 x 97) and grouped key/value heads.
PEFT_MODEL = {"hidden_size": 64, "intermediate_size": 97, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128}


@pytest.mark.parametrize("method, dora", [(name, dora) for name in LINEAR_METHODS  # DoRA where validation allows it
                                          for dora in (False, True)[:1 + (DORA in METHOD_SPECS[name].settings)]])
@pytest.mark.parametrize("rank", [2, 64])
def test_linear_shapes_are_the_tensors_peft_trains(method, dora, rank):
    model, _ = peft_model(method, lora={"r": rank, "use_dora": dora})
    adapted = [m for m in model.modules() if hasattr(m, "base_layer")]
    assert adapted
    for module in adapted:
        trained = sorted(tuple(p.shape) for p in module.parameters() if p.requires_grad)
        n_in, n_out = module.base_layer.in_features, module.base_layer.out_features
        table = METHOD_SPECS[method].linear_tensor_shapes(n_in, n_out, rank, n_in == PEFT_MODEL["intermediate_size"], dora)
        assert sorted(table) == trained, (module.base_layer, rank)


@pytest.mark.parametrize("method", VIRTUAL_TOKEN_METHODS)
def test_virtual_token_shapes_are_the_tensors_peft_trains(method):
    model, _ = peft_model(method)
    shape = model_shape({"model_type": "llama", **PEFT_MODEL})
    token = METHOD_SPECS[method].token_shape(shape.hidden, shape.layers, shape.kv_width)
    assert [tuple(p.shape) for p in model.parameters() if p.requires_grad] == [(7, *token)]


@pytest.mark.parametrize("method", list(METHOD_SPECS))
def test_kbit_base_is_what_validation_allows(method):
    kbit_base = METHOD_SPECS[method].kbit_base
    for load_in in ("4bit", "8bit"):
        refused = quantization_problems(config_for(method, quantization={"load_in": load_in}))
        assert bool(refused) == (kbit_base == "no"), (load_in, refused)
    unquantized = quantization_problems(config_for(method, quantization={"load_in": "none"}))
    assert bool(unquantized) == (kbit_base == "required"), unquantized
    assert config_for(method).effective_load_in == ("4bit" if kbit_base == "required" else "none")


@pytest.mark.parametrize("method", list(METHOD_SPECS))
def test_lora_variants_are_allowed_where_the_table_lists_them(method):
    settings = METHOD_SPECS[method].settings
    for field, setting in (("use_dora", DORA), ("use_rslora", RSLORA)):
        problems = [p for p in validate(config_for(method, lora={field: True}), check_files=False)
                    if p.where == f"lora.{field}"]
        assert (not problems) == (setting in settings), problems


def _run_with_a_checkpoint(tmp_path, method: str) -> RunDir:
    run = RunDir(tmp_path / method)
    checkpoint = run.checkpoint_path(1)
    checkpoint.mkdir(parents=True)
    (checkpoint / COMPLETE_MARKER).write_text("")
    run.config.write_text(f"method: {method}\n")
    return run


@pytest.mark.parametrize("method", [name for name, spec in METHOD_SPECS.items() if not spec.mergeable])
def test_export_refuses_to_merge_what_the_table_says_cannot_be_merged(method, tmp_path):
    from studio.train.export.hf_format import export_run

    run = _run_with_a_checkpoint(tmp_path, method)
    with pytest.raises(StudioError) as refused:
        export_run(run.path, "merged", tmp_path / "out")
    assert str(refused.value).startswith(f"{method} trains virtual tokens, which cannot be merged into the model's "
                                         "weights")
    assert not (tmp_path / "out").exists()


def test_export_refuses_an_adapter_of_the_method_without_one(tmp_path):
    from studio.train.export.hf_format import export_run

    (full,) = [name for name, spec in METHOD_SPECS.items() if not spec.uses_adapter]
    with pytest.raises(StudioError, match="a full fine-tune has no adapter"):
        export_run(_run_with_a_checkpoint(tmp_path, full).path, "adapter")


def test_every_adapter_method_has_its_peft_config_and_full_fine_tuning_none():
    from studio.train.model.methods import TRAINING, peft_config

    assert set(TRAINING) == {name for name, spec in METHOD_SPECS.items() if spec.uses_adapter}
    with pytest.raises(StudioError, match="method full has no adapter"):
        peft_config(config_for("full"))
