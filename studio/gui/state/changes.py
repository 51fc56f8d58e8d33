"""What a preset or a choice changed, said in the window's words: each field by its control's label, each value by
its own; and messages written for the config file (``training.seed``) with the labels on screen."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from studio.core.choices import CHOICE_WORDS
from studio.core.methods import METHOD_SPECS

# Fields the window sets through widgets other than a bound control (the model picker, the data's file list)
OTHER_LABELS = {"name": "Run name", "model.name_or_path": "Model", "data.train_files": "Training files",
                "data.eval_files": "Evaluation files"}


def value_words(path: str, value: Any) -> str:
    """A field's value as the window shows it: a method's or a choice's label, on/off, a list, a number."""
    if path == "method":
        return METHOD_SPECS[value].label
    if path == "grpo.rewards":
        return ", ".join(_reward_words(reward) for reward in value) or "none"
    if path in CHOICE_WORDS:
        labels = [CHOICE_WORDS[path][item][0] for item in (value if isinstance(value, (list, tuple)) else [value])]
        return ", ".join(labels) or "none"  # a list of choices: schedule.trackers
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        files = path.endswith("_files")  # their names say which: the folders make the line too long to read
        return ", ".join(Path(item).name if files else str(item) for item in value) or "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def change_lines(differences: dict[str, tuple[Any, Any]], labels: dict[str, str]) -> list[str]:
    """``Precision: bf16 (mixed) -> fp32`` for each changed field (``config.differences``), named by ``labels``
    (field path -> the label of its control) where the window has a control for it."""
    labels = {**OTHER_LABELS, **labels}
    return [f"{labels.get(path, path)}: {value_words(path, old)} → {value_words(path, new)}"
            for path, (old, new) in differences.items()]


def _reward_words(reward: dict[str, Any]) -> str:
    """``matches a format (kind of [a-z ]+ \\.)``, with its weight when it is not 1."""
    name = reward["name"]
    detail = {"matches_format": reward.get("pattern"), "contains": reward.get("text"),
              "length_within": f"{reward.get('min_length', 0)} to {reward.get('max_length', 0) or 'any'} "
                               f"{reward.get('unit', 'characters')}"}.get(name)
    words = CHOICE_WORDS["grpo.rewards.name"][name][0] + (f" ({detail})" if detail else "")
    weight = reward.get("weight", 1.0)
    return words if weight == 1.0 else f"{words} x {weight:g}"


_FIELD_PATH = re.compile(r"\b[a-z]+\.[a-z_]+\b")
_REWARD_PATH = re.compile(r"\bgrpo\.rewards\[(\d+)\](?:\.[a-z_]+)?")  # a row of the Rewards list: its number


# Fields the window has no control for, said in words (a run's config file sets them)
UNSHOWN_FIELDS = {"model.revision": "the model's revision (in the run's config file)"}


def in_window_words(text: str, labels: dict[str, str]) -> str:
    """``text`` with each config field it names (``distributed.sharding``) called by its label on screen, quoted."""
    labels = {**OTHER_LABELS, **labels}

    def word(match: re.Match) -> str:
        path = match.group()
        return f"“{labels[path]}”" if path in labels else UNSHOWN_FIELDS.get(path, path)

    return _FIELD_PATH.sub(word, _REWARD_PATH.sub(lambda m: f"Reward {int(m.group(1)) + 1}", text))
