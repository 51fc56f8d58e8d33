"""Pipeline parallelism (distributed.pipeline_stages): the stages, over gloo on the CPU, train exactly as one process.

One plain run (1 process, accumulation 2) is the reference: a pipeline of 2 stages runs the same 2 micro-batches
per step through its schedule, so its per-step losses and its trained adapter must equal the reference's within
1e-5 (float32 summation orders differ, nothing else). Its checkpoints resume and export as a single process's.
"""

import pytest
from safetensors.torch import load_file

from helpers import losses, quick_config
from model_factory import make_tiny_model, tiny_config
from studio.core.errors import StudioError
from studio.core.memory.placement import stage_blocks
from studio.core.run.commands import EXIT_OK
from studio.core.validation import validate
from studio.train.distributed.pipeline import check_stages, decoder_parts
from studio.train.export.hf_format import export_run
from studio.train.worker import run
from test_distributed import events_of, resume_cli, resumed_copy, train_cli

STEPS = 4
EXACT = {"rel": 0, "abs": 1e-5}


def config_for(data, stages: int = 0, schedule: str = "gpipe", replicas: int = 1, accumulation: int = 2):
    return quick_config(data, data={"train_files": (str(data),), "eval_files": (str(data),), "max_length": 48,
                                    "packing": "none"},
                        training={"micro_batch_size": 4, "max_steps": STEPS, "gradient_accumulation_steps": accumulation},
                        schedule={"save_every": 2},
                        distributed={"num_processes": max(stages, 1) * replicas, "pipeline_stages": stages,
                                     "pipeline_schedule": schedule})


def trained_tensors(run_dir):
    return load_file(str(run_dir.latest_checkpoint() / "trainable.safetensors"))


@pytest.fixture(scope="module")
def reference(small_data, tmp_path_factory):
    code, run_dir = run(config_for(small_data), tmp_path_factory.mktemp("reference") / "run", watch_stdin=False)
    assert code == EXIT_OK
    return losses(run_dir), trained_tensors(run_dir), eval_losses(run_dir)


def eval_losses(run_dir) -> list[float]:
    return [event["eval_loss"] for event in events_of(run_dir, "eval")]


def assert_same_adapter(tensors, expected):
    assert tensors.keys() == expected.keys()  # the usual names: every stage's LoRA weights in one adapter
    for name, tensor in expected.items():
        assert tensors[name] == pytest.approx(tensor, **EXACT), name


def assert_each_rank_measures_its_stage_s_estimate(config, run_dir):
    """The live tensors each process measured at its second step against its stage's estimate, less the receive
    buffers (allocated at the first step, before the tracker starts): within today's accuracy
    (docs/memory-accuracy.md)."""
    from studio.core.memory.estimate import ScaleOut, estimate
    from studio.core.model.info import load_model_config

    stages = estimate(load_model_config(config.model.name_or_path), config, "cpu", ScaleOut.from_config(config)).devices
    measured = {event["device"]: event for event in events_of(run_dir, "memory_measured")}
    for rank, stage in enumerate(stages):
        expected = stage.total_bytes - stage.parts["communication"]
        assert measured[f"cpu rank {rank}"]["peak_bytes"] == pytest.approx(expected, rel=0.15), rank
        assert measured[f"cpu rank {rank}"]["predicted_bytes"] == stage.total_bytes  # the worker's, of its own stage


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])  # interleaved: 2 chunks of 1 block per process
def test_two_stages_train_resume_and_export_like_one_process(small_data, tmp_path, reference, schedule):
    expected_losses, expected_tensors, expected_eval = reference
    config = config_for(small_data, 2, schedule)
    code, run_dir = train_cli(config, tmp_path)
    assert code == EXIT_OK, events_of(run_dir, "error")
    assert losses(run_dir) == pytest.approx(expected_losses, **EXACT)
    assert_same_adapter(trained_tensors(run_dir), expected_tensors)
    assert eval_losses(run_dir) == pytest.approx(expected_eval, **EXACT)  # evaluated through the stages
    total = events_of(run_dir, "run_started")[0]["total_params"]
    held = [int(line.split("holds ")[1].split(" ")[0].replace(",", "")) for line in run_dir.log.read_text().splitlines()
            if "pipeline stage" in line]
    assert len(held) == 2 and all(count < 0.8 * total for count in held)  # each its blocks, not the whole model
    chunks = {"gpipe": "blocks 0-1", "interleaved": "blocks 0, 2"}[schedule]  # interleaved: chunks 0 and 2 of 4
    assert f"pipeline stage 0 of 2 (replica 0 of 1): {chunks};" in run_dir.log.read_text()
    assert_each_rank_measures_its_stage_s_estimate(config, run_dir)

    resumed = resumed_copy(run_dir, tmp_path / "resumed")  # stopped after step 2
    assert resume_cli(resumed) == EXIT_OK
    assert losses(resumed)[STEPS:] == pytest.approx(expected_losses[2:], **EXACT)
    assert_same_adapter(trained_tensors(resumed), expected_tensors)

    _, verification = export_run(run_dir.path, "adapter")
    assert verification.passed


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("stages, schedule, checkpointing", [(2, "1f1b", True), (4, "gpipe", False)])
def test_other_schedules_and_stages_train_like_one_process(small_data, tmp_path, reference, stages, schedule,
                                                           checkpointing):
    config = config_for(small_data, stages, schedule).replace(training={"gradient_checkpointing": checkpointing})
    code, run_dir = train_cli(config, tmp_path)
    assert code == EXIT_OK, events_of(run_dir, "error")
    assert losses(run_dir) == pytest.approx(reference[0], **EXACT)
    assert_same_adapter(trained_tensors(run_dir), reference[1])
    assert eval_losses(run_dir) == pytest.approx(reference[2], **EXACT)


def test_the_blocks_are_cut_in_consecutive_even_stages():
    assert [list(stage_blocks(4, 2, stage)) for stage in (0, 1)] == [[0, 1], [2, 3]]
    assert [list(stage_blocks(5, 3, stage)) for stage in (0, 1, 2)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("family, reason", [("qwen3_moe", "a mixture of experts"), ("gemma2", "sliding window"),
                                            ("gpt2", "holds more than"), ("granite", "does more than")])
def test_families_a_pipeline_cannot_cut_are_refused_naming_the_reason(family, reason):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(family)))
    with pytest.raises(StudioError, match=f"cannot cut {family} models: .*{reason}"):
        check_stages(model, decoder_parts(model))


@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3"])
def test_llama_like_families_are_cut_at_their_blocks(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(family)))
    parts = decoder_parts(model)
    check_stages(model, parts)
    assert parts.blocks is model.model.layers and parts.head is model.lm_head


@pytest.mark.parametrize("change, message", [
    ({"distributed": {"num_processes": 2, "pipeline_stages": 2, "sharding": "zero3"}}, "zero3 shards them"),
    ({"distributed": {"num_processes": 2, "pipeline_stages": 2, "sharding": "fsdp"}}, "fsdp shards them"),
    ({"distributed": {"num_processes": 1, "pipeline_stages": 2, "layer_split": True}}, "both place the blocks"),
    ({"distributed": {"num_processes": 8, "pipeline_stages": 8}}, "the model has 4 blocks, fewer than 8 stages"),
    ({"distributed": {"num_processes": 3, "pipeline_stages": 2}}, "2 stages need a multiple of 2 processes, not 3"),
    ({"distributed": {"num_processes": 2, "pipeline_stages": 2, "pipeline_schedule": "1f1b"},
      "training": {"gradient_accumulation_steps": 1}}, "1F1B runs at least as many micro-batches"),
    ({"distributed": {"num_processes": 2, "pipeline_stages": 2}, "data": {"packing": "padding_free"}},
     "micro-batches are padded to data.max_length"),
    ({"distributed": {"num_processes": 2, "pipeline_stages": 2}, "schedule": {"sample_every": 5}},
     "sample answers need the whole model"),
    ({"distributed": {"num_processes": 2, "pipeline_stages": 2}, "method": "full"}, "a pipeline trains an adapter"),
])
def test_pipelines_that_cannot_run_are_refused_in_words(small_data, change, message):
    config = config_for(small_data).replace(**change)
    assert any(message in problem.message for problem in validate(config)
               if problem.where == "distributed.pipeline_stages")


def test_the_estimate_notes_the_bubble_and_the_other_ways_over_the_gpus(small_data):
    from studio.core.memory.estimate import estimate
    from studio.core.model.info import load_model_config

    config = config_for(small_data, 2).replace(training={"gradient_accumulation_steps": 6})
    result = estimate(load_model_config(config.model.name_or_path), config, "cpu")
    note = next(note for note in result.notes if note.startswith("pipeline of 2 stages"))
    assert "idles 14% of the step" in note  # (2 - 1) / (6 + 2 - 1)
    assert [way.way for way in result.comparison] == ["pipeline (gpipe)", "layer split", "ZeRO-3 or FSDP"]
    assert [device.device for device in result.devices] == ["cpu:0", "cpu:1"]  # one per stage



@pytest.mark.parametrize("family, reason", [("qwen3_moe", "a mixture of experts"), ("mistral", "sliding window")])
def test_a_family_a_pipeline_cannot_cut_is_refused_by_its_config_before_anything_loads(small_data, tmp_path,
                                                                                      family, reason):
    folder = make_tiny_model(family, tmp_path / family, weights=False, sliding_window=16)
    config = config_for(small_data).replace(model={"name_or_path": str(folder)},
                                            distributed={"num_processes": 2, "pipeline_stages": 2})
    (problem,) = [p for p in validate(config) if p.where == "distributed.pipeline_stages"]
    assert f"cannot cut {family} models: " in problem.message and reason in problem.message
    assert "pipeline_stages to 0" in problem.hint
