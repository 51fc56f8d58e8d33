"""Lean weights under k-bit loading: the frozen input embedding and output layer stay 16-bit, and training
computes exactly what the upcast (peft's k-bit preparation) computes: the same losses and gradients, bit for bit.
And the input embedding kept in CPU RAM (training.embedding_on_cpu), counted apart from the GPU's memory."""

import pytest
import torch

from model_factory import make_tiny_model
from studio.core.config import RunConfig
from studio.core.estimate import estimate
from studio.core.memory.regime import regime_for
from studio.core.memory.states import weight_bytes
from studio.core.memory.tape import activations
from studio.core.modelinfo import load_model_config, model_shape
from studio.core.validation import validate
from studio.train.data import IGNORE_INDEX
from studio.train.loss import lean_output_layer, token_loss_sum
from studio.train.model import build_model, host_weights, keep_embedding_on_cpu, load_base_model

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
    keep_embedding_on_cpu(model, config, CPU)  # as the worker does (training.embedding_on_cpu)
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
    from studio.train.simulate import measure_step

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
    assert measured.host_bytes == embedding
    assert abs(measured.peak_bytes - split.peak_bytes) <= 0.03 * measured.peak_bytes


def test_the_embedding_stays_with_a_tied_head_and_is_refused_where_it_trains(models):
    config = kbit_config(models["smollm3"], lean=True).replace(training={"embedding_on_cpu": True})
    model = build_model(config, CPU)
    keep_embedding_on_cpu(model, config, CPU)
    assert host_weights(model) == []
    split = estimate(load_model_config(str(models["smollm3"])), config, "cpu")
    assert [d.device for d in split.devices] == ["cpu"] and "no effect" in " ".join(split.notes)
    full = RunConfig().replace(method="full", training={"embedding_on_cpu": True})
    assert "training.embedding_on_cpu" in [p.where for p in validate(full, check_files=False)]
