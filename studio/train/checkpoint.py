"""Checkpoints that can be trusted: written atomically, loaded without unpickling code.

A checkpoint folder holds the trained tensors (``trainable.safetensors``: the
adapter for LoRA, every weight for full fine-tuning), the optimizer, scheduler and
RNG states (``torch.save``, read back with ``weights_only=True``) and
``state.json`` (the step; the data position follows from it). Under DeepSpeed ZeRO
the optimizer state is DeepSpeed's own, one shard per rank in ``deepspeed/``. It is written into a
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
from studio.core.run.directory import RunDir
from studio.train.model.build import load_trainable_state_dict

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
        for index, generator_state in zip(range(torch.cuda.device_count()), state["cuda"]):  # resumed on fewer GPUs
            torch.cuda.set_rng_state(generator_state, index)


def save_checkpoint(run_dir: RunDir, step: int, engine, raw_model, scheduler, extra: dict,
                    rank_state: dict | None = None) -> Path:
    """Write the checkpoint of ``step``; every rank calls it (see studio.train.distributed.engine). ``rank_state``:
    what this rank's next steps need beside the weights (grpo's generation batch), for ``load_rank_state``."""
    tensors = engine.trainable_tensors(raw_model)
    destination = run_dir.checkpoint_path(step)
    with engine.shared_staging(destination) as staging:
        engine.save_optimizer(staging)
        torch.save(_rng_state(), staging / _rng_file(engine.rank))
        if rank_state is not None:
            torch.save(rank_state, staging / f"rank-state-{engine.rank}.pt")
        if engine.is_main:
            save_file(tensors, str(staging / TENSORS))
            torch.save(scheduler.state_dict(), staging / "scheduler.pt")
            (staging / "state.json").write_text(json.dumps({"step": step, **extra}, indent=1), encoding="utf-8")
    return destination


def _rng_file(rank: int) -> str:
    return "rng.pt" if rank == 0 else f"rng-rank{rank}.pt"


def load_rank_state(checkpoint: Path, rank: int) -> dict | None:
    """What ``save_checkpoint`` kept for this rank's next steps, or None."""
    path = Path(checkpoint) / f"rank-state-{rank}.pt"
    return torch.load(path, weights_only=True) if path.is_file() else None


def read_state(checkpoint: Path) -> dict:
    return json.loads((Path(checkpoint) / "state.json").read_text(encoding="utf-8"))


def load_weights(checkpoint: Path, model) -> None:
    """Restore the trained tensors into a model built from the same config."""
    load_trainable_state_dict(model, load_file(str(Path(checkpoint) / TENSORS)))


def load_checkpoint(checkpoint: Path, engine, scheduler) -> dict:
    """Restore the optimizer, scheduler and random state saved by save_checkpoint; returns its state.json.

    The trained tensors are loaded before the engine wraps the model (``load_weights``):
    then every layout, sharded or not, reads them the same way.
    """
    checkpoint = Path(checkpoint)
    try:
        engine.load_optimizer(checkpoint)
        scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
        rng = checkpoint / _rng_file(engine.rank)
        _restore_rng(torch.load(rng if rng.is_file() else checkpoint / _rng_file(0), weights_only=True))
        return read_state(checkpoint)
    except (OSError, RuntimeError, ValueError, KeyError) as exc:
        raise StudioError(f"checkpoint {checkpoint} cannot be loaded: {exc}",
                          "delete that folder to resume from the one before it", kind="checkpoint") from exc
