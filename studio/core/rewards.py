"""GRPO's rewards: the built-ins a user picks and weighs (``grpo.rewards``), a reward file of the user's own, and
their weighted sum per completion, with each function's score kept for the window's charts.

Each built-in is ``f(completion: str, row: dict, settings: RewardConfig) -> float | None``: 1.0 or 0.0, None when it
cannot judge the row (equals_reference on a row without a reference), which counts as no reward from it, as TRL's
None does.

The user's file defines ``def reward(completion, prompt, row)`` returning a number or None, called once per
completion. One completion at a time (not TRL's batched ``(prompts, completions, **columns) -> list``): an exception
is then the one row's, which gets no reward from the file while every other row keeps its score, and the warning
names that row; scoring text is pure Python, so a batch would buy nothing. The file runs only with
``grpo.trust_reward_code`` on; only the worker calls it, never the window.

Pure Python: importing a user's file runs whatever it imports, but nothing here imports the ML stack.
"""

from __future__ import annotations

import importlib.util
import math
import re
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from studio.core.config import GrpoConfig, RewardConfig
from studio.core.data.row_formats import reference_answer
from studio.core.errors import Problem, ProblemsError

REWARD_FILE_FUNCTION = "reward"
REWARD_FILE_NAME = "reward_file"  # the file's reward among the scores, as the charts name it

# the last \boxed{...} (or \fbox{...}), its braces balanced: the answer a math completion gives
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
# a number as people write it: a sign, thousands separators, decimals ("-1,234.50", "3", ".5")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")
_GSM8K_ANSWER = "####"  # GSM8K's reference: the reasoning, then "#### 72"


# ---------------------------------------------------------------- the built-ins


def equals_reference(completion: str, row: dict, settings: RewardConfig) -> float | None:
    """1.0 when the completion's answer equals the row's reference answer, None without a reference. Each side's
    answer is its last \\boxed{...}, else its last number; numbers compare as numbers (1,234.0 equals 1234), other
    answers as text, case and surrounding space ignored."""
    reference = reference_answer(row)
    if reference is None:
        return None
    reference = str(reference).rpartition(_GSM8K_ANSWER)[2]
    return 1.0 if _same_answer(final_answer(completion), final_answer(reference)) else 0.0


def final_answer(text: str) -> str:
    """The answer a text gives: its last \\boxed{...}'s content, else its last number, else the whole text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else text.strip()


def last_boxed(text: str) -> str | None:
    """The content of the text's last \\boxed{...}, nested braces kept; None when it has none (or it is unclosed)."""
    starts = list(_BOXED.finditer(text))
    if not starts:
        return None
    depth, begin = 1, starts[-1].end()
    for index in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[index], 0)
        if depth == 0:
            return text[begin:index]
    return None


def _same_answer(answer: str, reference: str) -> bool:
    mine, theirs = _as_number(answer), _as_number(reference)
    if mine is not None and theirs is not None:
        return math.isclose(mine, theirs, rel_tol=1e-9, abs_tol=1e-12)
    return _normalized(answer) == _normalized(reference)


def _as_number(text: str) -> float | None:
    """The text as a number when it is one (a dollar sign or a trailing period allowed), else None."""
    cleaned = text.strip().strip("$").rstrip(".").strip()
    if not _NUMBER.fullmatch(cleaned):
        return None
    return float(cleaned.replace(",", ""))


def _normalized(text: str) -> str:
    return " ".join(text.split()).rstrip(".").casefold()


def matches_format(completion: str, row: dict, settings: RewardConfig) -> float:
    """1.0 when the whole completion, surrounding space stripped, matches the pattern (``.`` matching newlines).
    A full match: a format reward asks for the shape of the whole answer; ``.*X.*`` asks for X anywhere."""
    return 1.0 if re.fullmatch(settings.pattern, completion.strip(), re.DOTALL) else 0.0


def length_within(completion: str, row: dict, settings: RewardConfig) -> float:
    """1.0 when the completion's length in characters or words is within min_length and max_length (0: no limit)."""
    length = len(completion) if settings.unit == "characters" else len(completion.split())
    too_long = settings.max_length and length > settings.max_length
    return 0.0 if length < settings.min_length or too_long else 1.0


def contains(completion: str, row: dict, settings: RewardConfig) -> float:
    """1.0 when the completion contains the text (ignoring case unless case_sensitive)."""
    if settings.case_sensitive:
        return 1.0 if settings.text in completion else 0.0
    return 1.0 if settings.text.casefold() in completion.casefold() else 0.0


BUILT_INS: dict[str, Callable[[str, dict, RewardConfig], float | None]] = {
    "equals_reference": equals_reference, "matches_format": matches_format, "length_within": length_within,
    "contains": contains}


# ---------------------------------------------------------------- the user's file


@dataclass(frozen=True)
class RewardFailure:
    """An exception the user's reward function raised on one row: where in the file, and which row."""

    file: str
    line: int | None
    row: int | str
    """The row's index, or where it is in the data (file:line)."""
    error: str

    def __str__(self) -> str:
        where = f"{self.file}, line {self.line}" if self.line else self.file
        row = f"row {self.row}" if isinstance(self.row, int) else self.row
        return f"{where}: {self.error} on {row}; that completion gets no reward from the file"


class RewardFile:
    """The user's ``reward`` function, loaded from their file; each call scores one completion, never raising."""

    def __init__(self, path: Path, function: Callable[..., Any]):
        self.path, self.function = path, function

    @classmethod
    def load(cls, grpo: GrpoConfig) -> "RewardFile":
        """The file of ``grpo.reward_file``, run only with ``grpo.trust_reward_code``; refused naming the field
        otherwise, and naming the file when it cannot be run or defines no ``reward``."""
        path = Path(grpo.reward_file)
        if not grpo.trust_reward_code:
            raise _refusal("grpo.trust_reward_code", f"reward_file {path} is Python code, and it runs only when you "
                           "trust it", "read the file, then set grpo.trust_reward_code to true")
        module = _run_file(path)
        function = getattr(module, REWARD_FILE_FUNCTION, None)
        if not callable(function):
            raise _refusal(str(path), f"defines no function {REWARD_FILE_FUNCTION}",
                           "def reward(completion, prompt, row): return a number, or None for no reward")
        return cls(path, function)

    def score(self, completion: str, row: dict, index: int | str) -> tuple[float | None, RewardFailure | None]:
        """Its reward of one completion of row ``index`` (None: none), or the failure that gave it none."""
        try:
            value = self.function(completion, row.get("prompt"), row)
            return _as_reward(value), None
        except Exception as exc:  # the user's code: any exception is theirs, and ends nothing else
            return None, RewardFailure(str(self.path), self._line_of(exc), index, f"{type(exc).__name__}: {exc}")

    def _line_of(self, exc: BaseException) -> int | None:
        """The line of the user's file nearest the raise (the last frame in it)."""
        frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
                  if Path(frame.filename).resolve() == self.path.resolve()]
        return frames[-1].lineno if frames else None


def _as_reward(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"reward returned {value!r}, not a number or None")
    return float(value)


def _run_file(path: Path):
    spec = importlib.util.spec_from_file_location(f"studio_reward_file_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise _refusal("grpo.reward_file", f"no such Python file: {path}", "give the path of a .py file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # a broken file is the user's: say where, as a problem of theirs
        line = next((f.lineno for f in reversed(traceback.extract_tb(exc.__traceback__))
                     if Path(f.filename).resolve() == path.resolve()), getattr(exc, "lineno", None))
        raise _refusal(f"{path}:{line}" if line else str(path), f"the file does not run: {type(exc).__name__}: {exc}",
                       "fix it, then start again")
    return module


def _refusal(where: str, message: str, hint: str) -> ProblemsError:
    return ProblemsError([Problem(where, message, hint)], "config")


# ---------------------------------------------------------------- the weighted sum


@dataclass(frozen=True)
class Scores:
    """One completion's rewards: the weighted total (None when no function scored it: it then gets no advantage),
    each function's own score by its name, and the reward file's failure if it raised."""

    total: float | None
    by_function: dict[str, float | None]
    failure: RewardFailure | None = None


class Rewards:
    """The run's rewards (grpo.rewards, and grpo.reward_file when set), scoring one completion at a time."""

    def __init__(self, grpo: GrpoConfig, reward_file: RewardFile | None = None):
        self.built_ins = grpo.rewards
        self.reward_file, self.file_weight = reward_file, grpo.reward_file_weight

    @classmethod
    def for_run(cls, grpo: GrpoConfig) -> "Rewards":
        return cls(grpo, RewardFile.load(grpo) if grpo.reward_file else None)

    @property
    def names(self) -> tuple[str, ...]:
        """Each function's name in the scores: a built-in's, numbered when one is chosen twice; the file's."""
        names = [reward.name for reward in self.built_ins]
        unique = [name if names.count(name) == 1 else f"{name}_{names[:i].count(name) + 1}"
                  for i, name in enumerate(names)]
        return (*unique, *((REWARD_FILE_NAME,) if self.reward_file else ()))

    def score(self, completion: str, row: dict, index: int | str) -> Scores:
        """The completion's scores, for its row (all its columns) at ``index`` in the data (or where it is)."""
        values = [BUILT_INS[reward.name](completion, row, reward) for reward in self.built_ins]
        weights = [reward.weight for reward in self.built_ins]
        failure = None
        if self.reward_file is not None:
            value, failure = self.reward_file.score(completion, row, index)
            values.append(value)
            weights.append(self.file_weight)
        scored = [weight * value for weight, value in zip(weights, values) if value is not None]
        return Scores(sum(scored) if scored else None, dict(zip(self.names, values)), failure)

    def got_everything(self, scores: Scores) -> bool | None:
        """Whether a completion got the most the run's rewards give its row: every built-in that judged it at its
        best (1.0, or 0.0 for a negative weight; one weighted 0 counts for nothing), at least one judging. None with a
        reward file, whose best is unknown."""
        if self.reward_file is not None:
            return None
        judged = [(reward.weight, scores.by_function[name]) for reward, name in zip(self.built_ins, self.names)
                  if scores.by_function[name] is not None]
        return bool(judged) and all(value == (1.0 if weight > 0 else 0.0) for weight, value in judged if weight)
