"""Trace the worker's training step of a model no family describes, for ``studio.core.memory.derived``.

``python -m studio.train.measure.trace CONFIG.yaml`` builds copies of the configured
model with ``TRACE_DEPTHS`` decoder blocks on fake tensors (the simulation's
``fake_model``: the model's own code, no weights, no GPU) and runs the worker's
optimizer step at each of the ``trace_points``. For each step it records how
far the forward and the backward phase rise above what was live when the step
began (weights, adapters, optimizer state, inputs); for each copy its bytes,
parameters and trainable tensors. It does so for the configured settings and each
regime one toggle away (``neighbour_configs``: checkpointing, precision, 4/8-bit
loading), and for LoRA records one block's adapters (``_block_record``, read by
``studio.core.memory.recount``). The result goes to the trace cache, where the
estimate finds it, after each regime (the configured one first); a trace already
there keeps its regimes and gains the missing ones. The command prints
``{"trace": PATH, "seconds": S}`` or ``{"error", "hint"}`` as its last line.

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
from peft.tuners.lora import LoraLayer, ParamWrapper
from torch.utils._pytree import tree_leaves

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.derived import (MOMENTS, TRACE_DEPTHS, TRACE_VERSION, neighbour_configs, record_id, regime_axes,
                                        regime_id, trace_path, trace_points)
from studio.core.memory.recount import RECORD_LENGTH, RECORD_RANK, lora_settings, recounts_lora
from studio.core.memory.regime import loss_impl_for
from studio.core.model.info import load_model_config
from studio.core.run.directory import write_atomically
from studio.train.measure.memtrack import LiveTensorTracker, PeakReport
from studio.train.measure.simulate import (experts_grouped_on_fake_tensors, fake_model, full_length_batches, hub_config,
                                           loss_sum, rows_are_unpadded, run_optimizer_steps, target_tokens)
from studio.train.model.build import compute_dtype
from studio.train.objectives.next_token import run_output_layer
from studio.train.optim import build_optimizer

_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")  # the longest input
_ATTENTION_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob", "attn_dropout")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def trace_model(config: RunConfig, existing: dict | None = None, written=lambda data: None,
                neighbours: bool = True) -> dict:
    """The trace of ``config``'s model (see the module doc), as the JSON mapping the estimate reads: ``existing``
    (a trace of the same key) with the regimes it lacks; ``written`` is called after each new regime. Without
    ``neighbours``, only ``config``'s own regime."""
    hf_config = hub_config(config).get_text_config()  # a multimodal checkpoint trains its text model
    positions = next((value for key in _POSITION_KEYS if isinstance(value := getattr(hf_config, key, None), int)), 0)
    chunked = loss_impl_for(config) == "chunked"
    points = trace_points(hf_config.vocab_size, chunked, positions)
    data = existing or {"version": TRACE_VERSION, "model_type": hf_config.model_type,
                        "layers": hf_config.num_hidden_layers, "vocab": hf_config.vocab_size, "chunked": chunked,
                        "scores": _keeps_scores(config, hf_config), "points": [list(point) for point in points],
                        "regimes": {}, "records": {}}
    for neighbour in neighbour_configs(config) if neighbours else [config]:
        picked = neighbour is config
        try:
            _trace_regime(neighbour, data, points)
        except Exception as exc:  # the model's own code, on fake tensors: anything it raises
            if picked:
                raise
            lora_axis = recounts_lora(neighbour) and not data["lora_recount"]
            data["regimes"][regime_id(regime_axes(neighbour, lora_axis))] = {"error": f"{type(exc).__name__}: {exc}"}
        written(data)
    return data


def _trace_regime(config: RunConfig, data: dict, points) -> None:
    """Trace one regime into ``data`` unless it is there (and, for LoRA, its block record)."""
    data.setdefault("lora_recount", recounts_lora(config))  # until a record finds parameters that peft wraps
    recount = recounts_lora(config) and data["lora_recount"]
    axes = regime_axes(config, lora_axis=recounts_lora(config) and not recount)
    if regime_id(axes) in data["regimes"]:
        return
    if recount and record_id(axes) not in data["records"]:
        record = _block_record(config)
        if record is None:  # no record: LoRA's settings become an axis, and this regime is traced with them
            data["lora_recount"] = False
            return _trace_regime(config, data, points)
        data["records"][record_id(axes)] = record
    depths = {str(depth): _trace_depth(config, depth, points) for depth in TRACE_DEPTHS}
    data["regimes"][regime_id(axes)] = {"lora": lora_settings(config), "depths": depths}


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


def _block_record(config: RunConfig) -> dict | None:
    """The block record for ``studio.core.memory.recount``: LoRA of rank RECORD_RANK on every linear, with
    and without dropout, a forward pass of one row of RECORD_LENGTH tokens without checkpointing, for the first
    block (its input needs no gradient) and a typical one; ``None`` when peft wraps a parameter rather than a
    linear module (nothing to recount from)."""
    record = {}
    for state, rate in (("dropout", 0.1), ("none", 0.0)):
        recording = config.replace(training={"gradient_checkpointing": False, "micro_batch_size": 1},
                                   data={"max_length": RECORD_LENGTH},
                                   lora={"r": RECORD_RANK, "target_modules": ("all-linear",), "dropout": rate})
        model, fake_mode = fake_model(recording, layers=TRACE_DEPTHS[0])
        if any(isinstance(m, ParamWrapper) for m in model.modules()):
            return None
        blocks = _decoder_blocks(model)
        for block_name, block in (("first", blocks[0]), ("typical", blocks[-1])):
            adapters = {name: m for name, m in block.named_modules() if isinstance(m, LoraLayer)}
            if not adapters:
                return None
            saved, inputs = _saved_by_adapters(model, fake_mode, recording, adapters)
            groups = list(dict.fromkeys(inputs.values()))
            record["linears"] = {name: {"in": layer.in_features, "out": layer.out_features,
                                        "group": groups.index(inputs[name])} for name, layer in adapters.items()}
            record["adapter_dtype"] = _DTYPE_NAMES.get(next(iter(adapters.values())).lora_A.default.weight.dtype,
                                                       "fp32")
            record.setdefault("costs", {}).setdefault(block_name, {})[state] = _adapter_costs(saved, inputs, groups)
    return record


def _adapter_costs(saved: dict, inputs: dict, groups: list) -> dict:
    """What each adapter alone saves, by kind (see ``studio.core.memory.recount``): per token, and per rank the
    tensors that do not grow with the tokens (its weights, cast for autocast)."""
    costs = {"rank": dict.fromkeys(inputs, 0.0), "own": dict.fromkeys(inputs, 0.0),
             "weights": dict.fromkeys(inputs, 0.0), "groups": {}}
    for key, (owner, nbytes, shape) in saved.items():
        if RECORD_LENGTH not in shape[:-1]:
            costs["weights"][owner] += nbytes / RECORD_RANK
        elif key == inputs[owner]:
            group = str(groups.index(key))
            costs["groups"][group] = costs["groups"].get(group, 0.0) + nbytes / RECORD_LENGTH
        elif shape[-1] == RECORD_RANK:
            costs["rank"][owner] += nbytes / RECORD_LENGTH / RECORD_RANK
        else:
            costs["own"][owner] += nbytes / RECORD_LENGTH
    return costs


def _saved_by_adapters(model, fake_mode, config: RunConfig, adapters: dict) -> tuple[dict, dict]:
    """The storages saved for backward inside the adapters (not their base layers, and not also saved by code
    outside them) in one forward pass: {storage: (adapter, bytes, shape)}, and each adapter's input storage."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    inside: list = []  # the adapter running (None inside its base layer)
    inputs: dict = {}
    saved: dict = {}
    elsewhere: set = set()
    kept: list = []  # every saved tensor stays alive, so no storage id is reused during the pass

    def pack(tensor):
        key = tensor.untyped_storage()._cdata
        if key not in params:
            kept.append(tensor)
            if inside and inside[-1] is not None:
                saved.setdefault(key, (inside[-1], tensor.untyped_storage().nbytes(), tuple(tensor.shape)))
            else:
                elsewhere.add(key)
        return tensor

    def enter(name, base=False):
        def hook(module, args):
            inside.append(None if base else name)
            if not base:
                inputs[name] = args[0].untyped_storage()._cdata
        return hook

    def leave(*_):
        inside.pop()  # returns nothing: a forward hook's return value would replace the output

    handles = []
    for name, adapter in adapters.items():
        handles += [adapter.register_forward_pre_hook(enter(name)), adapter.register_forward_hook(leave),
                    adapter.base_layer.register_forward_pre_hook(enter(name, base=True)),
                    adapter.base_layer.register_forward_hook(leave)]
    batch = full_length_batches(config, model.config.get_text_config().vocab_size, torch.device("cpu"))[0]
    output_layer = run_output_layer(config, model)
    autocast = torch.autocast("cpu", dtype=compute_dtype(config), enabled=config.training.precision != "fp32")
    model.train()
    try:
        with fake_mode, rows_are_unpadded(), experts_grouped_on_fake_tensors(), autocast:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                loss_sum(model, batch, output_layer)
    finally:
        for handle in handles:
            handle.remove()
    return {key: value for key, value in saved.items() if key not in elsewhere}, inputs


def write_trace(config: RunConfig, neighbours: bool = True) -> Path:
    """Trace ``config``'s model into the cache, where the estimate looks for it (see the module doc)."""
    path = trace_path(load_model_config(config.model.name_or_path, config.model.revision), config)
    existing = None
    if path.is_file():
        with contextlib.suppress(OSError, ValueError):
            existing = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(existing, dict) or existing.get("version") != TRACE_VERSION:
            existing = None

    def written(data: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(data, indent=1))  # a reader never sees half a trace

    try:
        trace_model(config, existing, written, neighbours)
    except StudioError:
        raise
    except Exception as exc:  # the model's own code, on fake tensors: anything it raises
        raise StudioError(f"the model's code failed in the traced step: {type(exc).__name__}: {exc}",
                          "without a trace there is no estimate for this model; if the message names an attention "
                          "implementation, set model.attn_implementation accordingly", kind="model") from exc
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m studio.train.measure.trace CONFIG.yaml``: trace the model's step into the cache."""
    from studio.core.config import load_config

    parser = argparse.ArgumentParser(prog="python -m studio.train.measure.trace", description=main.__doc__)
    parser.add_argument("config", type=Path)
    parser.add_argument("--alone", action="store_true", help="only these settings, not the ones a toggle away")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        path = write_trace(load_config(args.config), neighbours=not args.alone)
    except StudioError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}))
        return 1
    print(json.dumps({"trace": str(path), "seconds": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
