"""Make, resume, repair, update or check the training runtime (studio.core.runtime.environment) in QProcesses.

The steps of ``RuntimePlan.steps`` run one after another; while they download, a timer measures uv's
cache (studio.core.runtime.progress). Cancel stops the running step: the marker was removed when the
setup began, so the runtime reads as half made and the next start resumes it with every finished
download kept. Only a check that passes writes the marker again.
"""

from __future__ import annotations

import os
import shutil

from PySide6.QtCore import QObject, QTimer, Signal

from studio.core.run.commands import last_json_object
from studio.core.runtime.environment import (Machine, RuntimePlan, Step, begin_setup, looks_offline, must_rebuild,
                                             offline_message, record_ready, runtime_environment, runtime_state)
from studio.core.runtime.progress import CacheMeter, SetupProgress
from studio.core.runtime.report import RuntimeReport, diagnose
from studio.gui.process import LineProcess

POLL_MS = 1500


class RuntimeSetup(QObject):
    """``step_started(label)``, ``progress(text, fraction)``, ``output(line)``, then ``done(ok, message)``;
    ``report`` holds the check's findings once the check has run."""

    step_started = Signal(str)
    progress = Signal(str, float)
    output = Signal(str)
    done = Signal(bool, str)

    def __init__(self, plan: RuntimePlan, uv: str, machine: Machine, parent: QObject | None = None):
        super().__init__(parent)
        self.plan, self.uv, self.machine = plan, uv, machine
        self.report: RuntimeReport | None = None
        self.cancelled = False
        self._steps: list[Step] = []
        self._process = LineProcess(self)
        self._process.line.connect(self._on_line)
        self._process.done.connect(self._on_step_done)
        self._meter = CacheMeter(plan.cache)
        self._progress = SetupProgress(plan.disk_bytes)
        self._timer = QTimer(self)
        self._timer.setInterval(POLL_MS)
        self._timer.timeout.connect(self._measure)

    @property
    def running(self) -> bool:
        return self._process.running or bool(self._steps)

    def start(self) -> None:
        """Set up whatever the runtime lacks: all of it, the rest of it, or the changed packages."""
        if must_rebuild(self.plan, runtime_state(self.plan)):
            shutil.rmtree(self.plan.env, ignore_errors=True)
        begin_setup(self.plan)
        self._run(self.plan.steps(self.uv))
        self._timer.start()

    def check(self) -> None:
        """Only the check: a ready runtime that fails it is no longer marked ready."""
        self._run(self.plan.steps(self.uv)[-1:])

    def cancel(self) -> None:
        self.cancelled = True
        self._steps = []
        self._process.stop()

    def wait(self, msecs: int) -> bool:
        return self._process.wait(msecs)

    # ------------------------------------------------------------ internals
    def _run(self, steps: list[Step]) -> None:
        self.cancelled, self.report = False, None
        self._steps = list(steps)
        self._next()

    def _next(self) -> None:
        step = self._steps[0]
        self.step_started.emit(step.label)
        self._process.start(list(step.argv), self.plan.root if self.plan.root.is_dir() else None,
                            runtime_environment(dict(os.environ)))

    def _on_line(self, _stream: str, text: str) -> None:
        self._progress.note_line(text)
        self.output.emit(text)

    def _measure(self) -> None:
        self._progress.update(*self._meter.measure())
        self.progress.emit(self._progress.text(), self._progress.fraction)

    def _on_step_done(self, exit_code: int, error: str) -> None:
        if self.cancelled:
            return self._finish(False, "Cancelled. Finished downloads are kept: Resume continues from there.")
        step = self._steps.pop(0)
        if step.key == "check":
            return self._finish_check()
        if exit_code != 0 or error:
            return self._finish(False, self._failure(step, error))
        self._next()

    def _failure(self, step: Step, error: str) -> str:
        lines = self._process.all_lines
        if self.plan.wheels is None and looks_offline(lines):
            return offline_message(self.plan)
        last = next((line for line in reversed(lines) if line.strip()), error or "no output")
        return f"{step.label} failed: {last.strip()}"

    def _finish_check(self) -> None:
        check = last_json_object("\n".join(self._process.stdout_lines))
        self.report = diagnose(check, self.machine)
        if self.report.healthy:
            record_ready(self.plan, check)
        else:
            self.plan.marker.unlink(missing_ok=True)  # never used while broken
        self._finish(self.report.healthy, self.report.as_text())

    def _finish(self, ok: bool, message: str) -> None:
        self._steps = []
        self._timer.stop()
        if ok:
            self.progress.emit(self._progress.text() if self._progress.bytes_done else "", 1.0)
        self.done.emit(ok, message)
