"""GGUF export (``studio export RUN --gguf --quant q8_0 ...``): for llama.cpp, Ollama and LM Studio.

The run's merged model is written and verified as a merged export (``--dtype auto``) in the staging
folder, with the chat template and end of turn training used; llama.cpp's converter turns it into
one GGUF per quantization type (``llama_cpp``); each GGUF is read back by an independent reader,
transformers' GGUF loader, and its next-token choices compared with the merged model's on
held-out samples (the eval files, else the training files), against a threshold per type. Each
GGUF gets an Ollama Modelfile (``modelfile``). A failed check keeps no file: the whole folder is
staged and only a complete, verified one is moved into place.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.export.gguf import (DEFAULT_QUANT, LLAMA_CPP_INSTALL, MIN_AGREEMENT, NEEDS_LLAMA_CPP, QUANT_TYPES,
                                     gguf_name, modelfile_name)
from studio.core.model.info import load_model_config
from studio.core.model.vision import is_vision_language
from studio.core.run.commands import EXPORT_RECORD, read_export_record
from studio.core.run.directory import RunDir, atomic_folder
from studio.train.export.card import write_card
from studio.train.export.hf_format import (Verification, compare_logits, logits_of, open_run, record_export,
                                           usual_file_modes, verification_inputs, write_verified)
from studio.train.export.llama_cpp import (Converter, check_vocabulary, convert, find_converter, llama_cpp_available,
                                           llama_cpp_logits, quantize_k, supported_architectures)
from studio.train.export.modelfile import write_modelfile
from studio.train.model.build import hub_kwargs, load_tokenizer

HELD_OUT_SAMPLES = 8


def export_gguf(run_dir: Path, quants: tuple[str, ...] = (DEFAULT_QUANT,), out: Path | None = None,
                say=print) -> tuple[Path, Verification]:
    """Export the run as verified GGUF files (one per quant) with their Modelfiles; returns the folder and
    the weakest file's verification."""
    quants = tuple(dict.fromkeys(quants))
    rd, config, checkpoint, converter = check_gguf(run_dir, quants, say)
    out = Path(out) if out else rd.exports_dir / "gguf"
    with atomic_folder(out, replace=True) as staging:
        merged = staging / "merged"  # the source of every GGUF; removed before the folder is moved into place
        say("merging and verifying the merged model")
        write_verified(rd, config, checkpoint, "merged", merged, "auto", card=False)
        files = _write_ggufs(config, converter, merged, staging, quants, say)
        record = {**read_export_record(merged), "kind": "gguf", "form": "GGUF " + ", ".join(quants),
                  "converter": converter.source, "files": files, "verification": _weakest(files)}
        shutil.rmtree(merged)
        write_card(config, rd, record, staging)
        (staging / EXPORT_RECORD).write_text(json.dumps(record, indent=1), encoding="utf-8")
        usual_file_modes(staging)
    weakest = Verification(**record["verification"])
    record_export(rd, "gguf", out, weakest)
    return out, weakest


def check_gguf(run_dir: Path, quants: tuple[str, ...] = (DEFAULT_QUANT,),
               say=print) -> tuple[RunDir, RunConfig, Path, Converter]:
    """What a GGUF export checks before any work (``studio export RUN --gguf --check`` alone): the types, the
    method, the family and the tokenizer, each refusal saying what to do. Returns the run, its config, its newest
    checkpoint and the converter."""
    rd, config, checkpoint = open_run(run_dir, "gguf")
    _refuse_unconvertible(config, quants)
    converter = find_converter(say)
    check_supported(config, converter)
    check_tokenizer(config, converter)
    return rd, config, checkpoint, converter


def _refuse_unconvertible(config: RunConfig, quants: tuple[str, ...]) -> None:
    unknown = [q for q in quants if q not in QUANT_TYPES]
    if unknown:
        raise StudioError(f"unknown GGUF type {', '.join(unknown)}", "use " + ", ".join(QUANT_TYPES), kind="usage")
    if config.qat.enabled:
        raise StudioError("a QAT run's merged model is quantized by torchao, which llama.cpp's converter cannot read",
                          "export it with --merged, or train without QAT for a GGUF", kind="usage")
    if is_vision_language(load_model_config(config.model.name_or_path, config.model.revision)):
        raise StudioError("a vision-language model's GGUF needs its vision projector beside it (llama.cpp's mmproj "
                          "file), which studio does not write and verify yet: a GGUF of the language model alone "
                          "would not read images", "export it with --merged (it reloads in transformers and vLLM "
                          "with the processor), or as an adapter", kind="usage")
    needs = [q for q in quants if q in NEEDS_LLAMA_CPP]
    if needs and not llama_cpp_available():
        raise StudioError(f"{', '.join(needs)} is made by llama.cpp's quantizer, which is not installed",
                          f"{LLAMA_CPP_INSTALL}; or export f16 or q8_0, which need only the converter", kind="usage")


def check_supported(config: RunConfig, converter: Converter) -> None:
    """Refuse a family that llama.cpp's converter does not know, or that no installed reader can verify, before
    any work."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(config.model.name_or_path, **hub_kwargs(config))
    architecture = (model_config.architectures or ["?"])[0]
    if architecture not in supported_architectures(converter):
        raise StudioError(f"llama.cpp's converter ({converter.source}) does not support {architecture}",
                          "export --merged and use it with transformers; llama.cpp lists what it converts with "
                          "convert_hf_to_gguf.py --print-supported-models", kind="usage")
    if not transformers_reads(model_config.model_type) and not llama_cpp_available():
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        raise StudioError(f"transformers' GGUF reader cannot load {model_config.model_type} and llama.cpp's "
                          "(llama-cpp-python) is not installed, so its GGUF cannot be verified",
                          f"{LLAMA_CPP_INSTALL} (llama.cpp then verifies it), or export --merged; without it GGUF "
                          "exports are verified for " + ", ".join(sorted(GGUF_SUPPORTED_ARCHITECTURES)),
                          kind="usage")


def check_tokenizer(config: RunConfig, converter: Converter) -> None:
    """Refuse a tokenizer the converter cannot carry into a GGUF (a BPE one it does not recognise) before any
    work: it writes the vocabulary alone from the tokenizer and config.json a merged export holds."""
    from transformers import AutoConfig

    with tempfile.TemporaryDirectory(prefix="studio-gguf-tokenizer-") as folder:
        load_tokenizer(config).save_pretrained(folder)
        AutoConfig.from_pretrained(config.model.name_or_path, **hub_kwargs(config)).save_pretrained(folder)
        check_vocabulary(converter, Path(folder))


def transformers_reads(model_type: str) -> bool:
    """Whether transformers' GGUF reader loads this family (the verification every install can run)."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return model_type in GGUF_SUPPORTED_ARCHITECTURES


def _write_ggufs(config: RunConfig, converter: Converter, merged: Path, staging: Path, quants: tuple[str, ...],
                 say) -> dict[str, dict]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.device("cpu")  # small held-out batches; the dequantized GGUF is a float32 model
    inputs = verification_inputs(config, load_tokenizer(config), device, HELD_OUT_SAMPLES,
                                 files=config.data.eval_files or None)
    reference = logits_of(AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval(), inputs)
    exported_tokenizer = AutoTokenizer.from_pretrained(str(merged))  # the trained template and end of turn
    chat = read_export_record(merged)["chat"]
    model_type = json.loads((merged / "config.json").read_text(encoding="utf-8"))["model_type"]
    shutil.copy(merged / "generation_config.json", staging)  # the Modelfiles' defaults come from it
    files = {}
    for quant in quants:
        name = gguf_name(config.name, quant)
        say(f"converting to {name} with llama.cpp")
        _make_gguf(converter, merged, quant, staging / name)
        file = {"file": name, "bytes": (staging / name).stat().st_size,
                **_verifications(staging / name, model_type, inputs, reference, quant)}
        file["modelfile"] = write_modelfile(staging, name, modelfile_name(quant), exported_tokenizer, chat)
        files[quant] = file
    return files


def _verifications(gguf: Path, model_type: str, inputs: dict, reference: torch.Tensor, quant: str) -> dict:
    """Each installed reader's check of one GGUF: transformers' where it reads the family, llama.cpp's (what
    llama.cpp, Ollama and LM Studio run) where llama-cpp-python is installed. The first is the "verification"
    (check_supported made sure there is one); a failed check raises."""
    from transformers import AutoModelForCausalLM

    samples = int(inputs["input_ids"].shape[0])
    checks = []
    if transformers_reads(model_type):
        reread = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        checks.append(_checked(logits_of(reread.eval(), inputs), reference, quant, gguf.name,
                               "transformers' GGUF reader", samples))
    if llama_cpp_available():
        checks.append(_checked(llama_cpp_logits(gguf, inputs), reference, quant, gguf.name, "llama.cpp", samples))
    return dict(zip(("verification", "llama_cpp_verification"), checks))


def _checked(logits: torch.Tensor, reference: torch.Tensor, quant: str, name: str, reader: str, samples: int) -> dict:
    """The GGUF's next-token choices against the merged model's; raises below the type's threshold."""
    verification = compare_logits(logits, reference, MIN_AGREEMENT[quant], samples=samples)
    if not verification.passed:
        raise StudioError(f"{name} read by {reader} chooses the merged model's next token only "
                          f"{verification.top1_agreement:.1%} of the time (needs {MIN_AGREEMENT[quant]:.0%})",
                          "nothing was written; try a less compressed type (f16 or q8_0)", kind="export")
    return asdict(verification)


def _make_gguf(converter: Converter, merged: Path, quant: str, target: Path) -> None:
    if quant not in NEEDS_LLAMA_CPP:
        convert(converter, merged, quant, target)
        return
    source = target.with_suffix(".f16-source")
    try:
        convert(converter, merged, "f16", source)
        quantize_k(source, target, quant)
    finally:
        source.unlink(missing_ok=True)


def _weakest(files: dict[str, dict]) -> dict:
    """The verification of the file that agrees least: what the record and the app show first."""
    weakest = min((Verification(**f["verification"]) for f in files.values()),
                  key=lambda v: (v.top1_agreement, -v.max_abs_diff))
    return asdict(weakest)
