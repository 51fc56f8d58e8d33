"""Padding-free packing and the chunked loss change the cost of a step, never its numbers."""

import itertools

import pytest
import torch

from helpers import losses, quick_config
from model_factory import tiny_config
from studio.core.model.info import SUPPORTED_MODEL_TYPES
from studio.core.run.commands import EXIT_OK
from studio.train.data.packed_attention import attend_packed
from studio.train.data.packing import pack, packing_refusal, real_tokens
from studio.train.data.prepare import IGNORE_INDEX, collate
from studio.train.objectives.next_token import chunked_cross_entropy, lean_output_layer, token_loss_sum
from studio.train.worker import BatchPlan, run

LENGTHS = (5, 17, 3, 11, 9, 16)


def tiny_model(family: str, packed: bool = False, **overrides):
    """A random tiny model of the family; ``packed`` switches it to per-example attention, as the worker does."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(family, **overrides)))
    model.config.use_cache = False
    if packed:
        assert packing_refusal(model) is None
        attend_packed(model)
    return model


def examples(lengths=LENGTHS, vocab=512, seed=0):
    """Random token rows with a masked prompt: the first third of each carries no loss."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        prompt = n // 3
        rows.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return rows


def per_token_losses(model, batch):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs).logits.float()
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:],
                                               ignore_index=IGNORE_INDEX, reduction="none")
    return torch.nn.functional.pad(losses, (1, 0))  # losses[r, t]: predicting token t of row r


def padded_example_losses(model, rows):
    table = per_token_losses(model, collate(rows, 0))
    return [float(table[i, :len(row["input_ids"])].sum()) for i, row in enumerate(rows)]


def packed_example_losses(model, rows):
    row = per_token_losses(model, pack(rows))[0]
    ends = list(itertools.accumulate(len(r["input_ids"]) for r in rows))
    return [float(row[end - len(r["input_ids"]):end].sum()) for r, end in zip(rows, ends)]


@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_a_packed_row_gives_every_example_its_padded_loss(family):
    rows = examples()
    with torch.no_grad():
        padded = padded_example_losses(tiny_model(family).eval(), rows)
        packed = packed_example_losses(tiny_model(family, packed=True).eval(), rows)
    assert packed == pytest.approx(padded, rel=1e-5, abs=1e-5)
    batch = pack(rows)
    assert real_tokens(batch) == sum(LENGTHS) == batch["input_ids"].numel()  # not one position of padding


def test_a_sliding_window_shorter_than_an_example_still_holds_when_packed():
    rows = examples()  # up to 17 tokens: a window of 4 cuts into most of them
    with torch.no_grad():
        padded = padded_example_losses(tiny_model("mistral", sliding_window=4).eval(), rows)
        packed = packed_example_losses(tiny_model("mistral", packed=True, sliding_window=4).eval(), rows)
        unwindowed = packed_example_losses(tiny_model("mistral", packed=True, sliding_window=None).eval(), rows)
    assert packed == pytest.approx(padded, rel=1e-5, abs=1e-5)
    assert unwindowed != pytest.approx(padded, rel=1e-3)  # the window matters here, so the test can see it


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # sdpa's mask, and eager's (soft-capped) one
def test_padded_batches_keep_their_mask_under_packed_attention(family):
    rows = examples()
    with torch.no_grad():
        plain = per_token_losses(tiny_model(family).eval(), collate(rows, 0))
        switched = per_token_losses(tiny_model(family, packed=True).eval(), collate(rows, 0))
    torch.testing.assert_close(switched, plain, rtol=1e-5, atol=1e-5)


def test_a_model_switched_to_packed_attention_still_generates_as_before():
    prompt = torch.tensor([examples()[1]["input_ids"]])
    outputs = [tiny_model("llama", packed=packed).eval().generate(prompt, max_new_tokens=6, do_sample=False,
                                                                  use_cache=True, pad_token_id=0)
               for packed in (False, True)]
    assert outputs[1].tolist() == outputs[0].tolist()


def test_packing_keeps_the_target_tokens_and_the_gradients():
    rows = examples()
    padded, packed = collate(rows, 0), pack(rows)
    count = lambda batch: int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())  # noqa: E731
    assert count(packed) == count(padded)
    grads = []
    for batch in (padded, packed):
        model = tiny_model("llama", packed="position_ids" in batch)
        token_loss_sum(model, batch).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6)


def test_the_switch_to_packed_attention_stays_out_of_saved_models(tmp_path):
    model = tiny_model("llama", packed=True)
    model.save_pretrained(tmp_path)
    assert "studio_packed" not in (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_loss_equals_the_full_loss_and_gradients(tied):
    rows, results = examples(), []
    for chunked in (False, True):
        model = tiny_model("llama", packed=True, tie_word_embeddings=tied)
        layer = lean_output_layer(model) if chunked else None
        loss = token_loss_sum(model, pack(rows), layer)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (full, full_grads), (chunked, chunked_grads) = results
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chunks_are_summed_exactly():
    generator = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(16, 300, bias=False)
    hidden, targets = torch.randn(37, 16, generator=generator), torch.randint(0, 300, (37,), generator=generator)
    whole = chunked_cross_entropy(hidden, targets, layer)
    in_chunks = chunked_cross_entropy(hidden, targets, layer, chunk_bytes=4 * 300 * 5)  # 8 chunks of 5 tokens
    torch.testing.assert_close(in_chunks, whole)
    torch.testing.assert_close(whole, torch.nn.functional.cross_entropy(layer(hidden), targets, reduction="sum"))


def test_models_with_transformed_logits_keep_the_full_loss():
    model = tiny_model("llama")
    model.config.final_logit_softcapping = 30.0
    assert lean_output_layer(model) is None


def test_length_grouping_is_deterministic_and_groups_similar_lengths():
    lengths = [(i * 37) % 101 + 1 for i in range(400)]
    plan, again = BatchPlan(400, 8, seed=3, lengths=lengths), BatchPlan(400, 8, seed=3, lengths=lengths)
    plain = BatchPlan(400, 8, seed=3)
    spread = lambda p, i: max(lengths[r] for r in p.rows_of(i)) - min(lengths[r] for r in p.rows_of(i))  # noqa: E731
    assert [again.rows_of(i) for i in range(60)] == [plan.rows_of(i) for i in range(60)]
    assert sorted(sum((plan.rows_of(i) for i in range(50)), [])) == list(range(400))  # one epoch, every row once
    assert sum(spread(plan, i) for i in range(50)) * 5 < sum(spread(plain, i) for i in range(50))


def packing_config(data, packing: str, chunked: bool):
    return quick_config(data, data={"packing": packing}, training={"chunked_loss": chunked, "max_steps": 4})


@pytest.mark.slow
def test_packed_chunked_training_follows_the_padded_full_loss_curve(tmp_path, small_data):
    curves = {}
    for name, packing, chunked in [("padded", "none", False), ("packed", "padding_free", True),
                                   ("grouped", "length_grouped", True)]:
        code, run_dir = run(packing_config(small_data, packing, chunked), tmp_path / name, watch_stdin=False)
        assert code == EXIT_OK
        curves[name] = losses(run_dir)
    assert curves["packed"] == pytest.approx(curves["padded"], rel=1e-4)
    assert curves["grouped"][-1] < curves["grouped"][0]


def test_only_models_that_keep_packed_examples_apart_are_packed():
    from transformers import AutoConfig, AutoModelForCausalLM

    assert packing_refusal(tiny_model("llama")) is None and packing_refusal(tiny_model("gpt2")) is None
    # Bloom's ALiBi attention never sees the position ids (Falcon's did until transformers 5.25 kept them apart)
    bloom = AutoModelForCausalLM.from_config(AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=1,
                                                                  n_head=2))
    attention = bloom.config._attn_implementation
    assert "bloom models" in packing_refusal(bloom)
    assert bloom.config._attn_implementation == attention  # and the model is handed back as it was
    assert packing_refusal(tiny_model("llama", attn_implementation="eager")) is None
    assert "sdpa or eager" in packing_refusal(tiny_model("llama", attn_implementation="flex_attention"))
