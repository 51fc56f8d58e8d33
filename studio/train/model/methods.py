"""Each adapter method's peft config and what it adds to the training loop, in one map (``TRAINING``).

What a method trains and allows is studio.core.methods' table; this is how peft builds and trains it.
``attach_adapter`` (studio.train.model.build) gives the peft model its method's hooks, so that every model
built from a config, for training, export or generation, saves and restores what its method keeps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.model.vision import vision_family

log = logging.getLogger("studio.train")


class TrainingHooks:
    """What a method adds to the training loop beyond peft's own forward: nothing, for most."""

    def regularization(self, model) -> torch.Tensor | float:
        """A term the worker adds to the loss."""
        return 0.0

    def after_optimizer_step(self, model, step: int) -> None:
        """Called after each optimizer step, before the gradients are zeroed."""

    def checkpoint_state(self, model) -> dict[str, torch.Tensor]:
        """Tensors a checkpoint keeps beside the trained ones."""
        return {}

    def restore_checkpoint_state(self, model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Take back what ``checkpoint_state`` saved; returns the other tensors (the trained ones)."""
        return tensors


NO_HOOKS = TrainingHooks()


class AdaLoraHooks(TrainingHooks):
    """AdaLoRA keeps its singular vectors orthogonal, re-allocates its ranks after each step and needs its
    importance scores back on resume. peft does the first two only inside its Trainer integration."""

    IMPORTANCE = ("ipt", "exp_avg_ipt", "exp_avg_unc")  # the rank allocator's averaged importance scores
    PREFIX = "adalora."  # checkpoint names: adalora.<score>.<parameter>

    def regularization(self, model) -> torch.Tensor | float:
        """The orthogonality penalty, as peft's AdaLoraModel.forward adds it, which it does only to a loss
        computed from labels: the worker computes its own."""
        tuner = model.base_model
        adapter = tuner.trainable_adapter_name
        distances = []
        for name, param in tuner.model.named_parameters():
            if ("lora_A" in name or "lora_B" in name) and adapter in name:
                gram = param @ param.T if "lora_A" in name else param.T @ param
                distances.append(torch.linalg.matrix_norm(gram - torch.eye(*gram.shape, dtype=gram.dtype, device=gram.device)))
        if not distances:
            return 0.0
        return tuner.peft_config[adapter].orth_reg_weight * torch.stack(distances).mean()

    def after_optimizer_step(self, model, step: int) -> None:
        """Re-allocate the ranks from the gradients' importance (before zero_grad)."""
        tuner = model.base_model
        adapter = tuner.peft_config[tuner.trainable_adapter_name]
        if adapter.rank_pattern is None and step > adapter.total_step - adapter.tfinal:
            adapter.rank_pattern = _rank_pattern_from_weights(tuner.model)  # a run resumed after the ranks were fixed
        tuner.update_and_allocate(step)

    def checkpoint_state(self, model) -> dict[str, torch.Tensor]:
        """The importance scores decide the ranks pruned later: a resumed run needs them to prune as the
        uninterrupted one would."""
        allocator = model.base_model.rankallocator
        return {f"{self.PREFIX}{score}.{name}": value.detach().to("cpu").contiguous()
                for score in self.IMPORTANCE for name, value in getattr(allocator, score).items()}

    def restore_checkpoint_state(self, model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        allocator = model.base_model.rankallocator
        device = next(model.parameters()).device
        for name, value in tensors.items():
            if name.startswith(self.PREFIX):
                score, parameter = name.removeprefix(self.PREFIX).split(".", 1)
                getattr(allocator, score)[parameter] = value.to(device)
        return {name: value for name, value in tensors.items() if not name.startswith(self.PREFIX)}


def _rank_pattern_from_weights(model) -> dict[str, list[bool]]:
    """AdaLoRA's kept ranks are its nonzero singular values (pruned ones are zeroed)."""
    return {name: (p.detach() != 0).view(-1).tolist() for name, p in model.named_parameters() if "lora_E." in name}


# (config, the run's total steps or None, the base model or None) -> keyword arguments of the peft config
Arguments = Callable[[RunConfig, int | None, Any], dict]


@dataclass(frozen=True)
class MethodTraining:
    peft_config_class: str  # the class's name in peft
    arguments: Arguments
    hooks: TrainingHooks = NO_HOOKS


def _targets(config: RunConfig) -> str | list[str]:
    targets = config.lora.target_modules
    return "all-linear" if targets == ("all-linear",) else list(targets)


def _lora_arguments(config: RunConfig, total_steps: int | None, model) -> dict:
    lora = config.lora
    return {"r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": _targets(config),
            "use_rslora": lora.use_rslora, "use_dora": lora.use_dora}


def _adalora_arguments(config: RunConfig, total_steps: int | None, model) -> dict:
    lora = config.lora
    return {"init_r": lora.r, "target_r": config.peft.adalora_target_r, "lora_alpha": lora.alpha,
            "lora_dropout": lora.dropout, "target_modules": _targets(config), **adalora_schedule(config, total_steps)}


def adalora_schedule(config: RunConfig, total_steps: int | None) -> dict:
    """peft's tinit / tfinal / deltaT / total_step from the config's fractions of the run's steps.

    Only training reads the schedule; a model rebuilt for export or generation without
    ``total_steps`` gets a placeholder length.
    """
    p = config.peft
    total = total_steps or max(config.training.max_steps, 100)
    return {"total_step": total, "tinit": int(p.adalora_warmup_ratio * total),
            "tfinal": int(p.adalora_final_ratio * total), "deltaT": p.adalora_update_every}


def _ia3_arguments(config: RunConfig, total_steps: int | None, model) -> dict:
    """IA3's target and feedforward layers, by leaf name; ``model`` (the base) tells which are feedforward.

    Feedforward layers (the MLP's output projection: its input is the MLP's width) get their
    input scaled, the others their output. Leaf names are passed even for all-linear: peft
    0.21 expands all-linear to full paths and then refuses to reload an adapter whose
    feedforward names are not among them.
    """
    from studio.core.model.info import model_shape

    targets = _targets(config)
    try:
        shape = model_shape(model.config.to_dict())
    except StudioError:  # an architecture the estimator does not know: peft's own table, if it has one
        return {"target_modules": None if targets == "all-linear" else targets, "feedforward_modules": None}
    wanted = shape.resolve_targets(tuple([targets] if isinstance(targets, str) else targets))
    return {"target_modules": sorted({layer.name for layer in wanted}),
            "feedforward_modules": sorted({layer.name for layer in wanted if layer.in_features == shape.intermediate})}


def _low_rank_product_arguments(config: RunConfig, total_steps: int | None, model) -> dict:
    lora = config.lora
    return {"r": lora.r, "alpha": lora.alpha, "rank_dropout": lora.dropout, "target_modules": _targets(config)}


def _virtual_token_arguments(config: RunConfig, total_steps: int | None, model) -> dict:
    return {"num_virtual_tokens": config.peft.num_virtual_tokens}


# Every method with an adapter (full fine-tuning has none).
TRAINING: dict[str, MethodTraining] = {
    "lora": MethodTraining("LoraConfig", _lora_arguments),
    "qlora": MethodTraining("LoraConfig", _lora_arguments),
    "adalora": MethodTraining("AdaLoraConfig", _adalora_arguments, AdaLoraHooks()),
    "ia3": MethodTraining("IA3Config", _ia3_arguments),
    "loha": MethodTraining("LoHaConfig", _low_rank_product_arguments),
    "lokr": MethodTraining("LoKrConfig", _low_rank_product_arguments),
    "prefix_tuning": MethodTraining("PrefixTuningConfig", _virtual_token_arguments),
    "prompt_tuning": MethodTraining("PromptTuningConfig", _virtual_token_arguments),
}


def peft_config(config: RunConfig, total_steps: int | None = None, model=None):
    """The peft config of the run's method; AdaLoRA's schedule needs the run's ``total_steps``.

    ``model`` (the base) lets IA3 find its feedforward layers.
    """
    import peft

    training = TRAINING.get(config.method)
    if training is None:
        raise StudioError(f"method {config.method} has no adapter", "use full fine-tuning without an adapter",
                          kind="config")
    settings = getattr(peft, training.peft_config_class)(**training.arguments(config, total_steps, model),
                                                         task_type="CAUSAL_LM")
    if model is not None and isinstance(settings, peft.LoraConfig):
        _without_dropout_on_parameters(settings, model)
    family = vision_family(model.config.to_dict()) if model is not None else None
    if family is not None:  # the language model's linears alone: the image parts train whole or not at all
        settings.exclude_modules = family.vision_parts
    elif model is not None and any(name.endswith(_UNUSED_TOWERS) for name, _ in model.named_modules()):
        settings.exclude_modules = _UNUSED_TOWERS_PATTERN
    return settings


# Towers a multimodal checkpoint's causal-LM class loads (Gemma 3's vision tower and its projector) that text
# training never runs: no adapter goes there (peft's all-linear would put one on each of their linears).
_UNUSED_TOWERS = ("vision_tower", "multi_modal_projector")
_UNUSED_TOWERS_PATTERN = r".*\.(vision_tower|multi_modal_projector)\..*"


def _without_dropout_on_parameters(settings, model) -> None:
    """LoRA on a mixture of experts: peft turns all-linear into the attention's modules plus the router's and the
    experts' parameters, which its ParamWrapper adapts but without dropout. The experts are most of the model,
    so they keep their adapter and the whole adapter trains without dropout (the estimate counts it so:
    studio.core.memory.regime.lora_dropout_for)."""
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    convert_peft_config_for_transformers(settings, model, None)  # what get_peft_model does first (idempotent)
    if settings.target_parameters and settings.lora_dropout:
        log.warning("LoRA adapts %s as parameters, which peft trains without dropout: lora.dropout %s is not applied",
                    ", ".join(sorted(settings.target_parameters)), settings.lora_dropout)
        settings.lora_dropout = 0.0


def attach_hooks(peft_model, config: RunConfig) -> None:
    """Give the model its method's training hooks (read back by ``hooks_of``)."""
    peft_model.studio_hooks = TRAINING[config.method].hooks


def hooks_of(model) -> TrainingHooks:
    """The training hooks of the model's method; none for a model without an adapter."""
    return getattr(model, "studio_hooks", NO_HOOKS)


def adapter_regularization(model) -> torch.Tensor | float:
    """The method's term added to the loss (AdaLoRA's orthogonality penalty); 0 for other methods."""
    return hooks_of(model).regularization(model)


def after_optimizer_step(model, step: int) -> None:
    """The method's work after each optimizer step (AdaLoRA re-allocates its ranks)."""
    hooks_of(model).after_optimizer_step(model, step)
