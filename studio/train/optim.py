"""Optimizer and learning-rate schedule from the config, through torch, bitsandbytes and transformers."""

from __future__ import annotations

import torch

from studio.core.config import RunConfig


def build_optimizer(config: RunConfig, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    t = config.training
    lr, wd = t.learning_rate, t.weight_decay
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    if t.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        import bitsandbytes as bnb

        cls = bnb.optim.AdamW8bit if t.optimizer == "adamw_8bit" else bnb.optim.PagedAdamW8bit
        return cls(params, lr=lr, weight_decay=wd)
    if t.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd)
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(params, lr=lr, weight_decay=wd, relative_step=False, scale_parameter=False, warmup_init=False)
    raise AssertionError(f"optimizer {t.optimizer} passed validation but is not wired")


def build_scheduler(config: RunConfig, optimizer: torch.optim.Optimizer, total_steps: int):
    from transformers import get_scheduler

    warmup = int(round(config.training.warmup_ratio * total_steps))
    name = {"constant": "constant_with_warmup"}.get(config.training.lr_scheduler, config.training.lr_scheduler)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps)
