"""Pipeline parallelism (distributed.pipeline_stages): the stages, over gloo on the CPU, train exactly as one process.

One plain run (1 process, accumulation 2) is the reference: a pipeline of 2 stages runs the same 2 micro-batches
per step through its schedule, so its per-step losses must equal the reference's within 1e-5 (float32 summation
orders differ, nothing else) and its trained adapter within 1e-4: Adam divides each gradient element by its own
running scale, so an element whose gradient nearly cancels across steps carries the summation order further
(2.2e-5 seen on one element of 1,024 with the December 2026 releases), under 1 % of the 1.2e-2 that 4 steps at 3e-3
move a weight. Its checkpoints resume and export as a single process's.
"""

import pytest
from safetensors.torch import load_file

from helpers import losses, quick_config
from model_factory import make_tiny_model, tiny_config
from studio.core.errors import StudioError
from studio.core.memory.placement import bubble, in_flight, process_chunks, stage_blocks
from studio.core.run.commands import EXIT_OK
from studio.core.validation import validate
from studio.train.distributed.pipeline import check_stages, decoder_parts
from studio.train.export.hf_format import export_run
from studio.train.worker import run
from test_distributed import events_of, resume_cli, resumed_copy, train_cli

STEPS = 4
EXACT = {"rel": 0, "abs": 1e-5}
SAME_ADAPTER = {"rel": 0, "abs": 1e-4}


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
        assert tensors[name] == pytest.approx(tensor, **SAME_ADAPTER), name


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
# interleaved: 2 chunks of 1 block per process; GPipe's run is test_pipeline_replicas' in the default run
@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.heavy), "interleaved"])
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
@pytest.mark.parametrize("stages, schedule, checkpointing", [(2, "1f1b", True), (4, "gpipe", False),
                                                             (2, "interleaved", True)])
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


def torch_interleaved_order(stages: int, chunks: int, micro_batches: int) -> dict:
    """Every rank's compute actions in the order torch's ScheduleInterleaved1F1B runs them (built in one process
    over torch's fake process group of ``stages`` ranks: the schedule computes every rank's order alike)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=stages)
    try:
        own = [PipelineStage(torch.nn.Linear(2, 2), chunk * stages, stages * chunks, torch.device("cpu"))
               for chunk in range(chunks)]
        schedule = ScheduleInterleaved1F1B(own, n_microbatches=micro_batches, loss_fn=lambda out, target: out.sum())
        return {rank: [action for action in actions if action is not None]
                for rank, actions in schedule.pipeline_order.items()}
    finally:
        dist.destroy_process_group()


def idle_share(order: dict, stages: int, chunks: int, micro_batches: int, backward: float) -> float:
    """Each rank's idle share of the step when it runs its actions in torch's order, each as soon as the action
    it waits for (the chunk before's forward, the chunk after's backward) is done: forwards 1, backwards
    ``backward`` long, the transfers free."""
    from torch.distributed.pipelining.schedules import _ComputationType

    last, done, clock = stages * chunks - 1, {}, dict.fromkeys(order, 0.0)
    queues = {rank: list(actions) for rank, actions in order.items()}
    while any(queues.values()):
        moved = False
        for rank, queue in queues.items():
            while queue:
                chunk, micro_batch = queue[0].stage_index, queue[0].microbatch_index
                forward = queue[0].computation_type == _ComputationType.FORWARD
                needs = _waits_for(chunk, forward, last)
                if needs is not None and (*needs, micro_batch) not in done:
                    break
                start = max(clock[rank], done[(*needs, micro_batch)] if needs else 0.0)
                clock[rank] = done[chunk, forward, micro_batch] = start + (1.0 if forward else backward)
                queue.pop(0)
                moved = True
        assert moved, "torch's order deadlocks"
    return 1 - chunks * micro_batches * (1 + backward) / max(clock.values())


def _waits_for(chunk: int, forward: bool, last: int) -> tuple[int, bool] | None:
    """What a chunk's forward (True) or backward of a micro-batch waits for: the chunk before's forward, the chunk
    after's backward; the last chunk's backward its own forward."""
    if forward:
        return (chunk - 1, True) if chunk > 0 else None
    return (chunk + 1, False) if chunk < last else (chunk, True)


@pytest.mark.parametrize("stages, chunks, micro_batches", [(2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 3, 3), (4, 2, 3),
                                                           (4, 2, 6), (4, 2, 8), (4, 3, 12)])
def test_the_interleaved_bubble_and_in_flight_counts_are_those_of_torch_s_own_order(stages, chunks, micro_batches):
    from torch.distributed.pipelining.schedules import _ComputationType

    order = torch_interleaved_order(stages, chunks, micro_batches)
    for backward in (1.0, 2.0):  # whatever a backward costs against a forward
        assert bubble(stages, micro_batches, chunks) == pytest.approx(
            idle_share(order, stages, chunks, micro_batches, backward))
    for rank, actions in order.items():  # each chunk's forwards held when the rank holds the most
        held, peak = dict.fromkeys(range(rank, stages * chunks, stages), 0), {}
        for action in actions:
            held[action.stage_index] += 1 if action.computation_type == _ComputationType.FORWARD else -1
            if sum(held.values()) > sum(peak.values()):
                peak = dict(held)
        assert list(peak.values()) == in_flight("interleaved", stages, rank, micro_batches, chunks), rank


def test_interleaved_stages_hold_every_stages_th_chunk_of_blocks():
    assert process_chunks(4, 2, 0, 2) == [range(0, 1), range(2, 3)]  # chunks 0 and 2 of 4
    assert process_chunks(6, 2, 1, 2) == [range(2, 4), range(5, 6)]  # 6 blocks in 4 chunks: 2, 2, 1, 1
    assert process_chunks(4, 2, 1) == [stage_blocks(4, 2, 1)]  # GPipe and 1F1B: one chunk, the stage's blocks


@pytest.mark.parametrize("distributed, training, where, message, hint", [
    ({"pipeline_chunks": 1}, {}, "pipeline_chunks", "runs 2 or more chunks of blocks per process, not 1",
     "set 2 or more, or use schedule 1f1b"),
    ({"pipeline_chunks": 3}, {}, "pipeline_chunks", "the model has 4 blocks, fewer than 2 stages x 3 chunks",
     "set distributed.pipeline_chunks to 2 or fewer"),
    ({}, {"gradient_accumulation_steps": 5}, "pipeline_stages", "5 do not make 2 rounds",
     "set training.gradient_accumulation_steps to 4 or 6, or use 1f1b"),
])
def test_interleaved_pipelines_torch_cannot_run_are_refused_naming_the_field(small_data, distributed, training, where,
                                                                             message, hint):
    config = config_for(small_data, 2, "interleaved").replace(distributed=distributed, training=training)
    (problem,) = [p for p in validate(config) if p.where.startswith("distributed.")]
    assert (problem.where, problem.hint) == (f"distributed.{where}", hint) and message in problem.message
    assert not [p for p in validate(config_for(small_data, 2, "interleaved"))
                if p.where.startswith("distributed.")]  # 2 stages x 2 chunks of the 4 blocks, 2 micro-batches
