"""Exporting a run: a LoRA adapter or a merged model, each verified before it is kept.

The trained model is rebuilt from the run's newest complete checkpoint. The export
is written into a staging folder, reloaded the way a user would load it (plain
``PeftModel.from_pretrained`` or ``AutoModelForCausalLM.from_pretrained``) and its
logits compared with the trained model's on a few training examples. An export
that passes gets the chat template and end of turn training used (``chat_export``)
and a model card (``export_card``), and is renamed into place; a failed or
interrupted export leaves no folder behind and an earlier export untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from studio.core.config import RunConfig, load_config
from studio.core.data.dataset import inspect_files
from studio.core.data.templates import Learning
from studio.core.errors import StudioError
from studio.core.run.commands import EXPORT_RECORD
from studio.core.run.directory import RunDir, atomic_folder
from studio.core.run.events import EventWriter
from studio.train.checkpoint import load_weights, read_state
from studio.train.data.images import ImageRows
from studio.train.data.prepare import RowEncoder, collate, encode, encode_prompt, render_segments
from studio.train.export.card import write_card
from studio.train.export.chat import base_generation_config, carry_chat_template, trained_template
from studio.train.model.build import (attach_adapter, auto_model_class, build_model, hub_kwargs, load_base_model,
                                      load_tokenizer, qat_base_config)
from studio.train.quiet import quiet_progress_bars

log = logging.getLogger("studio.train")

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EXACT_TOLERANCE = 1e-3  # max |logit difference| for exports that involve no rounding
MIN_TOP1_AGREEMENT = 0.9  # for 16-bit or dequantized exports: next-token choices that must agree


@dataclass(frozen=True)
class Verification:
    max_abs_diff: float  # export vs trained model
    top1_agreement: float
    base_max_abs_diff: float | None  # untrained base vs trained model (None: full fine-tune, base not kept)
    exact: bool  # whether the export should reproduce the logits to rounding error
    passed: bool
    samples: int


def export_run(run_dir: Path, kind: str, out: Path | None = None, dtype: str = "auto") -> tuple[Path, Verification]:
    """Export ``kind`` ("adapter" or "merged") of a run; returns the folder and its verification."""
    rd, config, checkpoint = open_run(run_dir, kind)
    out = Path(out) if out else rd.exports_dir / kind
    with atomic_folder(out, replace=True) as staging:
        verification = write_verified(rd, config, checkpoint, kind, staging, dtype)
    record_export(rd, kind, out, verification)
    return out, verification


def open_run(run_dir: Path, kind: str) -> tuple[RunDir, RunConfig, Path]:
    """The run, its config and newest checkpoint; refuses a run that cannot give ``kind``."""
    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise StudioError(f"{rd.path} is not a run directory (no config.yaml)", "pass the folder of a run", kind="export")
    config = load_config(rd.config)
    checkpoint = rd.latest_checkpoint()
    if checkpoint is None:
        raise StudioError(f"{rd.path} has no complete checkpoint yet", "train (or stop-and-save) the run first", kind="export")
    if kind == "adapter" and not config.uses_adapter:
        raise StudioError("a full fine-tune has no adapter", "export it with --merged", kind="export")
    if kind == "adapter" and (config.vision.train_vision_tower or config.vision.train_projector):
        raise StudioError("the run trained vision parts whole (vision.train_vision_tower or train_projector), which "
                          "an adapter does not carry", "export it with --merged", kind="export")
    if kind != "adapter" and not config.can_merge:
        raise StudioError(f"{config.method} trains {config.method_spec.trains}, which cannot be merged into the "
                          "model's weights",
                          "export the adapter (--adapter) and load it with peft's PeftModel.from_pretrained",
                          kind="export")
    return rd, config, checkpoint


def write_verified(rd: RunDir, config: RunConfig, checkpoint: Path, kind: str, folder: Path, dtype: str,
                   card: bool = True) -> Verification:
    """Write the ``kind`` export into ``folder``, reload it and compare its logits with the trained model's.

    A passing export gets its chat template, end of turn and (with ``card``) model card; a failing one
    raises after writing its record (the caller's staging folder goes with it)."""
    quiet_progress_bars()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(config)
    total_steps = read_state(checkpoint).get("total_steps")
    trained = build_model(config.replace(training={"gradient_checkpointing": False}), device, total_steps,
                          for_inference=True)
    load_weights(checkpoint, trained)
    trained.eval()
    inputs = verification_inputs(config, tokenizer, device)
    reference = logits_of(trained, inputs)
    base_diff = _base_difference(trained, inputs, reference)

    export_dtype = _export_dtype(config, dtype)
    if kind == "adapter":
        trained.save_pretrained(folder)
        reloaded = _reload_adapter(config, folder, device)
        exact = True
    else:
        _save_merged(config, checkpoint, tokenizer, folder, export_dtype, device, total_steps)
        reloaded = _reload_merged(config, folder, export_dtype, device)
        exact = export_dtype == torch.float32 and config.effective_load_in == "none" and not config.qat.enabled
    verification = _verify(reloaded, inputs, reference, base_diff, exact)
    info = {"kind": kind, "run_dir": str(rd.path), "checkpoint": checkpoint.name, "dtype": str(export_dtype).removeprefix("torch."),
            "base_model": config.model.name_or_path, "form": export_form(config, kind, export_dtype),
            "verification": asdict(verification)}
    if verification.passed:  # what makes it usable as trained: its template and eos, and its card
        chat = carry_chat_template(tokenizer, trained_template(config, rd.events, tokenizer), folder,
                                   base_generation_config(config))
        info["chat"] = chat.to_json()
        if card:
            write_card(config, rd, info, folder)
    (folder / EXPORT_RECORD).write_text(json.dumps(info, indent=1), encoding="utf-8")
    usual_file_modes(folder)
    if not verification.passed:
        raise StudioError(f"the exported {kind} does not reproduce the trained model "
                          f"(max logit difference {verification.max_abs_diff:.3g}, top-1 agreement {verification.top1_agreement:.0%})",
                          "nothing was written; report this with the run's train.log", kind="export")
    return verification


def export_form(config: RunConfig, kind: str, dtype: torch.dtype = torch.float32) -> str:
    """What the export holds, in words (the CLI prints it, the EXPORT_RECORD keeps it); ``dtype``: a merged
    model's weights."""
    if not config.qat.enabled:
        if kind == "adapter":
            return "adapter"
        name = str(dtype).removeprefix("torch.")
        return f"merged model in {name}" + (" (full precision)" if dtype == torch.float32 else "")
    qat = config.qat
    scheme = f"{qat.weights} weights (groups of {qat.group_size})" + (
        f", {qat.activations} dynamic activations" if qat.activations != "none" else "")
    if kind == "adapter":
        return (f"full-precision adapter for the base quantized with torchao to {scheme} (verified on that base: "
                "load the base with transformers' TorchAoConfig, then the adapter)")
    return f"quantized with torchao: {scheme}; the linears hold integer weights, the output head stays full precision"


def usual_file_modes(folder: Path) -> None:
    """Every file of an export readable like any file the user writes (0644 with the usual umask): the
    weight writers create theirs private (0600), so a shared export had unreadable weights only."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def _export_dtype(config: RunConfig, dtype: str) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if not config.uses_adapter or config.training.precision == "fp32" else torch.bfloat16
    if dtype not in EXPORT_DTYPES:
        raise StudioError(f"unknown export dtype {dtype}", "use auto, " + ", ".join(EXPORT_DTYPES), kind="export")
    return EXPORT_DTYPES[dtype]


def verification_inputs(config: RunConfig, tokenizer, device, count: int = 4,
                        files: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """A padded batch of the first few examples of ``files`` (the training files), rendered as in training (with
    their images)."""
    report = inspect_files(files or config.data.train_files, config.row_format, limit=count)
    image_rows = ImageRows.for_run(config, tokenizer)
    rows = [_verification_row(example, tokenizer, config, image_rows) for example in report.examples[:count]]
    batch = collate(rows, tokenizer.pad_token_id)
    return {name: tensor.to(device) for name, tensor in batch.items() if name != "labels"}


def _verification_row(example, tokenizer, config: RunConfig, image_rows: ImageRows | None) -> dict:
    """An example's tokens as training saw them (a prompt-only row: its prompt, which the completions followed; a
    row with images: its image tokens and images)."""
    if example.images:
        return RowEncoder.for_run(config, tokenizer, config.data.template, image_rows).encode(example)
    if example.kind == "prompt_only":
        ids = encode_prompt(example, tokenizer, config.data.template)[0][:config.data.max_length]
    else:
        ids = encode(render_segments(example, tokenizer, config.data.template, Learning.of(config.data)), tokenizer,
                     config.data.max_length, config.data.train_on_prompt)["input_ids"]
    return {"input_ids": ids, "labels": ids}


@torch.no_grad()
def logits_of(model, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**inputs).logits.float()
    logits = logits[:, -inputs["input_ids"].shape[1]:]  # prompt tuning prepends its virtual tokens' logits
    return logits[inputs["attention_mask"].bool()]  # real positions only


@torch.no_grad()
def _base_difference(trained, inputs, reference: torch.Tensor) -> float | None:
    """How far the untrained base is from the trained model; None for a full fine-tune."""
    if not hasattr(trained, "disable_adapter"):
        return None
    with trained.disable_adapter():
        return float((logits_of(trained, inputs) - reference).abs().max())


def _reload_adapter(config: RunConfig, folder: Path, device):
    from peft import PeftModel

    # an adapter trained with QAT learned on a fake-quantized base: it is verified on the really quantized one
    base = quantized_base(config, device) if config.qat.enabled else load_base_model(config, device)
    return PeftModel.from_pretrained(base, str(folder)).eval()


def torchao_config(config: RunConfig):
    """transformers' TorchAoConfig for the quantization the run's QAT simulated (the output head is left out)."""
    from transformers import AutoConfig, AutoModelForCausalLM, TorchAoConfig

    model_config = AutoConfig.from_pretrained(config.model.name_or_path, **hub_kwargs(config))
    with torch.device("meta"):  # only to learn the head's name
        skeleton = AutoModelForCausalLM.from_config(model_config, trust_remote_code=config.model.trust_remote_code)
    head = next(name for name, module in skeleton.named_modules() if module is skeleton.get_output_embeddings())
    return TorchAoConfig(qat_base_config(config), modules_to_not_convert=[head])


def quantized_base(config: RunConfig, device):
    """The base model quantized with torchao as the run's QAT simulated: what a QAT adapter runs on."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(config.model.name_or_path, dtype=torch.float32,
                                                quantization_config=torchao_config(config), **hub_kwargs(config)).to(device)


def _save_merged(config: RunConfig, checkpoint: Path, tokenizer, folder: Path, dtype: torch.dtype, device,
                 total_steps: int | None) -> None:
    """Merge into an unquantized copy of the base in ``dtype`` (for QLoRA: a 16-bit base).

    After QAT the merged weights are quantized as training simulated them (torchao).
    """
    model = load_base_model(config, device, quantized=False, dtype=torch.float32)
    if config.uses_adapter:
        model = attach_adapter(model, config, total_steps)
        load_weights(checkpoint, model)
        model = model.merge_and_unload()
    else:
        load_weights(checkpoint, model)
    tokenizer.save_pretrained(folder)
    image_rows = ImageRows.for_run(config, tokenizer)
    if image_rows is not None:  # what turns images into the merged model's inputs
        image_rows.save(folder)
    if not config.qat.enabled:
        model.to(dtype).save_pretrained(folder, safe_serialization=True)
        return
    merged = folder.parent / f"{folder.name}.unquantized"  # beside the staging folder, removed with it
    model.to(dtype).save_pretrained(merged, safe_serialization=True)
    try:
        _quantize_saved(config, merged, folder, dtype)
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def _quantize_saved(config: RunConfig, source: Path, folder: Path, dtype: torch.dtype) -> None:
    """Quantize a saved merged model into ``folder`` through transformers' torchao integration, so
    that ``from_pretrained`` alone loads the integer weights back. Never in place: the weights being
    read may be memory-mapped from the source files."""
    from transformers import AutoModelForCausalLM

    quantized = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, quantization_config=torchao_config(config))
    quantized.save_pretrained(folder, safe_serialization=True)


def _reload_merged(config: RunConfig, folder: Path, dtype: torch.dtype, device):
    return auto_model_class(config).from_pretrained(str(folder), dtype=dtype).to(device).eval()


def _verify(model, inputs, reference: torch.Tensor, base_diff: float | None, exact: bool) -> Verification:
    verification = compare_logits(logits_of(model, inputs), reference, MIN_TOP1_AGREEMENT, exact,
                                  int(inputs["input_ids"].shape[0]))
    # An export that is no closer to the trained model than the untrained base is the base.
    is_base = base_diff is not None and base_diff > 10 * EXACT_TOLERANCE and verification.max_abs_diff >= base_diff
    return replace(verification, base_max_abs_diff=base_diff, passed=verification.passed and not is_base)


def compare_logits(logits: torch.Tensor, reference: torch.Tensor, min_agreement: float, exact: bool = False,
                   samples: int = 0) -> Verification:
    """How far ``logits`` are from ``reference`` (real positions of the same inputs); passes to rounding error
    when ``exact``, else when at least ``min_agreement`` of the next-token choices agree."""
    max_diff = float((logits - reference).abs().max())
    agreement = float((logits.argmax(-1) == reference.argmax(-1)).float().mean())
    passed = max_diff <= EXACT_TOLERANCE if exact else agreement >= min_agreement
    return Verification(max_diff, agreement, None, exact, passed, samples)


def record_export(rd: RunDir, kind: str, out: Path, verification: Verification) -> None:
    events = EventWriter(rd.events)
    try:
        events.emit("export", kind=kind, path=str(out), verification=asdict(verification))
    finally:
        events.close()
    log.info("exported %s to %s (max logit difference %.3g, top-1 agreement %.1f%%)", kind, out,
             verification.max_abs_diff, 100 * verification.top1_agreement)
