"""Checkpoints that can be trusted: written atomically, loaded without unpickling code.

A checkpoint folder holds the trained tensors (``trainable.safetensors``: the
adapter for LoRA, every weight for full fine-tuning), the optimizer, scheduler and
RNG states (``torch.save``, read back with ``weights_only=True``) and
``state.json`` (the step; the data position follows from it). It is written into a
staging folder with its COMPLETE marker and renamed into place in one step, so
resume never picks a torn one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from studio.core.errors import StudioError
from studio.core.rundir import RunDir, atomic_folder
from studio.train.model import load_trainable_state_dict, trainable_state_dict

TENSORS = "trainable.safetensors"


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: RunDir, step: int, model, optimizer, scheduler, extra: dict) -> Path:
    destination = run_dir.checkpoint_path(step)
    with atomic_folder(destination, replace=True) as staging:
        save_file(trainable_state_dict(model), str(staging / TENSORS))
        torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(scheduler.state_dict(), staging / "scheduler.pt")
        torch.save(_rng_state(), staging / "rng.pt")
        (staging / "state.json").write_text(json.dumps({"step": step, **extra}, indent=1), encoding="utf-8")
    return destination


def read_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "state.json").read_text(encoding="utf-8"))


def load_weights(checkpoint: Path, model) -> None:
    """Restore the trained tensors into a model built from the same config."""
    load_trainable_state_dict(model, load_file(str(Path(checkpoint) / TENSORS)))


def load_checkpoint(checkpoint: Path, model, optimizer, scheduler) -> dict:
    """Restore everything saved by save_checkpoint; returns its state.json."""
    checkpoint = Path(checkpoint)
    try:
        load_weights(checkpoint, model)
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", weights_only=True))
        scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
        _restore_rng(torch.load(checkpoint / "rng.pt", weights_only=True))
        return read_state(checkpoint)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise StudioError(f"checkpoint {checkpoint} cannot be loaded: {exc}",
                          "delete that folder to resume from the one before it", kind="checkpoint") from exc
