"""A pipeline's estimate per stage, its comparison with the other ways over its GPUs, and fit choosing it (pure
Python, instant; the measurement per process on gloo is in test_pipeline)."""

from __future__ import annotations

import pytest

from studio.core.config import RunConfig
from studio.core.memory.estimate import ScaleOut, estimate
from studio.core.memory.fit import fit
from studio.core.memory.placement import bubble, in_flight, model_modules, stage_weights
from studio.core.memory.regime import regime_for
from studio.core.model.info import model_shape
from test_estimate import LLAMA_31_8B

GIB = 1024**3


def piped(stages: int = 4, schedule: str = "gpipe", micro_batches: int = 8, **training) -> RunConfig:
    return RunConfig().replace(data={"max_length": 2048, "packing": "none"},
                               training={"micro_batch_size": 1, "gradient_accumulation_steps": micro_batches, **training},
                               distributed={"pipeline_stages": stages, "num_processes": stages,
                                            "pipeline_schedule": schedule})


def stage_estimate(config: RunConfig, model: dict = LLAMA_31_8B):
    return estimate(model, config, "cpu", ScaleOut.from_config(config))


def test_each_stage_holds_its_blocks_the_first_the_embeddings_the_last_the_head():
    config = piped()
    result = stage_estimate(config)
    shape = model_shape(LLAMA_31_8B)
    head, blocks, tail = model_modules(shape, regime_for(config, shape, "cpu"))
    weights = [device.parts["weights"] for device in result.devices]
    assert len(weights) == 4 and sum(weights) == sum(size for _, size in head + blocks + tail)
    assert weights[0] - weights[1] == head[0][1]  # the embeddings
    assert weights[3] - weights[1] == sum(size for _, size in tail)  # the final norm and the output layer
    assert result.peak_bytes == max(device.total_bytes for device in result.devices)


def test_a_tied_output_layer_is_kept_by_the_first_and_the_last_stage():
    tied = {**LLAMA_31_8B, "tie_word_embeddings": True}
    shape = model_shape(tied)
    regime = regime_for(piped(2), shape, "cpu")
    embeddings = model_modules(shape, regime)[0][0][1]
    first, last = stage_weights(shape, regime, range(0, 16), True, False), stage_weights(shape, regime, range(16, 32), False, True)
    assert first - embeddings == last - embeddings - model_modules(shape, regime)[2][0][1]  # the norm besides


def test_gpipe_holds_every_micro_batch_and_1f1b_a_stage_s_share_of_them():
    assert [in_flight("gpipe", 4, stage, 8) for stage in range(4)] == [[8]] * 4  # one chunk each
    assert [in_flight("1f1b", 4, stage, 8) for stage in range(4)] == [[4], [3], [2], [1]]
    gpipe, one_f_one_b = (stage_estimate(piped(schedule=schedule)).devices for schedule in ("gpipe", "1f1b"))
    inputs = 3 * 8 * 2048 * 8
    for stage, held in enumerate([4, 3, 2, 1]):
        ratio = (one_f_one_b[stage].parts["activations"] - inputs) / (gpipe[stage].parts["activations"] - inputs)
        assert ratio == pytest.approx(held / 8, rel=0.01)
    assert max(d.total_bytes for d in one_f_one_b) < max(d.total_bytes for d in gpipe)


def test_interleaved_stages_hold_their_chunks_weights_and_the_chunk_forwards_in_flight():
    assert in_flight("interleaved", 4, 0, 8, 2) == [7, 4]  # a round of 4 per chunk in turn: 4 + 2 x 3 warm-up, 1 more
    assert [sum(in_flight("interleaved", 4, stage, 8, 2)) for stage in range(4)] == [11, 9, 7, 5]
    gpipe, interleaved = (stage_estimate(piped(schedule=schedule)).devices for schedule in ("gpipe", "interleaved"))
    inputs = 3 * 8 * 2048 * 8
    boundary = gpipe[0].parts["communication"] // 8  # GPipe's first stage: a receive buffer per micro-batch
    for stage, held in enumerate([11, 9, 7, 5]):  # chunk forwards of 4 blocks, against 8 micro-batches of 8
        assert interleaved[stage].parts["weights"] == gpipe[stage].parts["weights"]  # 8 blocks either way
        chunks = in_flight("interleaved", 4, stage, 8, 2)
        outputs = sum(chunks) - (chunks[-1] if stage == 3 else 0)  # the outputs in flight (the last chunk sends none)
        # what the stage sent stays alive until the step's end (as many as it receives), beside the outputs in flight
        sent = interleaved[stage].parts["communication"] - boundary * outputs
        ratio = (interleaved[stage].parts["activations"] - inputs - sent) / (gpipe[stage].parts["activations"] - inputs)
        assert ratio == pytest.approx(held / 16, rel=0.01)
    # a receive buffer per micro-batch for each chunk's input and its output's gradient (none before the first
    # chunk, none after the last)
    assert [d.parts["communication"] // gpipe[0].parts["communication"] for d in interleaved] == [3, 4, 4, 3]
    result = stage_estimate(piped(schedule="interleaved"))
    assert result.comparison[0].idle == pytest.approx(bubble(4, 8, 2)) == pytest.approx(3 / 19)  # 3 / (2 x 8 + 3)
    assert result.comparison[0].link_bytes == 7 * 2 * 8 * 2048 * 4096 * 2  # 7 chunk boundaries, forward and back


def test_checkpointing_inside_the_stages_keeps_only_each_block_s_input():
    plain, checkpointed = (stage_estimate(piped(gradient_checkpointing=on)).devices[1] for on in (False, True))
    assert checkpointed.parts["activations"] < plain.parts["activations"] / 5
    assert checkpointed.parts["temporaries"] > plain.parts["temporaries"]  # one block recomputed in backward


def test_the_last_stage_holds_the_loss():
    devices = stage_estimate(piped()).devices
    assert devices[-1].parts["logits_loss"] > 0 and all(d.parts["logits_loss"] == 0 for d in devices[:-1])


def test_the_comparison_gives_memory_the_bubble_and_the_link_bytes_of_each_way():
    result = estimate(LLAMA_31_8B, piped(2, "1f1b"), "cuda", ScaleOut.from_config(piped(2, "1f1b")))
    pipeline, split, sharded = result.comparison
    assert pipeline.idle == pytest.approx(bubble(2, 8)) == pytest.approx(1 / 9)
    assert split.idle == 0.5 and sharded.idle == 0
    hidden_states = 2048 * 4096 * 2  # one micro-batch's bf16 hidden states
    assert pipeline.link_bytes == split.link_bytes == 2 * 8 * hidden_states  # forward and back, one boundary
    assert not split.overlapped and pipeline.overlapped
    assert sharded.link_bytes > 100 * pipeline.link_bytes  # ZeRO-3 moves every weight, forward and backward
    assert pipeline.peak_bytes == result.peak_bytes
    assert any("On 2 GPUs: pipeline (1f1b)" in note for note in result.notes)
    assert result.to_json()["comparison"][0]["way"] == "pipeline (1f1b)"


def test_replicas_hold_what_one_holds_per_gpu_and_add_the_gradients_all_reduce_between_them():
    one, two = (estimate(LLAMA_31_8B, config, "cuda", ScaleOut.from_config(config))
                for config in (piped(2), piped(2).replace(distributed={"num_processes": 4})))
    assert [d.total_bytes for d in two.devices] == [d.total_bytes for d in one.devices]
    assert one.comparison[0].replica_link_bytes == 0
    lora_gradients = one.devices[0].parts["gradients"] + one.devices[1].parts["gradients"]
    assert two.comparison[0].replica_link_bytes == pytest.approx(2 * lora_gradients, rel=1e-3)  # a ring, 2 replicas
    assert two.comparison[1:] == one.comparison[1:]  # the other ways on one replica's GPUs
    note = next(note for note in two.notes if note.startswith("pipeline of 2 stages"))
    assert "its 2 replicas, each on its share of every batch, all-reduce the trained gradients once a step" in note
    assert "the ways below are on one replica's 2 GPUs" in note


def test_fit_turns_a_layer_split_into_a_pipeline_where_it_fits():
    split = RunConfig().replace(data={"max_length": 2048}, distributed={"layer_split": True},
                                training={"micro_batch_size": 2, "gradient_accumulation_steps": 8,
                                          "gradient_checkpointing": True})
    result = fit(LLAMA_31_8B, split, 24 * GIB, scale_out=ScaleOut.from_config(split, (24 * GIB,) * 2))
    d = result.config.distributed
    assert result.fits and (d.pipeline_stages, d.num_processes, d.layer_split) == (2, 2, False)
    assert result.config.data.packing == "none" and result.scale_out.pipeline_stages == 2
    assert "a pipeline of 2 stages" in result.explanation and result.relative_step_time < 0.6
    assert result.estimate.comparison  # the chosen pipeline's estimate compares it with the other ways

    dpo = split.replace(objective="dpo")  # a pipeline computes the next-token loss only
    kept = fit(LLAMA_31_8B, dpo, 24 * GIB, scale_out=ScaleOut.from_config(dpo, (24 * GIB,) * 2))
    assert kept.config.distributed.pipeline_stages == 0
    windowed = {**LLAMA_31_8B, "model_type": "mistral", "sliding_window": 4096}  # a mask of its own per stage
    kept = fit(windowed, split, 24 * GIB, scale_out=ScaleOut.from_config(split, (24 * GIB,) * 2))
    assert kept.config.distributed.pipeline_stages == 0
