"""GRPO's generation batch: each prompt of a step answered ``group_size`` times with the training weights, the
completions scored by the run's rewards, and each completion's advantage over its group.

Sampling is seeded by the generation's number and the process (``seed``), inside a forked random state: the same
step samples the same completions after a resume, and the training's own random state (dropout) is untouched.
A completion ends at its first end-of-sequence token (kept, as TRL keeps it) or at ``max_completion_length``.
The model generates in eval mode with its KV cache (no gradients), the adapter on: the weights being trained, no
second copy (``HfGenerate``); or vLLM samples with its own copy and the run's adapter (``grpo.generation_backend``
vllm: studio.train.objectives.vllm_sampling).

What the window charts is kept as sums (``ROLLOUT_SUMS`` and each reward function's), so that several processes
add theirs up before ``rollout_metrics`` turns them into TRL's names.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from studio.core.config import GrpoConfig, RunConfig
from studio.core.data.row_formats import reference_answer
from studio.core.rewards import RewardFailure, Rewards, Scores
from studio.train.objectives.grpo import group_advantages

ROLLOUT_SUMS = ("completions", "scored", "reward", "reward_squares", "groups", "group_std", "zero_std_groups",
                "completion_tokens", "clipped")
SHOWN_GROUPS = 1  # the groups of each sampling the completions event carries


@dataclass
class Rollout:
    """One generation batch: the completion rows ``Grpo.batch`` takes, the sums of its metrics, the groups to show
    and the reward file's failures."""

    rows: list[dict[str, Any]]
    sums: dict[str, float]
    shown: list[dict[str, Any]]
    failures: list[RewardFailure] = field(default_factory=list)
    seconds: float = 0.0

    def kept(self) -> dict[str, Any]:
        """What a checkpoint keeps of it for the steps that still train on it (``Rollout(**kept)``)."""
        return {"rows": self.rows, "sums": self.sums, "shown": self.shown}


class GroupSampler:
    """Samples and scores the groups of a step's prompts (rows of the prompt-only split)."""

    def __init__(self, config: RunConfig, tokenizer: Any, rewards: Rewards):
        self.settings, self.tokenizer, self.rewards = config.grpo, tokenizer, rewards
        self.eos_ids = end_tokens(tokenizer)
        if config.grpo.generation_backend == "vllm":
            from studio.train.objectives.vllm_sampling import VllmGenerate

            self.backend = VllmGenerate(config, self.eos_ids)
        else:
            self.backend = HfGenerate(config.grpo, tokenizer, self.eos_ids)

    def rollout(self, model, prompts: list[dict[str, Any]], seed: int) -> Rollout:
        """The groups of ``prompts`` sampled by ``model`` (unwrapped, in its autocast), scored, with advantages."""
        started, group = time.perf_counter(), self.settings.group_size
        rows, scores, shown, failures = [], [], [], []
        seeds = [seed * 1_000_003 + index for index in range(len(prompts))]
        sampled = self.backend.groups(model, [list(prompt["input_ids"]) for prompt in prompts], seeds)
        for prompt, generated in zip(prompts, sampled):
            completions = [until_end(ids, self.eos_ids) for ids in generated]
            row = json.loads(prompt["row"])
            texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completions]
            group_scores = [self.rewards.score(text, row, prompt["location"]) for text in texts]
            failures += [s.failure for s in group_scores if s.failure is not None]
            scores += group_scores
            rows += [{"prompt_ids": list(prompt["input_ids"]), "completion_ids": ids, "ended": ids[-1:] != [] and
                      ids[-1] in self.eos_ids} for ids in completions]
            if len(shown) < SHOWN_GROUPS:
                shown.append(shown_group(prompt, row, texts, group_scores))
        totals = torch.tensor([math.nan if s.total is None else s.total for s in scores])
        for row, advantage in zip(rows, group_advantages(totals, group).tolist()):
            row["advantage"] = advantage
        sums = rollout_sums(totals, scores, rows, group, self.rewards.names, self.settings.max_completion_length)
        return Rollout(rows, sums, shown, failures, time.perf_counter() - started)


class HfGenerate:
    """Samples each prompt's group with HF generate on the training weights: eval mode, its KV cache, no
    gradients, in a random state forked and seeded by the prompt's seed."""

    def __init__(self, settings: GrpoConfig, tokenizer: Any, eos_ids: list[int]):
        from transformers import GenerationConfig

        self.group_size = settings.group_size
        self.generation = GenerationConfig(
            max_new_tokens=settings.max_completion_length, do_sample=True, temperature=settings.temperature,
            top_p=settings.top_p, top_k=0,  # TRL's: no top-k cut
            pad_token_id=tokenizer.pad_token_id, eos_token_id=eos_ids)

    def groups(self, model, prompts: list[list[int]], seeds: list[int]) -> list[list[list[int]]]:
        """Each prompt's group of generated ids (up to the completion length; what follows an end is padding)."""
        return [self._sample_group(model, ids, seed) for ids, seed in zip(prompts, seeds)]

    @torch.no_grad()
    def _sample_group(self, model, prompt_ids: list[int], seed: int) -> list[list[int]]:
        device = next(model.parameters()).device
        inputs = torch.tensor([prompt_ids] * self.group_size, device=device)
        training = model.training
        model.eval()  # the KV cache (a checkpointed model in training mode generates without it)
        try:
            with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
                torch.manual_seed(seed)
                output = model.generate(input_ids=inputs, attention_mask=torch.ones_like(inputs),
                                        generation_config=self.generation)
        finally:
            model.train(training)
        return output[:, len(prompt_ids):].tolist()


def end_tokens(tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the tokenizer's end of sequence (and its end of turn, where it names one)."""
    ids = [tokenizer.eos_token_id]
    turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    return [i for i in dict.fromkeys([*ids, turn_end]) if i is not None]


def until_end(ids: list[int], eos_ids: list[int]) -> list[int]:
    """A generated row up to its first end token, that token kept (what follows is padding)."""
    end = next((i for i, token in enumerate(ids) if token in eos_ids), None)
    return ids if end is None else ids[:end + 1]


def shown_group(prompt: dict[str, Any], row: dict, texts: list[str], scores: list[Scores]) -> dict[str, Any]:
    """A group as the window's Samples view shows it: the prompt, its reference, and each completion's rewards."""
    asked = row.get("prompt")
    if isinstance(asked, list):  # turns: the last user turn is the question
        asked = next((turn.get("content") for turn in reversed(asked) if turn.get("role") == "user"), "")
    reference = reference_answer(row)
    return {"location": prompt["location"], "prompt": str(asked), "reference": None if reference is None else str(reference),
            "completions": [{"text": text, "reward": s.total, "rewards": s.by_function} for text, s in zip(texts, scores)]}


def rollout_sums(totals: torch.Tensor, scores: list[Scores], rows: list[dict], group: int, names: tuple[str, ...],
                 max_length: int) -> dict[str, float]:
    """The sums the generation batch's metrics are made of (see ``rollout_metrics``)."""
    scored = totals[~totals.isnan()]
    grouped = totals.view(-1, group)
    group_std = torch.stack([_std(g[~g.isnan()]) for g in grouped])
    sums = {"completions": len(rows), "scored": len(scored), "reward": float(scored.sum()),
            "reward_squares": float((scored ** 2).sum()), "groups": len(grouped),
            "group_std": float(torch.nan_to_num(group_std).sum()),
            "zero_std_groups": float(torch.isclose(torch.nan_to_num(group_std), torch.zeros(())).sum()),
            "completion_tokens": sum(len(r["completion_ids"]) for r in rows),
            "clipped": sum(not r["ended"] and len(r["completion_ids"]) >= max_length for r in rows)}
    for name in names:
        values = torch.tensor([s.by_function[name] for s in scores if s.by_function[name] is not None])
        sums.update({f"{name}:sum": float(values.sum()), f"{name}:squares": float((values ** 2).sum()),
                     f"{name}:count": len(values)})
    return sums


def sum_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """Every sum ``rollout_sums`` keeps, in a fixed order (the processes add them up in it)."""
    return ROLLOUT_SUMS + tuple(f"{name}:{part}" for name in names for part in ("sum", "squares", "count"))


def rollout_metrics(sums: dict[str, float], names: tuple[str, ...]) -> dict[str, float]:
    """TRL's metrics of a generation batch (and the spread within groups, which GRPO learns from); those without a
    value (no completion scored) are left out."""
    metrics = {"reward": _mean(sums["reward"], sums["scored"]),
               "reward_std": _sample_std(sums["reward"], sums["reward_squares"], sums["scored"]),
               "reward_std_in_group": _mean(sums["group_std"], sums["groups"]),
               "frac_reward_zero_std": _mean(sums["zero_std_groups"], sums["groups"]),
               "completions/mean_length": _mean(sums["completion_tokens"], sums["completions"]),
               "completions/clipped_ratio": _mean(sums["clipped"], sums["completions"])}
    for name in names:
        total, squares, count = (sums[f"{name}:{part}"] for part in ("sum", "squares", "count"))
        metrics[f"rewards/{name}/mean"] = _mean(total, count)
        metrics[f"rewards/{name}/std"] = _sample_std(total, squares, count)
    return {name: value for name, value in metrics.items() if not math.isnan(value)}


def held_out_rewards(scores: list[Scores], names: tuple[str, ...]) -> dict[str, float]:
    """The eval event's means of held-out completions' rewards: the total (``eval_reward``) and each function's;
    those no completion has are left out."""
    means = {"eval_reward": [s.total for s in scores],
             **{f"eval_rewards/{name}/mean": [s.by_function[name] for s in scores] for name in names}}
    return {key: sum(kept) / len(kept) for key, values in means.items()
            if (kept := [v for v in values if v is not None])}


def _std(values: torch.Tensor) -> torch.Tensor:
    return values.std() if len(values) > 1 else torch.tensor(math.nan)


def _mean(total: float, count: float) -> float:
    return total / count if count else math.nan


def _sample_std(total: float, squares: float, count: float) -> float:
    """The standard deviation with Bessel's correction (TRL's nanstd), from a sum and a sum of squares."""
    if count < 2:
        return math.nan
    return math.sqrt(max(squares - total * total / count, 0.0) / (count - 1))
