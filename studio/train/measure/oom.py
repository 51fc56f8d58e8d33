"""When memory runs out: say which part overflowed, keep what is consistent, suggest the cheapest fix.

The part comes from where the error was raised (model loading, forward, the loss
over the logits, backward, the optimizer step, evaluation). The fix comes from the
fit solver (studio.core.memory.fit): the fastest configuration whose estimate fits the
device, as config changes the app can apply with one click.

``STUDIO_SIMULATE_GPU_MEMORY`` (e.g. ``300MiB``) makes the worker behave as if it
ran on a GPU of that size: live tensor bytes are counted (LiveTensorTracker) and
an allocation beyond the limit raises torch.OutOfMemoryError. It lets a machine
without a GPU show, and test, what a user sees when a run does not fit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch

from studio.core.config import RunConfig, differences
from studio.core.errors import StudioError
from studio.core.sizes import format_bytes, parse_size
from studio.train.measure.memtrack import LiveTensorTracker

log = logging.getLogger("studio.train")

SIMULATE_ENV = "STUDIO_SIMULATE_GPU_MEMORY"

# In priority order: (what a frame's file path contains, its function names, the part).
# The first rule matching any frame wins: a forward recomputed in the backward pass is the backward
# pass, a forward during evaluation is evaluation.
_PARTS = (
    ("transformers", {"from_pretrained"}, "loading the model"),
    ("studio", {"evaluate"}, "evaluation"),
    ("studio", {"save_checkpoint"}, "saving a checkpoint"),
    ("optim", {"step"}, "the optimizer step"),
    ("", {"backward"}, "the backward pass"),
    ("", {"cross_entropy", "chunked_cross_entropy", "_chunk_loss"}, "the loss over the logits"),
    ("torch/nn/modules", {"_call_impl", "_wrapped_call_impl"}, "the forward pass"),
    ("studio", {"token_loss_sum"}, "the loss over the logits"),  # its fp32 upcast of the logits
)


def overflowed_part(exc: BaseException) -> str:
    """The part of training that ran out of memory, read from the stack where it was raised."""
    stack = getattr(exc, "stack", None) or traceback.extract_tb(exc.__traceback__)
    frames = [(frame.filename.replace("\\", "/"), frame.name) for frame in stack]
    for path_part, names, part in _PARTS:
        if any(path_part in filename and function in names for filename, function in frames):
            return part
    return "the forward pass"


def consistent_after(part: str) -> bool:
    """Whether the weights are still those of the last finished step (so saving them is safe)."""
    return part in ("the forward pass", "the loss over the logits", "the backward pass", "evaluation")


class MemoryCap(LiveTensorTracker):
    """Counts live tensor bytes and raises torch.OutOfMemoryError beyond ``limit_bytes``, like a small GPU."""

    def __init__(self, limit_bytes: int, device_type: str):
        super().__init__(device_type)
        self.limit_bytes = limit_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.live_bytes > self.limit_bytes:
            error = torch.OutOfMemoryError(
                f"simulated GPU of {format_bytes(self.limit_bytes)} ({SIMULATE_ENV}): "
                f"{format_bytes(self.live_bytes)} would be in use after {func}")
            error.stack = traceback.extract_stack()  # the traceback loses the frames above the dispatch
            raise error
        return out


def simulated_gpu_bytes() -> int | None:
    text = os.environ.get(SIMULATE_ENV, "").strip()
    return parse_size(text) if text else None


@contextlib.contextmanager
def simulated_memory_limit(model: torch.nn.Module, optimizer, device: torch.device) -> Iterator[None]:
    """Enforce STUDIO_SIMULATE_GPU_MEMORY over the block, counting the model and optimizer state."""
    limit = simulated_gpu_bytes()
    if limit is None:
        yield
        return
    with MemoryCap(limit, device.type) as cap:
        cap.add_module(model)
        cap.add(state for state in optimizer.state.values())
        yield


def device_memory_bytes(device: torch.device) -> int | None:
    """The memory a fix must fit in: the simulated limit, else what a new run may take on the CUDA device (what is
    free, and what this process's allocator holds: the display and other processes keep theirs), else unknown."""
    simulated = simulated_gpu_bytes()
    if simulated is not None:
        return simulated
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device)
    return None


def suggest_fix(config: RunConfig, device: torch.device) -> dict | None:
    """The fit solver's cheapest configuration for this device, as section changes; None if it has none."""
    from studio.core.memory.fit import fit
    from studio.core.model.info import load_model_config

    gpu_bytes = device_memory_bytes(device)
    if gpu_bytes is None:
        return None
    device_type = "cpu" if simulated_gpu_bytes() is not None else device.type
    try:
        result = fit(load_model_config(config.model.name_or_path, config.model.revision), config, gpu_bytes, device_type)
    except StudioError as exc:
        log.warning("no fix suggested: %s", exc.message)
        return None
    if not result.fits or not result.changes:
        return None
    return {"description": "; ".join(change.description for change in result.changes),
            "changes": _changed_fields(config, result.config),
            "needed_bytes": result.estimate.peak_bytes, "gpu_bytes": gpu_bytes}


def _changed_fields(before: RunConfig, after: RunConfig) -> dict:
    """``{section: {field: new value}}`` for every field of a section that differs."""
    changes: dict = {}
    for path, (_, value) in differences(before, after).items():
        section, _, name = path.rpartition(".")
        if section:
            changes.setdefault(section, {})[name] = value
    return changes


def release_memory(optimizer) -> None:
    """Drop gradients and cached blocks so that saving has room."""
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def oom_report(exc: BaseException, config: RunConfig, device: torch.device | None, saved: Path | None) -> dict:
    """The fields of the ``error`` event for an out-of-memory failure."""
    part = overflowed_part(exc)
    fix = suggest_fix(config, device) if device is not None else None
    kept = f"step {saved.name.split('-')[-1].lstrip('0') or 0} was saved" if saved else "the last checkpoint is kept"
    if fix:
        hint = f"{kept}. Cheapest change that fits: {fix['description']}; start a new run with it."
    else:
        hint = f"{kept}. Run `studio fit` for a configuration that fits, or lower the micro-batch size."
    return {"kind": "oom", "message": f"out of memory in {part}: {exc}", "hint": hint, "part": part, "fix": fix}
