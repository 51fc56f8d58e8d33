"""Semantic checks of a RunConfig: every problem at once, each with its field and a hint.

Types and choices are checked while loading (config.py); this module checks values
and combinations. The GUI calls it on every change to disable impossible choices.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

from studio.core.choices import choice_label
from studio.core.config import RunConfig
from studio.core.data.dataset import SUFFIXES
from studio.core.data.hub import is_hub_spec, parse_hub_spec
from studio.core.data.row_formats import ANSWERED_FORMATS, DataError
from studio.core.errors import Problem, ProblemsError, StudioError
from studio.core.memory.placement import pipeline_refusals, too_few_blocks
from studio.core.memory.savers import SAVER_SPECS
from studio.core.methods import ADALORA_BUDGET, ATTENTION_TOKENS, DORA, RSLORA, VIRTUAL_TOKEN_COUNT
from studio.core.model.check import is_local_model
from studio.core.model.info import load_model_config, looks_like_path
from studio.core.model.stages import PIPELINE_OFF_HINT, pipeline_family_refusal, pipeline_refusal_message


def validate(config: RunConfig, check_files: bool = True) -> list[Problem]:
    """Return every problem with ``config``; an empty list means it can run."""
    problems: list[Problem] = []
    problems += _check_model(config, check_files)
    problems += _check_data(config, check_files)
    problems += _check_method(config)
    problems += _check_peft(config)
    problems += _check_qat(config)
    problems += _check_preference(config)
    problems += _check_grpo(config, check_files)
    problems += _check_training(config)
    problems += _check_schedule(config)
    problems += _check_distributed(config, check_files)
    if config.vision.max_pixels < 0:
        problems.append(Problem("vision.max_pixels", f"must be 0 (the processor's limit) or more, got "
                                f"{config.vision.max_pixels}", "0 keeps the processor's own limit"))
    return problems


def machine_problems(config: RunConfig, nvidia_gpu: bool) -> list[Problem]:
    """What ``config`` needs that this machine lacks (``nvidia_gpu``: whether it has one): a run that would start
    but not finish correctly here. Not part of ``validate``: a config may be made here for another machine."""
    if nvidia_gpu:
        return []
    problems, load_in = [], config.effective_load_in
    if load_in != "none":
        label = choice_label("quantization.load_in", load_in)
        problems.append(Problem("quantization.load_in", f"{label} base weights need an NVIDIA GPU: without one "
                                "bitsandbytes computes them on the CPU, which it warns may be silently wrong, and the "
                                "export of such a run does not reproduce the trained model", "choose base weights "
                                "none (16/32-bit) here, with LoRA, or train on a machine with an NVIDIA GPU"))
    if config.objective == "grpo" and config.grpo.generation_backend == "vllm":
        problems.append(Problem("grpo.generation_backend", "vllm samples on an NVIDIA GPU only",
                                "set grpo.generation_backend to hf here, or train on a machine with an NVIDIA GPU"))
    return problems


def raise_if_invalid(config: RunConfig, source: str = "the config", check_files: bool = True,
                     lines: dict[str, int] | None = None) -> None:
    """Raise every problem at once; with the file's ``lines`` (config.key_lines) each names its YAML line."""
    problems = validate(config, check_files)
    if problems:
        raise ProblemsError([_with_line(p, source, lines or {}) for p in problems], "config", source)


def _with_line(problem: Problem, source: str, lines: dict[str, int]) -> Problem:
    """``data.train_files[0]`` -> ``data.train_files[0] (run.yaml:7)`` when the file sets that key."""
    line = lines.get(problem.where.split("[")[0])
    return replace(problem, where=f"{problem.where} ({source}:{line})") if line else problem


def _check_kto_weights(config: RunConfig) -> list[Problem]:
    """KTO's desirable and undesirable weights: positive for kto, left at 1 by the other objectives."""
    problems = []
    for name in ("desirable_weight", "undesirable_weight"):
        value, where = getattr(config.preference, name), f"preference.{name}"
        if config.objective == "kto":
            problems += _positive(value, where, "weight such as 1.0")
        elif value != 1.0:
            problems.append(Problem(where, f"objective {config.objective} does not weigh rows by their label",
                                    "set it to 1 (it is kto's)"))
    return problems


def _positive(value: float, where: str, what: str) -> list[Problem]:
    return [] if value > 0 else [Problem(where, f"must be greater than 0, got {value}", f"set a positive {what}")]


def _check_model(config: RunConfig, check_files: bool) -> list[Problem]:
    name = config.model.name_or_path
    if not name:
        return [Problem("model.name_or_path", "no model chosen", "give a local model folder or a Hub id")]
    if check_files and looks_like_path(name) and not is_local_model(name):
        return [Problem("model.name_or_path", f"{name}: no such model folder",
                        "check the path (relative paths start at the config's folder), or give a Hub id owner/name")]
    return []


def _check_data(config: RunConfig, check_files: bool) -> list[Problem]:
    data = config.data
    problems: list[Problem] = []
    if not data.train_files:
        problems.append(Problem("data.train_files", "no training data", "list at least one data file"))
    for key, files in (("data.train_files", data.train_files), ("data.eval_files", data.eval_files)):
        for index, name in enumerate(files):
            where = f"{key}[{index}]"
            if is_hub_spec(name):
                problems += _hub_problems(name, where)
            elif check_files and Path(name).is_dir():
                problems.append(Problem(where, f"{name} is a folder, not a data file: choose the files inside it",
                                        "list each file, e.g. " + (Path(name) / ("*" + SUFFIXES[0])).as_posix()))
            elif Path(name).suffix.lower() not in SUFFIXES:
                problems.append(Problem(where, f"{name}: unsupported file type", "use " + ", ".join(SUFFIXES)))
            elif check_files and not Path(name).is_file():
                problems.append(Problem(where, f"{name}: no such file", "check the path (relative paths start at the config's folder)"))
    if not 0.0 <= data.eval_fraction <= 0.5:
        problems.append(Problem("data.eval_fraction", f"must be between 0 and 0.5, got {data.eval_fraction}"))
    if data.eval_files and data.eval_fraction:
        problems.append(Problem("data.eval_fraction", "set together with data.eval_files", "use one of the two"))
    if data.max_length < 8:
        problems.append(Problem("data.max_length", f"must be at least 8 tokens, got {data.max_length}"))
    return problems


def _hub_problems(name: str, where: str) -> list[Problem]:
    """A Hub dataset is no file to look for: only its name is checked here (the worker loads it)."""
    try:
        parse_hub_spec(name, where)
    except DataError as exc:
        return [exc.problem]
    return []


def _check_method(config: RunConfig) -> list[Problem]:
    problems: list[Problem] = []
    load_in, spec = config.effective_load_in, config.method_spec
    if not spec.uses_adapter and load_in != "none":
        problems.append(Problem("quantization.load_in", f"{load_in} weights cannot be fully fine-tuned",
                                "use method lora/qlora, or set quantization.load_in to none"))
    elif spec.kbit_base == "required" and load_in == "none":
        problems.append(Problem("quantization.load_in", f"{config.method} needs a quantized base",
                                "set it to 4bit or 8bit, or use method lora"))
    elif load_in != "none" and spec.kbit_base == "no":
        problems.append(Problem("quantization.load_in", f"{config.method} cannot adapt a {load_in} base (peft has no "
                                "quantized layers for it)", "use lora, adalora or ia3 on a quantized base, or set "
                                "quantization.load_in to none"))
    if config.adapts_linears:
        lora = config.lora
        problems += _positive(lora.r, "lora.r", "rank such as 8 or 16")
        problems += _positive(lora.alpha, "lora.alpha", "alpha such as 2 x r")
        if not 0.0 <= lora.dropout < 1.0:
            problems.append(Problem("lora.dropout", f"must be in [0, 1), got {lora.dropout}"))
        if not lora.target_modules:
            problems.append(Problem("lora.target_modules", "empty", "use all-linear or name the modules"))
    for name, label, setting in (("use_dora", "DoRA", DORA), ("use_rslora", "rsLoRA", RSLORA)):
        if getattr(config.lora, name) and setting not in spec.settings:
            problems.append(Problem(f"lora.{name}", f"{label} is a variant of LoRA, not of {config.method}",
                                    f"use method lora or qlora, or turn lora.{name} off"))
    if not spec.uses_adapter and config.model.dtype in ("float16", "bfloat16") and config.training.optimizer != "adafactor":
        problems.append(Problem("model.dtype", f"full fine-tuning with {config.model.dtype} weights loses small updates",
                                "keep model.dtype auto (fp32 master weights) and use training.precision bf16"))
    return problems


def _check_peft(config: RunConfig) -> list[Problem]:
    p, settings = config.peft, config.method_spec.settings
    problems: list[Problem] = []
    if VIRTUAL_TOKEN_COUNT in settings:
        problems += _positive(p.num_virtual_tokens, "peft.num_virtual_tokens", "number of virtual tokens such as 20")
        # virtual tokens that enter as keys and values reach the layers as a key/value cache
        if config.method_spec.token_entry == ATTENTION_TOKENS and config.training.gradient_checkpointing:
            problems.append(Problem("training.gradient_checkpointing", f"{config.method_spec.label.lower()} passes its "
                                    "prefix as a key/value cache, which gradient checkpointing turns off", "turn gradient checkpointing off, "
                                    "or use prompt_tuning"))
    if ADALORA_BUDGET in settings:
        problems += _positive(p.adalora_target_r, "peft.adalora_target_r", "target rank such as r / 2")
        if p.adalora_target_r > config.lora.r:
            problems.append(Problem("peft.adalora_target_r", f"{p.adalora_target_r} is above the starting rank lora.r "
                                    f"({config.lora.r}): AdaLoRA only prunes", "lower it or raise lora.r"))
        problems += _positive(p.adalora_update_every, "peft.adalora_update_every", "interval in steps")
        for name in ("adalora_warmup_ratio", "adalora_final_ratio"):
            if not 0.0 <= getattr(p, name) < 1.0:
                problems.append(Problem(f"peft.{name}", f"must be in [0, 1), got {getattr(p, name)}"))
        if p.adalora_warmup_ratio + p.adalora_final_ratio >= 1.0:
            problems.append(Problem("peft.adalora_final_ratio", "warmup and final phases leave no steps for pruning",
                                    "keep adalora_warmup_ratio + adalora_final_ratio below 1"))
    return problems


def _check_qat(config: RunConfig) -> list[Problem]:
    q = config.qat
    problems: list[Problem] = []
    if q.activations != "none" and not q.enabled:
        problems.append(Problem("qat.activations", "activation fake-quantization comes with weight fake-quantization",
                                "set qat.weights to int4 or int8, or qat.activations to none"))
    if not q.enabled:
        return problems
    problems += _positive(q.group_size, "qat.group_size", "group size such as 32")
    if config.effective_load_in != "none":
        problems.append(Problem("qat.weights", "QAT needs full-precision base weights, not a bitsandbytes base",
                                "set quantization.load_in to none (lora instead of qlora), or qat.weights to none"))
    return problems


_FORMAT_OBJECTIVES = {"preference": ("the preference objectives", "dpo, orpo or simpo"),
                      "unpaired_preference": ("the preference objectives", "kto"),
                      "prompt_only": ("grpo, which writes their completions", "grpo")}
"""The row formats only some objectives read: who reads them (for a message), and the objective to set."""


def _check_preference(config: RunConfig) -> list[Problem]:
    """The preference objectives' data and settings; a setting the objective ignores is refused, not silently unused."""
    pref, objective, problems = config.preference, config.objective, []
    fmt, wanted = config.data.format, config.objective_format
    if wanted is None:
        if fmt in _FORMAT_OBJECTIVES:
            problems.append(Problem("data.format", f"{fmt} rows are for {_FORMAT_OBJECTIVES[fmt][0]}",
                                    f"set objective to {_FORMAT_OBJECTIVES[fmt][1]}, or choose another data.format"))
        return problems
    prompts = wanted == "prompt_only"  # grpo's: supervised rows are read as prompts too, each answer the reference
    if fmt not in ("auto", wanted) and not (prompts and fmt in ANSWERED_FORMATS):  # one reason, listed once
        rows = f"prompts ({', '.join((wanted, *ANSWERED_FORMATS))} rows)" if prompts else f"{wanted} rows"
        problems.append(Problem("data.format", f"objective {objective} learns from {rows}",
                                f"set data.format to {wanted} or auto"))
    if not config.learns_preferences:
        return problems
    problems += _positive(pref.beta, "preference.beta", "beta such as 0.1")
    problems += _check_kto_weights(config)
    smoothing_used = (objective == "dpo" and pref.dpo_loss == "robust") or objective == "simpo"
    if not 0.0 <= pref.label_smoothing < 0.5:
        problems.append(Problem("preference.label_smoothing", f"must be in [0, 0.5), got {pref.label_smoothing}"))
    elif pref.label_smoothing and not smoothing_used:
        what = f"dpo_loss {pref.dpo_loss}" if objective == "dpo" else f"objective {objective}"
        problems.append(Problem("preference.label_smoothing", f"{what} does not use label smoothing",
                                "set it to 0, or use dpo_loss robust (or objective simpo)"))
    if pref.sft_weight < 0:
        problems.append(Problem("preference.sft_weight", f"must be 0 or more, got {pref.sft_weight}"))
    elif pref.sft_weight and objective == "orpo":
        problems.append(Problem("preference.sft_weight", "ORPO always adds the chosen rows' cross-entropy, weight 1",
                                "set it to 0 (preference.beta weighs ORPO's odds-ratio term)"))
    elif pref.sft_weight and objective == "kto":
        problems.append(Problem("preference.sft_weight", "kto adds no cross-entropy", "set it to 0"))
    if config.uses_reference and pref.reference == "each_step" and not config.uses_adapter \
            and config.distributed.shards_weights:
        problems.append(Problem("preference.reference", f"a frozen copy of the reference would be whole on every GPU "
                                f"while {config.distributed.sharding} shards the trained weights",
                                "set preference.reference to precomputed"))
    return problems


def _check_grpo(config: RunConfig, check_files: bool) -> list[Problem]:
    """GRPO's sampling, loss and rewards; settings only grpo reads are not checked for the other objectives."""
    if config.objective != "grpo":
        return []
    grpo, problems = config.grpo, []
    if grpo.group_size < 2:
        problems.append(Problem("grpo.group_size", f"must be at least 2, got {grpo.group_size}",
                                "a completion is judged against the others of its group: sample 4 to 16"))
    problems += _positive(grpo.temperature, "grpo.temperature", "temperature such as 1.0")
    if not 0 < grpo.top_p <= 1:
        problems.append(Problem("grpo.top_p", f"must be in (0, 1], got {grpo.top_p}", "1 samples from every token"))
    problems += _positive(grpo.max_completion_length, "grpo.max_completion_length", "length such as 256")
    if grpo.max_completion_length >= config.data.max_length:
        problems.append(Problem("grpo.max_completion_length", f"is {grpo.max_completion_length}, which leaves no room "
                                f"for a prompt in data.max_length {config.data.max_length} (a prompt and its "
                                "completion together)", "lower it, or raise data.max_length"))
    problems += _whole_groups(config)
    if config.distributed.shards_weights:
        problems.append(Problem("distributed.sharding", f"grpo samples its completions on each process with the whole "
                                f"weights, which {config.distributed.sharding} spreads over the processes",
                                "use zero2 or none (each process holds the weights), or the layer split"))
    for name in ("beta", "epsilon", "epsilon_high"):
        if getattr(grpo, name) < 0:
            problems.append(Problem(f"grpo.{name}", f"must be 0 or more, got {getattr(grpo, name)}"))
    problems += _positive(grpo.num_iterations, "grpo.num_iterations", "count such as 1")
    for index, reward in enumerate(grpo.rewards):
        problems += _check_reward(reward, f"grpo.rewards[{index}]")
    problems += _check_reward_file(config, check_files)
    if not grpo.rewards and not grpo.reward_file:
        problems.append(Problem("grpo.rewards", "no reward scores the completions",
                                "add a built-in reward, or a reward_file of your own"))
    return problems + (_check_vllm(config) if grpo.generation_backend == "vllm" else [])


def _check_vllm(config: RunConfig) -> list[Problem]:
    """vLLM samples with its own copy of the base and the run's LoRA adapter, which it loads as peft saves it."""
    problems, lora = [], config.lora
    if config.method != "lora" or lora.use_dora or lora.use_rslora:
        problems.append(Problem("grpo.generation_backend", "vllm loads the run's adapter as a plain LoRA: method "
                                f"{config.method}{' with DoRA' if lora.use_dora else ''}"
                                f"{' with rsLoRA' if lora.use_rslora else ''} is not one",
                                "use method lora without DoRA and rsLoRA, or set grpo.generation_backend to hf"))
    if config.distributed.num_processes > 1 or config.distributed.layer_split:
        problems.append(Problem("grpo.generation_backend", "vllm samples in one process on one GPU",
                                "set distributed.num_processes to 1 without the layer split, or "
                                "grpo.generation_backend to hf"))
    if not 0 < config.grpo.vllm_memory_fraction < 1:
        problems.append(Problem("grpo.vllm_memory_fraction", f"must be between 0 and 1, got "
                                f"{config.grpo.vllm_memory_fraction}", "0.3 leaves most of the GPU to training"))
    return problems


def _whole_groups(config: RunConfig) -> list[Problem]:
    """A step's completions on each process (micro_batch_size x gradient_accumulation_steps) are whole groups: the
    advantages compare a prompt's completions with each other, on the process that sampled them."""
    training, group = config.training, config.grpo.group_size
    completions = training.micro_batch_size * training.gradient_accumulation_steps
    if group < 2 or completions % group == 0:
        return []
    return [Problem("training.gradient_accumulation_steps",
                    f"micro_batch_size {training.micro_batch_size} x gradient_accumulation_steps "
                    f"{training.gradient_accumulation_steps} = {completions} completions a step, not a whole number of "
                    f"grpo.group_size {group} groups",
                    f"make it a multiple of {group}: for example micro_batch_size {training.micro_batch_size} and "
                    f"gradient_accumulation_steps {math.lcm(completions, group) // training.micro_batch_size}")]


_REWARD_SETTINGS = {"equals_reference": (), "matches_format": ("pattern",),
                    "length_within": ("min_length", "max_length", "unit"), "contains": ("text", "case_sensitive")}
"""The settings each built-in reward reads; any other changed from its default is refused, not silently unused."""


def _check_reward(reward, where: str) -> list[Problem]:
    problems, defaults = [], type(reward)()
    for name in ("pattern", "min_length", "max_length", "unit", "text", "case_sensitive"):
        if name not in _REWARD_SETTINGS[reward.name] and getattr(reward, name) != getattr(defaults, name):
            problems.append(Problem(f"{where}.{name}", f"{reward.name} does not read {name}",
                                    f"remove it (it is {_reader_of(name)}'s)"))
    if reward.name == "matches_format":
        problems += _check_pattern(reward.pattern, f"{where}.pattern")
    if reward.name == "contains" and not reward.text:
        problems.append(Problem(f"{where}.text", "contains needs the text to look for", "set text"))
    if reward.min_length < 0 or reward.max_length < 0:
        problems.append(Problem(f"{where}.min_length", "lengths must be 0 or more (0: no limit)"))
    elif reward.max_length and reward.min_length > reward.max_length:
        problems.append(Problem(f"{where}.max_length", f"is below min_length ({reward.min_length})",
                                "raise max_length, or set it to 0 (no upper limit)"))
    return problems


def _reader_of(setting: str) -> str:
    return next(name for name, settings in _REWARD_SETTINGS.items() if setting in settings)


def _check_pattern(pattern: str, where: str) -> list[Problem]:
    if not pattern:
        return [Problem(where, "matches_format needs a regular expression", "set pattern, such as '<think>.*</think>.*'")]
    try:
        re.compile(pattern)
    except re.error as exc:
        return [Problem(where, f"not a valid regular expression: {exc}", "see Python's re module")]
    return []


def _check_reward_file(config: RunConfig, check_files: bool) -> list[Problem]:
    path = config.grpo.reward_file
    if not path:
        return []
    if not config.grpo.trust_reward_code:
        return [Problem("grpo.trust_reward_code", f"reward_file {path} is Python code, and it runs only when you trust "
                        "it", "read the file, then set grpo.trust_reward_code to true")]
    if check_files and not Path(path).is_file():
        return [Problem("grpo.reward_file", f"no such file: {path}", "give the path of a .py file")]
    return []


def _check_training(config: RunConfig) -> list[Problem]:
    t = config.training
    problems: list[Problem] = []
    problems += _positive(t.micro_batch_size, "training.micro_batch_size", "micro-batch size")
    problems += _positive(t.gradient_accumulation_steps, "training.gradient_accumulation_steps", "number of micro-batches")
    problems += _positive(t.learning_rate, "training.learning_rate", "learning rate such as 2e-4")
    if t.max_steps < 0:
        problems.append(Problem("training.max_steps", f"must be 0 or more, got {t.max_steps}"))
    if t.max_steps == 0 and t.epochs <= 0:
        problems.append(Problem("training.epochs", "no training length", "set epochs > 0 or max_steps > 0"))
    if not 0.0 <= t.warmup_ratio < 1.0:
        problems.append(Problem("training.warmup_ratio", f"must be in [0, 1), got {t.warmup_ratio}"))
    if t.weight_decay < 0:
        problems.append(Problem("training.weight_decay", f"must be 0 or more, got {t.weight_decay}"))
    if t.max_grad_norm < 0:
        problems.append(Problem("training.max_grad_norm", f"must be 0 or more, got {t.max_grad_norm}"))
    if t.torch_compile and (config.effective_load_in != "none" or config.distributed.deepspeed_stage is not None):
        problems.append(Problem("training.torch_compile", "torch.compile does not work with bitsandbytes weights or DeepSpeed",
                                "turn training.torch_compile off"))
    for spec in SAVER_SPECS.values():
        if getattr(t, spec.name) and (refusal := spec.refused(config)):
            problems.append(Problem(spec.field, refusal, spec.validation_hint))
    return problems


def _check_schedule(config: RunConfig) -> list[Problem]:
    s = config.schedule
    problems: list[Problem] = []
    problems += _positive(s.log_every, "schedule.log_every", "interval in steps")
    for name in ("eval_every", "save_every", "sample_every"):
        if getattr(s, name) < 0:
            problems.append(Problem(f"schedule.{name}", "must be 0 or more"))
    problems += _positive(s.keep_checkpoints, "schedule.keep_checkpoints", "number of checkpoints to keep")
    return problems + _check_trackers(config)


# What every tracker takes as a project name: W&B refuses / \ # ? % : and more than 128 characters, Trackio
# makes a file name of it.
_PROJECT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def _check_trackers(config: RunConfig) -> list[Problem]:
    s = config.schedule
    problems = [Problem("schedule.trackers", f"{name} is listed twice", "list each tracker once")
                for name in sorted(set(s.trackers)) if s.trackers.count(name) > 1]
    if s.trackers and not _PROJECT_NAME.fullmatch(s.tracker_project):
        problems.append(Problem("schedule.tracker_project", f"{s.tracker_project!r} is not a project name every "
                                "tracker takes", "use 1 to 128 letters, digits, '-', '_' or '.'"))
    return problems


def _check_distributed(config: RunConfig, check_files: bool) -> list[Problem]:
    d = config.distributed
    problems: list[Problem] = []
    problems += _positive(d.num_processes, "distributed.num_processes", "number of processes (one per GPU)")
    stage = d.deepspeed_stage
    if d.offload_optimizer != "none" and stage is None:
        problems.append(Problem("distributed.offload_optimizer", "offloading needs DeepSpeed ZeRO",
                                "set distributed.sharding to zero1, zero2 or zero3"))
    if d.offload_params != "none" and stage != 3:
        problems.append(Problem("distributed.offload_params", "weights can only be offloaded with ZeRO-3",
                                "set distributed.sharding to zero3"))
    if "nvme" in (d.offload_optimizer, d.offload_params):
        if not d.nvme_path:
            problems.append(Problem("distributed.nvme_path", "nvme offload needs a folder", "pick a folder on a fast SSD"))
        elif check_files and not Path(d.nvme_path).is_dir():
            problems.append(Problem("distributed.nvme_path", f"{d.nvme_path}: no such folder", "create it or pick another"))
    if d.deepspeed_config:
        if stage is None:
            problems.append(Problem("distributed.deepspeed_config", "a DeepSpeed file is only used with ZeRO",
                                    "set distributed.sharding to zero1, zero2 or zero3, or clear the file"))
        elif check_files and not Path(d.deepspeed_config).is_file():
            problems.append(Problem("distributed.deepspeed_config", f"{d.deepspeed_config}: no such file", "check the path"))
        elif check_files and (other := _deepspeed_file_stage(d.deepspeed_config)) not in (None, stage):
            problems.append(Problem("distributed.deepspeed_config", f"{d.deepspeed_config} sets ZeRO stage {other}, "
                                    f"the config's sharding is {d.sharding}", f"set distributed.sharding to zero{other}, "
                                    "or remove zero_optimization.stage from the file (the estimate and the loss follow sharding)"))
    if ADALORA_BUDGET in config.method_spec.settings and d.sharding != "none":
        problems.append(Problem("distributed.sharding", "AdaLoRA reallocates its ranks from whole gradients, which "
                                f"{d.sharding} splits across processes", "use sharding none (DDP) with adalora"))
    if config.effective_load_in == "4bit" and d.shards_weights:
        problems.append(Problem("distributed.sharding", f"{d.sharding} cannot shard bitsandbytes 4-bit weights",
                                "use zero2 (or DDP) with a 4-bit base, or zero3 with a 16-bit base (method lora)"))
    if d.layer_split:
        if d.num_processes > 1 or d.sharding != "none":
            problems.append(Problem("distributed.layer_split", "a layer split runs in one process, without sharding",
                                    "set num_processes to 1 and sharding to none, or turn layer_split off"))
        if not config.uses_adapter:
            problems.append(Problem("distributed.layer_split", "a layer split is for LoRA/QLoRA",
                                    "use method lora or qlora, or shard full fine-tuning with zero3"))
    for name in ("max_gpu_memory_gib", "max_cpu_memory_gib"):
        if getattr(d, name) < 0:
            problems.append(Problem(f"distributed.{name}", "must be 0 or more"))
    return problems + _check_pipeline(config, check_files)


def _check_pipeline(config: RunConfig, check_files: bool) -> list[Problem]:
    """A pipeline (studio.core.memory.placement.pipeline_refusals), and what the model's files say of it."""
    problems = pipeline_refusals(config)
    if check_files and config.distributed.pipeline_stages > 0:
        problems += _pipeline_model_problems(config)
    return problems


def _pipeline_model_problems(config: RunConfig) -> list[Problem]:
    """What the model's config.json says a pipeline cannot do, when it can be read offline (else the worker
    finds it): a family it cannot cut, fewer blocks than chunks (stages x their chunks)."""
    try:
        model_config = load_model_config(config.model.name_or_path, config.model.revision, allow_network=False)
    except StudioError:
        return []
    decoder = model_config.get("text_config") or model_config  # a multimodal model's language model
    where, stages = "distributed.pipeline_stages", config.distributed.pipeline_stages
    if reason := pipeline_family_refusal(decoder):
        family = str(model_config.get("model_type", "this family's"))
        return [Problem(where, pipeline_refusal_message(family, reason), PIPELINE_OFF_HINT)]
    blocks = decoder.get("num_hidden_layers")
    refusal = too_few_blocks(blocks, stages, config.distributed.chunks_per_process) if isinstance(blocks, int) else None
    return [refusal] if refusal is not None else []


def _deepspeed_file_stage(path: str) -> int | None:
    """The ZeRO stage a user's DeepSpeed JSON sets, if it sets one (unreadable files are the worker's to report)."""
    try:
        stage = json.loads(Path(path).read_text(encoding="utf-8")).get("zero_optimization", {}).get("stage")
    except (OSError, ValueError, AttributeError):
        return None
    return stage if isinstance(stage, int) else None
