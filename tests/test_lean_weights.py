"""Lean weights under k-bit loading: the frozen input embedding and output layer stay 16-bit, and training
computes exactly what the upcast (peft's k-bit preparation) computes: the same losses and gradients, bit for bit.
And the input embedding and the output layer kept in CPU RAM (training.embedding_on_cpu, output_layer_on_cpu),
counted apart from the GPU's memory."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from memory_frontier import LEAN_SETTINGS, LLAMA_31_8B, config_with  # noqa: E402
from model_factory import make_tiny_model  # noqa: E402
from studio.core.config import RunConfig  # noqa: E402
from studio.core.memory.estimate import estimate  # noqa: E402
from studio.core.memory.regime import regime_for  # noqa: E402
from studio.core.memory.parts.states import weight_bytes  # noqa: E402
from studio.core.memory.parts.tape import activations  # noqa: E402
from studio.core.model.info import load_model_config, model_shape  # noqa: E402
from studio.core.validation import validate  # noqa: E402
from studio.train.data.prepare import IGNORE_INDEX  # noqa: E402
from studio.train.objectives.next_token import lean_output_layer, token_loss_sum  # noqa: E402
from studio.train.model.build import build_model, load_base_model  # noqa: E402
from studio.train.savers.host_weights import host_weights, keep_weights_on_cpu  # noqa: E402

# plain embeddings untied and tied, a fused-qkv and a LayerNorm family, Gemma's scaled embedding (stays fp32)
FAMILIES = ("llama", "smollm3", "gpt_neox", "phi", "gemma")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    return {family: make_tiny_model(family, root / family) for family in FAMILIES}


def kbit_config(folder, lean: bool, precision="bf16", checkpointing=False, load_in="4bit", method="qlora"):
    return RunConfig().replace(method=method, model={"name_or_path": str(folder)}, quantization={"load_in": load_in},
                               training={"precision": precision, "gradient_checkpointing": checkpointing,
                                         "lean_weights": lean})


def batch(vocab=512, rows=2, length=24):
    ids = torch.randint(3, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :length // 3] = IGNORE_INDEX  # a masked prompt
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def step(config, chunked: bool):
    """The worker's forward and backward of one micro-batch: the loss and every trained tensor's gradient."""
    torch.manual_seed(0)  # the adapter's initialization
    model = build_model(config, CPU)
    keep_weights_on_cpu(model, config, CPU)  # as the worker does (training.embedding_on_cpu, output_layer_on_cpu)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.training.precision != "fp32"):
        loss = token_loss_sum(model, batch(), lean_output_layer(model) if chunked else None)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def assert_same_step(before, after):
    (loss, grads), (lean_loss, lean_grads) = before, after
    assert torch.equal(lean_loss, loss)
    assert grads.keys() == lean_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.equal(lean_grads[name], grad), name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunked", [True, False])
def test_lean_weights_train_exactly_as_the_upcast_ones(models, family, chunked):
    before = step(kbit_config(models[family], lean=False), chunked)
    after = step(kbit_config(models[family], lean=True), chunked)
    assert_same_step(before, after)


@pytest.mark.parametrize("settings", [
    {"checkpointing": True},
    {"load_in": "8bit"},
    {"precision": "fp16"},
    {"precision": "fp32", "method": "qlora"},
])
def test_lean_weights_are_exact_with_checkpointing_8bit_and_other_precisions(models, settings):
    before = step(kbit_config(models["llama"], lean=False, **settings), chunked=True)
    after = step(kbit_config(models["llama"], lean=True, **settings), chunked=True)
    assert_same_step(before, after)


def outer_dtypes(model) -> tuple[torch.dtype, torch.dtype]:
    return model.get_input_embeddings().weight.dtype, model.get_output_embeddings().weight.dtype


@pytest.mark.parametrize("family, precision, expected", [
    ("llama", "bf16", (torch.bfloat16, torch.bfloat16)),
    ("smollm3", "bf16", (torch.bfloat16, torch.bfloat16)),  # tied: one weight
    ("gemma", "bf16", (torch.float32, torch.float32)),  # its embedding scales the rows in the weight's dtype
])
def test_only_what_must_be_fp32_is(models, family, precision, expected):
    config = kbit_config(models[family], lean=True, precision=precision)
    model = build_model(config, CPU)
    assert outer_dtypes(model) == expected
    norms = [p for name, p in model.named_parameters() if "norm" in name]
    assert norms and all(p.dtype == torch.float32 for p in norms)  # the fp32 residual stream's norms, as before


def test_without_autocast_the_untied_output_layer_stays_fp32(models):
    config = kbit_config(models["llama"], lean=True).replace(model={"dtype": "bfloat16"}, training={"precision": "fp32"})
    assert outer_dtypes(build_model(config, CPU)) == (torch.bfloat16, torch.float32)


def test_without_lean_weights_the_preparation_is_peft_s(models):
    from peft import prepare_model_for_kbit_training

    config = kbit_config(models["llama"], lean=False, checkpointing=True)
    ours = build_model(config.replace(method="qlora"), CPU)
    peft_prepared = prepare_model_for_kbit_training(load_base_model(config, CPU), use_gradient_checkpointing=True,
                                                    gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_state = {name: (p.dtype, p.requires_grad) for name, p in peft_prepared.named_parameters()}
    base = {name.replace("base_model.model.", ""): (p.dtype, p.requires_grad) for name, p in ours.named_parameters()
            if "lora_" not in name}
    assert {name.replace(".base_layer", ""): state for name, state in base.items()} == peft_state


@pytest.mark.parametrize("family", FAMILIES)
def test_the_estimate_sheds_what_the_loaded_model_sheds(models, family):
    shape = model_shape(load_model_config(str(models[family])))
    loaded, counted = {}, {}
    for lean in (False, True):
        config = kbit_config(models[family], lean=lean)
        loaded[lean] = sum(p.nbytes for p in build_model(config, CPU).parameters())
        counted[lean] = weight_bytes(shape, regime_for(config, shape, "cpu"))
    assert counted[False] - counted[True] == loaded[False] - loaded[True]
    assert (loaded[True] < loaded[False]) == (family != "gemma")


def test_the_8b_estimate_sheds_the_upcast_and_the_head_copy():
    llama = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False}
    shape, weights, copies, totals = model_shape(llama), {}, {}, {}
    for lean in (False, True):
        config = RunConfig().replace(method="qlora", training={"micro_batch_size": 1, "gradient_checkpointing": True,
                                                               "lean_weights": lean}, data={"max_length": 2048})
        regime = regime_for(config, shape)
        weights[lean], copies[lean] = weight_bytes(shape, regime), activations(shape, regime).weight_copies
        totals[lean] = estimate(llama, config).peak_bytes
    assert weights[False] - weights[True] == 2 * 128256 * 4096 * 2  # the embedding and the head: 2 bytes a value less
    assert copies[False] == 128256 * 4096 * 2 and copies[True] == 0  # autocast's bf16 copy of the fp32 head
    assert totals[False] - totals[True] > 2.4 * 2**30


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_the_embedding_in_cpu_ram_trains_exactly_as_on_the_device(models, family):
    config = kbit_config(models[family], lean=True, checkpointing=True)
    before = step(config, chunked=True)
    after = step(config.replace(training={"embedding_on_cpu": True}), chunked=True)
    assert_same_step(before, after)


def test_the_estimate_moves_the_embedding_to_host_ram_as_measured(models):
    from studio.train.measure.simulate import measure_step

    config = kbit_config(models["llama"], lean=True).replace(data={"max_length": 64})
    on_cpu = config.replace(training={"embedding_on_cpu": True})
    model_config = load_model_config(str(models["llama"]))
    gpu, split = estimate(model_config, config, "cpu"), estimate(model_config, on_cpu, "cpu")
    host = next(d for d in split.devices if d.device == "host")
    embedding = 512 * 64 * 2  # vocabulary x hidden, bf16
    assert host.total_bytes == host.parts["weights"] == embedding
    assert split.devices[0].parts["weights"] == gpu.devices[0].parts["weights"] - embedding
    assert "the input embedding stays in CPU RAM" in " ".join(split.notes)
    measured = measure_step(on_cpu, CPU)
    assert measured.host_peak_bytes == embedding
    assert abs(measured.peak_bytes - split.peak_bytes) <= 0.03 * measured.peak_bytes


def test_the_embedding_stays_with_a_tied_head_and_is_refused_where_it_trains(models):
    config = kbit_config(models["smollm3"], lean=True).replace(training={"embedding_on_cpu": True})
    model = build_model(config, CPU)
    keep_weights_on_cpu(model, config, CPU)
    assert host_weights(model) == []
    split = estimate(load_model_config(str(models["smollm3"])), config, "cpu")
    assert [d.device for d in split.devices] == ["cpu"] and "no effect" in " ".join(split.notes)
    full = RunConfig().replace(method="full", training={"embedding_on_cpu": True})
    assert "training.embedding_on_cpu" in [p.where for p in validate(full, check_files=False)]


HEAD_ON_CPU = {"output_layer_on_cpu": True}


@pytest.mark.parametrize("family, settings", [
    ("llama", {"checkpointing": True}),
    ("llama", {"lean": False}),  # an fp32 output layer, autocast's bf16 copy made from the device's copy
    ("gpt_neox", {}),  # its output layer is embed_out
    ("phi", {"precision": "fp16"}),  # with a bias
])
def test_the_output_layer_in_cpu_ram_trains_exactly_as_on_the_device(models, family, settings):
    config = kbit_config(models[family], **{"lean": True, **settings})
    before = step(config, chunked=True)
    after = step(config.replace(training=HEAD_ON_CPU), chunked=True)
    assert_same_step(before, after)
    both = step(config.replace(training={**HEAD_ON_CPU, "embedding_on_cpu": True}), chunked=True)
    assert_same_step(before, both)


@pytest.mark.parametrize("family", ["llama", "phi"])
def test_the_output_layer_is_what_stays_in_cpu_ram_and_evaluation_computes_the_same(models, family):
    config = kbit_config(models[family], lean=True)
    model = build_model(config.replace(training=HEAD_ON_CPU), CPU)
    keep_weights_on_cpu(model, config.replace(training=HEAD_ON_CPU), CPU)
    head = model.get_output_embeddings()
    assert host_weights(model) == list(head.parameters()) and head.weight.device == CPU
    plain = build_model(config, CPU)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # the worker's evaluation
        losses = [token_loss_sum(m, batch(), lean_output_layer(m)) for m in (plain, model)]
    assert torch.equal(*losses)


def test_the_estimate_has_the_output_layer_on_the_device_only_for_the_loss_as_measured(models):
    from studio.train.measure.simulate import measure_step

    config = kbit_config(models["llama"], lean=True).replace(data={"max_length": 64})
    on_cpu = config.replace(training=HEAD_ON_CPU)
    model_config = load_model_config(str(models["llama"]))
    gpu, split = estimate(model_config, config, "cpu"), estimate(model_config, on_cpu, "cpu")
    host = next(d for d in split.devices if d.device == "host")
    head = 512 * 64 * 2  # vocabulary x hidden, bf16
    assert host.total_bytes == host.parts["weights"] == head
    assert "the output layer stays in CPU RAM" in " ".join(split.notes)
    measured = {c.training.output_layer_on_cpu: measure_step(c, CPU) for c in (config, on_cpu)}
    assert measured[True].host_peak_bytes == head
    # copied to the device for the loss, at the forward phase's peak; off it through backward and the update
    device = split.devices[0].phases
    for phase, dropped in (("forward", 0), ("backward", head), ("optimizer", head)):
        assert gpu.devices[0].phases[phase] - device[phase] == dropped
        assert measured[False].phase_peaks[phase] - measured[True].phase_peaks[phase] == dropped
    assert abs(measured[True].peak_bytes - split.peak_bytes) <= 0.03 * measured[True].peak_bytes


def test_the_8b_qlora_at_2048_tokens_sheds_the_output_layer_through_backward():
    config = RunConfig().replace(method="qlora", training={"micro_batch_size": 1, "gradient_checkpointing": True},
                                 data={"max_length": 2048})
    on_cpu = config.replace(training=HEAD_ON_CPU)
    before, after = (estimate(LLAMA_31_8B, c, "cpu").devices[0].phases for c in (config, on_cpu))
    head = 128256 * 4096 * 2  # bf16 (lean weights)
    # the loss copies the layer back, so the forward peak drops by less than the layer: only the moment
    # at the end of the last block, which held the layer with the block's activations, is gone
    assert 0 < before["forward"] - after["forward"] < head
    assert before["backward"] - after["backward"] == head == before["optimizer"] - after["optimizer"]
    assert estimate(LLAMA_31_8B, config).peak_phase == "backward"
    host = next(d for d in estimate(LLAMA_31_8B, on_cpu).devices if d.device == "host")
    assert host.parts["weights"] == 2**30  # pinned on CUDA: the 1,002 MiB layer in a block of a power of two
    # issue 14's target: every saver, r16 at 2,048 tokens in at most 6 GiB of GPU memory
    lean = config_with(LEAN_SETTINGS, {"lora": {"r": 16}}, {"data": {"max_length": 2048}})
    assert estimate(LLAMA_31_8B, lean).peak_bytes <= 6 * 2**30


def test_the_output_layer_stays_with_a_tied_embedding_or_transformed_logits(models, tmp_path):
    tied = kbit_config(models["smollm3"], lean=True).replace(training=HEAD_ON_CPU)
    model = build_model(tied, CPU)
    keep_weights_on_cpu(model, tied, CPU)
    assert host_weights(model) == []
    split = estimate(load_model_config(str(models["smollm3"])), tied, "cpu")
    assert [d.device for d in split.devices] == ["cpu"] and "no effect" in " ".join(split.notes)
    granite = kbit_config(make_tiny_model("granite", tmp_path / "granite"), lean=True).replace(training=HEAD_ON_CPU)
    model = build_model(granite, CPU)
    keep_weights_on_cpu(model, granite, CPU)  # its logits are scaled: the full loss needs the layer on the device
    assert host_weights(model) == []
    split = estimate(load_model_config(str(tmp_path / "granite")), granite, "cpu")
    assert [d.device for d in split.devices] == ["cpu"] and "no effect" in " ".join(split.notes)


@pytest.mark.parametrize("changes, reason", [
    ({"method": "full"}, "full fine-tuning trains the output layer"),
    ({"training": {"chunked_loss": False}}, "chunked loss"),
    ({"distributed": {"num_processes": 2, "sharding": "zero3"}}, "chunked loss"),
    ({"distributed": {"num_processes": 2, "sharding": "zero2"}}, "no ZeRO"),
    ({"lora": {"target_modules": ["q_proj", "lm_head"]}}, "adapts lm_head"),
])
def test_the_output_layer_in_cpu_ram_is_refused_where_it_trains_or_the_loss_needs_it(changes, reason):
    config = RunConfig().replace(training=HEAD_ON_CPU).replace(**changes)
    problems = [p for p in validate(config, check_files=False) if p.where == "training.output_layer_on_cpu"]
    assert len(problems) == 1 and reason in problems[0].message
    assert "turn training.output_layer_on_cpu off" in problems[0].hint


def test_the_output_layer_in_cpu_ram_is_allowed_with_data_parallelism():
    config = RunConfig().replace(training=HEAD_ON_CPU, distributed={"num_processes": 2})
    assert "training.output_layer_on_cpu" not in [p.where for p in validate(config, check_files=False)]
