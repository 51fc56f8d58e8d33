"""Trace the worker's training step of a model no family describes, for ``studio.core.memory.derived``.

``python -m studio.train.trace CONFIG.yaml`` builds copies of the configured
model with ``TRACE_DEPTHS`` decoder blocks on fake tensors (the simulation's
``fake_model``: the model's own code, no weights, no GPU) and runs the worker's
optimizer step at each of the ``trace_points``. For each step it records how
far the forward and the backward phase rise above what was live when the step
began (weights, adapters, optimizer state, inputs); for each copy its bytes,
parameters and trainable tensors. The result goes to the trace cache, where the
estimate finds it; the command prints ``{"trace": PATH, "seconds": S}`` or
``{"error", "hint"}`` as its last line.

The steps use SGD (its state is recounted for the chosen optimizer by the
estimate) and one micro-batch per step (accumulation is recounted too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.derived import MOMENTS, TRACE_DEPTHS, TRACE_VERSION, trace_path, trace_points
from studio.core.memory.regime import loss_impl_for
from studio.core.modelinfo import load_model_config
from studio.train.memtrack import LiveTensorTracker, PeakReport
from studio.train.optim import build_optimizer
from studio.train.simulate import (experts_grouped_on_fake_tensors, fake_model, full_length_batches, hub_config,
                                   rows_are_unpadded, run_optimizer_steps, target_tokens)

_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")  # the longest input
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def trace_model(config: RunConfig) -> dict:
    """The trace of ``config``'s model (see the module doc), as the JSON mapping the estimate reads."""
    hf_config = hub_config(config).get_text_config()  # a multimodal checkpoint trains its text model
    positions = next((value for key in _POSITION_KEYS if isinstance(value := getattr(hf_config, key, None), int)), 0)
    chunked = loss_impl_for(config) == "chunked"
    points = trace_points(hf_config.vocab_size, chunked, positions)
    depths = {str(depth): _trace_depth(config, depth, points) for depth in TRACE_DEPTHS}
    return {"version": TRACE_VERSION, "model_type": hf_config.model_type, "layers": hf_config.num_hidden_layers,
            "vocab": hf_config.vocab_size, "chunked": chunked, "scores": _keeps_scores(config, hf_config), "points": [list(point) for point in points],
            "depths": depths}


def _keeps_scores(config: RunConfig, hf_config) -> bool:
    """Whether attention keeps its batch x heads x length² probabilities: eager attention does, and so does
    SDPA with attention dropout on the CPU (its math path), which is where the trace runs."""
    dropout = max((float(value) for key in _ATTENTION_DROPOUT_KEYS
                   if isinstance(value := getattr(hf_config, key, None), (int, float))), default=0.0)
    return config.model.attn_implementation == "eager" or dropout > 0


def _trace_depth(config: RunConfig, depth: int, points) -> dict:
    """One copy with ``depth`` blocks: its sizes, and a step at each point."""
    traced = config.replace(training={"optimizer": "sgd", "gradient_accumulation_steps": 1})
    model, fake_mode = fake_model(traced, layers=depth)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(traced, trainable)
    with LiveTensorTracker() as sizer:
        sizer.add_module(model)
    steps = [_step(model, fake_mode, optimizer, traced.replace(training={"micro_batch_size": batch},
                                                               data={"max_length": length}))
             for batch, length in points]
    return {"model_bytes": sizer.live_bytes, "parameters": sum(_parameter_count(p) for p in model.parameters()),
            "trainable": [[list(p.shape), _DTYPE_NAMES.get(p.dtype, "fp32")] for p in trainable], "steps": steps}


def _parameter_count(param: torch.Tensor) -> int:
    """Weights a parameter holds: a 4-bit one packs two into each byte (bitsandbytes keeps its quant_state)."""
    return param.numel() * (2 if hasattr(param, "quant_state") else 1)


def _step(model, fake_mode, optimizer, config: RunConfig) -> dict:
    """The peak of each moment of a steady step (the second), over the bytes live when it began."""
    batches = full_length_batches(config, model.config.get_text_config().vocab_size, torch.device("cpu"))
    targets = target_tokens(batches)
    with fake_mode, rows_are_unpadded(), experts_grouped_on_fake_tensors():
        with LiveTensorTracker() as tracker, _marked_moments(model, tracker):
            tracker.add_module(model)
            tracker.add([batches, list(optimizer.state.values())])
            run_optimizer_steps(model, optimizer, batches, config, tracker, 1, targets)
            start = tracker.live_bytes
            tracker.report = PeakReport()
            run_optimizer_steps(model, optimizer, batches, config, tracker, 1, targets)
    peaks = tracker.report.phase_peaks
    return {moment: peaks.get(moment, start) - start for moment in MOMENTS}


@contextlib.contextmanager
def _marked_moments(model, tracker: LiveTensorTracker):
    """Split the step's phases into MOMENTS, marked by hooks on the decoder blocks.

    The forward pass becomes "forward_head" once the last block has returned;
    the backward pass (first the head's) becomes "backward_last" when the last
    block's output has its gradient, "backward_first" when the first block's has.
    A block recomputed in backward (gradient checkpointing) marks nothing.
    """
    blocks = _decoder_blocks(model)

    def on_output(forward_moment: str | None, backward_moment: str):
        def hook(module, args, output):
            if not tracker.current_phase.startswith("forward"):
                return
            if forward_moment:
                tracker.mark(forward_moment)
            hidden = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor)), None)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(lambda grad: tracker.mark(backward_moment))
        return hook

    handles = [blocks[-1].register_forward_hook(on_output("forward_head", "backward_last")),
               blocks[0].register_forward_hook(on_output(None, "backward_first"))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _decoder_blocks(model) -> torch.nn.ModuleList:
    """The model's stack of decoder blocks: its largest module list."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
    if not lists:
        raise StudioError(f"cannot find the decoder blocks of {type(model).__name__}",
                          "the traced estimate needs a model whose blocks are a torch.nn.ModuleList", kind="model")
    return max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))


def write_trace(config: RunConfig) -> Path:
    """Trace ``config``'s model and store the trace where the estimate looks for it."""
    path = trace_path(load_model_config(config.model.name_or_path, config.model.revision), config)
    try:
        trace = trace_model(config)
    except StudioError:
        raise
    except Exception as exc:  # the model's own code, on fake tensors: anything it raises
        raise StudioError(f"the model's code failed in the traced step: {type(exc).__name__}: {exc}",
                          "without a trace there is no estimate for this model; if the message names an attention "
                          "implementation, set model.attn_implementation accordingly", kind="model") from exc
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(trace, indent=1), encoding="utf-8")
    partial.replace(path)  # a reader never sees half a trace
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m studio.train.trace CONFIG.yaml``: trace the model's step into the cache."""
    from studio.core.config import load_config

    parser = argparse.ArgumentParser(prog="python -m studio.train.trace", description=main.__doc__)
    parser.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        path = write_trace(load_config(args.config))
    except StudioError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}))
        return 1
    print(json.dumps({"trace": str(path), "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
