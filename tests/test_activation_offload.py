"""Offloaded activation checkpointing (training.activation_offload): exact, counted apart, refused without checkpointing."""

import json

import pytest
import torch

from helpers import loss_and_gradients, quick_config
from model_factory import make_tiny_model
from studio.core.memory.estimate import estimate
from studio.core.sizes import format_bytes
from studio.core.validation import validate
from studio.train.measure.simulate import measure_step

LAYERS, HIDDEN, LENGTH, BATCH = 4, 128, 128, 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("model")
    make_tiny_model("llama", folder, num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=256)
    data = folder / "train.txt"
    data.write_text("unused: the steps below make their own rows\n")
    return folder, data


def offload_config(tiny, offload: bool, **sections):
    folder, data = tiny
    training = {"micro_batch_size": BATCH, "gradient_checkpointing": True, "activation_offload": offload,
                **sections.pop("training", {})}
    return quick_config(data, model={"name_or_path": str(folder)}, data={"max_length": LENGTH}, training=training,
                        **sections)


@pytest.mark.parametrize("sections", [
    {"method": "lora"},  # with the default dropout: the recomputation replays it
    {"method": "qlora", "training": {"precision": "bf16"}},
    {"method": "full"},
    {"method": "ia3"},
    {"method": "loha"},
    {"method": "prompt_tuning"},
], ids=lambda s: s["method"])
def test_losses_and_gradients_equal_the_checkpointed_path(tiny, sections):
    """The offload only moves the saved block inputs and copies them back: every number is bitwise the same."""
    plain_loss, plain = loss_and_gradients(offload_config(tiny, False, **sections))
    loss, offloaded = loss_and_gradients(offload_config(tiny, True, **sections))
    assert torch.equal(loss, plain_loss)
    assert plain and offloaded.keys() == plain.keys()
    for name, grad in plain.items():
        assert torch.equal(offloaded[name], grad), name


def test_the_block_inputs_are_counted_in_host_memory_and_leave_the_device(tiny):
    """On the CPU the tracker counts the offloaded copies apart; the estimate predicts both sides."""
    model_config = json.loads((tiny[0] / "config.json").read_text())
    plain_config, config = (offload_config(tiny, offload, method="qlora", training={"precision": "bf16"})
                            for offload in (False, True))
    plain, offloaded = measure_step(plain_config, torch.device("cpu")), measure_step(config, torch.device("cpu"))
    block_input = BATCH * LENGTH * HIDDEN * 4  # k-bit preparation keeps the residual stream in fp32
    assert plain.host_peak_bytes == 0
    assert offloaded.host_peak_bytes == LAYERS * block_input
    # three of four block inputs leave (the first is the embeddings' output: a leaf that autograd keeps)
    assert plain.phase_peaks["forward"] - offloaded.phase_peaks["forward"] == (LAYERS - 1) * block_input

    plain_estimate, predicted = (estimate(model_config, c, "cpu") for c in (plain_config, config))
    host = predicted.devices[-1]
    assert [d.device for d in predicted.devices] == ["cpu", "host"] and len(plain_estimate.devices) == 1
    assert host.parts["activations"] == host.total_bytes == offloaded.host_peak_bytes
    # the device saves what was measured, in each phase (the estimate's own error on this toy is the same with
    # and without)
    for phase in ("forward", "backward"):
        saved = plain_estimate.devices[0].phases[phase] - predicted.devices[0].phases[phase]
        assert saved == plain.phase_peaks[phase] - offloaded.phase_peaks[phase], phase


def test_studio_estimate_prints_the_cpu_ram_beside_the_gpu(tiny):
    from studio.cli_memory import estimate_table

    model_config = json.loads((tiny[0] / "config.json").read_text())
    config = offload_config(tiny, True)
    result = estimate(model_config, config)
    table = estimate_table(result, config, model_config, None)
    host = table[table.index("host:"):]
    block_inputs = LAYERS * BATCH * LENGTH * HIDDEN * 4  # the demo config trains in fp32
    assert "cuda:0:" in table and "offload layer inputs to CPU RAM" in table
    assert "activations" in host and format_bytes(block_inputs) in host
    assert result.to_json()["devices"][-1]["parts"]["activations"] == block_inputs


def test_without_checkpointing_it_is_refused_naming_the_field(tiny):
    config = offload_config(tiny, True, training={"gradient_checkpointing": False})
    problems = [p for p in validate(config) if p.where == "training.activation_offload"]
    assert len(problems) == 1
    assert "gradient_checkpointing" in problems[0].hint
    assert not [p for p in validate(offload_config(tiny, True)) if p.where == "training.activation_offload"]


def test_it_trains_under_torch_compile(tmp_path, story_data):
    from helpers import losses
    from studio.core.run.commands import EXIT_OK
    from studio.train.worker import run

    config = quick_config(story_data, training={"torch_compile": True, "gradient_checkpointing": True,
                                                "activation_offload": True, "max_steps": 3})
    code, run_dir = run(config.replace(data={"format": "text"}), tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK and len(losses(run_dir)) == 3


def test_on_cuda_each_pinned_block_takes_a_power_of_two_of_cpu_ram(tiny):
    """torch's caching host allocator rounds every pinned block up to a power of two; the CPU keeps exact sizes."""
    config = offload_config(tiny, True).replace(data={"max_length": 120})
    model = json.loads((tiny[0] / "config.json").read_text())
    on_cpu, on_cuda = (next(d for d in estimate(model, config, device).devices if d.device == "host")
                       for device in ("cpu", "cuda"))
    block_input = on_cpu.parts["activations"] // LAYERS
    assert block_input & (block_input - 1)  # this block input is no power of two
    assert on_cuda.parts["activations"] == LAYERS * (1 << block_input.bit_length())


def test_a_run_whose_cpu_ram_the_machine_lacks_is_refused_before_it_loads(small_data, tmp_path, monkeypatch):
    from studio.core.run.events import read_events
    from studio.train import worker

    monkeypatch.setattr(worker, "available_ram", lambda: 1024)  # a machine with 1 KiB free
    config = quick_config(small_data, training={"gradient_checkpointing": True, "activation_offload": True,
                                                "max_steps": 2})
    code, run_dir = worker.run(config, tmp_path / "run", watch_stdin=False)
    error = next(e for e in read_events(run_dir.events) if e["type"] == "error")
    assert code != 0 and error["kind"] == "memory"
    assert "of CPU RAM" in error["message"] and "1.00 KiB free" in error["message"] and "activation offload" in error["hint"]
    assert not any(e["type"] == "run_started" for e in read_events(run_dir.events))  # refused before loading
