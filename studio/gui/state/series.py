"""Chart data of a run, built from its events: numpy buffers, no Qt.

Buffers are preallocated and double when full, so appending a point is O(1)
amortized and a chart redraw hands pyqtgraph views, never copies of lists.
``RunSeries`` turns ``step`` and ``eval`` events into the series the charts
show, and ``samples`` events into each sample prompt's answers over the steps
(the Samples tab) and the pauses they cost training (the throughput chart); a
preference run's reward margin and accuracy go beside the loss; a GRPO run's
rewards, their spread within groups, completion length, KL and clip ratio come
from its steps and its sampled groups from ``completions`` events. A resumed
run whose ``run_started`` says it restarts at step k drops any points after k
(the steps a crash lost are trained again).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from studio.core.sizes import GIB

if TYPE_CHECKING:
    import numpy as np

MARGIN, ACCURACY = "rewards/margins", "rewards/accuracies"  # a preference run's step metrics, as TRL names them
# a GRPO run's step metrics the charts draw beside its reward and each function's (TRL's names)
ROLLOUT_METRICS = ("reward_std_in_group", "frac_reward_zero_std", "entropy", "completions/mean_length",
                   "completions/clipped_ratio", "loss", "kl", "clip_ratio/region_mean")
COMPLETION_STEPS_KEPT = 20  # the Samples tab shows the groups of the last this many samplings
SMOOTHING = 0.8  # weight of the loss's exponential moving average (debiased, as TensorBoard does); lags ~5 steps


def _numpy():
    import numpy  # on the first point, not at import: the window shows before numpy has loaded

    return numpy


class Series:
    """x and y values in float64 buffers that double when full."""

    def __init__(self, capacity: int = 1024):
        self._x = self._y = None  # allocated on the first point
        self._capacity = capacity
        self._size = 0
        self.version = 0  # bumped on every change: charts redraw only what changed

    def __len__(self) -> int:
        return self._size

    @property
    def x(self) -> np.ndarray:
        return self._buffers()[0][: self._size]

    @property
    def y(self) -> np.ndarray:
        return self._buffers()[1][: self._size]

    def _buffers(self) -> tuple[np.ndarray, np.ndarray]:
        if self._x is None:
            self._x, self._y = _numpy().empty(self._capacity), _numpy().empty(self._capacity)
        return self._x, self._y

    def append(self, x: float, y: float) -> None:
        self._buffers()
        if self._size == len(self._x):
            self._grow(2 * len(self._x))
        self._x[self._size], self._y[self._size] = x, y
        self._size += 1
        self.version += 1

    def extend(self, xs: np.ndarray, ys: np.ndarray) -> None:
        self._buffers()
        needed = self._size + len(xs)
        if needed > len(self._x):
            self._grow(max(needed, 2 * len(self._x)))
        self._x[self._size:needed], self._y[self._size:needed] = xs, ys
        self._size = needed
        self.version += 1

    def truncate_after(self, x: float) -> None:
        """Drop the points whose x is greater than ``x`` (x grows monotonically)."""
        if not self._size:
            return
        keep = int(_numpy().searchsorted(self.x, x, side="right"))
        if keep != self._size:
            self._size = keep
            self.version += 1

    def _grow(self, capacity: int) -> None:
        for name in ("_x", "_y"):
            bigger = _numpy().empty(capacity)
            bigger[: self._size] = getattr(self, name)[: self._size]
            setattr(self, name, bigger)


def smooth(values: np.ndarray, weight: float = SMOOTHING) -> np.ndarray:
    """Debiased exponential moving average."""
    out = _numpy().empty(len(values))
    average = 0.0
    for index, value in enumerate(values):
        average = weight * average + (1 - weight) * value
        out[index] = average / (1 - weight ** (index + 1))
    return out


class Smoothed:
    """A series and its debiased moving average (``smooth``), kept in step point by point."""

    def __init__(self):
        self.raw, self.smoothed = Series(), Series()
        self._ema = 0.0
        self._count = 0

    def append(self, x: float, y: float) -> None:
        self.raw.append(x, y)
        self._ema = SMOOTHING * self._ema + (1 - SMOOTHING) * y
        self._count += 1
        self.smoothed.append(x, self._ema / (1 - SMOOTHING**self._count))

    def truncate_after(self, x: float) -> None:
        """Drop the points after ``x``; the average is recomputed over what is kept."""
        self.raw.truncate_after(x)
        if len(self.raw) == self._count:
            return
        kept = smooth(self.raw.y)
        self.smoothed.truncate_after(-math.inf)
        self.smoothed.extend(self.raw.x.copy(), kept)
        self._count = len(self.raw)
        self._ema = kept[-1] * (1 - SMOOTHING**self._count) if len(kept) else 0.0


@dataclass
class MemoryTrace:
    """The memory series of one device, with its label (a GPU name, or CPU process memory)."""

    device: str
    label: str
    is_gpu: bool
    series: dict[str, Series] = field(default_factory=dict)  # allocated, reserved, nvml_used / process
    capacity_bytes: int | None = None


_GPU_FIELDS = {"allocated": "allocated_bytes", "reserved": "reserved_bytes", "nvml used": "nvml_used_bytes"}


# ---------------------------------------------------------------- the Samples tab's answers


@dataclass
class SamplePrompt:
    prompt: str
    reference: str | None
    location: str = ""
    answers: list[tuple[int, str]] = field(default_factory=list)  # (step, answer), oldest first

    @property
    def base_answer(self) -> str | None:
        """The answer before the first step: the base model's."""
        return self.answers[0][1] if self.answers and self.answers[0][0] == 0 else None

    def newest_first(self) -> list[tuple[int, str]]:
        """The answers of the trained steps, newest first (the base's is shown on its own)."""
        return [(step, answer) for step, answer in reversed(self.answers) if step > 0]


class SampleHistory:
    """The prompts in the order the worker asks them; ``add`` takes events in file order."""

    def __init__(self):
        self.prompts: list[SamplePrompt] = []
        self.version = 0
        self.warning = ""  # why the run has no samples, when the worker said so
        self.every = 0  # the run's schedule.sample_every (0: it takes none)

    def add(self, event: dict[str, Any]) -> bool:
        kind = event.get("type")
        if kind == "samples":
            self._add_samples(int(event.get("step") or 0), event.get("samples") or [])
        elif kind == "warning" and str(event.get("message", "")).startswith("no samples while training"):
            self.warning = f"{event['message']}; {event.get('hint', '')}".rstrip("; ")
        elif kind == "run_started":
            schedule = (event.get("config") or {}).get("schedule") or {}
            self.every = int(schedule.get("sample_every", self.every) or 0)
            self.restart_at(int(event.get("start_step") or 0))
        else:
            return False
        self.version += 1
        return True

    def _add_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        for index, sample in enumerate(samples):
            if index == len(self.prompts):
                self.prompts.append(SamplePrompt(str(sample.get("prompt", "")), sample.get("reference"),
                                                 str(sample.get("location") or "")))
            self.prompts[index].answers.append((step, str(sample.get("answer", ""))))

    def restart_at(self, step: int) -> None:
        """A resumed run trains again from ``step``: its later answers were lost with the steps."""
        for prompt in self.prompts:
            prompt.answers = [(s, a) for s, a in prompt.answers if s <= step]


@dataclass
class SampledGroup:
    """One prompt's group of completions as a GRPO step sampled them: each with its total reward and each
    function's (None: not scored)."""

    step: int
    prompt: str
    reference: str | None
    location: str
    completions: list[dict[str, Any]]


class CompletionHistory:
    """A GRPO run's sampled groups (``completions`` events), the newest ``COMPLETION_STEPS_KEPT`` samplings."""

    def __init__(self):
        self.groups: list[SampledGroup] = []
        self.version = 0

    def add(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "completions":
            step = int(event.get("step") or 0)
            self.groups += [SampledGroup(step, _prompt_text(group.get("prompt")), group.get("reference"),
                                         str(group.get("location") or ""), list(group.get("completions") or ()))
                            for group in event.get("groups") or ()]
            steps = sorted({group.step for group in self.groups})[-COMPLETION_STEPS_KEPT:]
            self.groups = [group for group in self.groups if group.step >= steps[0]] if steps else []
        elif kind == "run_started":  # a resumed run samples the lost steps again
            start = int(event.get("start_step") or 0)
            self.groups = [group for group in self.groups if group.step <= start]
        else:
            return
        self.version += 1

    def newest_first(self) -> list[SampledGroup]:
        return sorted(self.groups, key=lambda group: -group.step)


def _prompt_text(prompt: Any) -> str:
    """A prompt as one line of text: plain text as it is, a conversation's messages one after another."""
    if isinstance(prompt, list):
        return " | ".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict))
    return str(prompt or "")


class RunSeries:
    """Every chart series of one run; ``add`` takes events in file order."""

    def __init__(self, name: str = ""):
        self.name = name
        self._loss, self._tokens_per_s = Smoothed(), Smoothed()  # raw steps jump: the average shows the trend
        self.loss, self.loss_smoothed = self._loss.raw, self._loss.smoothed
        self.tokens_per_s, self.tokens_per_s_smoothed = self._tokens_per_s.raw, self._tokens_per_s.smoothed
        self.eval_loss = Series()
        self.lr = Series()
        self.memory: dict[str, MemoryTrace] = {}
        self.estimate_bytes: int | None = None
        self.estimate_by_device: dict[str, int] = {}  # each GPU's own estimate (ZeRO's ranks, a layer split's devices)
        self.started = False  # a run_started event was seen (the model is loaded)
        self.samples = SampleHistory()  # the Samples tab's answers, from the same events
        self.sample_pauses = Series()  # (step, seconds) the worker stopped training to answer the sample prompts
        # a preference run's reward margin and accuracy (TRL's rewards/margins, rewards/accuracies), on training
        # and held-out pairs
        self.margin, self.accuracy = Series(), Series()
        self.eval_margin, self.eval_accuracy = Series(), Series()
        # a GRPO run's (TRL's names: reward, rewards/NAME/mean, reward_std_in_group, completions/mean_length, kl,
        # clip_ratio/region_mean, ...), and its held-out eval_reward and eval_rewards/NAME/mean
        self.reward = Smoothed()
        self.rollout: dict[str, Series] = {}
        self.eval_rewards: dict[str, Series] = {}
        self.completions = CompletionHistory()  # the Samples tab's sampled groups, from the same events

    @classmethod
    def from_events(cls, events: list[dict[str, Any]], name: str = "") -> "RunSeries":
        run = cls(name)
        for event in events:
            run.add(event)
        return run

    @property
    def step_count(self) -> int:
        return len(self.loss)

    @property
    def version(self) -> int:
        return sum(s.version for s in self.all_series()) + (self.estimate_bytes or 0)

    @property
    def preference_series(self) -> tuple[Series, ...]:
        return self.margin, self.accuracy, self.eval_margin, self.eval_accuracy

    @property
    def learns_from_rewards(self) -> bool:
        """Whether the run's steps sample completions and score them (GRPO)."""
        return "completions/mean_length" in self.rollout

    def reward_functions(self) -> list[str]:
        """The names of the run's reward functions, in the order its steps report them."""
        return [key[len("rewards/"):-len("/mean")] for key in self.rollout
                if key.startswith("rewards/") and key.endswith("/mean")]

    @property
    def learns_preferences(self) -> bool:
        """Whether the run's steps say how its rewards separate chosen from rejected (a preference objective)."""
        return len(self.margin) > 0

    def all_series(self) -> list[Series]:
        found = [self.loss, self.loss_smoothed, self.eval_loss, self.lr, self.tokens_per_s, self.tokens_per_s_smoothed,
                 self.sample_pauses, *self.preference_series, *self.reward_series]
        return found + [s for trace in self.memory.values() for s in trace.series.values()]

    @property
    def reward_series(self) -> list[Series]:
        return [self.reward.raw, self.reward.smoothed, *self.rollout.values(), *self.eval_rewards.values()]

    def add(self, event: dict[str, Any]) -> bool:
        """Take one event; returns whether any series changed."""
        self.samples.add(event)
        self.completions.add(event)
        kind = event.get("type")
        if kind == "run_started":
            self.started = True
            self._restart_at(int(event.get("start_step") or 0))
            return True
        if kind == "step":
            return self._add_step(event)
        if kind == "samples" and _finite(event.get("seconds")):
            self.sample_pauses.append(int(event.get("step") or 0), float(event["seconds"]))
            return True
        if kind == "eval" and _finite(event.get("eval_loss")):
            self.eval_loss.append(event["step"], event["eval_loss"])
            for key, series in ((f"eval_{MARGIN}", self.eval_margin), (f"eval_{ACCURACY}", self.eval_accuracy)):
                if _finite(event.get(key)):
                    series.append(event["step"], float(event[key]))
            return True
        if kind == "eval" and _finite(event.get("eval_reward")):
            for key, value in event.items():
                if key.startswith("eval_reward") and _finite(value):
                    self.eval_rewards.setdefault(key, Series()).append(event["step"], float(value))
            return True
        if kind == "estimate":  # the worker's prediction, drawn as a dashed line on GPU memory charts
            devices = [d for d in event.get("devices") or () if d.get("device") != "host" and d.get("total_bytes")]
            # what the reserved curve should reach: the estimate less the CUDA context, which no allocator sees
            self.estimate_by_device = {str(d["device"]): _reserved_estimate(d) for d in devices}
            self.estimate_bytes = max(self.estimate_by_device.values(), default=None)
            return self.estimate_bytes is not None
        return False

    def _add_step(self, event: dict[str, Any]) -> bool:
        step = event.get("step")
        if step is None:
            return False
        for key, series in (("loss", self._loss), ("lr", self.lr), ("tokens_per_s", self._tokens_per_s),
                            (MARGIN, self.margin), (ACCURACY, self.accuracy)):
            if _finite(event.get(key)):
                series.append(step, float(event[key]))
        if "completions/mean_length" in event:  # a GRPO step (its reward is left out when nothing scored)
            if _finite(event.get("reward")):
                self.reward.append(step, float(event["reward"]))
            for key, value in event.items():
                rollout = key in ROLLOUT_METRICS or (key.startswith("rewards/") and key.endswith("/mean"))
                if rollout and _finite(value):
                    self.rollout.setdefault(key, Series()).append(step, float(value))
        for entry in event.get("memory") or ():
            self._add_memory(step, entry)
        return True

    def _add_memory(self, step: float, entry: dict[str, Any]) -> None:
        device = str(entry.get("device", "?"))
        is_gpu = entry.get("kind") != "process"
        trace = self.memory.get(device)
        if trace is None:
            label = entry.get("label") or device
            trace = self.memory[device] = MemoryTrace(device, str(label), is_gpu)
        if is_gpu:
            for name, key in _GPU_FIELDS.items():
                if entry.get(key) is not None:
                    trace.series.setdefault(name, Series()).append(step, entry[key] / GIB)
            trace.capacity_bytes = entry.get("nvml_total_bytes") or trace.capacity_bytes
        elif entry.get("rss_bytes") is not None:
            trace.series.setdefault("process", Series()).append(step, entry["rss_bytes"] / GIB)

    def _restart_at(self, step: int) -> None:
        """A (resumed) run starts at ``step``: points after it belong to a lost attempt."""
        for smoothed in (self._loss, self._tokens_per_s, self.reward):
            smoothed.truncate_after(step)
        for series in (self.eval_loss, self.lr, self.sample_pauses, *self.preference_series,
                       *self.rollout.values(), *self.eval_rewards.values(),
                       *(s for t in self.memory.values() for s in t.series.values())):
            series.truncate_after(step)


def _reserved_estimate(device: dict[str, Any]) -> int:
    """A device's estimate of the allocator's reserved bytes: its peak without the CUDA context."""
    return int(device["total_bytes"]) - int((device.get("parts") or {}).get("cuda_context", 0))


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
