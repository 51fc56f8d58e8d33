"""Built-in chat templates, for tokenizers without one (base models) or by choice, and which text is learned.

A rendered conversation is a list of segments ``(text, trainable)``. Trainable
text is what the model learns to produce: each assistant turn's content (its
tool calls and reasoning included) and its end marker; headers, system, user
and tool turns are context the loss ignores. ``Learning`` narrows that: only the
last assistant turn (data.last_turn_only), a turn marked ``train: false``, a
turn's reasoning (data.learn_reasoning off: the text up to the ``</think>``
closing it). Keeping the text in segments rather than one string lets the
tokenizer side mask exactly those characters, and rebuild for generation the
very prompt that training put before a response.

- chatml: ``<|im_start|>{role}\\n{content}<|im_end|>`` turns joined by newlines;
  generation starts after ``<|im_start|>assistant\\n``. Tools and reasoning in
  Qwen's (Hermes') convention: the tools' JSON schemas in the system turn inside
  ``<tools></tools>``, each call as ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  after the assistant's content, the results of a turn's calls as one user turn
  of ``<tool_response>\\n{result}\\n</tool_response>``, and the reasoning first
  in the assistant's turn as ``<think>\\n{reasoning}\\n</think>\\n\\n``.
- alpaca: ``### Instruction:\\n{user}\\n\\n### Response:\\n{assistant}{eos}``,
  with the system turn (if any) as a preamble; single-turn only, no tools.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from studio.core.data.row_formats import DataError, has_images

Segment = tuple[str, bool]
Message = dict[str, Any]
BUILTIN_TEMPLATES = ("chatml", "alpaca")
CHATML_END = "<|im_end|>"
THINK_START, THINK_END = "<think>", "</think>"
_THINK = re.compile(r"<think>(.*?)</think>", re.S)


@dataclass(frozen=True)
class Learning:
    """Which assistant text the loss covers: every assistant turn or the last, the reasoning or not, and
    whether a turn's ``train: false`` counts."""

    last_turn_only: bool = False
    reasoning: bool = True
    per_message: bool = True

    @classmethod
    def of(cls, data: Any) -> "Learning":
        """The run's choice: its DataConfig's last_turn_only and learn_reasoning."""
        return cls(data.last_turn_only, data.learn_reasoning)


PROMPTING = Learning(last_turn_only=True, per_message=False)
"""For finding the prompt of the final response: that turn learned whole, whatever the row or the run say."""


def render(template: str, messages: Sequence[Message], eos_token: str = "", tools: Sequence[dict] = (),
           learning: Learning = Learning()) -> list[Segment]:
    """Render a conversation with a built-in template into merged segments.

    ``eos_token`` ends the response where the template has no end marker of
    its own (alpaca), so that the model learns to stop. Images are the model's own template's to render.
    """
    if has_images(messages):
        raise DataError("", f"a row with images needs the model's own chat template, not {template}",
                        "set data.template to auto or tokenizer (the model's template renders image parts)")
    renderers = {"chatml": _chatml, "alpaca": _alpaca}
    if template not in renderers:
        raise DataError("data.template", f"{template!r} is not a built-in template", "use " + " or ".join(BUILTIN_TEMPLATES))
    return merge_segments(renderers[template](messages, eos_token, tools, learning))


def generation_prompt(template: str, messages: Sequence[Message], eos_token: str = "",
                      tools: Sequence[dict] = ()) -> str:
    """The text a model continues to answer the conversation's last user turn.

    A final assistant turn (the reference answer) is left out; the result is
    the same text that training put before that turn, ending with the
    assistant header.
    """
    context = list(messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages)
    segments = render(template, context + [{"role": "assistant", "content": ""}], eos_token, tools, PROMPTING)
    return "".join(text for text, _ in prompt_segments(segments))


def learned_turns(messages: Sequence[Message], learning: Learning) -> set[int]:
    """The indices of the assistant turns the loss covers."""
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if learning.last_turn_only:
        turns = turns[-1:]
    return {index for index in turns if not learning.per_message or messages[index].get("train", True)}


def reasoning_of(message: Message) -> str:
    """An assistant turn's reasoning: its ``reasoning_content``, or what ``<think>`` tags hold in its content."""
    found = _THINK.search(message.get("content") or "")
    return message.get("reasoning_content") or (found.group(1) if found else "")


def turn_segments(text: str, message: Message, learned: bool, learning: Learning) -> list[Segment]:
    """An assistant turn's rendered text as segments: not learned, learned whole, or learned after its reasoning
    (the reasoning and the ``</think>`` closing it masked), as ``learning`` says."""
    if not learned:
        return [(text, False)]
    cut = 0 if learning.reasoning else _reasoning_end(text, message)
    return [(text[:cut], False), (text[cut:], True)]


def _reasoning_end(text: str, message: Message) -> int:
    """Where the turn's reasoning, and the ``</think>`` right after it, end in its rendered text (0: not there)."""
    reasoning = reasoning_of(message).strip()
    start = text.find(reasoning) if reasoning else -1
    if start < 0:
        return 0
    end = start + len(reasoning)
    closing = text.find(THINK_END, end)
    return closing + len(THINK_END) if closing >= 0 and not text[end:closing].strip() else end


def prompt_segments(segments: Sequence[Segment]) -> list[Segment]:
    """The segments before the last trainable one: the prompt of the final response."""
    trainable = [index for index, (_, flag) in enumerate(segments) if flag]
    if not trainable:
        raise DataError("", "the rendered example has no response to learn")
    return list(segments[: trainable[-1]])


def merge_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Join neighbours with the same flag: fewer, longer pieces tokenize as the model reads them."""
    merged: list[Segment] = []
    for text, trainable in segments:
        if merged and merged[-1][1] == trainable:
            merged[-1] = (merged[-1][0] + text, trainable)
        else:
            merged.append((text, trainable))
    return merged


def _chatml(messages: Sequence[Message], eos_token: str, tools: Sequence[dict], learning: Learning) -> list[Segment]:
    messages = _with_tools_in_system(messages, tools)
    learned = learned_turns(messages, learning)
    segments: list[Segment] = []
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "tool":  # the results of one turn's calls make one user turn
            first = messages[index - 1]["role"] != "tool"
            last = index + 1 == len(messages) or messages[index + 1]["role"] != "tool"
            text = ("\n<|im_start|>user\n" if first else "\n") + f"<tool_response>\n{message['content']}\n</tool_response>"
            segments.append((text + (CHATML_END if last else ""), False))
            continue
        head = ("\n" if index else "") + f"<|im_start|>{role}\n"
        if role == "assistant":
            segments += [(head, False), *turn_segments(_assistant_text(message) + CHATML_END, message,
                                                       index in learned, learning)]
        else:
            segments.append((head + message["content"] + CHATML_END, False))
    return segments


def _assistant_text(message: Message) -> str:
    """An assistant turn in Qwen's convention: its reasoning in <think> tags, its content, its calls."""
    text = message["content"]
    if message.get("reasoning_content"):
        text = f"<think>\n{message['reasoning_content'].strip()}\n</think>\n\n{text}"
    for call in message.get("tool_calls", ()):
        function = call["function"]
        body = json.dumps({"name": function["name"], "arguments": function["arguments"]}, ensure_ascii=False)
        text += ("\n" if text else "") + f"<tool_call>\n{body}\n</tool_call>"
    return text


TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
               "with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
               "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")


def _with_tools_in_system(messages: Sequence[Message], tools: Sequence[dict]) -> list[Message]:
    """The conversation with the tools' schemas at the end of its system turn (one made for them if it has none)."""
    if not tools:
        return list(messages)
    block = TOOLS_INTRO + "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools) + TOOLS_OUTRO
    has_system = bool(messages) and messages[0]["role"] == "system"
    system = messages[0]["content"] + "\n\n" if has_system else ""
    return [{"role": "system", "content": system + block}, *messages[1 if has_system else 0:]]


def _alpaca(messages: Sequence[Message], eos_token: str, tools: Sequence[dict], learning: Learning) -> list[Segment]:
    has_system = bool(messages) and messages[0]["role"] == "system"
    system, turns = (messages[0]["content"], messages[1:]) if has_system else ("", messages)
    if tools or any(message.get("tool_calls") or message.get("reasoning_content") for message in turns):
        raise DataError("", "the alpaca template renders no tools, tool calls or reasoning_content",
                        "use template chatml or the tokenizer's template for tool-calling and reasoning rows")
    if [m["role"] for m in turns] != ["user", "assistant"]:
        raise DataError("", f"the alpaca template renders one instruction and its response; this conversation "
                        f"has {len(turns)} user and assistant turns",
                        "use template chatml or the tokenizer's template for multi-turn chats")
    preamble = f"{system}\n\n" if system.strip() else ""
    prompt = f"{preamble}### Instruction:\n{turns[0]['content']}\n\n### Response:\n"
    response = turns[1]
    return [(prompt, False), *turn_segments(response["content"] + eos_token, response,
                                            1 in learned_turns(turns, learning), learning)]


# The built-in templates in the Jinja form tokenizers carry (``tokenizer.chat_template``), so that an
# export renders conversations exactly as training did. Newlines are written as expressions because
# transformers renders with trim_blocks, which would eat a literal newline after a tag.
BUILTIN_JINJA = {
    "chatml": (
        "{% set has_system = messages and messages[0]['role'] == 'system' %}"
        "{% if tools %}{{ '<|im_start|>system\\n' + (messages[0]['content'] + '\\n\\n' if has_system else '') }}"
        "{{ TOOLS_INTRO }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
        "{{ TOOLS_OUTRO + '<|im_end|>' }}{% endif %}"
        "{% for m in messages %}{% if loop.first and has_system and tools %}"
        "{% elif m['role'] == 'tool' %}"
        "{{ '\\n<|im_start|>user\\n' if loop.previtem['role'] != 'tool' else '\\n' }}"
        "{{ '<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
        "{% if loop.last or loop.nextitem['role'] != 'tool' %}{{ '<|im_end|>' }}{% endif %}"
        "{% else %}{% if not loop.first or tools %}{{ '\\n' }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' }}{% set text = m['content'] %}"
        "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}"
        "{% set text = '<think>\\n' + m['reasoning_content'] | trim + '\\n</think>\\n\\n' + text %}{% endif %}"
        "{{ text }}{% for call in m.get('tool_calls') or [] %}{{ '\\n' if text or not loop.first else '' }}"
        "{{ '<tool_call>\\n{\"name\": ' + call['function']['name'] | tojson + ', \"arguments\": ' }}"
        "{{ call['function']['arguments'] | tojson + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>' }}"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}"
    ).replace("TOOLS_INTRO", json.dumps(TOOLS_INTRO)).replace("TOOLS_OUTRO", json.dumps(TOOLS_OUTRO)),
    "alpaca": (
        "{% set has_system = messages and messages[0]['role'] == 'system' %}"
        "{% set turns = messages[1:] if has_system else messages %}"
        "{% if has_system and messages[0]['content'].strip() %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
        "{{ '### Instruction:\\n' + turns[0]['content'] + '\\n\\n### Response:\\n' }}"
        "{% if turns | length > 1 %}{{ turns[1]['content'] + eos_token }}{% endif %}"
    ),
}


TEMPLATE_HINT = "set data.template to chatml (or alpaca for single-turn rows)"


Render = Callable[[Sequence[Message], Sequence[dict], bool], str]
"""A chat template: ``render(messages, tools, add_generation_prompt)``, the text it makes."""


def split_rendered_chat(messages: Sequence[Message], tools: Sequence[dict], render: Render,
                        learning: Learning = Learning()) -> list[Segment]:
    """Segments of a conversation rendered by a chat template, the assistant turns ``learning`` names trainable.

    ``render`` renders with the template (the tokenizer's, in the worker; a
    sandboxed copy, in the GUI's preview). A learned
    assistant turn's text is what rendering messages[:i+1] adds to rendering
    messages[:i] with the generation prompt. Both must be prefixes of the full
    rendering, or the template renders history differently from the end (it
    drops reasoning, say) and there is no honest way to mask it. The turns not
    learned are context whatever the template makes of them (Qwen3's drops the
    reasoning of turns before the last user turn): with data.last_turn_only such
    rows train. A template that leaves out the tools, a call or a learned turn's
    reasoning is refused: training would not see what the row says.
    """
    learned = sorted(learned_turns(messages, learning))
    full = render(messages, tools, False)
    _check_rendered(full, messages, tools, learned)

    def prefix_length(head: Sequence[Message], generation_prompt: bool, at_least: int) -> int:
        text = render(head, tools, generation_prompt)
        if not full.startswith(text) or len(text) < at_least:
            what = "with the generation prompt " if generation_prompt else ""
            raise DataError("", f"the tokenizer's chat template renders the first {len(head)} messages {what}"
                            "differently from the start of the whole conversation, so the response cannot be masked",
                            TEMPLATE_HINT)
        return len(text)

    segments: list[Segment] = []
    done = 0
    for index in learned:
        start = prefix_length(messages[:index], True, done)
        end = prefix_length(messages[: index + 1], False, start)
        segments += [(full[done:start], False), *turn_segments(full[start:end], messages[index], True, learning)]
        done = end
    segments.append((full[done:], False))
    return merge_segments([segment for segment in segments if segment[0]])


def _check_rendered(full: str, messages: Sequence[Message], tools: Sequence[dict], learned: Sequence[int]) -> None:
    """Refuse a template that drops the row's tools, calls or a learned turn's reasoning: each name and reasoning
    is in the text."""
    names = [("the tool", tool["function"]["name"]) for tool in tools]
    names += [("the call of", call["function"]["name"]) for message in messages for call in message.get("tool_calls", ())]
    names += [("the reasoning", messages[index]["reasoning_content"].strip()[:40]) for index in learned
              if messages[index].get("reasoning_content")]
    for what, text in names:
        if text not in full:
            raise DataError("", f"the tokenizer's chat template leaves out {what} {text!r}",
                            "its template renders no tools or no reasoning (or, like Qwen3's, only the last turns' "
                            "reasoning: set data.last_turn_only); or set data.template to chatml, which renders "
                            "them in Qwen's convention")
