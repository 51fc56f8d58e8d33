"""Exports are usable as trained: the chat template and end of turn training used, and a model card."""

import json
import shutil

import pytest
import torch

from helpers import quick_config
from studio.core.data.templates import BUILTIN_JINJA, render
from studio.core.export.model_card import front_matter
from studio.core.presets import DEMO_HELDOUT, DEMO_MODEL
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.train.export.chat import end_of_turn
from studio.train.export.hf_format import export_run
from studio.train.worker import run

CONVERSATIONS = [
    [{"role": "user", "content": "What kind of thing is a plum?"}, {"role": "assistant", "content": "a fruit"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And a cat?"},
     {"role": "assistant", "content": "an animal"}],
]
END_OF_TURN = "<|im_end|>"


def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.mark.parametrize("template, conversations", [("chatml", CONVERSATIONS), ("alpaca", CONVERSATIONS[:1])])
def test_a_built_in_template_as_jinja_renders_what_training_rendered(template, conversations):
    tokenizer = demo_tokenizer()
    tokenizer.chat_template = BUILTIN_JINJA[template]
    for messages in conversations:
        trained = "".join(text for text, _ in render(template, messages, tokenizer.eos_token))
        assert tokenizer.apply_chat_template(messages, tokenize=False) == trained
        prompt = "".join(text for text, _ in render(template, messages[:-1] + [{"role": "assistant", "content": ""}],
                                                    tokenizer.eos_token)[:-1])
        assert tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True) == prompt


@pytest.mark.parametrize("template, chat_template, expected", [
    ("chatml", None, END_OF_TURN), ("alpaca", None, "<s>"), ("none", None, "<s>"),
    ("tokenizer", "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<pad>\n{% endfor %}", "<pad>"),
    ("tokenizer", "{{ raise_exception('a system turn first') }}", "<s>"),  # falls back to the eos
])
def test_the_end_of_turn_is_what_the_template_ends_a_response_with(template, chat_template, expected):
    tokenizer = demo_tokenizer()
    tokenizer.eos_token, tokenizer.chat_template = "<s>", chat_template
    assert end_of_turn(tokenizer, template) == expected


@pytest.fixture(scope="module")
def base_without_template(tmp_path_factory):
    """The demo model as a base model: no chat template, its eos another token than ChatML's end of turn,
    and a card declaring a license."""
    folder = tmp_path_factory.mktemp("base") / "tiny-base"
    shutil.copytree(DEMO_MODEL, folder)
    (folder / "chat_template.jinja").unlink()
    for name, key, value in (("tokenizer_config.json", "eos_token", "<s>"), ("generation_config.json", "eos_token_id", 1)):
        settings = json.loads((folder / name).read_text())
        settings[key] = value
        (folder / name).write_text(json.dumps(settings))
    (folder / "README.md").write_text("---\nlicense: apache-2.0\n---\n# a tiny base\n")
    return folder


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, small_data, base_without_template):
    config = quick_config(small_data, training={"max_steps": 8, "learning_rate": 1e-2},
                          model={"name_or_path": str(base_without_template)})
    code, run_dir = run(config, tmp_path_factory.mktemp("chat") / "run", watch_stdin=False)
    assert code == EXIT_OK
    return config, run_dir


def demo_question() -> list[dict]:
    return [{"role": "user", "content": json.loads(DEMO_HELDOUT.read_text().splitlines()[0])["instruction"]}]


def greedy_answer(model, tokenizer, max_new_tokens: int = 24) -> list[int]:
    inputs = tokenizer.apply_chat_template(demo_question(), add_generation_prompt=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.slow
def test_the_merged_model_stops_by_itself_at_the_trained_end_of_turn(chat_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_dir = chat_run
    out, _ = export_run(run_dir.path, "merged", tmp_path / "merged", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == END_OF_TURN  # the base's eos was <s>: training taught <|im_end|>
    assert tokenizer.chat_template == BUILTIN_JINJA["chatml"]  # auto chose the built-in ChatML for a base
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [end, 1]
    answer = greedy_answer(AutoModelForCausalLM.from_pretrained(out).eval(), tokenizer)
    assert answer[-1] == end and len(answer) < 24, tokenizer.decode(answer)
    record = json.loads((out / "studio_export.json").read_text())
    assert record["chat"] == {"template": "chatml", "end_of_turn": END_OF_TURN, "eos_token_ids": [end, 1]}


@pytest.mark.slow
def test_the_adapter_loaded_with_peft_stops_by_itself_and_its_card_says_how_it_was_made(chat_run, tmp_path):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer, GenerationConfig

    config, run_dir = chat_run
    out, verification = export_run(run_dir.path, "adapter", tmp_path / "adapter")
    model = AutoPeftModelForCausalLM.from_pretrained(out).eval()  # as the card says
    model.generation_config = GenerationConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    answer = greedy_answer(model, tokenizer)
    assert answer[-1] == tokenizer.convert_tokens_to_ids(END_OF_TURN) and len(answer) < 24, tokenizer.decode(answer)

    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "peft" and meta["license"] == "apache-2.0" and "lora" in meta["tags"]
    assert "base_model" not in meta  # a local folder is no Hub id
    events = read_events(run_dir.events)
    last_step = [e for e in events if e["type"] == "step"][-1]
    data = next(e for e in events if e["type"] == "run_started")["data"]["train"]
    assert f"| steps trained | {last_step['step']} |" in card
    assert f"| final train loss | {last_step['loss']:.4f} |" in card
    assert f"| train | {data['rows']:,} | {data['tokens']:,} | {data['target_tokens']:,} | instruction | chatml |" in card
    assert f"| LoRA rank / alpha / dropout | {config.lora.r} / {config.lora.alpha:g} / 0 |" in card
    assert f"passed, max logit difference {verification.max_abs_diff:.3g}" in card
    assert "| estimated peak |" in card and "| measured peak, cpu |" in card
    assert 'AutoPeftModelForCausalLM.from_pretrained("PATH/TO/THIS/FOLDER")' in card
    assert "studio export RUN --gguf" in card  # where llama.cpp, Ollama and LM Studio users go next
