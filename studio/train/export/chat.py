"""What an export carries so that it is used as it was trained: the chat template and where a turn ends.

A run renders its chat rows with the tokenizer's template or a built-in one
(``studio.core.data.templates``) and teaches the model to end each response with
that template's end marker (``<|im_end|>`` for ChatML, the tokenizer's eos for
alpaca). Every export gets a tokenizer whose ``chat_template`` is the one
training used and whose eos is that marker, and a ``generation_config.json``
whose ``eos_token_id`` holds it, so ``generate`` stops where training taught
the model to stop (a base model trained on chat data otherwise never stops).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from studio.core.config import RunConfig
from studio.core.data.row_formats import DataError, Example
from studio.core.data.templates import BUILTIN_JINJA
from studio.core.run.events import read_events
from studio.train.data.prepare import render_segments, resolve_template

_PROBE = "studio-probe-response"  # an assistant turn's text, to find what the template writes after it


@dataclass(frozen=True)
class ChatExport:
    template: str  # "tokenizer", "chatml", "alpaca", or "none" (prompt/completion or text rows)
    end_of_turn: str  # the text that ends a response ("" when it is not a single token)
    eos_token_ids: tuple[int, ...]  # generation_config.json's eos_token_id

    def to_json(self) -> dict:
        return asdict(self)


def trained_template(config: RunConfig, events_file: Path, tokenizer: Any) -> str:
    """The template the run's data went through: its run_started event says; else resolved from the config."""
    started = [event for event in read_events(events_file) if event["type"] == "run_started"] if events_file.is_file() else []
    if started:
        return started[-1].get("data", {}).get("train", {}).get("template", "none")
    if config.data.format in ("prompt_completion", "text"):
        return "none"
    return resolve_template(config.data.template, tokenizer)


def end_of_turn(tokenizer: Any, template: str) -> str:
    """The text a response ends with under ``template`` (an eos for "none"): what training made the model write."""
    if template == "none":
        return tokenizer.eos_token or ""
    probe = Example("chat", messages=({"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}))
    try:
        response = [text for text, trainable in render_segments(probe, tokenizer, template) if trainable][-1]
    except DataError:  # a template that refuses this minimal chat (one that demands a system turn, say)
        return tokenizer.eos_token or ""
    return response.split(_PROBE, 1)[1].strip()


def single_token_id(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    return ids[0] if len(ids) == 1 else None


def carry_chat_template(tokenizer: Any, template: str, folder: Path, generation_config: Any) -> ChatExport:
    """Save ``tokenizer`` into ``folder`` with the trained template and end of turn, and the generation config.

    ``generation_config`` (the base model's, or a fresh one) is updated and saved beside it. The
    tokenizer is changed in place: pass a copy if the caller still renders with the original.
    """
    if template in BUILTIN_JINJA:
        tokenizer.chat_template = BUILTIN_JINJA[template]
    marker = end_of_turn(tokenizer, template)
    marker_id = single_token_id(tokenizer, marker)
    # the base's eos stays a stop too: the end of a text, should the model ever write it
    stops = tuple(dict.fromkeys(i for i in (marker_id, tokenizer.eos_token_id) if i is not None))
    if marker_id is not None:
        tokenizer.eos_token = marker
    else:
        marker = ""  # several tokens: no eos can say it; the model card says what to stop on
    tokenizer.save_pretrained(folder)
    if stops:
        generation_config.eos_token_id = list(stops) if len(stops) > 1 else stops[0]
    if generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id
    generation_config.save_pretrained(folder)
    return ChatExport(template, marker, stops)


def base_generation_config(config: RunConfig):
    """The base model's generation config, or one built from its config.json when it ships none."""
    from transformers import AutoConfig, GenerationConfig

    name, revision = config.model.name_or_path, config.model.revision or None
    try:
        return GenerationConfig.from_pretrained(name, revision=revision)
    except OSError:
        model_config = AutoConfig.from_pretrained(name, revision=revision, trust_remote_code=config.model.trust_remote_code)
        return GenerationConfig.from_model_config(model_config)
