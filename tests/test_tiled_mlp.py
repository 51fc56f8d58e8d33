"""Tiled MLP (training.tiled_mlp): the same numbers as the untiled MLP, less memory, refused where the MLP routes."""

import json

import pytest
import torch

from helpers import loss_and_gradients, quick_config
from model_factory import make_tiny_model
from studio.core.errors import StudioError
from studio.core.memory.estimate import estimate
from studio.core.validation import validate
from studio.train.measure.simulate import measure_step
from studio.train.model.build import build_model

NO_DROPOUT = {"gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}}


def tiny_config(tmp_path, family, tiled, **sections):
    folder = tmp_path / family
    if not (folder / "config.json").exists():
        make_tiny_model(family, folder, **NO_DROPOUT.get(family, {}))
    data = tmp_path / "train.txt"
    data.write_text("unused: the steps below make their own rows\n")
    training = {"micro_batch_size": 2, "precision": "fp32", "tiled_mlp": tiled, **sections.pop("training", {})}
    return quick_config(data, model={"name_or_path": str(folder)}, data={"max_length": 96}, training=training,
                        lora={"dropout": 0.0}, **sections)  # dropout draws its masks per tile


@pytest.mark.parametrize("family, sections", [
    ("llama", {}),
    ("llama", {"training": {"gradient_checkpointing": True, "activation_offload": True}}),
    ("gpt2", {"method": "full"}),
    ("gpt_neox", {"training": {"gradient_checkpointing": True}}),
    ("phi", {"method": "full", "training": {"gradient_checkpointing": True}}),
    ("phi3", {}),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}" for s in v.values() for k in (s if isinstance(s, dict) else [s])))
def test_losses_and_gradients_equal_the_untiled_mlp(tmp_path, family, sections):
    """The MLP works token by token: tiles compute the same rows. The parameter gradients are sums over the
    tokens, here summed tile by tile and then added: the same terms in another order, so fp32 rounding (a
    relative 1e-7 a term, a few hundred terms) is all that may differ; 1e-5 of the largest gradient allows it
    and no real difference (a lost or doubled tile would change a gradient by a third or more)."""
    plain_loss, plain = loss_and_gradients(tiny_config(tmp_path, family, False, **json.loads(json.dumps(sections))))
    loss, tiled = loss_and_gradients(tiny_config(tmp_path, family, True, **json.loads(json.dumps(sections))))
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=0)
    assert plain and tiled.keys() == plain.keys()
    for name, grad in plain.items():
        scale = grad.abs().max().item()
        assert (tiled[name] - grad).abs().max().item() <= 1e-5 * scale + 1e-12, name


def test_the_mlp_intermediate_is_never_whole(tmp_path):
    """On a model whose MLP is wide, the measured peak falls, and the estimate follows it."""
    folder = make_tiny_model("llama", tmp_path / "wide", num_hidden_layers=2, hidden_size=64, intermediate_size=512)
    model_config = json.loads((folder / "config.json").read_text())
    plain_config, config = (tiny_config(tmp_path, "wide", tiled, training={"precision": "bf16"}) for tiled in (False, True))
    plain, tiled = measure_step(plain_config, torch.device("cpu")), measure_step(config, torch.device("cpu"))
    assert tiled.peak_bytes < 0.8 * plain.peak_bytes
    predicted_plain, predicted = (estimate(model_config, c, "cpu").peak_bytes for c in (plain_config, config))
    assert abs(predicted / tiled.peak_bytes - 1) < 0.05
    assert predicted_plain - predicted == pytest.approx(plain.peak_bytes - tiled.peak_bytes, rel=0.1)


def test_a_mixture_of_experts_is_refused_by_the_worker_and_the_estimate(tmp_path):
    config = tiny_config(tmp_path, "qwen3_moe", True)
    with pytest.raises(StudioError, match="training.tiled_mlp"):
        build_model(config, torch.device("cpu"))
    model_config = json.loads((tmp_path / "qwen3_moe" / "config.json").read_text())
    with pytest.raises(StudioError, match="training.tiled_mlp") as refused:
        estimate(model_config, config)
    assert "turn training.tiled_mlp off" in refused.value.hint


def test_sharded_weights_are_refused_naming_the_field(tmp_path):
    for sharding in ("zero3", "fsdp"):
        config = tiny_config(tmp_path, "llama", True, distributed={"num_processes": 2, "sharding": sharding})
        problems = [p for p in validate(config) if p.where == "training.tiled_mlp"]
        assert len(problems) == 1 and sharding in problems[0].message and "zero2" in problems[0].hint
    allowed = tiny_config(tmp_path, "llama", True, distributed={"num_processes": 2, "sharding": "zero2"})
    assert not [p for p in validate(allowed) if p.where == "training.tiled_mlp"]


@pytest.mark.heavy  # torch.compile beside a saver: test_activation_offload's, in CI
def test_it_trains_under_torch_compile(tmp_path, story_data):
    """dynamo cannot trace the tiles' checkpoints inside a compiled block: the tiled MLP runs eagerly there."""
    from helpers import losses
    from studio.core.run.commands import EXIT_OK
    from studio.train.worker import run

    config = quick_config(story_data, training={"torch_compile": True, "tiled_mlp": True, "max_steps": 3})
    code, run_dir = run(config.replace(data={"format": "text"}), tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK and len(losses(run_dir)) == 3


def test_dropout_draws_the_same_masks_when_a_tile_is_recomputed():
    """Backward recomputes each tile under the random state its forward pass had: the gradients are those of
    the masks the loss saw (with other masks the half of the units they drop would differ)."""
    from studio.train.savers.tiled import _TiledMLP

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 8))
    hidden = torch.randn(2, 12, 8)
    tiles, weights = 3, list(mlp.parameters())

    def gradients(run):
        torch.manual_seed(1)
        x = hidden.clone().requires_grad_()
        (run(x) ** 2).sum().backward()
        grads = [x.grad, *(p.grad for p in weights)]
        mlp.zero_grad()
        return grads

    # the reference: the same tiles in the same order, kept by autograd (no recomputation)
    expected = gradients(lambda x: torch.cat([mlp(tile) for tile in x.reshape(-1, 8).chunk(tiles)]))
    tiled = gradients(lambda x: _TiledMLP.apply(mlp.forward, tiles, x, *weights))
    for want, got in zip(expected, tiled):
        torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-6, atol=1e-7)
