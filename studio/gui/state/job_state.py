"""The state of one training run as the window sees it: pure Python, no Qt.

    idle -> starting -> running -> stopping -> finished | failed | crashed

The run directory's events decide (``apply``); the process only adds what
events cannot say: that the worker is gone without a ``finished`` event
(``process_gone``: crashed, or failed when its console holds a readable error)
or never started (``launch_failed``). A status that says success is only ever
set by a ``finished`` event whose status is completed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class State(str, Enum):
    IDLE = "idle"
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    FINISHED = "finished"
    FAILED = "failed"
    CRASHED = "crashed"


ACTIVE = (State.STARTING, State.RUNNING, State.STOPPING)
TERMINAL = (State.FINISHED, State.FAILED, State.CRASHED)


@dataclass(frozen=True)
class ErrorReport:
    """What went wrong, readable: the worker's error event, or the end of its console output."""

    message: str
    hint: str = ""
    kind: str = "error"
    fix: dict | None = None  # {description, changes: {section: {field: value}}}: a change the app can apply


@dataclass
class Job:
    """One run's progress, built from its events; drives the status bar and the buttons."""

    state: State = State.IDLE
    final_status: str = ""  # completed | stopped | aborted | failed, from the finished event
    error: ErrorReport | None = None
    step: int = 0
    start_step: int = 0
    total_steps: int | None = None
    epoch: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_per_s: float | None = None
    last_checkpoint_step: int | None = None
    stop_requests: int = 0
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (message, hint), oldest first
    _step_times: list[tuple[float, int]] = field(default_factory=list, repr=False)

    # ------------------------------------------------------------ inputs
    def begin(self) -> None:
        """A worker is being launched (a new run or a resume)."""
        if self.state in ACTIVE:
            raise RuntimeError(f"a run is already {self.state.value}")
        self.state, self.final_status, self.error, self.stop_requests = State.STARTING, "", None, 0
        self._step_times.clear()

    def attach(self) -> None:
        """Following a worker that was started earlier (by another window or the command line);
        its events, replayed next, say how far it got."""
        self.state, self.final_status, self.error, self.stop_requests = State.STARTING, "", None, 0

    def apply(self, event: dict[str, Any]) -> None:
        handler = getattr(self, f"_on_{event.get('type')}", None)
        if handler is not None:
            handler(event)

    def request_stop(self) -> bool:
        """Count a stop press; returns True when it should abort (the second press)."""
        if self.state not in ACTIVE:
            return False
        self.stop_requests += 1
        self.state = State.STOPPING
        return self.stop_requests > 1

    def request_abort(self) -> None:
        """Cancel: stop without saving (as a second stop press does)."""
        if self.state in ACTIVE:
            self.state, self.stop_requests = State.STOPPING, max(self.stop_requests, 2)

    def process_gone(self, console_error: ErrorReport | None = None, stopped_by_user: bool = False) -> None:
        """The worker process no longer exists. Without a finished event that is a crash, unless the
        user ended it before it had loaded anything (then it is a cancelled run)."""
        if self.state in TERMINAL or self.state is State.IDLE:
            return
        if stopped_by_user:
            self.state, self.final_status = State.FINISHED, "aborted"
        elif console_error is not None:
            self.state, self.error = State.FAILED, console_error
        else:
            self.state = State.CRASHED
            self.error = ErrorReport(
                "the worker stopped without finishing the run (it crashed or was killed)",
                "see the log for its last lines; Resume continues from the newest checkpoint", "crashed")

    def launch_failed(self, message: str, hint: str = "") -> None:
        self.state, self.error = State.FAILED, ErrorReport(message, hint, "launch")

    # ------------------------------------------------------------ events
    def _on_run_started(self, event: dict) -> None:
        if self.state is not State.STOPPING:
            self.state = State.RUNNING
        self.final_status, self.error = "", None
        self.total_steps = event.get("total_steps", self.total_steps)
        self.start_step = self.step = event.get("start_step", 0) or 0
        self._step_times.clear()

    def _on_step(self, event: dict) -> None:
        if self.state is State.STARTING:
            self.state = State.RUNNING
        self.step = event.get("step", self.step)
        self.epoch = event.get("epoch", self.epoch)
        self.loss = event.get("loss", self.loss)
        self.tokens_per_s = event.get("tokens_per_s", self.tokens_per_s)
        self._step_times.append((float(event.get("time", time.time())), self.step))
        del self._step_times[:-50]  # the ETA follows the recent pace

    def _on_eval(self, event: dict) -> None:
        self.eval_loss = event.get("eval_loss", self.eval_loss)

    def _on_checkpoint(self, event: dict) -> None:
        self.last_checkpoint_step = event.get("step", self.last_checkpoint_step)

    def _on_warning(self, event: dict) -> None:
        self.warnings.append((str(event.get("message", "")), str(event.get("hint", ""))))

    def _on_error(self, event: dict) -> None:
        fix = event.get("fix")
        self.error = ErrorReport(str(event.get("message", "unknown error")), str(event.get("hint", "")),
                                 str(event.get("kind", "error")), fix if isinstance(fix, dict) and fix.get("changes") else None)

    def _on_finished(self, event: dict) -> None:
        self.final_status = str(event.get("status", ""))
        self.step = event.get("step", self.step) or self.step
        if self.final_status in ("completed", "stopped", "aborted"):
            self.state = State.FINISHED
        else:
            self.state = State.FAILED
            if self.error is None:
                self.error = ErrorReport(f"the run ended with status '{self.final_status or 'unknown'}'",
                                         "see the log for details")

    # ------------------------------------------------------------ derived
    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    def eta_seconds(self) -> float | None:
        """Seconds left at the recent pace; None until two steps have been seen."""
        if self.total_steps is None or len(self._step_times) < 2:
            return None
        (t0, s0), (t1, s1) = self._step_times[0], self._step_times[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return max(0.0, (self.total_steps - self.step) * (t1 - t0) / (s1 - s0))

    def headline(self) -> str:
        """One word or phrase for the state, never claiming success for anything but a completed run."""
        if self.state is State.FINISHED:
            return {"completed": "Completed", "stopped": "Stopped and saved", "aborted": "Cancelled"}[self.final_status]
        return {State.IDLE: "Ready", State.STARTING: "Starting", State.RUNNING: "Training",
                State.STOPPING: "Stopping", State.FAILED: "Failed", State.CRASHED: "Crashed"}[self.state]


def format_duration(seconds: float) -> str:
    """``1 h 05 min``, ``22 min 13 s``, ``45 s``: a span of time, never to be read as a clock time."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def status_text(job: Job, loading_note: str = "") -> str:
    """The status bar line: state, step, epoch, ETA, tokens/s."""
    parts = [job.headline()]
    if job.state is State.STARTING and loading_note:
        parts.append(loading_note)
    if job.state is not State.IDLE and (job.step or job.total_steps):
        parts.append(f"step {job.step}/{job.total_steps}" if job.total_steps else f"step {job.step}")
    if job.epoch is not None and job.state is not State.IDLE:
        parts.append(f"epoch {job.epoch:.2f}")
    eta = job.eta_seconds() if job.state in (State.RUNNING, State.STOPPING) else None
    if eta is not None:
        parts.append(f"{format_duration(eta)} left")
    if job.tokens_per_s is not None and job.state in (State.RUNNING, State.STOPPING):
        parts.append(f"{job.tokens_per_s:,.0f} tokens/s")
    if job.state is State.FINISHED and job.loss is not None:
        parts.append(f"loss {job.loss:.3f}")
    return "  ·  ".join(parts)
