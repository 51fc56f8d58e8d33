"""Layer split placement and the estimate of every distributed option (pure Python)."""

import pytest

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.estimate import ScaleOut, estimate
from studio.core.memory.parts.states import block_weight_bytes
from studio.core.memory.placement import OFFLOAD, DeviceBudget, plan_placement
from studio.core.memory.regime import regime_for
from studio.core.model.info import model_shape
from studio.core.sizes import GIB
from tests.test_estimate import LLAMA_31_8B

LORA = RunConfig().replace(method="lora", training={"precision": "bf16", "gradient_checkpointing": True})
SHAPE = model_shape(LLAMA_31_8B)
REGIME = regime_for(LORA, SHAPE)
BLOCK = block_weight_bytes(SHAPE, REGIME)  # 0.41 GiB in bf16


def gpus(*sizes_gib):
    return [DeviceBudget(f"cuda:{i}", int(size * GIB)) for i, size in enumerate(sizes_gib)]


def test_blocks_fill_the_gpus_in_order_with_the_head_on_the_last():
    placement = plan_placement(SHAPE, REGIME, gpus(10, 10))
    assert placement.device_map["model.embed_tokens"] == "cuda:0"
    first, second = placement.layers_on("cuda:0"), placement.layers_on("cuda:1")
    assert first == list(range(len(first))) and second == list(range(len(first), 32))
    assert placement.device_map["lm_head"] == placement.device_map["model.norm"] == "cuda:1"
    assert placement.bytes_on("cuda:0") <= 10 * GIB and placement.bytes_on("cuda:1") <= 10 * GIB


def test_unequal_gpus_take_blocks_in_proportion():
    placement = plan_placement(SHAPE, REGIME, gpus(4, 16))
    assert len(placement.layers_on("cuda:0")) < 8 < len(placement.layers_on("cuda:1"))


def test_blocks_that_do_not_fit_go_to_cpu_ram():
    placement = plan_placement(SHAPE, REGIME, gpus(6, 6), offload_bytes=10 * GIB)
    offloaded = placement.offloaded_layers
    assert offloaded and offloaded == list(range(32 - len(offloaded), 32))  # the last blocks
    assert placement.bytes_on(OFFLOAD) == len(offloaded) * BLOCK
    assert "CPU RAM (offloaded)" in placement.summary() and placement.execution_device == "cuda:0"


def test_a_model_that_fits_nowhere_says_how_much_is_missing():
    with pytest.raises(StudioError) as error:
        plan_placement(SHAPE, REGIME, gpus(6, 6), offload_bytes=1 * GIB)
    total = sum(plan_placement(SHAPE, REGIME, gpus(100)).module_bytes)
    missing = float(error.value.message.split(" GiB missing")[0].split()[-1])
    # everything beyond 2 x 6 GiB of GPUs and 1 GiB of RAM, up to the partial block left unused on cuda:0
    assert (total / GIB - 13) <= missing <= (total / GIB - 13) + BLOCK / GIB
    assert "max_cpu_memory_gib" in error.value.hint


def split(config, *device_gib, cpu_gib=0.0):
    config = config.replace(distributed={"layer_split": True, "max_cpu_memory_gib": cpu_gib})
    return ScaleOut.from_config(config, tuple(int(g * GIB) for g in device_gib))


def test_layer_split_over_two_gpus_puts_about_half_the_weights_on_each():
    single = estimate(LLAMA_31_8B, LORA)
    result = estimate(LLAMA_31_8B, LORA, scale_out=split(LORA, 12, 12))
    gpu0, gpu1 = result.devices
    total = single.parts["weights"]
    assert abs(gpu0.parts["weights"] - total / 2) < 0.15 * total
    assert abs(gpu0.parts["weights"] + gpu1.parts["weights"] - total) < 0.01 * total
    assert gpu1.parts["logits_loss"] == single.parts["logits_loss"] and gpu0.parts["logits_loss"] == 0
    assert result.peak_bytes < single.peak_bytes and result.placement is not None


def test_layer_split_with_offload_reports_host_ram_and_the_fetched_block():
    result = estimate(LLAMA_31_8B, LORA, scale_out=split(LORA, 8, cpu_gib=20))
    gpu, host = result.devices
    offloaded = len(result.placement.offloaded_layers)
    assert host.device == "host" and host.parts["weights"] == offloaded * BLOCK
    assert gpu.parts["weights"] == result.placement.bytes_on("cuda:0") + BLOCK  # one block fetched at a time
    assert result.peak_bytes <= 8 * GIB


def test_without_checkpointing_every_offloaded_block_stays_fetched_until_backward():
    config = LORA.replace(training={"gradient_checkpointing": False, "micro_batch_size": 1},
                          data={"max_length": 256})
    result = estimate(LLAMA_31_8B, config, scale_out=split(config, 12, cpu_gib=20))
    offloaded = len(result.placement.offloaded_layers)
    assert result.devices[0].parts["weights"] == result.placement.bytes_on("cuda:0") + offloaded * BLOCK


def test_zero3_on_two_gpus_needs_less_per_gpu_than_plain_data_parallel():
    full = RunConfig().replace(method="full", training={"precision": "bf16"})
    ddp = estimate(LLAMA_31_8B, full, scale_out=ScaleOut.from_config(full.replace(distributed={"num_processes": 2})))
    zero3 = estimate(LLAMA_31_8B, full, scale_out=ScaleOut.from_config(
        full.replace(distributed={"num_processes": 2, "sharding": "zero3"})))
    fsdp = estimate(LLAMA_31_8B, full, scale_out=ScaleOut.from_config(
        full.replace(distributed={"num_processes": 2, "sharding": "fsdp"})))
    assert zero3.peak_bytes < ddp.peak_bytes / 2 and fsdp.peak_bytes == zero3.peak_bytes


def test_loading_is_estimated_per_process_whole_or_sharded_by_zero3_or_fsdp():
    lora = LORA.replace(distributed={"num_processes": 4})
    assert estimate(LLAMA_31_8B, LORA).loading == ()  # one process: its devices say it all
    (every,) = estimate(LLAMA_31_8B, lora, scale_out=ScaleOut.from_config(lora)).loading
    assert every.processes == "every rank" and every.checkpoint_bytes == pytest.approx(16.06e9, rel=0.01)
    assert every.weights_bytes > every.checkpoint_bytes  # the adapters too
    zero3 = lora.replace(distributed={"sharding": "zero3"})
    rank0, others = estimate(LLAMA_31_8B, zero3, scale_out=ScaleOut.from_config(zero3)).to_json()["loading"]
    assert rank0 == {"processes": "rank 0", "weights_bytes": -(-every.weights_bytes // 4),
                     "checkpoint_bytes": every.checkpoint_bytes}
    assert others == {"processes": "ranks 1-3", "weights_bytes": rank0["weights_bytes"], "checkpoint_bytes": 0}
    # FSDP: rank 0 builds the whole model and holds it beside its shard until the shards are handed out
    fsdp = lora.replace(distributed={"sharding": "fsdp"})
    fsdp_rank0, fsdp_others = estimate(LLAMA_31_8B, fsdp, scale_out=ScaleOut.from_config(fsdp)).to_json()["loading"]
    assert fsdp_rank0 == {**rank0, "weights_bytes": every.weights_bytes + rank0["weights_bytes"]} and fsdp_others == others
    qlora_fsdp = fsdp.replace(method="qlora")  # 4-bit weights: every rank loads them whole
    assert [e.processes for e in estimate(LLAMA_31_8B, qlora_fsdp, scale_out=ScaleOut.from_config(qlora_fsdp)).loading] == [
        "every rank"]


def test_optimizer_offload_moves_state_to_host_ram():
    full = RunConfig().replace(method="full", training={"precision": "bf16"},
                               distributed={"num_processes": 2, "sharding": "zero2", "offload_optimizer": "cpu"})
    scale = ScaleOut.from_config(full, num_machines=2)
    result = estimate(LLAMA_31_8B, full, scale_out=scale)
    assert scale.num_gpus == 4 and result.devices[-1].device == "host"
    assert result.devices[0].parts["optimizer_state"] == 0 and result.devices[-1].parts["optimizer_state"] > 0


def test_layer_split_estimate_needs_the_gpus_memory():
    with pytest.raises(StudioError, match="GPUs' memory"):
        ScaleOut.from_config(LORA.replace(distributed={"layer_split": True}))
