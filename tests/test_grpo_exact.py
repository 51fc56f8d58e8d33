"""GRPO's loss equals TRL's GRPOTrainer: on the same tiny model, completions, advantages and settings, the loss,
every trained parameter's gradient (1e-5) and every metric (the entropy too), for each loss type, without and with
the KL term, with the sampling model's log-probabilities given (several steps per generation batch) or not (one step:
the detached current ones).

TRL's ``_compute_loss`` is fed the inputs dict its ``_generate_and_score_completions`` builds. The prompts have one
length: TRL pads prompts on the left and calls the model without position ids, which shifts a shorter prompt's
positions; ours start each sequence at 0, as generation does."""

import pytest
import torch

from helpers import with_demo_tokenizer
from model_factory import make_tiny_model
from studio.core.presets import demo_config
from studio.train.model.build import build_model, load_tokenizer
from studio.train.data.packed_attention import attend_packed
from studio.train.objectives import objective_for
from studio.train.objectives.grpo import group_advantages
from studio.train.objectives.next_token import token_logps

trl = pytest.importorskip("trl")

PROMPT_LENGTH, COMPLETION_LENGTHS, GROUP = 5, (4, 2, 6, 3), 2
REWARDS = torch.tensor([1.0, 0.0, 0.5, 2.0])


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return with_demo_tokenizer(make_tiny_model("llama", tmp_path_factory.mktemp("tiny"), vocab_size=1200))


def _config(folder, **grpo):
    return demo_config().replace(
        model={"name_or_path": str(folder)}, method="lora", objective="grpo",
        grpo={"group_size": GROUP, "temperature": 0.7, "max_completion_length": 8, "epsilon": 0.2,
              "epsilon_high": 0.28, **grpo},
        training={"precision": "fp32", "gradient_checkpointing": False}, lora={"dropout": 0.0})


def _policy(config):
    """The trained model, its adapter moved off the start (a seeded random step) so that it differs from its
    reference (the adapter off)."""
    torch.manual_seed(0)
    model = build_model(config, torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter += 0.3 * torch.randn(parameter.shape, generator=generator)
    return model


def _completions():
    """Fixed prompts (two, each sampled GROUP times) and completions of several lengths, token ids of the vocabulary."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 1200, (PROMPT_LENGTH,), generator=generator).tolist() for _ in range(2)]
    return [{"prompt_ids": prompts[i // GROUP], "completion_ids": torch.randint(3, 1200, (n,), generator=generator).tolist()}
            for i, n in enumerate(COMPLETION_LENGTHS)]


def _old_logps(config, rows):
    """The sampling model's log-probabilities, as if it were a step behind: the current ones moved by up to 0.6 either
    way, so that ratios leave the clip range on both sides."""
    model = _policy(config)
    sampling = config.replace(grpo={"num_iterations": 1})  # the batch of the step that samples them
    batch = objective_for(sampling, model, 0).batch([{**row, "advantage": 0.0} for row in rows], packed=False)
    with torch.no_grad():
        current = token_logps(model, batch, temperature=config.grpo.temperature)
    moved = current + 1.2 * torch.rand(current.shape, generator=torch.Generator().manual_seed(7)) - 0.6
    return [part.tolist() for part in moved.split([len(row["completion_ids"]) for row in rows])]


def _grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


def _ours(config, rows, packed=False):
    model = _policy(config)
    if packed:
        attend_packed(model)
    objective = objective_for(config, model, load_tokenizer(config).pad_token_id)
    model.train()
    batch = objective.batch(rows, packed=packed)
    loss = objective.loss_sum(model, batch) / objective.units(batch)
    loss.backward()
    return loss.detach(), _grads(model), objective.metrics(objective.take_metric_sums(), objective.units(batch))


def _trl_inputs(rows, pad_token_id, old_logps):
    completions = [torch.tensor(row["completion_ids"]) for row in rows]
    completion_ids = torch.nn.utils.rnn.pad_sequence(completions, batch_first=True, padding_value=pad_token_id)
    completion_mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(c), dtype=torch.long) for c in completions],
                                                      batch_first=True)
    prompt_ids = torch.tensor([row["prompt_ids"] for row in rows])
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor([row["advantage"] for row in rows]),
              "num_items_in_batch": completion_mask.sum()}
    if old_logps is not None:
        inputs["old_per_token_logps"] = torch.nn.utils.rnn.pad_sequence([torch.tensor(x) for x in old_logps],
                                                                        batch_first=True)
    return inputs


def _trl(config, rows, old_logps, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    grpo = config.grpo
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=GROUP, temperature=grpo.temperature,
                      max_completion_length=grpo.max_completion_length, loss_type=grpo.loss_type, beta=grpo.beta,
                      epsilon=grpo.epsilon, epsilon_high=grpo.epsilon_high, per_device_train_batch_size=len(rows),
                      report_to=[], bf16=False, use_cpu=True, gradient_checkpointing=False)
    model, tokenizer = _policy(config), load_tokenizer(config)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_list([{"prompt": "hi"}] * len(rows)), processing_class=tokenizer)
    inputs = _trl_inputs(rows, tokenizer.pad_token_id, old_logps)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets: one micro-batch a step
    if grpo.beta:  # TRL's own reference: the model with its adapter off, as its generation step takes it
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad(), trainer.model.disable_adapter():
            inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                trainer.model, ids, mask, inputs["completion_ids"].shape[1])[0]
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), _grads(model), {name: values[-1] for name, values in trainer._metrics["train"].items()}


@pytest.mark.parametrize("sampled_logps", [False, True], ids=["one_step", "old_logps"])
@pytest.mark.parametrize("beta", [0.0, 0.3])
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_loss_and_gradients_equal_trl(model_folder, tmp_path, loss_type, beta, sampled_logps):
    config = _config(model_folder, loss_type=loss_type, beta=beta, num_iterations=2 if sampled_logps else 1)
    rows = _completions()
    advantages = group_advantages(REWARDS, GROUP)
    old_logps = _old_logps(config, rows) if sampled_logps else None
    ours_rows = [{**row, "advantage": float(a), **({"old_logps": old} if old_logps else {})}
                 for row, a, old in zip(rows, advantages, old_logps or [None] * len(rows))]
    loss, grads, metrics = _ours(config, ours_rows)
    trl_loss, trl_grads, logged = _trl(config, ours_rows, old_logps, tmp_path)

    torch.testing.assert_close(loss, trl_loss, atol=1e-5, rtol=1e-5)
    assert grads.keys() == trl_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], trl_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    for name, value in metrics.items():
        assert value == pytest.approx(logged[name], abs=1e-5), name
    if sampled_logps:  # the clip is in the loss, both ways
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    if beta:
        assert metrics["kl"] > 0.01  # the KL term is in the loss


@pytest.mark.parametrize("layout", ["packed", "full_logits"])
def test_packed_or_full_logits_give_the_padded_chunked_loss_and_gradients(model_folder, layout):
    config = _config(model_folder, loss_type="grpo", beta=0.3)
    rows = [{**row, "advantage": float(a)} for row, a in zip(_completions(), group_advantages(REWARDS, GROUP))]
    padded_loss, padded_grads, _ = _ours(config, rows)
    if layout == "full_logits":
        config = config.replace(training={"chunked_loss": False})
    loss, grads, _ = _ours(config, rows, packed=layout == "packed")
    torch.testing.assert_close(loss, padded_loss, atol=1e-5, rtol=1e-5)
    for name in padded_grads:
        torch.testing.assert_close(grads[name], padded_grads[name], atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("layout", ["chunked", "packed", "full_logits"])
def test_the_entropy_is_the_mean_over_completion_tokens_of_the_sampling_distributions_entropy(model_folder, layout):
    """TRL's ``entropy``: each completion token's distribution at the sampling temperature, its entropy in nats,
    averaged over the tokens; here straight from each sequence's full logits, one at a time."""
    config = _config(model_folder, loss_type="grpo")
    if layout == "full_logits":
        config = config.replace(training={"chunked_loss": False})
    rows = [{**row, "advantage": float(a)} for row, a in zip(_completions(), group_advantages(REWARDS, GROUP))]
    _, _, metrics = _ours(config, rows, packed=layout == "packed")
    model, entropies = _policy(config), []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
            logits = model(input_ids=ids).logits[0, len(row["prompt_ids"]) - 1:-1] / config.grpo.temperature
            probabilities = logits.softmax(-1)
            entropies.append(-(probabilities * probabilities.log()).sum(-1))
    expected = torch.cat(entropies).mean().item()
    assert 0 < expected < torch.log(torch.tensor(1200.0)).item()  # neither certain nor uniform
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)


def test_group_advantages_are_trls():
    from trl.trainer.utils import nanstd

    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, float("nan"), 3.0, 1.0, 2.0])
    grouped = rewards.view(-1, 2)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(2)
    std = nanstd(grouped, dim=1).repeat_interleave(2)
    expected = torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)
    torch.testing.assert_close(group_advantages(rewards, 2), expected)
    assert group_advantages(rewards, 2)[2:6].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards; an unscored one


def test_several_steps_per_generation_batch_need_the_sampling_models_log_probabilities(model_folder):
    config = _config(model_folder, num_iterations=2)
    objective = objective_for(config, _policy(config), 0)
    with pytest.raises(ValueError, match="old_logps"):
        objective.batch([{**row, "advantage": 0.0} for row in _completions()], packed=False)

