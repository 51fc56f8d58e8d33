"""The Ollama Modelfile's template renders a conversation as the Jinja chat template the run trained with.

Ollama renders with Go's text/template; ``render_go`` below is a small renderer of the subset the
translation writes (if/else if/else/end, range over .Messages, variables, eq/not/or/len/slice, string
literals), written for this test only, so that the two renderings can be compared as text.
"""

import json
import re

import pytest

from studio.core.data.templates import BUILTIN_JINJA
from studio.core.export.gguf import go_template, modelfile, ollama_parameters
from studio.core.presets import DEMO_MODEL
from studio.train.export.modelfile import Untranslatable, chat_turns, write_modelfile

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' "
          "+ message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25 = ("{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
          "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
          "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
          "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\") %}{{- '<|im_start|>' + "
          "message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
TEMPLATES = {"built-in chatml": BUILTIN_JINJA["chatml"], "llama-3": LLAMA3, "qwen2.5": QWEN25}
CONVERSATIONS = [
    [{"role": "user", "content": "What is a plum?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Plum?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! {{ not a template }}"},
     {"role": "user", "content": "A fruit, please.\nThanks"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}],
]


# ---------------------------------------------------------------- a renderer of the emitted Go-template subset


def render_go(template: str, data: dict) -> str:
    parts = re.split(r"(\{\{.*?\}\})", template, flags=re.S)
    nodes, _ = _parse(parts, 0)
    out: list[str] = []
    _run(nodes, {"$": data, ".": data}, out)
    return "".join(out)


def _parse(parts, i, stop=("end",)):
    nodes = []
    while i < len(parts):
        part = parts[i]
        if not part.startswith("{{"):
            nodes.append(("text", part))
            i += 1
            continue
        action = part[2:-2].strip()
        word = action.split(" ")[0]
        if word in ("end", "else"):
            return nodes, i
        if word in ("if", "range"):
            body, i = _parse(parts, i + 1)
            branches = [(action, body)]
            while parts[i][2:-2].strip() != "end":
                branch = parts[i][2:-2].strip()
                body, i = _parse(parts, i + 1)
                branches.append((branch, body))
            nodes.append((word, branches))
        else:
            nodes.append(("action", action))
        i += 1
    return nodes, i


def _run(nodes, scope, out):
    for kind, value in nodes:
        if kind == "text":
            out.append(value)
        elif kind == "action" and ":=" in value:
            name, expression = value.split(":=")
            scope[name.strip()] = _eval(expression.strip(), scope)
        elif kind == "action":
            out.append(str(_eval(value, scope)))
        elif kind == "if":
            for condition, body in value:
                test = condition.removeprefix("else").strip()
                if test == "" or _truthy(_eval(test.removeprefix("if").strip(), scope)):
                    _run(body, scope, out)
                    break
        elif kind == "range":
            header, body = value[0]
            names, items = header.removeprefix("range").split(":=")
            index_name, item_name = [n.strip() for n in names.split(",")]
            for index, item in enumerate(_eval(items.strip(), scope)):
                _run(body, {**scope, index_name: index, item_name: item, ".": item}, out)


def _tokens(expression):
    return re.findall(r'"(?:\\.|[^"\\])*"|\(|\)|[^\s()]+', expression)


def _eval(expression, scope):
    tokens = _tokens(expression)
    value, rest = _call(tokens, scope)
    assert not rest, expression
    return value


def _call(tokens, scope):
    functions = {"eq": lambda a, b: a == b, "not": lambda a: not _truthy(a), "or": lambda *a: next(
        (x for x in a if _truthy(x)), a[-1]), "len": len, "slice": lambda x, i: x[i:]}
    head, args = tokens[0], []
    if head not in functions:
        return _operand(tokens, scope)
    rest = tokens[1:]
    while rest and rest[0] != ")":
        value, rest = _operand(rest, scope)
        args.append(value)
    return functions[head](*args), rest


def _operand(tokens, scope):
    token = tokens[0]
    if token == "(":
        value, rest = _call(tokens[1:], scope)
        return value, rest[1:]
    if token.startswith('"') or token.isdigit():
        return json.loads(token), tokens[1:]
    if token.startswith("$."):
        return scope["$"][token[2:]], tokens[1:]
    if token.startswith("$"):
        return scope[token], tokens[1:]
    return scope["."][token[1:]], tokens[1:]


def _truthy(value):
    return bool(value)


# ---------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def ollama_data(messages):
    """What Ollama hands a template: the system prompt in .System, and every message in .Messages."""
    system = next((m["content"] for m in messages if m["role"] == "system"), "")
    return {"System": system, "Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages]}


@pytest.mark.parametrize("name", TEMPLATES)
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=lambda m: "-".join(x["role"][0] for x in m))
def test_the_go_template_renders_a_conversation_as_the_jinja_template(tokenizer, name, messages):
    tokenizer.chat_template = TEMPLATES[name]
    jinja = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    go = render_go(go_template(chat_turns(tokenizer)), ollama_data(messages))
    assert go == jinja.removeprefix(tokenizer.bos_token)  # llama.cpp writes the bos itself


def test_a_modelfile_system_prompt_outside_the_messages_renders_the_same(tokenizer):
    """A Modelfile's SYSTEM line reaches the template as .System alone, not in .Messages."""
    tokenizer.chat_template = BUILTIN_JINJA["chatml"]
    messages = CONVERSATIONS[1]
    data = {**ollama_data(messages), "Messages": ollama_data(messages)["Messages"][1:]}
    jinja = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_go(go_template(chat_turns(tokenizer)), data) == jinja


def test_a_template_that_numbers_its_turns_is_not_translated(tokenizer):
    tokenizer.chat_template = "{% for m in messages %}{{ loop.index }}. {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(Untranslatable):  # a turn is written differently by its position
        chat_turns(tokenizer)


def test_a_single_turn_template_is_left_to_ollama(tokenizer, tmp_path):
    tokenizer.chat_template = BUILTIN_JINJA["alpaca"]
    with pytest.raises(Untranslatable):
        chat_turns(tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.9}))
    kept = write_modelfile(tmp_path, "run-q8_0.gguf", "Modelfile.q8_0", tokenizer,
                           {"template": "alpaca", "end_of_turn": "<|im_end|>"})
    text = (tmp_path / "Modelfile.q8_0").read_text()
    assert "TEMPLATE" not in text and kept["template"] == "from the GGUF" and "not translated" in kept["note"]
    assert "PARAMETER temperature 0.6" in text and "PARAMETER top_p 0.9" in text


def test_a_template_for_tool_calling_is_translated_for_plain_turns_and_says_the_tools_are_left_out(tokenizer,
                                                                                                     tmp_path):
    tokenizer.chat_template = BUILTIN_JINJA["chatml"]  # it renders tools, calls and results (Qwen's convention)
    kept = write_modelfile(tmp_path, "run-q8_0.gguf", "Modelfile.q8_0", tokenizer,
                           {"template": "chatml", "end_of_turn": "<|im_end|>"})
    assert kept["template"] == "translated" and "tool calls and tool results" in kept["note"]
    tokenizer.chat_template = LLAMA3  # this one takes no tools: nothing is left out
    assert not write_modelfile(tmp_path, "run-q8_0.gguf", "Modelfile.q8_0", tokenizer,
                               {"template": "llama-3", "end_of_turn": "<|eot_id|>"})["note"]


def test_the_modelfile_names_its_file_stops_and_defaults():
    text = modelfile("run-f16.gguf", "{{ .Prompt }}", ["<|im_end|>", "</s>"], ollama_parameters({"do_sample": False}))
    assert text.splitlines() == ["FROM ./run-f16.gguf", 'TEMPLATE """{{ .Prompt }}"""', 'PARAMETER stop "<|im_end|>"',
                                 'PARAMETER stop "</s>"', "PARAMETER temperature 0"]
    assert ollama_parameters({"do_sample": True, "top_k": 20, "repetition_penalty": 1.1}) == {"top_k": 20,
                                                                                              "repeat_penalty": 1.1}
