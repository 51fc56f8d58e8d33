"""Built-in chat templates, for tokenizers without one (base models) or by choice.

A rendered conversation is a list of segments ``(text, trainable)``. Trainable
text is what the model learns to produce: each assistant turn's content and
its end marker; headers, system and user turns are context the loss ignores.
Keeping the text in segments rather than one string lets the tokenizer side
mask exactly those characters, and rebuild for generation the very prompt that
training put before a response.

- chatml: ``<|im_start|>{role}\\n{content}<|im_end|>`` turns joined by newlines;
  generation starts after ``<|im_start|>assistant\\n``.
- alpaca: ``### Instruction:\\n{user}\\n\\n### Response:\\n{assistant}{eos}``,
  with the system turn (if any) as a preamble; single-turn only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from studio.core.data.row_formats import DataError

Segment = tuple[str, bool]
Message = dict[str, str]
BUILTIN_TEMPLATES = ("chatml", "alpaca")
CHATML_END = "<|im_end|>"


def render(template: str, messages: Sequence[Message], eos_token: str = "") -> list[Segment]:
    """Render a conversation with a built-in template into merged segments.

    ``eos_token`` ends the response where the template has no end marker of
    its own (alpaca), so that the model learns to stop.
    """
    renderers = {"chatml": _chatml, "alpaca": _alpaca}
    if template not in renderers:
        raise DataError("data.template", f"{template!r} is not a built-in template", "use " + " or ".join(BUILTIN_TEMPLATES))
    return merge_segments(renderers[template](messages, eos_token))


def generation_prompt(template: str, messages: Sequence[Message], eos_token: str = "") -> str:
    """The text a model continues to answer the conversation's last user turn.

    A final assistant turn (the reference answer) is left out; the result is
    the same text that training put before that turn, ending with the
    assistant header.
    """
    context = list(messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages)
    segments = render(template, context + [{"role": "assistant", "content": ""}], eos_token)
    return "".join(text for text, _ in prompt_segments(segments))


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


def _chatml(messages: Sequence[Message], eos_token: str) -> list[Segment]:
    segments: list[Segment] = []
    for index, message in enumerate(messages):
        head = ("\n" if index else "") + f"<|im_start|>{message['role']}\n"
        if message["role"] == "assistant":
            segments += [(head, False), (message["content"] + CHATML_END, True)]
        else:
            segments.append((head + message["content"] + CHATML_END, False))
    return segments


def _alpaca(messages: Sequence[Message], eos_token: str) -> list[Segment]:
    has_system = bool(messages) and messages[0]["role"] == "system"
    system, turns = (messages[0]["content"], messages[1:]) if has_system else ("", messages)
    if [m["role"] for m in turns] != ["user", "assistant"]:
        raise DataError("", f"the alpaca template renders one instruction and its response; this conversation "
                        f"has {len(turns)} user and assistant turns",
                        "use template chatml or the tokenizer's template for multi-turn chats")
    preamble = f"{system}\n\n" if system.strip() else ""
    prompt = f"{preamble}### Instruction:\n{turns[0]['content']}\n\n### Response:\n"
    return [(prompt, False), (turns[1]["content"] + eos_token, True)]


# The built-in templates in the Jinja form tokenizers carry (``tokenizer.chat_template``), so that an
# export renders conversations exactly as training did. Newlines are written as expressions because
# transformers renders with trim_blocks, which would eat a literal newline after a tag.
BUILTIN_JINJA = {
    "chatml": (
        "{% for m in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '\\n<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "alpaca": (
        "{% set has_system = messages and messages[0]['role'] == 'system' %}"
        "{% set turns = messages[1:] if has_system else messages %}"
        "{% if has_system and messages[0]['content'].strip() %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
        "{{ '### Instruction:\\n' + turns[0]['content'] + '\\n\\n### Response:\\n' }}"
        "{% if turns | length > 1 %}{{ turns[1]['content'] + eos_token }}{% endif %}"
    ),
}


TEMPLATE_HINT = "set data.template to chatml (or alpaca for single-turn rows)"


def split_rendered_chat(messages: Sequence[dict[str, str]], render: Callable[[Sequence[dict[str, str]], bool], str]) -> list[Segment]:
    """Segments of a conversation rendered by a chat template, assistant turns trainable.

    ``render(messages, add_generation_prompt)`` renders with the template (the
    tokenizer's, in the worker; a sandboxed copy, in the GUI's preview). An
    assistant turn's text is what rendering messages[:i+1] adds to rendering
    messages[:i] with the generation prompt. Both must be prefixes of the full
    rendering, or the template renders history differently from the end (it
    drops reasoning, say) and there is no honest way to mask it.
    """
    full = render(messages, False)

    def prefix_length(head: Sequence[dict[str, str]], generation_prompt: bool, at_least: int) -> int:
        text = render(head, generation_prompt)
        if not full.startswith(text) or len(text) < at_least:
            what = "with the generation prompt " if generation_prompt else ""
            raise DataError("", f"the tokenizer's chat template renders the first {len(head)} messages {what}"
                            "differently from the start of the whole conversation, so the response cannot be masked",
                            TEMPLATE_HINT)
        return len(text)

    segments: list[Segment] = []
    done = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = prefix_length(messages[:index], True, done)
        end = prefix_length(messages[: index + 1], False, start)
        segments += [(full[done:start], False), (full[start:end], True)]
        done = end
    segments.append((full[done:], False))
    return [segment for segment in segments if segment[0]]
