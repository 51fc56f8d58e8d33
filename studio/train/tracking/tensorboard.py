"""TensorBoard event files in ``RUN/tensorboard``: what the worker writes to ``events.jsonl``, as scalars and text.

A bridge, not a second log: ``TrackedEvents`` hands every event it writes to the tracker, and ``replay`` feeds a
run's whole ``events.jsonl`` to it again (a run trained before, or the files deleted). ``tensorboardX`` writes the
files (no TensorFlow); without it the run trains and a warning says what to install.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from studio.core.config import RunConfig
from studio.core.run.directory import RunDir
from studio.core.run.evaluation import MODELS
from studio.core.run.events import EventWriter, read_events

log = logging.getLogger("studio.train")
FOLDER = "tensorboard"
STEP_SCALARS = {"loss": "train/loss", "lr": "train/learning_rate", "grad_norm": "train/grad_norm",
                "tokens_per_s": "train/tokens_per_s", "step_seconds": "train/step_seconds"}
SUMMARY_SCALARS = ("loss", "perplexity", "exact_match", "contains", "f1")


class TensorBoard:
    """Writes the events that carry figures; the others (checkpoints, warnings) are not TensorBoard's."""

    def __init__(self, folder: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(folder), flush_secs=10)
        self.step = 0  # the newest training step: an evaluation after training is drawn there

    def record(self, event: dict[str, Any]) -> None:
        kind, step = event.get("type"), event.get("step")
        if isinstance(step, int):
            self.step = step
        if kind == "step":
            for key, tag in STEP_SCALARS.items():
                if isinstance(event.get(key), (int, float)):
                    self.writer.add_scalar(tag, event[key], self.step)
            for reading in event.get("memory") or ():  # allocated on a GPU, the process's memory without one
                used = reading.get("allocated_bytes", reading.get("rss_bytes"))
                if used is not None:
                    self.writer.add_scalar(f"memory/{reading.get('device', 'device')} GiB", used / 2**30, self.step)
        elif kind == "eval" and event.get("eval_loss") is not None and step is not None:
            self.writer.add_scalar("eval/loss", event["eval_loss"], step)
        elif kind == "evaluation":
            for model in MODELS:
                for key in SUMMARY_SCALARS:
                    if event[model].get(key) is not None:
                        self.writer.add_scalar(f"evaluation/{key}/{model}", event[model][key], self.step)
        elif kind == "samples":
            for number, sample in enumerate(event.get("samples") or (), 1):
                self.writer.add_text(f"samples/{number}", _sample_markdown(sample), self.step)
        elif kind == "finished":
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _sample_markdown(sample: dict[str, Any]) -> str:
    reference = f"\n\n**reference:** {sample['reference']}" if sample.get("reference") is not None else ""
    return f"**prompt:** {sample.get('prompt', '')}{reference}\n\n**answer:** {sample.get('answer', '')}"


class TrackedEvents:
    """An EventWriter whose events also go to the run's trackers (the worker's and `studio eval`'s writer)."""

    def __init__(self, writer: EventWriter, trackers: list[TensorBoard]):
        self.writer, self.trackers = writer, trackers

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = self.writer.emit(type_, **fields)
        for tracker in self.trackers:
            tracker.record(event)
        return event

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.writer.close()


def tracked_events(rd: RunDir, config: RunConfig) -> EventWriter | TrackedEvents:
    """The run's event writer, with TensorBoard beside it when the config asks for it and tensorboardX is there."""
    writer = EventWriter(rd.events)
    if not config.schedule.tensorboard:
        return writer
    try:
        tracker = TensorBoard(rd.path / FOLDER)
    except ImportError:
        writer.emit("warning", message="no TensorBoard files: the tensorboardX package is not installed",
                    hint="pip install tensorboardX, or set schedule.tensorboard to false")
        return writer
    log.info("TensorBoard: tensorboard --logdir \"%s\"", rd.path / FOLDER)
    return TrackedEvents(writer, [tracker])


def replay(run_dir: Path) -> Path:
    """Write the run's TensorBoard files again from its events.jsonl (the old ones are replaced)."""
    rd = RunDir(run_dir)
    folder = rd.path / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    tracker = TensorBoard(folder)
    try:
        for event in read_events(rd.events):
            tracker.record(event)
    finally:
        tracker.close()
    return folder
