"""The Ollama Modelfile of a GGUF export: the run's chat template, its stop tokens and default parameters.

A Jinja chat template cannot be translated in general, but what it writes around each turn can be
learned by rendering it: a few small conversations with marker contents, split at the markers,
give the text before and after a system, user and assistant turn and the generation prompt
(``ChatTurns``). Every rendering is then rebuilt from those pieces; a template whose turns depend
on more than their role (a position, a tool call) does not rebuild, and its Modelfile leaves the
template to Ollama, which reads the one inside the GGUF. A template that renders tools is translated for plain
conversations, and the export's note says that the tools are left out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from studio.core.export.gguf import ChatTurns, go_template, modelfile, ollama_parameters

_SYSTEM, _USER, _ASSISTANT, _NEXT = "studio-system-7f3a", "studio-user-2b9c", "studio-assistant-5d1e", "studio-user-8c4f"


class Untranslatable(ValueError):
    """The template writes more than the same text around each turn of a role."""


def chat_turns(tokenizer: Any) -> ChatTurns:
    """The text around each turn of ``tokenizer.chat_template``, without the leading bos (llama.cpp adds it)."""
    user, assistant, system = _message("user", _USER), _message("assistant", _ASSISTANT), _message("system", _SYSTEM)
    renders = {"one": [user], "two": [user, assistant], "three": [user, assistant, _message("user", _NEXT)],
               "system": [system, user]}
    text = {name: _render(tokenizer, messages) for name, messages in renders.items()}
    asked = _render(tokenizer, [user], generation_prompt=True)
    before_user, user_suffix = _split(text["one"], _USER)
    later_user = _split(_after(text["three"], text["two"]), _NEXT)[0]
    # a user turn's own prefix is what it starts with both first and later; the rest is the conversation's
    # start before it, or the separator between two turns
    user_prefix = _common_suffix(before_user, later_user)
    separator = later_user[:len(later_user) - len(user_prefix)]
    assistant_prefix, assistant_suffix = _split(_after(_after(text["two"], text["one"]), separator), _ASSISTANT)
    system_prefix, system_rest = _split(text["system"], _SYSTEM)
    user_turn = separator + user_prefix + _USER + user_suffix
    if not system_rest.endswith(user_turn):
        raise Untranslatable("a user turn after a system message is written differently")
    bos = tokenizer.bos_token or ""
    turns = ChatTurns(start=_without_bos(before_user[:len(before_user) - len(user_prefix)], bos),
                      system_prefix=_without_bos(system_prefix, bos),
                      system_suffix=system_rest[:len(system_rest) - len(user_turn)], separator=separator,
                      user_prefix=user_prefix, user_suffix=user_suffix, assistant_prefix=assistant_prefix,
                      assistant_suffix=assistant_suffix, generation_prompt=_after(asked, text["one"]))
    for messages in ([user, assistant, _message("user", _NEXT)], [system, user, assistant, _message("user", _NEXT)]):
        if turns.render(messages) != _without_bos(_render(tokenizer, messages, generation_prompt=True), bos):
            raise Untranslatable("a longer conversation is not its turns written one after another")
    return turns


def write_modelfile(folder: Path, gguf_file: str, name: str, tokenizer: Any, chat: dict) -> dict:
    """Write the Modelfile ``name`` for ``gguf_file`` beside it; returns what the export record keeps of it.

    ``chat`` is the export's ChatExport (its template and end of turn); the defaults come from the
    export's generation_config.json."""
    template, note = _template(tokenizer, chat["template"])
    stops = list(dict.fromkeys(s for s in (chat["end_of_turn"], tokenizer.eos_token) if s))
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text(encoding="utf-8")) if generation_file.is_file() else {}
    (folder / name).write_text(modelfile(gguf_file, template, stops, ollama_parameters(generation)), encoding="utf-8")
    return {"file": name, "template": "translated" if template else "from the GGUF", "note": note, "stops": stops}


def _template(tokenizer: Any, trained: str) -> tuple[str | None, str]:
    if trained == "none":  # prompt/completion or plain text: the prompt goes in as it is
        return go_template(None), ""
    try:
        translated = go_template(chat_turns(tokenizer))
    except Untranslatable as exc:
        return None, f"not translated: {exc}; Ollama uses the template inside the GGUF"
    return translated, TOOLS_DROPPED if _renders_tools(tokenizer) else ""


TOOLS_DROPPED = ("the Modelfile's template writes plain turns: the tools, tool calls and tool results the chat "
                 "template renders are left out (Ollama's tool calling needs a template written for it)")
_TOOL = "studio_tool_3e8a"


def _renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template writes the tools it is given (a template for tool calling)."""
    tools = [{"type": "function", "function": {"name": _TOOL, "description": "", "parameters": {"type": "object"}}}]
    try:
        text = tokenizer.apply_chat_template([_message("user", _USER)], tools=tools, tokenize=False)
    except Exception:  # jinja2's errors, or a template's raise_exception: it does not take tools
        return False
    return _TOOL in text


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2's errors, or a template's raise_exception
        raise Untranslatable(f"the template does not render a plain conversation ({exc})") from exc


def _split(text: str, marker: str) -> tuple[str, str]:
    if text.count(marker) != 1:
        raise Untranslatable(f"a message's text is not written once as it is ({marker!r})")
    before, after = text.split(marker)
    return before, after


def _after(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise Untranslatable("a longer conversation does not start as the shorter one rendered")
    return text[len(prefix):]


def _common_suffix(a: str, b: str) -> str:
    size = 0
    while size < min(len(a), len(b)) and a[len(a) - size - 1] == b[len(b) - size - 1]:
        size += 1
    return a[len(a) - size:]


def _without_bos(text: str, bos: str) -> str:
    return text[len(bos):] if bos and text.startswith(bos) else text
