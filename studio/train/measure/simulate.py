"""Measure, or simulate, the memory of the worker's training step.

``measure_step`` builds the real model with ``studio.train.model.build.build_model``
and runs real optimizer steps (forward, backward, clipping, update) the way the
worker does, tracking the peak of live tensor bytes.

``simulate_step`` runs the same steps of the same model code on fake tensors:
the model is built on the ``meta`` device (bitsandbytes layers included),
every parameter and buffer is swapped for a FakeTensor on the CPU, and the step
runs under FakeTensorMode with the tracker counting the bytes each fake tensor
would hold. A 7B model's step is "measured" in seconds, with no GPU and no
weights. Fake ``cuda`` tensors cannot work with a CPU-only torch, so the
simulation always places the fake tensors on the CPU, and it runs in its own
process (``python -m studio.train.measure.simulate CONFIG``): never in the GUI's.

Two optimizer steps are run: the first allocates the optimizer state (torch
creates it lazily), the second shows the steady state every later step has.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.train.measure.memtrack import LiveTensorTracker, tracker_for
from studio.train.model import build as model_module
from studio.train.data.prepare import IGNORE_INDEX
from studio.train.model.build import build_model, compute_dtype, hub_config, load_base_model
from studio.train.objectives import objective_for
from studio.train.objectives.next_token import (chunked_cross_entropy, predicting_hidden_states, run_output_layer,
                                                token_loss_sum)
from studio.train.optim import build_optimizer
from studio.train.savers.host_weights import host_weights, keep_weights_on_cpu

STEPS = 2


@dataclass
class StepMemory:
    """The peak of a measured or simulated step, and which phase held it."""

    peak_bytes: int
    peak_phase: str
    phase_peaks: dict[str, int]
    seconds: float
    peak_reserved_bytes: int = 0  # CUDA only
    # host RAM beside the device, not in peak_bytes: the weights kept there (studio.train.savers.host_weights)
    # and offloaded activations (counted apart on the CPU; not measured on CUDA)
    host_peak_bytes: int = 0


def full_length_batches(config: RunConfig, vocab_size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """One optimizer step's micro-batches, every row at data.max_length (the estimate's worst case)."""
    t = config.training
    shape = (t.micro_batch_size, config.data.max_length)
    generator = torch.Generator().manual_seed(t.seed)
    batches = []
    for _ in range(t.gradient_accumulation_steps):
        ids = torch.randint(3, vocab_size, shape, generator=generator)
        batches.append({"input_ids": ids.to(device), "attention_mask": torch.ones(shape, dtype=torch.long, device=device),
                        "labels": ids.clone().to(device)})
    return batches


def pair_batches(config: RunConfig, objective, vocab_size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """One optimizer step's micro-batches of preference rows, each sequence data.max_length long after a one-token
    prompt (every other position a target: the estimate's worst case), padded: pairs, or KTO's completions."""
    t, length = config.training, config.data.max_length
    generator = torch.Generator().manual_seed(t.seed)

    def sequence() -> tuple[list[int], list[int]]:
        ids = torch.randint(3, vocab_size, (length,), generator=generator).tolist()
        return ids, [IGNORE_INDEX] + ids[1:]
    def row(index: int) -> dict:
        (chosen, chosen_labels), (rejected, rejected_labels) = sequence(), sequence()
        if config.objective == "kto":  # one completion, desirable or not, and the mismatched one of its KL term
            return {"input_ids": chosen, "labels": chosen_labels, "completion_ids": chosen[1:],
                    "kl_completion_ids": rejected[1:], "label": index % 2 == 0}
        return {"input_ids": chosen, "labels": chosen_labels, "rejected_input_ids": rejected,
                "rejected_labels": rejected_labels}
    return [{k: v.to(device) for k, v in objective.batch([row(i) for i in range(t.micro_batch_size)],
                                                         packed=False).items()}
            for _ in range(t.gradient_accumulation_steps)]


def frozen_reference(config: RunConfig, device: torch.device):
    """DPO's frozen copy of the starting weights (full fine-tuning), as the worker loads it."""
    copy = load_base_model(config, device)
    copy.requires_grad_(False)
    return copy.eval()


def target_tokens(batches) -> int:
    """Tokens that carry a loss in one optimizer step (the worker divides each micro-batch's loss sum by it)."""
    return sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)


def run_optimizer_steps(model, optimizer, batches, config: RunConfig, tracker, steps: int, targets: int,
                        objective_loss=None) -> None:
    """The worker's optimizer step (Worker._optimizer_step), ``steps`` times, phases marked for the tracker.

    ``targets`` (the step's units) comes from ``target_tokens``, computed before any fake mode is entered;
    ``objective_loss``: a preference objective's ``loss_sum`` instead of the next-token loss.
    """
    device_type = batches[0]["input_ids"].device.type  # not a parameter's: the embedding may stay on the CPU
    precision = config.training.precision
    autocast = torch.autocast(device_type, dtype=compute_dtype(config), enabled=precision != "fp32")
    max_norm = config.training.max_grad_norm
    output_layer = run_output_layer(config, model)
    model.train()
    for _ in range(steps):
        for batch in batches:
            with tracker.phase("forward"), autocast:
                summed = objective_loss(model, batch) if objective_loss else loss_sum(model, batch, output_layer)
                loss = summed / max(targets, 1)
                del summed
            with tracker.phase("backward"):
                loss.backward()
            del loss
        with tracker.phase("optimizer"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def loss_sum(model, batch, output_layer) -> torch.Tensor:
    """token_loss_sum for these batches, where every position is a target: the chunked loss then
    needs no boolean gather (whose output shape fake tensors cannot know)."""
    if output_layer is None:
        return token_loss_sum(model, batch)
    hidden = predicting_hidden_states(model, batch)
    return chunked_cross_entropy(hidden.flatten(0, 1), batch["labels"][:, 1:].flatten(), output_layer)


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def measure_step(config: RunConfig, device: torch.device | None = None, steps: int = STEPS) -> StepMemory:
    """Build the real model and measure the peak of real optimizer steps on ``device`` (a preference objective's
    with its reference, as the worker has it)."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(config.training.seed)
    model = build_model(config, device)
    keep_weights_on_cpu(model, config, device)
    optimizer = build_optimizer(config, _trainable(model))
    vocab = model.config.get_text_config().vocab_size
    frozen = frozen_reference(config, device) if config.frozen_reference else None
    objective = objective_for(config, model, 0, frozen) if config.learns_preferences else None
    batches = pair_batches(config, objective, vocab, device) if objective else full_length_batches(config, vocab, device)
    units = sum(objective.units(b) for b in batches) if objective else target_tokens(batches)
    started = time.perf_counter()
    with tracker_for(device) as tracker:
        tracker.add_module(model, host=host_weights(model))
        if frozen is not None:
            tracker.add_module(frozen)
        tracker.add(batches)
        run_optimizer_steps(model, optimizer, batches, config, tracker, steps, units,
                            objective.loss_sum if objective else None)
    report = tracker.report
    return StepMemory(report.peak_bytes, report.peak_phase, report.phase_peaks, time.perf_counter() - started,
                      getattr(tracker, "peak_reserved_bytes", 0), tracker.host_report.peak_bytes)


# ---------------------------------------------------------------- simulation on fake tensors


def simulate_step(config: RunConfig, steps: int = STEPS) -> StepMemory:
    """The peak of the worker's steps on fake tensors: the real model code, no weights, no GPU.

    Only the model's config.json is read (a local folder, the Hugging Face
    cache or the Hub). Tensors are placed on the CPU, so CUDA-only kernels are
    not what runs; the estimate's ``device_type="cpu"`` is the comparable one.
    """
    if config.learns_preferences:  # its per-sequence gathers have shapes fake tensors cannot know
        raise StudioError(f"the simulation runs next-token steps, not {config.objective}'s",
                          "the estimate counts a preference step (measured: docs/memory-accuracy.md)", kind="config")
    model, fake_mode = fake_model(config)
    batches = full_length_batches(config, model.config.get_text_config().vocab_size, torch.device("cpu"))
    targets = target_tokens(batches)
    # built outside fake mode: bitsandbytes fills its quantization maps from real data; state comes at the step
    optimizer = build_optimizer(config, _trainable(model))
    started = time.perf_counter()
    with fake_mode, rows_are_unpadded(), experts_grouped_on_fake_tensors():
        with LiveTensorTracker() as tracker:
            tracker.add_module(model, host=host_weights(model))
            tracker.add(batches)
            run_optimizer_steps(model, optimizer, batches, config, tracker, steps, targets)
    report = tracker.report
    return StepMemory(report.peak_bytes, report.peak_phase, report.phase_peaks, time.perf_counter() - started,
                      host_peak_bytes=tracker.host_report.peak_bytes)


def fake_model(config: RunConfig, layers: int | None = None):
    """The worker's model built from config.json alone, every tensor fake; ``layers`` overrides its depth.

    Returns the model and the FakeTensorMode to run it under.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    _warm_up_bitsandbytes_tables(config)
    with _base_model_on_meta(layers):
        model = build_model(config, torch.device("meta"))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    _materialize_fake(model, fake_mode)
    keep_weights_on_cpu(model, config, torch.device("cpu"))  # for the tracker: the fake tensors are on the CPU
    return model, fake_mode


@contextlib.contextmanager
def _base_model_on_meta(layers: int | None = None):
    """Make build_model load its base model on the meta device from config.json alone.

    build_model's other steps (k-bit preparation, checkpointing, the adapter)
    then run unchanged, so the simulation follows whatever the worker does.
    """
    original = model_module.load_base_model
    model_module.load_base_model = functools.partial(_load_base_model_on_meta, layers=layers)
    try:
        yield
    finally:
        model_module.load_base_model = original


@contextlib.contextmanager
def experts_grouped_on_fake_tensors():
    """Let fake tensors take transformers' own grouped-matmul fallback where torch's fake kernel refuses them.

    torch's shape function for grouped_mm accepts bf16 only (the CUDA kernel's rule), while its CPU kernel
    also runs fp32 experts. The fallback (transformers::grouped_mm_fallback) has a fake kernel and keeps, for
    backward, what grouped_mm keeps: the input and the weights.
    """
    from transformers.integrations import moe

    original = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: (weight.dtype == torch.bfloat16
                                                           and original(input, weight, offs))
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original


@contextlib.contextmanager
def rows_are_unpadded():
    """Let transformers drop the all-ones attention mask, as it does on real tensors.

    It checks that no row is padded by reading the mask, which fake tensors
    cannot; every simulated row is full length, so the answer is known.
    """
    from transformers import masking_utils

    original = masking_utils._ignore_causal_mask_sdpa
    masking_utils._ignore_causal_mask_sdpa = lambda padding_mask, *args, **kwargs: original(None, *args, **kwargs)
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = original


def with_depth(hf_config, layers: int):
    """``hf_config`` with ``layers`` decoder blocks (per-layer lists such as ``layer_types`` cut to match, or
    grown by their last entry for a model shallower than the trace); in a multimodal checkpoint's config, its text
    model's. Cross-attention layers (mllama's) are left out: a text row skips them, so the blocks traced on text are
    the self-attention ones."""
    text = hf_config.get_text_config()
    text.num_hidden_layers = layers
    if getattr(text, "cross_attention_layers", None):
        text.cross_attention_layers = []
    for key in ("layer_types", "mlp_layer_types"):
        value = getattr(text, key, None)
        if isinstance(value, list) and value:
            setattr(text, key, value[:layers] + value[-1:] * (layers - len(value)))
    return hf_config


def _load_base_model_on_meta(config: RunConfig, device: torch.device, quantized: bool = True, dtype=None,
                             layers: int | None = None):
    hf_config = hub_config(config)
    if layers is not None:
        hf_config = with_depth(hf_config, layers)
    model = model_module.skeleton_model(config, hf_config, dtype)
    quant = model_module.quantization_config(config) if quantized else None
    if quant is not None:
        from transformers.integrations.bitsandbytes import replace_with_bnb_linear
        from transformers.quantizers.base import get_keys_to_not_convert

        replace_with_bnb_linear(model, modules_to_not_convert=get_keys_to_not_convert(model), quantization_config=quant)
        # what transformers' quantizer marks after loading; k-bit preparation reads it
        setattr(model, "is_loaded_in_4bit" if config.effective_load_in == "4bit" else "is_loaded_in_8bit", True)
    model.config.use_cache = False
    return model


def _warm_up_bitsandbytes_tables(config: RunConfig) -> None:
    """bitsandbytes builds its quantization code books from real data once; do it before going fake."""
    if config.effective_load_in == "4bit":
        import bitsandbytes as bnb

        bnb.functional.quantize_4bit(torch.ones(64, 64), compress_statistics=True)


def _materialize_fake(model: torch.nn.Module, fake_mode) -> None:
    """Swap every meta parameter and buffer for a fake CPU tensor; quantize bitsandbytes weights fakely.

    A parameter shared by several modules (tied embeddings) stays shared.
    """
    def fake(tensor: torch.Tensor) -> torch.Tensor:
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, tensor, torch.device("cpu"))

    swapped: dict[int, torch.Tensor] = {}

    def swap(module, param):
        if id(param) not in swapped:
            if type(param).__name__ == "Params4bit":
                swapped[id(param)] = _fake_4bit(module, param, fake, fake_mode)
            elif type(param).__name__ == "Int8Params":
                swapped[id(param)] = _fake_8bit(param, fake, fake_mode)
            else:
                swapped[id(param)] = torch.nn.Parameter(fake(param.data), requires_grad=param.requires_grad)
        return swapped[id(param)]

    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = swap(module, param)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = swap(module, buffer) if isinstance(buffer, torch.nn.Parameter) else fake(buffer)


def _fake_4bit(module, param, fake, fake_mode) -> torch.Tensor:
    import bitsandbytes as bnb

    with fake_mode:
        weight = fake(param.data.to(module.compute_dtype or torch.float32))
        packed, quant_state = bnb.functional.quantize_4bit(
            weight, blocksize=param.blocksize, compress_statistics=param.compress_statistics,
            quant_type=param.quant_type, quant_storage=param.quant_storage)
    packed = torch.nn.Parameter(packed, requires_grad=False)
    packed.quant_state = quant_state  # what Linear4bit.forward reads; Params4bit cannot wrap a fake tensor
    return packed


def _fake_8bit(param, fake, fake_mode) -> torch.Tensor:
    rows = param.shape[0]
    with fake_mode:
        weight = torch.nn.Parameter(fake(param.data.to(torch.int8)), requires_grad=False)
        weight.CB, weight.SCB = weight, torch.empty(rows, dtype=torch.float32)
    return weight


def main(argv: list[str] | None = None) -> int:
    """``python -m studio.train.measure.simulate CONFIG.yaml``: print the simulated peak as JSON."""
    from studio.core.config import load_config
    from studio.core.errors import StudioError

    parser = argparse.ArgumentParser(prog="python -m studio.train.measure.simulate", description=main.__doc__)
    parser.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    try:
        result = simulate_step(load_config(args.config))
    except StudioError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}))
        return 1
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
