"""The event protocol between the worker and everything that watches it.

The worker appends one JSON object per line to ``events.jsonl`` in its run
directory (and, through studio.train.tracking, the same figures to TensorBoard files and the opt-in trackers); each has a ``type`` and a ``time`` (Unix seconds). The file is the
truth: a viewer that starts late, or after a crash, rebuilds the whole history
from it. Types and their main fields:

- ``run_started``: config (resolved), versions, devices, run_dir, pid, total_steps, start_step,
  resumed_from, trainable_params, total_params, adapted_modules, data (rows, tokens, truncated per split),
  placement (a layer split: device_map, summary, layers and weight bytes per device; null without one),
  world_size (training processes), loading_memory (per rank: sharded, rss_before/peak/after_bytes while the
  model loaded, gpu_peak_bytes on CUDA)
- ``estimate``: the predicted peak memory (studio.core.memory.estimate: devices with parts, peak_phase; with several
  processes ``loading``, what each holds while the model loads)
- ``memory_measured``: step, device, peak_bytes (the allocator's allocated bytes on CUDA, the live tensors
  elsewhere) and peak_phase (forward, backward or optimizer) of one tracked steady-state step, phase_bytes
  (the peak of each phase), on CUDA peak_reserved_bytes and nvml_used_bytes; the estimate of each reading:
  predicted_allocated_bytes (beside peak_bytes; both appended per machine to memory-calibration.jsonl beside
  the runs folder), predicted_reserved_bytes, predicted_nvml_used_bytes, and predicted_bytes (the estimate's
  peak, context and allocator margin included); with several processes one per rank, its device "cuda:N" or
  "cpu rank N"
- ``step``: step, epoch, loss, lr, grad_norm, tokens_per_s, samples_per_s, memory (list per device;
  with several processes, each rank's own device). Only rank 0 writes events: one writer per file
- ``eval``: step, eval_loss (grpo: eval_reward, and eval_rewards/NAME/mean per reward function: the held-out
  prompts' greedy completions scored)
- ``benchmarks``: checkpoint, limit, chat_template, tasks (per lm-evaluation-harness task, base and tuned: metric ->
  value), written by `studio eval --tasks`
- ``samples``: step, seconds (generating took), samples (per prompt: location, prompt, reference or null,
  answer): the greedy answers to the sample prompts with the weights of that step (step 0: the base's)
- ``completions``: step, seconds (sampling took), groups (grpo, after each sampling: its first group's location,
  prompt, reference or null and completions, each with its text, reward (the total, null when none scored it)
  and rewards (each function's score))
- ``evaluation``: checkpoint, data (the files), base and tuned (each model's summary: rows, tokens, loss,
  perplexity, answered, exact_match, contains, f1; a grpo run's: rows, eval_reward, eval_rewards/NAME/mean,
  full_reward, reward_functions, decoding, max_new_tokens; studio.core.run.evaluation), written by `studio eval`
- ``checkpoint``: step, path
- ``export``: kind (adapter | merged), path, verification (max logit difference, passed)
- ``warning``: message
- ``error``: kind, message, hint; with several processes also rank and host (the message starts
  "rank N on HOST: "), and an out of memory its part and fix
- ``finished``: status (completed | stopped | aborted | failed), step
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

EVENT_TYPES = ("run_started", "estimate", "memory_measured", "step", "eval", "evaluation", "benchmarks", "samples", "completions",
               "checkpoint", "export", "warning", "error", "finished")


def make_event(type_: str, **fields: Any) -> dict[str, Any]:
    if type_ not in EVENT_TYPES:
        raise ValueError(f"unknown event type {type_!r}")
    return {"type": type_, "time": round(time.time(), 3), **fields}


class EventWriter:
    """Appends events to a JSONL file, one flushed line each, so a reader never sees half a line
    that will not be completed and a crash loses at most the event being written."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if _ends_inside_a_line(self.path):
            self._file.write("\n")  # end the line a killed writer tore, so the next event stays whole

    def emit(self, type_: str, **fields: Any) -> dict[str, Any]:
        event = make_event(type_, **fields)
        self._file.write(json.dumps(event, default=_jsonable, allow_nan=False) + "\n")
        self._file.flush()
        return event

    def close(self) -> None:
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()


def _ends_inside_a_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


@dataclass
class EventReader:
    """Reads new complete events from a growing JSONL file (for following a live run).

    Partial trailing lines are kept until their newline arrives; lines that are not
    valid JSON (a torn write after a crash) are skipped.
    """

    path: Path
    offset: int = 0
    _pending: bytes = field(default=b"", repr=False)

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        data = self._pending + chunk
        lines = data.split(b"\n")
        self._pending = lines.pop()  # b"" when the chunk ended with a newline
        return list(self._parse(lines))

    def _parse(self, lines: list[bytes]) -> Iterator[dict[str, Any]]:
        for line in lines:
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "type" in event:
                yield event


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every complete event in a file (a torn last line is ignored)."""
    reader = EventReader(Path(path))
    events = reader.read_new()
    if reader._pending.strip():
        events += list(reader._parse([reader._pending]))
    return events


def kept_history(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events of the steps a run kept: a resumed run trains again from its checkpoint's step, and what the
    lost steps after it wrote (their steps, evaluations, samples) is dropped, as a viewer of the run drops it."""
    kept: list[dict[str, Any]] = []
    for event in events:
        if event.get("type") == "run_started" and kept:
            start = int(event.get("start_step") or 0)
            kept = [e for e in kept if not isinstance(e.get("step"), int) or e["step"] <= start]
        kept.append(event)
    return kept


@dataclass(frozen=True)
class RunSummary:
    """What a list of past runs shows: derived from the events alone."""

    status: str  # running-or-crashed is "unfinished"
    last_step: int
    last_loss: float | None
    total_steps: int | None
    error: str | None


def summarize(events: list[dict[str, Any]]) -> RunSummary:
    status, last_step, last_loss, total, error = "unfinished", 0, None, None, None
    for event in events:
        kind = event["type"]
        if kind == "run_started":
            total = event.get("total_steps", total)
            status = "unfinished"
        elif kind == "step":
            last_step, last_loss = event.get("step", last_step), event.get("loss", last_loss)
        elif kind == "error":
            error = event.get("message")
        elif kind == "finished":
            status = event.get("status", "completed")
    return RunSummary(status, last_step, last_loss, total, error)
