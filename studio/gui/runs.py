"""Starting, following, stopping and resuming the training worker (the Qt side of job_state).

The worker runs detached (see process.launch_detached): closing the window
never ends a run, and the next window re-attaches to it. A QTimer polls the
run directory: new events (the truth) go to the Job and the chart series, new
console lines become the "loading model…" note, and a worker that is gone
without a ``finished`` event is reported as crashed (or failed, when its
console holds a readable error).

Stopping is cooperative first: a STOP file (the worker saves a checkpoint and
exits); a second press, or Cancel, writes ABORT; a worker still alive after
that is terminated, then killed.
"""

from __future__ import annotations

import time
from pathlib import Path

import psutil
from PySide6.QtCore import QObject, QTimer, Signal

from studio.core.config import RunConfig, save_config
from studio.core.errors import StudioError
from studio.core.run import commands
from studio.core.run.directory import RunDir, default_runs_root
from studio.core.run.events import EventReader
from studio.gui.process import background_python, launch_detached
from studio.gui.state.console import CONSOLE_FILE, ConsoleTail, console_error
from studio.gui.state.job_state import Job, State
from studio.gui.state.run_history import find_process, process_alive, worker_pid
from studio.gui.state.series import RunSeries

POLL_MS = 250
ABORT_GRACE_S = 10.0  # after ABORT: time to exit on its own before terminate
KILL_GRACE_S = 5.0  # after terminate: before kill


def worker_command(config_path: Path, run_dir: Path) -> list[str]:
    return commands.worker_command(background_python(), commands.worker_args(config_path, run_dir))


def resume_command(run_dir: Path) -> list[str]:
    return commands.worker_command(background_python(), commands.worker_args(None, run_dir, resume=True))


class RunController(QObject):
    changed = Signal()  # job state, progress or the loading note changed
    run_replaced = Signal(object)  # a RunSeries: the charts follow another run

    def __init__(self, runs_root: Path | None = None, parent: QObject | None = None):
        super().__init__(parent)
        self.runs_root = Path(runs_root) if runs_root else default_runs_root()
        self.job = Job()
        self.run_dir: RunDir | None = None
        self.series = RunSeries()
        self.worker_command = worker_command  # tests swap in a scripted stand-in
        self.resume_command = resume_command
        self._reader: EventReader | None = None
        self._console: ConsoleTail | None = None
        self._pid: int | None = None
        self._command: list[str] = []
        self._launched_at = 0.0
        self._stopped_before_start = False
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.poll)
        self._timer.start(POLL_MS)

    # ------------------------------------------------------------ commands
    def start(self, config: RunConfig) -> None:
        """A new run directory under the runs root, its config, and a worker for it."""
        rd = RunDir.create(config.name, self.runs_root)
        save_config(config, rd.config)
        self._follow(rd)
        self.job.begin()
        self._launch(self.worker_command(rd.config, rd.path))

    def resume(self, run_dir: Path | None = None) -> None:
        """Continue a run from its newest checkpoint; its charts continue where they stopped."""
        target = RunDir(run_dir) if run_dir is not None else self.run_dir
        if target is None:
            raise StudioError("no run to resume", "open a run in History first")
        if self.run_dir is None or target.path != self.run_dir.path:
            self._follow(target)
        self.job.begin()
        self._launch(self.resume_command(target.path))

    def attach(self, run_dir: Path) -> None:
        """Follow a worker started earlier: replay its events, then keep reading."""
        self._follow(RunDir(run_dir), live=True)
        self._pid = worker_pid(run_dir)
        self.poll()
        self.changed.emit()

    def stop(self) -> None:
        """Stop and save; a second press aborts."""
        if self.job.request_stop():
            self._abort()
        elif self._worker_still_importing():
            self._stopped_before_start = True  # nothing to save yet: end it now
            self._terminate()
        else:
            self.run_dir.request_stop()
        self.changed.emit()

    def cancel(self) -> None:
        """Abort without saving."""
        if not self.job.active:
            return
        self.job.request_abort()
        if self._worker_still_importing():
            self._stopped_before_start = True
            self._terminate()
        else:
            self._abort()
        self.changed.emit()

    def shutdown(self) -> None:
        """The window closes: stop watching; the worker goes on."""
        self._timer.stop()

    # ------------------------------------------------------------ following
    def _follow(self, rd: RunDir, live: bool = False) -> None:
        """Show ``rd``: its events so far are replayed into a new Job and new chart series.

        ``live``: its worker is running. Otherwise a replay that ends without a
        ``finished`` event is a worker that died: the job says crashed.
        """
        self.run_dir = rd
        self.job = Job()
        if live:
            self.job.attach()
        self.series = RunSeries(rd.path.name)
        self._reader = EventReader(rd.events)
        self._console = ConsoleTail(rd.path / CONSOLE_FILE)
        self._pid, self._command, self._stopped_before_start = None, [], False
        self._read_events()
        if not live and self.job.active:
            self.job.process_gone()
        self.run_replaced.emit(self.series)

    def _launch(self, command: list[str]) -> None:
        self._console = ConsoleTail(self.run_dir.path / CONSOLE_FILE)
        self._launched_at = time.monotonic()
        self._command, self._pid, self._stopped_before_start = command, None, False
        error = launch_detached(command, self.run_dir.path / CONSOLE_FILE)
        if error:
            self.job.launch_failed(error, "check that Python and finetune-studio are installed")
        else:
            self._pid = find_process(command)
        self.changed.emit()

    def poll(self) -> None:
        if self.run_dir is None:
            return
        changed = self._read_events()
        if self._console is not None:
            before = self._console.note
            self._console.read()
            changed |= self._console.note != before
        if self.job.active and not self._worker_alive():
            self._read_events()  # a finished event written just before exiting
            self._on_worker_gone()
            changed = True
        if changed or self.job.state is State.STARTING:
            self.changed.emit()

    def _read_events(self) -> bool:
        events = self._reader.read_new() if self._reader else []
        for event in events:
            self.job.apply(event)
            self.series.add(event)
        return bool(events)

    def _worker_alive(self) -> bool:
        if self._pid is None:  # attached without worker.json yet, or not visible right after the launch
            self._pid = find_process(self._command) if self._command else worker_pid(self.run_dir.path)
        if self._pid is not None:
            return process_alive(self._pid)
        return time.monotonic() - self._launched_at < 5.0

    def _on_worker_gone(self) -> None:
        if not self.job.active:
            return
        if self._stopped_before_start:
            self.job.process_gone(stopped_by_user=True)
            return
        self.job.process_gone(console_error(self._console.text if self._console else ""))

    # ------------------------------------------------------------ ending a worker
    def _worker_still_importing(self) -> bool:
        """Launched by us and not yet where it clears old control files and writes worker.json: a STOP
        file written now would be deleted unseen."""
        return self._pid is not None and worker_pid(self.run_dir.path) != self._pid

    def _abort(self) -> None:
        self.run_dir.request_stop(abort=True)
        pid = self._pid
        QTimer.singleShot(int(ABORT_GRACE_S * 1000), lambda: self._terminate(pid))

    def _terminate(self, pid: int | None = None) -> None:
        """Ask the worker to end, then kill it and the training processes it started (several GPUs)."""
        pid = pid or self._pid
        if pid is None or not process_alive(pid):
            return
        try:
            worker = psutil.Process(pid)
            tree = [worker, *worker.children(recursive=True)]  # taken now: orphans cannot be found later
            worker.terminate()
        except psutil.Error:
            return
        QTimer.singleShot(int(KILL_GRACE_S * 1000), lambda: self._kill(tree))

    @staticmethod
    def _kill(processes: list[psutil.Process]) -> None:
        for process in processes:
            try:
                process.kill()  # psutil checks it is still the same process, not a reused pid
            except psutil.Error:
                pass

    # ------------------------------------------------------------ for the window
    @property
    def loading_note(self) -> str:
        """What the worker is doing before its first event: it is never silent."""
        if self.job.state is not State.STARTING:
            return ""
        seconds = time.monotonic() - self._launched_at if self._launched_at else 0
        detail = self._console.note if self._console and self._console.note else "starting Python and the training libraries"
        return f"loading model… {seconds:.0f} s ({detail})"

    @property
    def worker_pid(self) -> int | None:
        return self._pid
