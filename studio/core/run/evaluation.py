"""What an evaluation of a run found, base vs tuned: the scores of one answer, the summary of many, the file.

`studio eval` (studio.train.evaluation.compare) writes ``RUN/evaluation.json``: a summary per model
("base", "tuned") and one entry per held-out row, worst first; the summary also goes to the run's events
(type "evaluation"), so the model card and the window show it. Pure Python: the window reads it too.

A held-out row is a response to score, or (a run of a preference objective) a preference pair: both models'
log-probabilities of its chosen and rejected responses, ranked as the objective ranks them, their difference the
pair's margin; the preference accuracy is the fraction of pairs where the chosen response ranks higher. A grpo run's
row is a held-out prompt: each model's greedy completion and its rewards, the summary their means named as the run's
eval events name them (``eval_reward``, ``eval_rewards/NAME/mean``, with the functions' names in
``reward_functions``) and ``full_reward``, the share of prompts whose completion got every reward its row can give.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from studio.core.data.templates import THINK_END, THINK_START
from studio.core.rewards import REWARD_FILE_NAME

EVALUATION_FILE = "evaluation.json"
BENCHMARKS_FILE = "benchmarks.json"  # `studio eval RUN --tasks`: lm-evaluation-harness's metrics, base and tuned
MODELS = ("base", "tuned")
BAR_LABELS = {"contains": "contains", "full_reward": "every reward"}  # where the table's words are too long for a bar
ANSWER_SCORES = ("exact_match", "contains", "f1")

_WORD = re.compile(r"\w+", re.UNICODE)
# what a progress line counts: its phase and the phases of the whole (the tuned model is scored first)
PROGRESS_PHASES = {"tuned model": (0, 2), "base model": (1, 2), "benchmarks": (0, 1)}
_PROGRESS = re.compile(rf"^({'|'.join(PROGRESS_PHASES)}): (\d+)/(\d+)\b")


def normalized_words(text: str) -> list[str]:
    """Lower-cased words without punctuation: "The Plum." and "the plum" answer alike."""
    return _WORD.findall(text.lower().translate(str.maketrans("", "", string.punctuation)))


def after_reasoning(text: str) -> str:
    """What a text answers after its reasoning: what follows its last ``</think>``; nothing while a ``<think>``
    is still open (the reasoning was cut before it answered); the text itself when it has no reasoning."""
    if THINK_END in text:
        return text.rpartition(THINK_END)[2]
    return "" if THINK_START in text else text


def answer_scores(answer: str, reference: str) -> dict[str, float]:
    """Exact match and contains on normalized words, and the token-level F1 (SQuAD's) of one answer; a reasoning
    model's answer is scored after its reasoning."""
    said, wanted = normalized_words(after_reasoning(answer)), normalized_words(after_reasoning(reference))
    common = sum((Counter(said) & Counter(wanted)).values())
    f1 = 0.0 if not common else 2 * common / (len(said) + len(wanted))
    joined, target = " ".join(said), " ".join(wanted)
    return {"exact_match": float(said == wanted), "contains": float(bool(target) and f" {target} " in f" {joined} "),
            "f1": float(f1) if wanted or said else 1.0}


def summary(rows: Iterable[dict[str, Any]], model: str) -> dict[str, Any]:
    """One model's figures over the rows: loss and perplexity over completion tokens (a pair's: its chosen
    response's), mean answer scores, and over preference pairs the preference accuracy and the mean margin."""
    rows = list(rows)
    tokens = sum(row["tokens"] for row in rows)
    loss = sum(row[model]["loss_sum"] for row in rows) / tokens if tokens else None
    result: dict[str, Any] = {"rows": len(rows), "tokens": tokens, "loss": loss,
                              "perplexity": math.exp(loss) if loss is not None and loss < 700 else None}
    answered = [row[model] for row in rows if "answer" in row[model]]
    for name in ANSWER_SCORES:
        result[name] = sum(scores[name] for scores in answered) / len(answered) if answered else None
    result["answered"] = len(answered)
    ranked = [row[model]["margin"] for row in rows if "margin" in row[model]]
    result["pairs"] = len(ranked)
    result["preference_accuracy"] = sum(margin > 0 for margin in ranked) / len(ranked) if ranked else None
    result["margin"] = sum(ranked) / len(ranked) if ranked else None
    return result


def worst_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tuned model's weakest rows first: lowest margin (of a pair), lowest reward (of a grpo prompt; none is the
    lowest), lowest F1 (where there is an answer), then highest loss per token."""
    def badness(row: dict[str, Any]) -> tuple[float, float, float, float]:
        tuned = row["tuned"]
        reward = tuned.get("reward", 0.0)
        return (tuned.get("margin", 0.0), -math.inf if reward is None else reward, tuned.get("f1", 1.0),
                -tuned.get("loss_sum", 0.0) / max(row.get("tokens", 1), 1))
    return sorted(rows, key=badness)


def read_evaluation(run_dir: Path, name: str = EVALUATION_FILE) -> dict[str, Any] | None:
    """What the last `studio eval` of a run wrote (``name``: BENCHMARKS_FILE for its benchmarks); None when it has
    not been evaluated so."""
    path = Path(run_dir) / name
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def comparison_rows(summaries: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str]]:
    """(measure, base, tuned, change) as words, for the console, the card and the window's table."""
    rows = []
    for label, key, is_share in _measures(summaries["tuned"]):
        base, tuned = summaries["base"].get(key), summaries["tuned"].get(key)
        change = None if base is None or tuned is None else tuned - base
        rows.append((label, *(_share(v) if is_share else _number(v) for v in (base, tuned)),
                     _share_change(change) if is_share else _number(change, signed=True)))
    return rows


def _measures(tuned: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(label, summary key, whether it is a share) of each measure a summary has."""
    if "reward_functions" in tuned:  # grpo: the held-out prompts' rewards
        measures = [("reward (weighted total)", "eval_reward", False)]
        measures += [(f"reward {name}", f"eval_rewards/{name}/mean", False) for name in tuned["reward_functions"]]
        return measures + ([("prompts given every reward", "full_reward", True)] if tuned["full_reward"] is not None
                           else [])
    pairs = tuned.get("pairs")
    measures = [("loss (chosen responses)" if pairs else "loss (completion tokens)", "loss", False),
                ("perplexity", "perplexity", False)]
    if tuned.get("answered"):
        measures += [("exact match", "exact_match", True), ("contains the reference", "contains", True),
                     ("token F1", "f1", True)]
    if pairs:
        measures += [("preference accuracy", "preference_accuracy", True), ("mean margin (log-prob)", "margin", False)]
    return measures


def bar_measures(tuned: dict[str, Any]) -> list[tuple[str, str]]:
    """(summary key, label) of the shares a summary has, for the window's bar chart in percent: the answer scores and
    the preference accuracy; a grpo run's prompts given every reward and each built-in's mean (a share: it scores 0
    or 1; a reward file's may be any number)."""
    shares = [(key, BAR_LABELS.get(key, label)) for label, key, is_share in _measures(tuned)
              if is_share and tuned.get(key) is not None]
    if "reward_functions" in tuned:
        shares += [(f"eval_rewards/{name}/mean", name) for name in tuned["reward_functions"]
                   if name != REWARD_FILE_NAME and tuned.get(f"eval_rewards/{name}/mean") is not None]
    return shares


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _number(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else f"{value:+.4g}" if signed else f"{value:.4g}"


def _share_change(value: float | None) -> str:
    """A change of a share in percentage points: "+12.5 pts"."""
    return "-" if value is None else f"{100 * value:+.1f} pts"


def comparison_lines(result: dict[str, Any], run_dir: Path) -> list[str]:
    """What `studio eval` prints: the rows and tokens, the two models side by side, the weakest answers (or the
    pairs whose rejected response the tuned model ranks higher)."""
    tuned = result["summary"]["tuned"]
    lines = [f"{held_out_words(tuned)}; checkpoint {result['checkpoint']}",
             f"{'':30}{'base':>12}{'fine-tuned':>12}{'change':>12}"]
    lines += [f"{label:30}{base:>12}{tuned_value:>12}{change:>12}"
              for label, base, tuned_value, change in comparison_rows(result["summary"])]
    for row in result["rows"][:3]:
        if "reward" in row["tuned"]:
            if row["tuned"]["full_reward"] is not True:
                lines.append(f"weakest: {row['location']}: {row['prompt'][:60]!r} got {row['tuned']['answer'][:60]!r} "
                             f"({reward_words(row['tuned'])})")
        elif row["tuned"].get("margin", 1.0) <= 0:
            lines.append(f"weakest: {row['location']}: ranks the rejected {row['rejected'][:60]!r} above the chosen "
                         f"{row['reference'][:60]!r} (margin {row['tuned']['margin']:.3g})")
        elif row["tuned"].get("f1", 1.0) < 1.0:
            lines.append(f"weakest: {row['location']}: wanted {row['reference'][:60]!r}, got {row['tuned']['answer'][:60]!r}")
    lines.append(f"every row: {Path(run_dir) / EVALUATION_FILE}")
    return lines


def reward_words(scores: dict[str, Any]) -> str:
    """"reward 0.5: matches_format 1, equals_reference 0": a completion's weighted reward and each function's."""
    def shown(value):
        return "none" if value is None else f"{value:.3g}"
    parts = ", ".join(f"{name} {shown(value)}" for name, value in scores["rewards"].items())
    return f"reward {shown(scores['reward'])}: {parts}"


def held_out_words(figures: dict[str, Any]) -> str:
    """"80 held-out pairs, 640 chosen-response tokens": what a model's summary was measured on."""
    if "reward_functions" in figures:
        return (f"{figures['rows']} held-out prompts, one {figures['decoding']} completion each (at most "
                f"{figures['max_new_tokens']} tokens)")
    if figures.get("pairs"):
        return f"{figures['rows']} held-out pairs, {figures['tokens']} chosen-response tokens"
    return f"{figures['rows']} held-out rows, {figures['tokens']} completion tokens"


def progress_line(what: str, done: int, total: int, seconds_left: float | None) -> str:
    """"tuned model: 12/40 [######--------------] about 31 s left": what `studio eval` prints as it goes (``what``: one
    of PROGRESS_PHASES)."""
    filled = round(20 * min(done / max(total, 1), 1.0))
    left = "" if seconds_left is None else f" about {seconds_left:.0f} s left"
    return f"{what}: {done}/{total} [{'#' * filled}{'-' * (20 - filled)}]{left}"


def progress_of(line: str) -> float | None:
    """How far an evaluation is (0 to 1) by one of its progress lines; None: not one."""
    found = _PROGRESS.match(line.strip())
    if not found:
        return None
    phase, phases = PROGRESS_PHASES[found.group(1)]
    return (phase + min(int(found.group(2)) / max(int(found.group(3)), 1), 1.0)) / phases


def benchmark_rows(result: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(task, metric, base, tuned) as words, for the console and the card."""
    return [(task, metric, f"{models['base'].get(metric, float('nan')):.4g}", f"{value:.4g}")
            for task, models in result["tasks"].items() for metric, value in models["tuned"].items()]
