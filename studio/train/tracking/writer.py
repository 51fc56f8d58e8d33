"""The run's event writer with its trackers beside it, and ``replay``: a run's ``events.jsonl`` fed to a tracker.

A bridge, not a second log: ``TrackedEvents`` hands every event it writes to the trackers, so they show what
``events.jsonl`` says, whoever watches; ``replay`` (``studio track RUN``) feeds them the whole file later. A
tracker never stops a run: one that cannot start, or fails while it trains (network down, login expired), is
dropped with one warning event.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from pathlib import Path
from typing import Any

from studio.core.config import RunConfig, load_config
from studio.core.errors import StudioError
from studio.core.run.directory import RunDir
from studio.core.run.events import EventWriter, kept_history, read_events, summarize
from studio.train.tracking.bridges import BRIDGES, without_secrets
from studio.train.tracking.figures import Tracker
from studio.train.tracking.tensorboard import TensorBoard

log = logging.getLogger("studio.train")
TRACKERS: dict[str, type[Tracker]] = {TensorBoard.name: TensorBoard, **BRIDGES}


class TrackedEvents:
    """An EventWriter whose events also go to the run's trackers (the worker's and `studio eval`'s writer)."""

    def __init__(self, writer: EventWriter, trackers: list[Tracker]):
        self.writer, self.trackers = writer, trackers

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = self.writer.emit(type_, **fields)
        for tracker in list(self.trackers):
            try:
                tracker.record(event)
            except Exception as exc:  # whatever its library raises: the run trains on without it
                self._drop(tracker, exc)
        return event

    def _drop(self, tracker: Tracker, exc: Exception) -> None:
        self.trackers.remove(tracker)
        self.writer.emit("warning", message=f"{tracker.label} stopped receiving this run's figures: "
                         f"{without_secrets(exc)}", hint=f"{tracker.failure_hint}; then studio track "
                         f"\"{self.writer.path.parent}\" --to {tracker.name} sends it the whole run")
        with contextlib.suppress(Exception):  # it is broken already: closing only frees what it holds
            tracker.close()

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # the run's events are complete: only this tracker misses its end
                self.writer.emit("warning", message=f"{tracker.label} did not finish: {without_secrets(exc)}",
                                 hint=tracker.failure_hint)
        self.writer.close()


def open_tracker(name: str, rd: RunDir, config: RunConfig, step: int = 0) -> Tracker:
    """The tracker ``name`` (tensorboard, or one of schedule.trackers) of the run ``rd``; a StudioError says what
    to install, or why it did not start."""
    kind = TRACKERS[name]
    try:
        tracker = kind.open(rd, config, step)
    except ImportError as exc:
        raise StudioError(f"no {kind.label}: the {kind.package} package is not installed ({exc})", kind.install_hint(),
                          kind="runtime") from None
    except Exception as exc:  # whatever its library raises: a login refused, a server not reached
        raise StudioError(f"{kind.label} did not start: {without_secrets(exc)}", kind.failure_hint,
                          kind="runtime") from None
    log.info("%s: %s", kind.label, tracker.where)
    return tracker


def tracked_events(rd: RunDir, config: RunConfig) -> EventWriter | TrackedEvents:
    """The run's event writer, with the trackers the config asks for beside it: each that cannot start is a
    warning event instead. A command after training (``studio eval``) draws its figures at the run's last step."""
    step = summarize(read_events(rd.events)).last_step
    writer = EventWriter(rd.events)
    names = ([TensorBoard.name] if config.schedule.tensorboard else []) + list(config.schedule.trackers)
    trackers = []
    for name in names:
        try:
            trackers.append(open_tracker(name, rd, config, step))
        except StudioError as exc:
            writer.emit("warning", message=exc.message, hint=exc.hint)
    return TrackedEvents(writer, trackers) if trackers else writer


def replay(run_dir: Path, to: str = "tensorboard") -> str:
    """Feed the run's events.jsonl to the tracker ``to`` (the steps it kept: a resumed run's lost steps left out);
    returns where the run can be seen there. TensorBoard's files are written anew; a bridge's run of the run
    directory's name is added to."""
    rd = RunDir(run_dir)
    config = load_config(rd.config)
    if to == TensorBoard.name:
        shutil.rmtree(rd.tensorboard_dir, ignore_errors=True)
    tracker = open_tracker(to, rd, config)
    try:
        for event in kept_history(read_events(rd.events)):
            tracker.record(event)
        tracker.close()
    except Exception as exc:  # whatever its library raises
        raise StudioError(f"{tracker.label} stopped: {without_secrets(exc)}", tracker.failure_hint,
                          kind="runtime") from None
    return tracker.where
