"""The DeepSpeed JSON of a run: generated from the run config, then the user's file on top.

The generated keys keep DeepSpeed consistent with the worker's own loop: the
micro-batch and accumulation of each process, clipping, the precision, the ZeRO
stage and where the optimizer state and (ZeRO-3) the weights live; the buckets are
sized to the model as the memory estimate counts them (studio.core.memory.sharding). A user file
(``distributed.deepspeed_config``) is merged over it key by key, nested sections
included, so its values win. The result is written to ``deepspeed.json`` in the run
directory: what ran is what the user can read.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.memory.sharding import zero_bucket_sizes

FILE_NAME = "deepspeed.json"


def generated_config(config: RunConfig, world_size: int, hidden: int) -> dict[str, Any]:
    t, d = config.training, config.distributed
    zero: dict[str, Any] = {"stage": d.deepspeed_stage, **zero_bucket_sizes(hidden, d.deepspeed_stage)}
    if d.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(d.offload_optimizer, d.nvme_path)
    if d.offload_params != "none":
        zero["offload_param"] = _offload(d.offload_params, d.nvme_path)
    return {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "train_batch_size": t.micro_batch_size * t.gradient_accumulation_steps * world_size,
        "gradient_clipping": t.max_grad_norm,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0},
        "zero_optimization": zero,
        # The worker's own optimizer runs on offloaded state when it is not AdamW (see build_optimizer).
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1 << 30,  # the worker logs; DeepSpeed's own progress lines would only repeat it
        "wall_clock_breakdown": False,
    }


def _offload(device: str, nvme_path: str) -> dict[str, Any]:
    offload: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        offload["nvme_path"] = nvme_path
    return offload


def merged(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s keys on top, recursively for nested sections."""
    result = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merged(result[key], value)
        else:
            result[key] = value
    return result


def user_config(path: str) -> dict[str, Any]:
    if not path:
        return {}
    try:
        loaded = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StudioError(f"cannot read distributed.deepspeed_config {path}: {exc}",
                          "give a readable DeepSpeed JSON file, or clear the field", kind="config") from exc
    if not isinstance(loaded, dict):
        raise StudioError(f"distributed.deepspeed_config {path} is not a JSON object",
                          "the file must hold one object of DeepSpeed settings", kind="config")
    return loaded


def deepspeed_config(config: RunConfig, world_size: int, hidden: int) -> dict[str, Any]:
    """The configuration DeepSpeed runs with for a model of width ``hidden`` (the user's keys win)."""
    return merged(generated_config(config, world_size, hidden), user_config(config.distributed.deepspeed_config))


def write(ds_config: dict[str, Any], run_dir: Path) -> Path:
    path = Path(run_dir) / FILE_NAME
    path.write_text(json.dumps(ds_config, indent=1), encoding="utf-8")
    return path
