"""Checking a local model folder before anything loads it, and what remote code would run. No torch.

``check_model_folder`` reads only small files and the safetensors headers, so
``studio config check``, the app's model panel and the worker (before loading)
all name the broken file at once: a config.json that is not JSON (with its line),
no model_type, no weights, a cut-off safetensors file, a missing shard or tokenizer.
``model_problems`` adds what can be known of a Hub id without the network: with
the Hub switched off (HF_HUB_OFFLINE=1), one not in the cache cannot load.
Whether transformers knows the architecture needs transformers itself, so the
worker checks that (studio.train.preflight).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from studio.core.errors import Problem, ProblemsError
from studio.core.model.info import cached_config, hub_cache_dir, looks_like_path

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")
PICKLE = ("pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weight files transformers' from_pretrained looks for, safetensors first."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
_MAX_JSON_BYTES = 64 * 2**20  # a tokenizer.json is a few MB; larger files are not parsed here
_REDOWNLOAD = "download the model again or copy the complete file"


def is_local_model(name_or_path: str) -> bool:
    return bool(name_or_path) and Path(name_or_path).expanduser().is_dir()


def check_model_folder(folder: str | Path) -> list[Problem]:
    """Every problem that would stop transformers loading the model in ``folder``; [] when none."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return [Problem(str(folder), "no such model folder", "check model.name_or_path")]
    return _check_config(folder) + _check_weights(folder) + _check_tokenizer(folder)


def model_problems(name_or_path: str, revision: str = "") -> list[Problem]:
    """Every problem that would stop the model loading, found offline in a second; [] when none.

    A local folder is checked file by file. A Hub id is a problem only with the Hub
    switched off and its config or weights not in the cache: otherwise the worker downloads it.
    """
    if is_local_model(name_or_path):
        return check_model_folder(name_or_path)
    if not name_or_path or looks_like_path(name_or_path) or os.environ.get("HF_HUB_OFFLINE") != "1":
        return []
    hint = (f"download it once on a connected machine (hf download {name_or_path}), "
            "or choose a local model folder")
    config = cached_config(name_or_path, revision)
    if config is None:
        return [Problem(name_or_path, "not in the Hugging Face cache, and the Hub is switched off (HF_HUB_OFFLINE=1)",
                        hint)]
    if weight_format(config.parent) is None:
        return [Problem(str(config.parent), "the cache has its config.json but no weights, and the Hub is switched "
                        "off (HF_HUB_OFFLINE=1)", hint)]
    return []


def raise_for_model(name_or_path: str, revision: str = "") -> None:
    """Raise ProblemsError (kind "model") with every ``model_problems``."""
    problems = model_problems(name_or_path, revision)
    if problems:
        raise ProblemsError(problems, "model", name_or_path)


def weight_format(folder: str | Path) -> str | None:
    """"safetensors", "pickle" (only PyTorch .bin files) or None (no weights transformers would find)."""
    folder = Path(folder).expanduser()
    if any((folder / name).is_file() for name in SAFETENSORS):
        return "safetensors"
    if any((folder / name).is_file() for name in PICKLE):
        return "pickle"
    return None


def _json_problem(path: Path) -> tuple[object, Problem | None]:
    """(the parsed JSON, None) or (None, a Problem naming the file and line)."""
    try:
        return json.loads(path.read_text(encoding="utf-8")), None
    except FileNotFoundError:
        return None, Problem(str(path), "missing", "the model folder needs this file")
    except UnicodeDecodeError as exc:
        return None, Problem(str(path), f"not UTF-8 text (byte offset {exc.start})", _REDOWNLOAD)
    except json.JSONDecodeError as exc:
        return None, Problem(f"{path}:{exc.lineno}", f"not valid JSON: {exc.msg} (column {exc.colno})", _REDOWNLOAD)
    except OSError as exc:
        return None, Problem(str(path), f"cannot read it: {exc.strerror or exc}", "check its permissions")


def _check_config(folder: Path) -> list[Problem]:
    path = folder / "config.json"
    config, problem = _json_problem(path)
    if problem:
        return [problem]
    if not isinstance(config, dict):
        return [Problem(str(path), "not a JSON object of settings", _REDOWNLOAD)]
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return [Problem(str(path), "has no model_type, so no architecture can be chosen",
                        "use the config.json the model was published with")]
    return []


def _check_weights(folder: Path) -> list[Problem]:
    fmt = weight_format(folder)
    if fmt is None:
        return [Problem(str(folder), "no weights: none of " + ", ".join(SAFETENSORS + PICKLE) + " is in the folder",
                        "copy the weight files into the folder, or choose the folder that has them")]
    index_name, single = (SAFETENSORS[1], SAFETENSORS[0]) if fmt == "safetensors" else (PICKLE[1], PICKLE[0])
    if (folder / single).is_file():
        files = [folder / single]
    else:
        index, problem = _json_problem(folder / index_name)
        if problem:
            return [problem]
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return [Problem(str(folder / index_name), "has no weight_map of tensors to files", _REDOWNLOAD)]
        files = [folder / name for name in sorted(set(map(str, weight_map.values())))]
    problems = [Problem(str(f), "missing: the index lists this shard", _REDOWNLOAD) for f in files if not f.is_file()]
    if fmt == "safetensors":
        problems += [p for f in files if f.is_file() for p in [_safetensors_problem(f)] if p]
    return problems


def _safetensors_problem(path: Path) -> Problem | None:
    """A cut-off or corrupt safetensors file, from its header alone (8-byte length, JSON, data offsets)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as file:
            head = file.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if length < 2 or 8 + length > size:
                return Problem(str(path), f"cut off or not a safetensors file ({size:,} bytes, no complete header)", _REDOWNLOAD)
            header = json.loads(file.read(length).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return Problem(str(path), f"corrupt safetensors header: {exc}", _REDOWNLOAD)
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (TypeError, KeyError, IndexError, ValueError, AttributeError):
        return Problem(str(path), "corrupt safetensors header: tensors without data_offsets", _REDOWNLOAD)
    expected = 8 + length + end
    if size < expected:
        return Problem(str(path), f"cut off: {size:,} of {expected:,} bytes", _REDOWNLOAD)
    return None


def has_tokenizer(folder: Path) -> bool:
    """Whether the folder holds a tokenizer's files (any kind transformers reads)."""
    return any((folder / name).is_file() for name in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


def _check_tokenizer(folder: Path) -> list[Problem]:
    present = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not has_tokenizer(folder):
        return [Problem(str(folder), "no tokenizer: none of " + ", ".join(TOKENIZER_FILES) + " is in the folder",
                        "copy the tokenizer files from the model's original folder or Hub page")]
    tokenizer_json = folder / "tokenizer.json"
    if tokenizer_json in present and tokenizer_json.stat().st_size <= _MAX_JSON_BYTES:
        _, problem = _json_problem(tokenizer_json)
        return [problem] if problem else []
    return []


# ---------------------------------------------------------------- remote code


def resolved_revision(name_or_path: str, revision: str = "") -> str:
    """The revision that would load, as precisely as is known offline.

    A local folder has none; a Hub id in the cache resolves to its commit hash;
    otherwise the configured revision, or the (unpinned) default branch.
    """
    if is_local_model(name_or_path):
        return f"the local folder {Path(name_or_path).expanduser()} (no Hub revision)"
    ref = hub_cache_dir() / ("models--" + name_or_path.replace("/", "--")) / "refs" / (revision or "main")
    commit = ref.read_text(encoding="utf-8").strip() if ref.is_file() else ""
    if commit:
        return f"commit {commit}" + (f" ({revision})" if revision and revision != commit else " (default branch)")
    return f"revision {revision}" if revision else "the default branch (not pinned to a commit)"


def remote_code_warning(name_or_path: str, revision: str = "") -> tuple[str, str]:
    """(message, hint) shown wherever model.trust_remote_code is on."""
    message = (f"trust_remote_code is on: Python code shipped with {name_or_path} will run on this machine, "
               f"from {resolved_revision(name_or_path, revision)}")
    hint = "read that code first and pin model.revision to its commit; turn the option off unless the model needs it"
    return message, hint
