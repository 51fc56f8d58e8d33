"""Subprocesses for the ML side: short-lived helpers attached by pipes, and the detached training worker.

``LineProcess`` runs a helper (export, simulation, generation) with both pipes
read as soon as data arrives (an undrained pipe blocks the child once its
buffer fills) and hands out whole lines only; a carriage return ends a line
too, so progress bars show their latest state. A process that cannot start
never emits ``finished``: ``errorOccurred`` is turned into ``done`` instead.

The training worker is started detached (``launch_detached``) with its
console going to a file in the run directory: the run must not depend on the
window, and a pipe to a window that closes would break the worker's output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

import studio
from studio.gui.state.console import LineSplitter

STUDIO_ROOT = Path(studio.__file__).resolve().parents[1]
TERMINATE_GRACE_MS = 5000


def background_python() -> str:
    """The interpreter for a detached worker: on Windows the console-less pythonw.exe, so that no
    console window pops up for a run started from the app."""
    if sys.platform == "win32":
        windowless = Path(sys.executable).with_name("pythonw.exe")
        if windowless.is_file():
            return str(windowless)
    return sys.executable


def child_environment() -> QProcessEnvironment:
    """The app's environment, unbuffered, with this checkout importable even when not pip-installed."""
    env = QProcessEnvironment.systemEnvironment()
    env.insert("PYTHONUNBUFFERED", "1")
    path = env.value("PYTHONPATH", "")
    env.insert("PYTHONPATH", str(STUDIO_ROOT) + (os.pathsep + path if path else ""))
    return env


def qt_environment(variables: dict[str, str]) -> QProcessEnvironment:
    env = QProcessEnvironment()
    for key, value in variables.items():
        env.insert(key, value)
    return env


class LineProcess(QObject):
    """A helper subprocess reporting its output line by line.

    ``line(stream, text)``: stream is "out" or "err". ``done(exit_code, error)``:
    error is "" for a process that ran and exited (whatever its code) and a
    readable message when it could not start or crashed.
    """

    line = Signal(str, str)
    done = Signal(int, str)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self.stdout_lines: list[str] = []
        self.all_lines: list[str] = []  # both streams, in arrival order (for error messages)
        self._process: QProcess | None = None
        self._splitters = {"out": LineSplitter(), "err": LineSplitter()}

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.state() != QProcess.ProcessState.NotRunning

    def start(self, command: list[str], working_dir: Path | None = None,
              environment: dict[str, str] | None = None) -> None:
        """Run ``command``; ``environment`` replaces the app's own (child_environment) when given."""
        if self.running:
            raise RuntimeError("the process is still running")
        self.stdout_lines, self.all_lines = [], []
        self._splitters = {"out": LineSplitter(), "err": LineSplitter()}
        process = self._process = QProcess(self)
        process.setProcessEnvironment(child_environment() if environment is None else qt_environment(environment))
        process.setWorkingDirectory(str(working_dir or STUDIO_ROOT))
        process.readyReadStandardOutput.connect(lambda: self._read("out"))
        process.readyReadStandardError.connect(lambda: self._read("err"))
        process.finished.connect(self._on_finished)
        process.errorOccurred.connect(self._on_error)
        process.start(command[0], command[1:])

    def stop(self) -> None:
        """Terminate, then kill if it has not exited after a grace period."""
        process = self._process
        if process is None or not self.running:
            return
        process.terminate()
        # The process is the timer's context: a panel closed meanwhile takes the timer with it.
        QTimer.singleShot(TERMINATE_GRACE_MS, process,
                          lambda: process.kill() if process.state() != QProcess.ProcessState.NotRunning else None)

    def wait(self, msecs: int = 30000) -> bool:
        return self._process is None or self._process.waitForFinished(msecs)

    def _read(self, stream: str) -> None:
        process = self._process
        data = process.readAllStandardOutput() if stream == "out" else process.readAllStandardError()
        self._emit_lines(stream, self._splitters[stream].feed(bytes(data)))

    def _emit_lines(self, stream: str, lines: list[str]) -> None:
        for text in lines:
            if stream == "out":
                self.stdout_lines.append(text)
            self.all_lines.append(text)
            self.line.emit(stream, text)

    def _flush(self) -> None:
        for stream in ("out", "err"):
            self._read(stream)
            self._emit_lines(stream, self._splitters[stream].flush())

    def _on_finished(self, exit_code: int, exit_status: QProcess.ExitStatus) -> None:
        self._flush()
        crashed = exit_status == QProcess.ExitStatus.CrashExit
        self.done.emit(exit_code, "the process crashed or was killed" if crashed else "")

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart:  # no finished signal will follow
            program = self._process.program()
            self.done.emit(-1, f"could not start {program}: {self._process.errorString()}")


def launch_detached(command: list[str], console_file: Path, working_dir: Path | None = None) -> str:
    """Start ``command`` independent of this process, stdout and stderr appended to ``console_file``.

    Returns "" on success, else a readable reason. The pid is found afterwards
    from the command line (PySide's startDetached does not return it).
    """
    process = QProcess()
    process.setProgram(command[0])
    process.setArguments(command[1:])
    process.setProcessEnvironment(child_environment())
    process.setWorkingDirectory(str(working_dir or STUDIO_ROOT))
    process.setStandardInputFile(QProcess.nullDevice())
    process.setStandardOutputFile(str(console_file), QProcess.OpenModeFlag.Append)
    process.setStandardErrorFile(str(console_file), QProcess.OpenModeFlag.Append)
    if not process.startDetached():
        return f"could not start {command[0]}: {process.errorString()}"
    return ""
