"""Tool-calling and reasoning rows: read in the OpenAI / TRL and LLaMA-Factory shapes, rendered through the
tokenizer's template (tools=) or the built-in ChatML, learned as the settings say, and refused by line and field
when they are malformed."""

import json

import pytest

from test_data_pipeline import backend, make_tokenizer, trained_text  # noqa: F401 (backend: a fixture)
from studio.core.data.dataset import inspect_files
from studio.core.data.row_formats import to_messages
from studio.core.data.templates import BUILTIN_JINJA, Learning, render
from studio.core.errors import ProblemsError
from studio.core.presets import AGENT_CHAT
from studio.gui.state.data_preview import TokenizerInfo, render_example
from studio.train.data.prepare import encode, render_segments

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}
TOOL_ROW = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny and 21 C."}]}
REASONING_ROW = {"messages": [
    {"role": "user", "content": "Is 7 prime?"},
    {"role": "assistant", "reasoning_content": "7 has no divisor but 1 and 7.", "content": "Yes."}]}
LLAMA_FACTORY_ROW = {"tools": json.dumps([WEATHER["function"]]), "conversations": [
    {"from": "human", "value": "Weather in Paris?"},
    {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
    {"from": "observation", "value": "sunny, 21 C"},
    {"from": "gpt", "value": "Sunny and 21 C."}]}

# Modelled on Qwen3's: tools in the system turn, calls in <tool_call>, results as a user turn of <tool_response>,
# reasoning_content in <think> (here for every turn: Qwen3's keeps only the last turns').
QWEN_LIKE = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}"
    "{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ m.content }}{% for call in m.tool_calls or [] %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}"
    "{{ call.function.arguments | tojson + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def qwen_like(backend):  # noqa: F811
    return make_tokenizer(backend, QWEN_LIKE)


@pytest.fixture(scope="module")
def plain(backend):  # noqa: F811
    return make_tokenizer(backend)


def example(record):
    return to_messages(record, "auto", "agent.jsonl:3")


def learned(tokenizer, record, template="auto", learning=Learning()) -> str:
    return trained_text(tokenizer, encode(render_segments(example(record), tokenizer, template, learning), tokenizer,
                                          1024))


# ---------------------------------------------------------------- what is learned


@pytest.mark.parametrize("template", ["auto", "chatml"])  # the tokenizer's (tools=), the built-in
def test_the_loss_covers_the_call_and_the_answer_never_the_tool_result(qwen_like, template):
    text = learned(qwen_like, TOOL_ROW, template)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "Sunny and 21 C." in text
    assert "sunny, 21 C" not in text and "Weather in Paris" not in text and "<tools>" not in text
    whole = "".join(segment for segment, _ in render_segments(example(TOOL_ROW), qwen_like, template))
    assert '"name": "get_weather", "description"' in whole and "<tool_response>\nsunny, 21 C" in whole


def test_the_tokenizer_template_gets_the_tools(qwen_like):
    segments = render_segments(example(TOOL_ROW), qwen_like, "auto")
    assert "".join(text for text, _ in segments) == qwen_like.apply_chat_template(
        TOOL_ROW["messages"], tools=TOOL_ROW["tools"], tokenize=False)


def test_llama_factory_function_calls_read_as_the_openai_shape():
    assert example(LLAMA_FACTORY_ROW).messages == example(TOOL_ROW).messages[:1] + (
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C"}, {"role": "assistant", "content": "Sunny and 21 C."})
    assert example(LLAMA_FACTORY_ROW).tools == (WEATHER,)


@pytest.mark.parametrize("template", ["auto", "chatml"])
def test_reasoning_is_learned_or_masked_as_the_setting_says(qwen_like, template):
    assert "<think>\n7 has no divisor but 1 and 7.\n</think>\n\nYes." in learned(qwen_like, REASONING_ROW, template)
    masked = learned(qwen_like, REASONING_ROW, template, Learning(reasoning=False))
    assert "divisor" not in masked and "</think>" not in masked and masked.startswith("\n\nYes.")


def test_think_tags_in_the_content_are_the_reasoning_and_thinking_is_read_as_reasoning_content(plain):
    tagged = {"messages": [REASONING_ROW["messages"][0],
                           {"role": "assistant", "content": "<think>7 is odd and not 3 times 3.</think>Yes."}]}
    assert learned(plain, tagged, "chatml", Learning(reasoning=False)).startswith("Yes.")
    thinking = {"messages": [REASONING_ROW["messages"][0], {"role": "assistant", "thinking": "odd", "content": "Yes."}]}
    assert example(thinking).messages[1]["reasoning_content"] == "odd"


def test_a_turn_marked_train_false_or_weight_0_is_not_learned_and_last_turn_only_learns_the_answer(qwen_like):
    called, _, answered = TOOL_ROW["messages"][1:]
    for mark in ({"train": False}, {"weight": 0}):
        row = {**TOOL_ROW, "messages": [*TOOL_ROW["messages"][:3], {**answered, **mark}]}
        assert "Sunny and 21 C." not in learned(qwen_like, row) and "<tool_call>" in learned(qwen_like, row)
    only_last = learned(qwen_like, TOOL_ROW, learning=Learning(last_turn_only=True))
    assert "<tool_call>" not in only_last and "Sunny and 21 C." in only_last


def test_a_row_whose_turns_are_all_train_false_contributes_no_learned_tokens(plain):
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "train": False}]}
    assert learned(plain, row, "chatml") == ""


# ---------------------------------------------------------------- the built-in template's Jinja, the preview


def test_the_built_in_chatml_as_jinja_renders_tools_and_reasoning_as_training_did(plain):
    tokenizer = make_tokenizer_copy(plain, BUILTIN_JINJA["chatml"])
    for record in (TOOL_ROW, REASONING_ROW, {**TOOL_ROW, "messages": [{"role": "system", "content": "Be brief."},
                                                                      *TOOL_ROW["messages"]]}):
        row = example(record)
        trained = "".join(text for text, _ in render("chatml", row.messages, tools=row.tools))
        assert tokenizer.apply_chat_template(list(row.messages), tools=list(row.tools) or None, tokenize=False) \
            == trained


def make_tokenizer_copy(tokenizer, chat_template):
    import copy

    copied = copy.deepcopy(tokenizer)
    copied.chat_template = chat_template
    return copied


@pytest.mark.parametrize("template", ["tokenizer", "chatml"])
def test_the_preview_masks_calls_and_results_as_training_does(qwen_like, template):
    info = TokenizerInfo(QWEN_LIKE, {"eos_token": "</s>", "bos_token": "<s>"})
    for learning in (Learning(), Learning(reasoning=False)):
        for record in (TOOL_ROW, REASONING_ROW):
            assert render_example(example(record), template, info, learning=learning) == \
                render_segments(example(record), qwen_like, template, learning)


# ---------------------------------------------------------------- bad rows


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"},
                   {"role": "assistant", "content": "a"}]}, "messages[1] is a tool result with no tool call before it"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": "get it"},
                   {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]},
     "messages[1].tool_calls must be a list of tool calls, got text 'get it'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{}]},
                   {"role": "tool", "content": "r"}, {"role": "assistant", "content": "a"}]},
     "messages[1].tool_calls[0] names no function"),
    ({"tools": [{"description": "no name"}], "messages": REASONING_ROW["messages"]},
     "field 'tools'[0] is not a function's JSON schema"),
    ({"tools": "get_weather", "messages": REASONING_ROW["messages"]},
     "field 'tools' must be a list of JSON schemas of functions, got text 'get_weather'"),
    ({"messages": TOOL_ROW["messages"][:2] + [{"role": "user", "content": "and?"}, TOOL_ROW["messages"][3]]},
     "messages[2]: the tool calls of messages[1] get no result"),
    ({"messages": TOOL_ROW["messages"][:2] + [{**TOOL_ROW["messages"][2], "tool_call_id": "call_9"}]
      + TOOL_ROW["messages"][3:]}, "messages[2].tool_call_id 'call_9' is not the id of a call it answers"),
    ({"messages": [REASONING_ROW["messages"][0], {"role": "assistant", "content": "a", "train": "no"}]},
     "messages[1].train must be true or false"),
])
def test_a_bad_tool_row_names_its_file_line_and_field(tmp_path, row, message):
    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps(REASONING_ROW) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ProblemsError) as caught:
        inspect_files([data])
    (problem,) = caught.value.problems
    assert problem.where == "agent.jsonl:2" and message in problem.message, problem


def test_a_tokenizer_template_without_tools_is_refused_rather_than_dropping_them(backend):  # noqa: F811
    chatml_only = make_tokenizer(backend, "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
                                          "'<|im_end|>\\n' }}{% endfor %}")
    with pytest.raises(Exception, match="agent.jsonl:3: the tokenizer's chat template leaves out the tool"):
        render_segments(example(TOOL_ROW), chatml_only, "auto")


def test_the_length_histogram_counts_the_reasoning_and_the_tool_turns(tmp_path, backend):  # noqa: F811
    from studio.gui.state.data_preview import build_preview

    backend.save(str(tmp_path / "tokenizer.json"))
    info = TokenizerInfo(None, {"eos_token": "</s>"}, tmp_path / "tokenizer.json")
    without = {"messages": [REASONING_ROW["messages"][0], {"role": "assistant", "content": "Yes."}]}
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in (without, REASONING_ROW, TOOL_ROW)))
    lengths = build_preview([str(data)], "auto", "chatml", info).lengths
    reasoning = len(backend.encode("<think>\n7 has no divisor but 1 and 7.\n</think>\n\n", add_special_tokens=False).ids)
    assert lengths[1] - lengths[0] >= reasoning - 2  # a token or two may merge across the borders
    assert lengths[2] > len(backend.encode(json.dumps(WEATHER), add_special_tokens=False).ids)


# ---------------------------------------------------------------- the demo rows: exported and trained


def test_an_export_of_the_built_in_template_renders_the_tools_as_training_did(plain, tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from studio.train.export.chat import carry_chat_template

    exported = carry_chat_template(make_tokenizer_copy(plain, None), "chatml", tmp_path, GenerationConfig())
    saved = AutoTokenizer.from_pretrained(tmp_path)
    assert exported.end_of_turn == saved.eos_token == "<|im_end|>"
    for row in inspect_files([AGENT_CHAT]).examples:
        trained = "".join(text for text, _ in render_segments(row, plain, "chatml"))
        assert saved.apply_chat_template(list(row.messages), tools=list(row.tools) or None, tokenize=False) == trained


def test_a_short_run_on_the_demo_tool_and_reasoning_rows_learns_them(tmp_path):
    from helpers import losses, quick_config
    from studio.core.run.commands import EXIT_OK
    from studio.train.worker import run

    config = quick_config(AGENT_CHAT, data={"train_files": (str(AGENT_CHAT),), "template": "chatml",
                                            "max_length": 512})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    steps = losses(run_dir)
    assert steps[-1] < 0.7 * steps[0], steps


def test_the_data_panel_previews_the_reasoning_learned_or_masked_as_the_toggle_says(qtbot):
    from studio.core.presets import demo_config
    from studio.gui.panels.data import DataPanel
    from studio.gui.widgets.common import ConfigStore

    store = ConfigStore(demo_config().replace(data={"train_files": (str(AGENT_CHAT),), "template": "chatml"}))
    panel = DataPanel(store)
    qtbot.addWidget(panel)

    def reasoning_learned() -> bool | None:
        if panel.task.busy or panel.preview is None:
            return None
        segments = panel.preview.examples[2].segments  # the row with reasoning_content
        return any("part of a face" in text for text, trainable in segments if trainable)

    qtbot.waitUntil(lambda: reasoning_learned() is True, timeout=20000)
    panel.learn_reasoning.check.setChecked(False)
    assert store.config.data.learn_reasoning is False
    qtbot.waitUntil(lambda: reasoning_learned() is False, timeout=20000)


def test_preference_and_prompt_only_rows_carry_their_tools_into_the_prompt(plain):
    from studio.train.data.prepare import prompt_only_text

    pair = {"tools": [WEATHER], "prompt": TOOL_ROW["messages"][:1], "chosen": TOOL_ROW["messages"][1:],
            "rejected": [{"role": "assistant", "content": "No idea."}]}
    assert "<tools>" in "".join(text for text, _ in render_segments(example(pair), plain, "chatml"))
    prompt = to_messages({"tools": [WEATHER], "prompt": TOOL_ROW["messages"][:1]}, "prompt_only", "grpo.jsonl:1")
    assert prompt_only_text(prompt, plain, "chatml").endswith("Weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "get_weather"' in prompt_only_text(prompt, plain, "chatml")


def test_rows_with_no_turn_to_learn_are_left_out_by_name_and_a_dataset_of_them_is_refused(tmp_path, plain):
    from studio.core.config import RunConfig
    from studio.train.data.prepare import prepare_data

    silent = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "train": False}]}
    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps(REASONING_ROW) + "\n" + json.dumps(silent) + "\n")
    config = RunConfig().replace(data={"train_files": (str(data),), "template": "chatml"})
    prepared = prepare_data(config, plain)
    assert prepared.stats["train"]["rows"] == 1 and prepared.stats["train"]["unlearned"] == 1
    ((message, _),) = prepared.warnings
    assert message.startswith("1 of 2 training rows learn nothing") and "(agent.jsonl:2)" in message
    data.write_text(json.dumps(silent) + "\n")
    with pytest.raises(ProblemsError, match="no row is left to train on: 1 of the training rows learn nothing"):
        prepare_data(config, plain)


def test_parquet_rows_read_as_json_rows_though_parquet_fills_every_field_with_nulls(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def arguments_as_text(record):  # as Hub datasets store them: one schema for every call's arguments
        messages = [{**m, "tool_calls": [{**call, "function": {**call["function"], "arguments": json.dumps(
            call["function"]["arguments"])}} for call in m["tool_calls"]]} if "tool_calls" in m else m
            for m in record["messages"]]
        return {**record, "messages": messages}

    rows = [arguments_as_text(TOOL_ROW), REASONING_ROW]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "agent.parquet")
    read = inspect_files([tmp_path / "agent.parquet"]).examples
    assert [row.messages for row in read] == [example(row).messages for row in (TOOL_ROW, REASONING_ROW)]
    assert read[0].tools[0]["function"]["name"] == "get_weather"


def test_the_preview_names_the_row_a_template_without_tools_cannot_render(tmp_path, backend):  # noqa: F811
    from studio.core.data.row_formats import DataError
    from studio.gui.state.data_preview import rows_beyond

    backend.save(str(tmp_path / "tokenizer.json"))
    no_tools = TokenizerInfo("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}",
                             {"eos_token": "</s>"}, tmp_path / "tokenizer.json")
    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps(REASONING_ROW) + "\n" + json.dumps(TOOL_ROW) + "\n")
    with pytest.raises(DataError, match="agent.jsonl:1: the tokenizer's chat template leaves out the reasoning"):
        rows_beyond([str(data)], "chat", "auto", no_tools, 512)  # studio config check's count of every row


def test_last_turn_only_in_the_config_leaves_the_tool_call_out_of_the_loss(tmp_path, plain):
    from studio.core.config import RunConfig
    from studio.train.data.prepare import prepare_data

    data = tmp_path / "agent.jsonl"
    data.write_text(json.dumps(TOOL_ROW) + "\n")
    for last_turn_only, call_learned in ((False, True), (True, False)):
        config = RunConfig().replace(data={"train_files": (str(data),), "template": "chatml",
                                           "last_turn_only": last_turn_only, "max_length": 1024})
        text = trained_text(plain, prepare_data(config, plain).train[0])
        assert ("<tool_call>" in text) is call_learned and "Sunny and 21 C." in text


def test_a_template_that_drops_earlier_turns_reasoning_as_qwen3_s_trains_the_last_turn_only(backend):  # noqa: F811
    history_drops_reasoning = make_tokenizer(backend, (
        "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}"
        "{% endif %}{% endfor %}" + QWEN_LIKE.replace("{% if m.reasoning_content %}",
                                                     "{% if m.reasoning_content and loop.index0 > ns.last %}")))
    two_turns = {"messages": [*REASONING_ROW["messages"], {"role": "user", "content": "And 9?"},
                              {"role": "assistant", "reasoning_content": "9 is 3 times 3.", "content": "No."}]}
    with pytest.raises(Exception, match="(?s)leaves out the reasoning '7 has no divisor.*set data.last_turn_only"):
        learned(history_drops_reasoning, two_turns)
    text = learned(history_drops_reasoning, two_turns, learning=Learning(last_turn_only=True))
    assert text == "<think>\n9 is 3 times 3.\n</think>\n\nNo.<|im_end|>\n"
