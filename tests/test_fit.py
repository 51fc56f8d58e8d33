"""The fit solver (studio.core.memory.fit): the fastest configuration that fits, keeping the effective batch."""

from __future__ import annotations

import argparse
import json

import pytest

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.estimate import ScaleOut, estimate
from studio.core.memory.fit import FIT_STEPS, fit
from studio.core.memory.placement import pipeline_replicas
from studio.core.sizes import format_bytes
from studio.core.validation import validate
from test_estimate import LLAMA_31_8B, QWEN3_30B_A3B

GIB = 1024**3


def lora_run(**training) -> RunConfig:
    return RunConfig().replace(data={"max_length": 2048},
                               training={"micro_batch_size": 8, "gradient_accumulation_steps": 2, **training})


def effective_batch(config: RunConfig) -> int:
    return config.training.micro_batch_size * config.training.gradient_accumulation_steps


def test_the_fastest_config_that_fits_is_left_alone():
    config = lora_run(micro_batch_size=2, gradient_accumulation_steps=1)  # no saver on, one micro-step
    result = fit(LLAMA_31_8B, config, 80 * GIB)
    assert result.fits and result.changes == () and result.config == config
    assert result.relative_step_time == 1.0
    assert "fits as it is" in result.explanation


def test_with_room_fit_switches_slow_savers_off_for_a_faster_step():
    """A run set up for a small card (micro-batch 1, checkpointing, its inputs in CPU RAM, the tiled MLP, 8-bit
    AdamW, a 4-bit base) on a card with room becomes the faster one that fits, each change said."""
    slow = lora_run(micro_batch_size=1, gradient_accumulation_steps=16, gradient_checkpointing=True,
                    activation_offload=True, tiled_mlp=True, optimizer="adamw_8bit").replace(method="qlora")
    result = fit(LLAMA_31_8B, slow, 80 * GIB)
    t = result.config.training
    assert result.fits and result.relative_step_time < 0.6 and "x as fast" in result.explanation
    assert not t.tiled_mlp and not t.activation_offload and t.optimizer == "adamw" and t.micro_batch_size > 1
    assert result.config.method == "lora" and result.config.effective_load_in == "none"
    assert t.micro_batch_size * t.gradient_accumulation_steps == 16
    assert "takes" in result.explanation and "training.tiled_mlp off" in result.explanation


def test_after_fit_chose_a_4bit_base_choosing_lora_again_unquantizes():
    """Fit's 4-bit base is QLoRA's own loading (auto), not a 4-bit setting LoRA would keep."""
    result = fit(LLAMA_31_8B, lora_run(), 8 * GIB)
    assert result.config.method == "qlora" and result.config.quantization.load_in == "auto"
    assert result.config.replace(method="lora").effective_load_in == "none"


def test_fit_keeps_the_effective_batch_and_fits():
    config = lora_run()
    result = fit(LLAMA_31_8B, config, 24 * GIB)
    assert result.fits
    assert effective_batch(result.config) == effective_batch(config)
    assert result.estimate.peak_bytes <= 24 * GIB
    assert result.estimate.peak_bytes == estimate(LLAMA_31_8B, result.config).peak_bytes


def test_each_change_is_explained_with_the_bytes_it_saves():
    config = lora_run()
    result = fit(LLAMA_31_8B, config, 24 * GIB)
    assert result.changes
    assert all(change.saves_bytes > 0 for change in result.changes)
    saved = sum(change.saves_bytes for change in result.changes)
    assert saved == estimate(LLAMA_31_8B, config).peak_bytes - result.estimate.peak_bytes
    for change in result.changes:
        assert str(change) in result.explanation


def test_cheap_savings_come_first():
    """A smaller micro-batch costs less time than a 4-bit base: it is tried and explained first."""
    result = fit(LLAMA_31_8B, lora_run(), 16 * GIB)
    order = [change.saver for change in result.changes]
    assert order == sorted(order, key=[step.name for step in FIT_STEPS].index)
    assert result.fits


@pytest.mark.parametrize("distributed", [{"num_processes": 2, "sharding": "zero3"}, {"num_processes": 2, "sharding": "fsdp"},
                                         {"num_processes": 2}, {"layer_split": True, "max_gpu_memory_gib": 80.0}])
def test_fit_never_switches_on_a_saver_validation_refuses(distributed):
    """From a valid run, every saver fit switches on is one this spread allows (the tiled MLP sums whole weights'
    gradients, which ZeRO-3 and FSDP shard; the embedding in CPU RAM needs one process)."""
    config = lora_run().replace(model={"name_or_path": "org/model"}, data={"train_files": ("train.jsonl",),
                                "max_length": 8192}, distributed=distributed)
    assert validate(config, check_files=False) == []
    result = fit(LLAMA_31_8B, config, 80 * GIB, scale_out=ScaleOut.from_config(config, (80 * GIB,)))
    switched = {f"training.{change.saver}" for change in result.changes} | {"training.gradient_checkpointing"}
    assert result.changes and not [p for p in validate(result.config, check_files=False) if p.where in switched]


def test_more_memory_never_means_a_slower_configuration():
    """With room to spare the solver needs fewer (and cheaper) savers."""
    roomy = fit(LLAMA_31_8B, lora_run(), 60 * GIB)
    tight = fit(LLAMA_31_8B, lora_run(), 16 * GIB)  # (18 GiB fits LoRA with the outer weights in CPU RAM)
    assert roomy.relative_step_time <= tight.relative_step_time
    assert roomy.config.method == "lora" and tight.config.method == "qlora"


def test_nothing_fits_reports_the_closest_and_why():
    result = fit(LLAMA_31_8B, RunConfig(method="full"), 8 * GIB)
    assert not result.fits
    assert "Nothing fits" in result.explanation and "LoRA or QLoRA" in result.explanation
    assert result.estimate.peak_bytes > 8 * GIB


def test_offload_only_when_allowed():
    config = RunConfig(method="full").replace(training={"micro_batch_size": 1, "gradient_checkpointing": True},
                                              data={"max_length": 512})
    without = fit(LLAMA_31_8B, config, 80 * GIB)
    with_offload = fit(LLAMA_31_8B, config, 80 * GIB, allow_offload=True)
    assert not without.scale_out.offload_optimizer
    assert with_offload.fits and with_offload.scale_out.offload_optimizer
    assert any(change.saver == "offload" for change in with_offload.changes)


def test_fit_json_is_serializable():
    out = fit(LLAMA_31_8B, lora_run(), 24 * GIB).to_json()
    json.dumps(out)
    assert out["fits"] and out["changes"] and out["config"]["training"]["micro_batch_size"] >= 1


def test_gpu_size_must_be_positive():
    with pytest.raises(StudioError):
        fit(LLAMA_31_8B, lora_run(), 0)


def test_fit_command_writes_the_fitted_config(tmp_path, capsys):
    from studio.cli_memory import add_fit
    from studio.core.config import load_config, save_config

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    save_config(lora_run().replace(model={"name_or_path": str(folder)}), tmp_path / "run.yaml")
    parser = argparse.ArgumentParser(prog="studio")
    add_fit(parser.add_subparsers())
    args = parser.parse_args(["fit", str(tmp_path / "run.yaml"), "--gpu-memory", "24GiB", "--write", str(tmp_path / "fit.yaml")])
    assert args.handler(args) == 0
    assert "Fits in 24.00 GiB" in capsys.readouterr().out
    fitted = load_config(tmp_path / "fit.yaml")
    assert effective_batch(fitted) == 16 and fit(LLAMA_31_8B, fitted, 24 * GIB).changes == ()


def test_scale_out_is_kept():
    result = fit(LLAMA_31_8B, lora_run(), 24 * GIB, scale_out=ScaleOut(2, 2))
    assert result.scale_out.num_gpus == 2 and result.scale_out.zero_stage == 2


def test_on_a_small_card_fit_keeps_the_embedding_and_the_output_layer_in_cpu_ram():
    """Llama-3.1-8B QLoRA at 2,048 tokens on an 8 GiB card: only with the embedding in CPU RAM, and the output
    layer there too (on the GPU only for the loss)."""
    result = fit(LLAMA_31_8B, RunConfig().replace(method="qlora", data={"max_length": 2048}), 8 * GIB)
    training = result.config.training
    assert result.fits and training.embedding_on_cpu and training.output_layer_on_cpu
    assert "training.embedding_on_cpu on" in result.explanation
    assert "training.output_layer_on_cpu on" in result.explanation
    host = next(d for d in result.estimate.devices if d.device == "host")
    # the embedding and the output layer, bf16; the output layer pinned, in a block of a power of two
    assert host.parts["weights"] == 128256 * 4096 * 2 + 2**30


def test_fit_does_not_offer_the_output_layer_in_cpu_ram_under_zero():
    config = RunConfig().replace(method="qlora", data={"max_length": 2048})
    result = fit(LLAMA_31_8B, config, 7 * GIB, scale_out=ScaleOut(2, 2))
    assert not result.config.training.output_layer_on_cpu
def test_offloaded_activations_are_a_saver_that_names_its_cpu_ram():
    """On a card where only the block inputs stand in the way, fit moves them to CPU RAM and says how much."""
    config = lora_run().replace(method="qlora", quantization={"load_in": "4bit"}, data={"max_length": 24576},
                                training={"micro_batch_size": 1, "gradient_accumulation_steps": 1,
                                          "gradient_checkpointing": True})
    result = fit(LLAMA_31_8B, config, 24 * GIB)
    assert result.fits and result.config.training.activation_offload
    host = result.estimate.devices[-1]
    assert host.device == "host" and host.parts["activations"] > 0
    assert f"need {format_bytes(host.parts['activations'])} of CPU RAM" in result.explanation


def test_fit_never_picks_what_the_machine_s_cpu_ram_cannot_hold_and_says_so():
    """At 128K tokens on 94 GiB (an H100 NVL) the fastest fit offloads tens of GiB of block inputs: with 16 GiB of
    RAM free fit takes a configuration that needs at most that, and says the RAM bound the choice."""
    config = lora_run(micro_batch_size=1, gradient_accumulation_steps=1).replace(data={"max_length": 131072})
    free = fit(LLAMA_31_8B, config, 94 * GIB)
    assert free.fits and free.estimate.host_bytes > 16 * GIB
    bound = fit(LLAMA_31_8B, config, 94 * GIB, host_bytes=16 * GIB)
    assert bound.estimate.host_bytes <= 16 * GIB and bound.relative_step_time >= free.relative_step_time
    assert "The CPU RAM bound the choice" in bound.explanation and "16.00 GiB available" in bound.explanation
    assert bound.to_json()["ram_bound"] and bound.to_json()["host_bytes"] == 16 * GIB


def rows_per_step(config: RunConfig) -> int:
    """The rows of one optimizer step over every process: each data-parallel process, or each pipeline replica,
    takes micro-batch x accumulation of them."""
    d = config.distributed
    return effective_batch(config) * (pipeline_replicas(config) if d.pipeline_stages else d.num_processes)


def data_parallel(processes: int, sharding: str = "none", **training) -> RunConfig:
    return lora_run(**{"micro_batch_size": 1, "gradient_accumulation_steps": 8, "gradient_checkpointing": True,
                       **training}).replace(distributed={"num_processes": processes, "sharding": sharding})


def fit_on(model: dict, config: RunConfig, gib: int):
    processes = config.distributed.num_processes
    return fit(model, config, gib * GIB, scale_out=ScaleOut.from_config(config, (gib * GIB,) * processes))


@pytest.mark.parametrize("processes", [2, 4])
def test_data_parallelism_whose_weights_fill_a_gpu_becomes_a_pipeline_of_its_processes(processes):
    """Llama-3.1-8B LoRA: its 15 GiB of 16-bit weights do not fit a 12 GiB GPU under DDP; a pipeline over the same
    processes holds 1/S of them per GPU, each replica S times the accumulation (the same rows a step), and costs
    only its bubble, less than a 4-bit base's dequantizing: fit takes it and says so."""
    config = data_parallel(processes)
    assert estimate(LLAMA_31_8B, config).parts["weights"] > 12 * GIB
    result = fit_on(LLAMA_31_8B, config, 12)
    d = result.config.distributed
    stages, replicas = d.pipeline_stages, pipeline_replicas(result.config)
    assert result.fits and result.config.method == "lora" and stages >= 2 and d.sharding == "none"
    assert d.num_processes == stages * replicas == processes and rows_per_step(result.config) == rows_per_step(config)
    assert result.scale_out == ScaleOut(num_gpus=processes, pipeline_stages=stages)
    assert result.estimate.peak_bytes == estimate(LLAMA_31_8B, result.config, "cuda",
                                                  ScaleOut.from_config(result.config)).peak_bytes <= 0.9 * 12 * GIB
    change = result.changes[0]
    assert change.saver == "pipeline" and change.mostly == "weights" and change.saves_bytes > 0
    assert (f"a pipeline of {stages} stages x {replicas} replica" in change.description
            and f"instead of data parallelism (DDP) over {processes} GPUs" in change.description
            and "the same effective batch" in change.description and "idle" in change.description)
    assert str(change) in result.explanation
    assert validate(result.config.replace(model={"name_or_path": "org/model"}, data={"train_files": ("t.jsonl",)}),
                    check_files=False) == []


def test_zero3_gives_way_to_a_pipeline_only_where_it_does_not_fit():
    """fit prices ZeRO-3's gathering of the weights at nothing and a pipeline's bubble at its idle share: a ZeRO-3
    run that fits is kept; one that does not (its full logits at 12 GiB) becomes a pipeline, whose words say what
    it saves (no weights gathered at every micro-batch) and what it costs (idle share)."""
    config = data_parallel(2, "zero3")
    kept = fit_on(LLAMA_31_8B, config, 16)
    assert kept.changes == () and kept.config == config
    result = fit_on(LLAMA_31_8B, config, 12)
    assert result.fits and result.config.distributed.pipeline_stages == 2
    assert result.config.distributed.sharding == "none" and rows_per_step(result.config) == rows_per_step(config)
    description = result.changes[0].description
    assert "instead of ZeRO-3 over 2 GPUs" in description and "no weights gathered over the links" in description
    assert "idle" in description and result.relative_step_time > 1.0


@pytest.mark.parametrize("model, config, gib", [(LLAMA_31_8B, data_parallel(2).replace(method="full"), 12),
                                                (QWEN3_30B_A3B, data_parallel(4), 32),
                                                (LLAMA_31_8B, data_parallel(2).replace(objective="dpo"), 12)])
def test_fit_never_offers_a_pipeline_the_config_or_the_model_cannot_run(model, config, gib):
    """Full fine-tuning, a mixture of experts (its routing is not cut into stages; 4 stages would need 27.4 GiB a
    GPU, its DDP 57 GiB of weights), DPO (its loss needs the whole model's outputs)."""
    result = fit_on(model, config, gib)
    assert result.config.distributed.pipeline_stages == 0 and "pipeline" not in result.explanation
