"""What a tracker draws of the run's events, decided once for every tracker: the scalars of each event by tag,
the sample answers as text, the step each is drawn at.

``Tracker`` is the interface ``TrackedEvents`` feeds: it turns each event into figures and hands them to its
library's class (``tensorboard``, ``bridges``), which only writes them.
"""

from __future__ import annotations

from typing import Any

from studio.core.config import RunConfig
from studio.core.run.directory import RunDir
from studio.core.run.evaluation import MODELS

STEP_SCALARS = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
                "tokens_per_s": "train/tokens_per_s", "step_seconds": "train/step_seconds"}
SUMMARY_SCALARS = ("loss", "perplexity", "exact_match", "contains", "f1",
                   "eval_reward", "full_reward")  # a grpo run's held-out prompts
SAMPLE_COLUMNS = ("prompt", "reference", "answer")


def scalars(event: dict[str, Any]) -> dict[str, float]:
    """The figures an event carries, by tag: ``{"train/loss": 1.9, ...}``; empty for the others (checkpoints,
    warnings, ...)."""
    kind = event.get("type")
    if kind == "step":
        found = {tag: event[key] for key, tag in STEP_SCALARS.items() if _is_number(event.get(key))}
        return found | _memory(event.get("memory") or ())
    if kind == "eval" and _is_number(event.get("eval_loss")):
        return {"eval/loss": event["eval_loss"]}
    if kind == "evaluation":
        return {f"evaluation/{key}/{model}": event[model][key]
                for model in MODELS for key in SUMMARY_SCALARS if _is_number(event[model].get(key))}
    if kind == "benchmarks":
        return {f"benchmarks/{task}/{metric}/{model}": value for task, models in event["tasks"].items()
                for model in MODELS for metric, value in models[model].items()}
    return {}


def _memory(readings) -> dict[str, float]:
    """GiB per device: allocated on a GPU, the process's memory without one."""
    found = {}
    for reading in readings:
        used = reading.get("allocated_bytes", reading.get("rss_bytes"))
        if used is not None:
            found[f"memory/{reading.get('device', 'device')} GiB"] = used / 2**30
    return found


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sample_row(sample: dict[str, Any]) -> list[str]:
    """A sample answer as a table row of ``SAMPLE_COLUMNS`` (no reference: empty)."""
    return [str(sample.get(column) or "") for column in SAMPLE_COLUMNS]


def sample_markdown(sample: dict[str, Any]) -> str:
    reference = f"\n\n**reference:** {sample['reference']}" if sample.get("reference") is not None else ""
    return f"**prompt:** {sample.get('prompt', '')}{reference}\n\n**answer:** {sample.get('answer', '')}"


class Tracker:
    """One experiment tracker fed the run's events. An event without a step (an evaluation after training) is
    drawn at the newest step seen, ``step`` to begin with (the run's last step, for a command after training)."""

    name = ""  # its name in the config and on the command line (studio track RUN --to NAME)
    label = ""  # its name in messages
    package = ""  # the Python package it writes with
    failure_hint = ""  # what to check when it does not start or stops working

    def __init__(self, step: int = 0):
        self.step = step
        self.where = ""  # where the run's figures can be seen, for the log

    @classmethod
    def open(cls, rd: RunDir, config: RunConfig, step: int = 0) -> Tracker:
        """The tracker of run ``rd``, beginning at ``step``; raises what its library raises."""
        raise NotImplementedError

    @classmethod
    def install_hint(cls) -> str:
        raise NotImplementedError

    def record(self, event: dict[str, Any]) -> None:
        if isinstance(event.get("step"), int):
            self.step = event["step"]
        if values := scalars(event):
            self.write_scalars(values, self.step)
        if event.get("type") == "samples" and event.get("samples"):
            self.write_samples(event["samples"], self.step)
        if event.get("type") == "finished":
            self.finished(event.get("status", ""))

    def write_scalars(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def write_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        raise NotImplementedError

    def finished(self, status: str) -> None:
        """The run ended with ``status`` (completed, stopped, aborted, failed): what the tracker is told."""

    def close(self) -> None:
        raise NotImplementedError
