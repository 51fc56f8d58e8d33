"""Rendering, tokenizing, loss masks and splits (studio.train.data.prepare) with a tiny tokenizer built offline."""

import json
import re
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from studio.core.config import RunConfig
from studio.core.data.row_formats import DataError, to_messages
from studio.core.errors import ProblemsError, StudioError
from studio.train.data.prepare import (IGNORE_INDEX, PreparedData, collate, encode, encode_prompt, prepare_data,
                                       render_segments, resolve_template)

SPECIAL = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Hello there, how are you today?", "The capital of France is Paris.", "Translate chat into cat.",
          "Be brief and kind. Bye!", "Once upon a time there was a small model."]

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Capital of France?"},
                     {"role": "assistant", "content": "Paris."}]}
ALPACA = {"instruction": "Translate.", "input": "chat", "output": "cat"}


@pytest.fixture(scope="session")
def backend() -> Tokenizer:
    """A byte-level BPE trained in milliseconds on a few sentences: every string round-trips."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    return tokenizer


def make_tokenizer(backend: Tokenizer, chat_template: str | None = None, adds_bos: bool = False):
    inner = Tokenizer.from_str(backend.to_str())
    if adds_bos:  # like Llama: encoding with special tokens puts <s> first
        inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    tokenizer.chat_template = chat_template
    return tokenizer


@pytest.fixture(scope="session")
def plain(backend):
    """No chat template, no bos: a GPT-2-like base model tokenizer."""
    return make_tokenizer(backend)


@pytest.fixture(scope="session")
def templated(backend):
    """A ChatML chat template of its own, like Qwen."""
    return make_tokenizer(backend, CHATML_TEMPLATE)


@pytest.fixture(scope="session")
def llama_like(backend):
    return make_tokenizer(backend, adds_bos=True)


def trained_text(tokenizer, encoded) -> str:
    """The text of the tokens the loss sees."""
    return tokenizer.decode([i for i, label in zip(encoded["input_ids"], encoded["labels"]) if label != IGNORE_INDEX])


def example(record, fmt="auto"):
    return to_messages(record, fmt, "data.jsonl:7")


# ---------------------------------------------------------------- rendering and loss masks


def test_builtin_chatml_trains_only_on_assistant_turns(plain):
    segments = render_segments(example(CHAT), plain, "auto")  # no tokenizer template: chatml
    encoded = encode(segments, plain, 512, train_on_prompt=False)
    assert trained_text(plain, encoded) == "Hello!<|im_end|>Paris.<|im_end|>"
    assert plain.decode(encoded["input_ids"]) == "".join(text for text, _ in segments)
    assert encoded["truncated"] is False and encoded["input_ids"][0] != plain.bos_token_id


def test_tokenizer_chat_template_is_split_at_assistant_turns(templated):
    assert resolve_template("auto", templated) == "tokenizer"
    segments = render_segments(example(CHAT), templated, "auto")
    assert "".join(text for text, _ in segments) == templated.apply_chat_template(CHAT["messages"], tokenize=False)
    assert [text for text, trainable in segments if trainable] == ["Hello!<|im_end|>\n", "Paris.<|im_end|>\n"]
    encoded = encode(segments, templated, 512)
    assert trained_text(templated, encoded) == "Hello!<|im_end|>\nParis.<|im_end|>\n"


def test_builtin_template_can_be_forced_over_the_tokenizers(templated):
    segments = render_segments(example(CHAT), templated, "chatml")
    assert [text for text, trainable in segments if trainable] == ["Hello!<|im_end|>", "Paris.<|im_end|>"]


def test_alpaca_template_appends_eos_and_refuses_multi_turn(plain):
    segments = render_segments(example(ALPACA), plain, "alpaca")
    assert segments == [("### Instruction:\nTranslate.\n\nchat\n\n### Response:\n", False), ("cat</s>", True)]
    assert trained_text(plain, encode(segments, plain, 512)) == "cat</s>"
    with pytest.raises(DataError, match=r"^data.jsonl:7: the alpaca template renders one instruction"):
        render_segments(example(CHAT), plain, "alpaca")


def test_prompt_completion_and_text_rows(plain):
    pc = encode(render_segments(example({"prompt": "2+2=", "completion": " 4"}), plain, "auto"), plain, 512)
    assert trained_text(plain, pc) == " 4</s>" and plain.decode(pc["input_ids"]) == "2+2= 4</s>"
    assert pc["input_ids"][-1] == plain.eos_token_id  # the eos text becomes the eos token
    text = encode(render_segments(example({"text": "Once upon a time."}), plain, "auto"), plain, 512)
    assert text["labels"] == text["input_ids"] and plain.decode(text["input_ids"]) == "Once upon a time.</s>"


def test_train_on_prompt_unmasks_everything(plain, llama_like):
    for tokenizer in (plain, llama_like):
        encoded = encode(render_segments(example(CHAT), tokenizer, "auto"), tokenizer, 512, train_on_prompt=True)
        assert encoded["labels"] == encoded["input_ids"]


def test_truncation_is_reported(plain):
    segments = render_segments(example(CHAT), plain, "auto")
    full = encode(segments, plain, 512)
    cut = encode(segments, plain, 10)
    assert cut["truncated"] is True and cut["input_ids"] == full["input_ids"][:10] and len(cut["labels"]) == 10
    assert all(label == IGNORE_INDEX for label in cut["labels"])  # the response started later


def test_bos_is_added_once(llama_like, backend):
    encoded = encode(render_segments(example(CHAT), llama_like, "chatml"), llama_like, 512)
    assert encoded["input_ids"][0] == llama_like.bos_token_id and encoded["labels"][0] == IGNORE_INDEX
    assert encoded["input_ids"][1] != llama_like.bos_token_id
    writes_bos = make_tokenizer(backend, "<s>" + CHATML_TEMPLATE, adds_bos=True)
    encoded = encode(render_segments(example(CHAT), writes_bos, "auto"), writes_bos, 512)
    assert encoded["input_ids"][:2] == [writes_bos.bos_token_id, writes_bos.encode("<|im_start|>", add_special_tokens=False)[0]]
    assert encoded["input_ids"].count(writes_bos.bos_token_id) == 1


def test_template_that_renders_history_differently_is_refused(backend):
    counting = make_tokenizer(backend, "{{ messages|length }}" + CHATML_TEMPLATE)
    with pytest.raises(DataError) as info:
        render_segments(example(CHAT), counting, "tokenizer")
    assert str(info.value).startswith("data.jsonl:7: the tokenizer's chat template renders the first 2 messages "
                                      "with the generation prompt differently")
    assert "chatml" in info.value.hint


def test_template_errors_name_the_row(backend):
    strict = make_tokenizer(backend, "{% if messages[0].role == 'system' %}{{ raise_exception('System role not "
                                     "supported') }}{% endif %}" + CHATML_TEMPLATE)
    with pytest.raises(DataError, match=r"data.jsonl:7: the tokenizer's chat template failed: System role not supported"):
        render_segments(example(CHAT), strict, "auto")


def test_tokenizer_template_is_required_when_asked_for(plain):
    with pytest.raises(StudioError, match="the tokenizer has no chat template") as info:
        render_segments(example(CHAT), plain, "tokenizer")
    assert info.value.kind == "data"


@pytest.mark.parametrize("template", ["auto", "chatml"])
def test_encode_prompt_matches_training_tokens(templated, llama_like, template):
    for tokenizer in (templated, llama_like):
        training = encode(render_segments(example(CHAT), tokenizer, template), tokenizer, 512)
        ids, expected = encode_prompt(example(CHAT), tokenizer, template)
        last_response = max(i for i, label in enumerate(training["labels"])
                             if label != IGNORE_INDEX and training["labels"][i - 1] == IGNORE_INDEX)
        assert ids == training["input_ids"][:last_response] and expected == "Paris."
        assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_encode_prompt_for_completions_and_text(plain):
    ids, expected = encode_prompt(example({"prompt": "2+2=", "completion": " 4"}), plain, "auto")
    assert plain.decode(ids) == "2+2=" and expected == " 4"
    with pytest.raises(DataError, match="data.jsonl:7: text rows have no prompt"):
        encode_prompt(example({"text": "x"}), plain, "auto")


def test_collate_pads_right():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": torch.tensor([8]), "labels": [8]}], 0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())


# ---------------------------------------------------------------- prepare_data


def write_jsonl(path: Path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def config_for(train_files, **data) -> RunConfig:
    return RunConfig().replace(data={"train_files": tuple(train_files), **data})


def alpaca_rows(count: int) -> list[dict]:
    return [{"instruction": "Repeat the number.", "input": str(i), "output": str(i)} for i in range(count)]


def test_prepare_data_builds_datasets_and_stats(tmp_path, plain):
    path = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(10))
    prepared = prepare_data(config_for([path]), plain)
    assert isinstance(prepared, PreparedData) and prepared.eval is None
    assert isinstance(prepared.train, datasets.Dataset) and prepared.train.column_names == ["input_ids", "labels"]
    stats = prepared.stats["train"]
    assert stats == {"rows": 10, "tokens": sum(len(r) for r in prepared.train["input_ids"]),
                     "target_tokens": sum(sum(label != IGNORE_INDEX for label in r) for r in prepared.train["labels"]),
                     "truncated": 0, "dropped": 0, "unlearned": 0, "format": "instruction", "template": "chatml"}
    row = prepared.train[3]
    assert trained_text(plain, row) == "3<|im_end|>"


def test_eval_fraction_split_is_seeded(tmp_path, plain):
    path = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(20))

    def held_out(seed):
        prepared = prepare_data(config_for([path], eval_fraction=0.25).replace(training={"seed": seed}), plain)
        assert (prepared.stats["train"]["rows"], prepared.stats["eval"]["rows"]) == (15, 5)
        return sorted(trained_text(plain, row) for row in prepared.eval)

    assert held_out(1) == held_out(1) != held_out(2)


def test_eval_files_make_the_eval_split(tmp_path, templated):
    train = write_jsonl(tmp_path / "train.jsonl", [CHAT] * 4)
    held = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "2+2=", "completion": "4"}] * 2)
    prepared = prepare_data(config_for([train], eval_files=(held,)), templated)
    assert prepared.stats["train"]["template"] == "tokenizer" and prepared.stats["eval"]["format"] == "prompt_completion"
    assert len(prepared.train) == 4 and len(prepared.eval) == 2


def test_truncated_and_dropped_rows_are_counted(tmp_path, plain):
    long_prompt = {"instruction": "word " * 60, "output": "done"}
    long_answer = {"instruction": "Say it.", "output": "word " * 60}
    path = write_jsonl(tmp_path / "train.jsonl", [long_prompt, long_answer, alpaca_rows(1)[0]])
    stats = prepare_data(config_for([path], max_length=64), plain).stats["train"]
    assert (stats["rows"], stats["truncated"], stats["dropped"]) == (2, 1, 1)


def test_rows_whose_response_lies_beyond_max_length_are_named_with_the_length_that_keeps_them(tmp_path, plain):
    long_prompt = {"instruction": "word " * 60, "output": "done"}
    path = write_jsonl(tmp_path / "train.jsonl", [alpaca_rows(1)[0], long_prompt, alpaca_rows(1)[0]])
    prepared = prepare_data(config_for([path], max_length=64), plain)
    [(message, hint)] = prepared.warnings  # the run goes on with the others, and says which row it left out
    assert message.startswith("1 of 3 training rows is left out") and "(train.jsonl:2: after " in message
    assert hint.startswith("the run trains on the other 2 rows; to keep it, raise data.max_length to at least ")
    needed = int(re.search(r"at least (\d+) tokens", hint).group(1))

    only = write_jsonl(tmp_path / "long.jsonl", [long_prompt])
    with pytest.raises(ProblemsError) as refused:  # nothing left to train on: refused, naming the row
        prepare_data(config_for([only], max_length=needed - 1), plain)
    row, summary = refused.value.problems
    assert refused.value.kind == "data" and row.where == "long.jsonl:1"
    assert f"the response starts after {needed - 1} tokens" in row.message and f"at least {needed} tokens" in row.hint
    assert summary.message == "no row is left to train on: the only training row is cut before its response"
    kept = prepare_data(config_for([only], max_length=needed), plain)  # the length it names is enough
    assert kept.stats["train"]["target_tokens"] == 1 and not kept.warnings


def test_bad_data_is_refused_before_tokenizing(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [ALPACA, {"instruction": "x"}, ALPACA, {"instruction": "y", "output": 1}])

    class Untouchable:
        chat_template = None

        def __getattr__(self, name):
            raise AssertionError(f"the tokenizer was used ({name}) before the data was checked")

    with pytest.raises(ProblemsError) as info:
        prepare_data(config_for([path]), Untouchable())
    assert [str(p).split(" (")[0] for p in info.value.problems] == [
        "train.jsonl:2: field 'output' is missing", "train.jsonl:4: field 'output' must be text, got a number"]


def test_rendering_problems_are_collected_with_their_rows(tmp_path, plain):
    path = write_jsonl(tmp_path / "train.jsonl", [{"messages": CHAT["messages"][1:3]}, CHAT, CHAT])
    with pytest.raises(ProblemsError) as info:
        prepare_data(config_for([path], template="alpaca"), plain)
    assert [p.where for p in info.value.problems] == ["train.jsonl:2", "train.jsonl:3"]


def test_too_few_rows_to_hold_out(tmp_path, plain):
    path = write_jsonl(tmp_path / "train.jsonl", alpaca_rows(1))
    with pytest.raises(StudioError, match="cannot hold out 50% of 1 row"):
        prepare_data(config_for([path], eval_fraction=0.5), plain)


@pytest.mark.parametrize("row, kind", [({"prompt": "2+2=", "completion": "4"}, "prompt_completion"),
                                       ({"instruction": "Add 2 and 2.", "output": "4"}, "chat")])
def test_try_it_puts_the_prompt_as_the_run_s_rows_did_when_the_format_was_detected(tmp_path, row, kind):
    """A run left on format auto: Try it asks in the shape its rows had (a raw prompt, or a user's message)."""
    from studio.train.evaluation.generate import prompt_example

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    config = RunConfig().replace(data={"train_files": (str(data),), "format": "auto"})
    assert prompt_example(config, "What is 3+3?").kind == kind
