"""What the model picker shows about a model, read from its files (config.json, tokenizer files). No Qt.

Nothing here loads weights or touches the network: a Hub id is looked up in
the local Hugging Face cache only, and the message for a missing one says what
happens at Start (the worker downloads it) and what to do offline.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from studio.core.errors import StudioError
from studio.core.model.check import has_tokenizer
from studio.core.model.info import UnknownArchitectureError, hub_cache_dir, load_model_config, model_shape
from studio.core.model.vision import image_training_refusal, vision_family

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelSummary:
    name_or_path: str
    architecture: str
    model_type: str
    parameters: int | None
    context_length: int | None
    dtype: str
    vocabulary: int | None
    weights_local: bool
    weights_bytes: int
    folder: Path | None  # the local folder (or cache snapshot) holding its files
    local_folder: bool  # a folder the user chose (not the Hugging Face cache)
    has_tokenizer: bool  # its folder holds tokenizer files (a model without cannot read text)
    chat_template: str | None  # the tokenizer's Jinja chat template, when it has one
    special_tokens: dict[str, str]  # bos_token, eos_token... as the tokenizer config names them
    note: str = ""  # e.g. why the parameter count is unknown
    image_placeholder: str = ""  # what its chat template writes for an image; "" unless it trains on images
    images_refusal: StudioError | None = None  # why it cannot train on rows with images (a text model, say)


class ModelNotFound(StudioError):
    """The model is neither a local folder nor in the Hugging Face cache."""


def model_folder(name_or_path: str, revision: str = "") -> Path | None:
    """The folder holding the model's files: the local folder, or its snapshot in the HF cache."""
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return local
    repo = hub_cache_dir() / ("models--" + name_or_path.replace("/", "--"))
    ref = repo / "refs" / (revision or "main")
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo / "snapshots" / commit if commit else None
    return snapshot if snapshot is not None and snapshot.is_dir() else None


def looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "/", "~")) and "\\" not in text


def summarize_model(name_or_path: str, revision: str = "") -> ModelSummary:
    """Describe a model; raises ModelNotFound (with an offline-friendly hint) or StudioError."""
    folder = model_folder(name_or_path, revision)
    if folder is None:
        raise _not_found(name_or_path)
    config = load_model_config(str(folder), allow_network=False)
    parameters, note = _parameter_count(config)
    weights = [p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    tokenizer_config = _read_json(folder / "tokenizer_config.json")
    return ModelSummary(
        name_or_path=name_or_path,
        architecture=(config.get("architectures") or [config.get("model_type", "?")])[0],
        model_type=str(config.get("model_type", "?")),
        parameters=parameters,
        context_length=_first(config, "max_position_embeddings", "n_positions", "seq_length"),
        dtype=str(config.get("torch_dtype") or config.get("dtype") or "not stated"),
        vocabulary=_first(config, "vocab_size"),
        weights_local=bool(weights),
        weights_bytes=sum(_size(p) for p in weights),
        folder=folder,
        local_folder=Path(name_or_path).expanduser().is_dir(),
        has_tokenizer=has_tokenizer(folder),
        chat_template=_chat_template(folder, tokenizer_config),
        special_tokens={k: _token_text(v) for k, v in tokenizer_config.items()
                        if k.endswith("_token") and _token_text(v)},
        note=note,
        image_placeholder=family.placeholder if (family := vision_family(config)) is not None else "",
        images_refusal=image_training_refusal(config),
    )


def _not_found(name: str) -> ModelNotFound:
    if not looks_like_hub_id(name):
        return ModelNotFound(f"no model folder at {name}", "choose a folder holding config.json and the weights",
                             kind="model")
    offline = os.environ.get("HF_HUB_OFFLINE") == "1"
    message = f"'{name}' is not on this machine yet"
    hint = ("you are offline (HF_HUB_OFFLINE=1): download it once on a connected machine "
            "(hf download " + name + "), or choose a local folder" if offline else
            "Start downloads it from the Hugging Face Hub (needs the network); offline, choose a local folder instead")
    return ModelNotFound(message, hint, kind="model")


def _parameter_count(config: dict) -> tuple[int | None, str]:
    try:
        return model_shape(config).parameter_count, ""
    except UnknownArchitectureError:  # the estimate measures such a model (a traced step); it does not refuse it
        return None, "no family describes it by hand: the memory estimate measures it instead"
    except StudioError as exc:
        return None, exc.message


def _first(config: dict, *keys: str) -> int | None:
    return next((config[k] for k in keys if isinstance(config.get(k), int)), None)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


def _token_text(value) -> str:
    if isinstance(value, dict):  # AddedToken serialized
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def human_count(number: int | None) -> str:
    if number is None:
        return "unknown"
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if number >= size:
            return f"{number / size:.1f} {unit}"
    return str(number)
