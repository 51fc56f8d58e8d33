"""Past and running runs on disk: what the History tab lists and what the window re-attaches to.

Pure Python (no Qt). A run is "running" only when its worker process is alive
*and* its events hold no ``finished`` event; a run without ``finished`` whose
worker is gone crashed (or was killed). Liveness is checked with psutil, which
works the same on Linux, Windows and macOS, and the process's start time is
compared with worker.json so that a reused pid is not mistaken for the worker.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from studio.core.run.directory import RunDir
from studio.core.run.events import read_events, summarize

@dataclass(frozen=True)
class RunRecord:
    """One row of the History list."""

    path: Path
    name: str
    started: float  # Unix time (the folder's creation as a fallback)
    status: str  # running | completed | stopped | aborted | failed | crashed | not started
    last_step: int
    total_steps: int | None
    last_loss: float | None
    eval_loss: float | None
    model: str
    method: str
    error: str | None
    has_checkpoint: bool

    @property
    def resumable(self) -> bool:
        return self.has_checkpoint and self.status in ("stopped", "aborted", "failed", "crashed")


def worker_pid(run_dir: Path) -> int | None:
    """The pid of the run's worker if that process is alive, else None."""
    try:
        info = json.loads(RunDir(run_dir).worker_info.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    pid = info.get("pid")
    return pid if isinstance(pid, int) and process_alive(pid, info.get("started")) else None


def process_alive(pid: int, started_at: float | None = None) -> bool:
    """Whether ``pid`` runs (not a zombie) and, given ``started_at``, began before that time."""
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return started_at is None or process.create_time() <= float(started_at) + 2.0
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def find_process(command: list[str]) -> int | None:
    """The pid of the newest process running ``command`` (compared without the interpreter's path,
    which the OS may report resolved). A worker that is still exiting from an earlier launch on the
    same run directory has other arguments or is older, so it is never mistaken for the new one."""
    arguments = list(command[1:])
    found: list[tuple[float, int]] = []
    for process in psutil.process_iter(["cmdline", "create_time"]):
        cmdline = process.info.get("cmdline") or []
        if arguments and cmdline[-len(arguments):] == arguments:
            found.append((process.info.get("create_time") or 0.0, process.pid))
    return max(found)[1] if found else None


def _finished(events: list[dict[str, Any]]) -> bool:
    """Whether the last session of the run ended (a resume appends a new run_started)."""
    for event in reversed(events):
        if event["type"] == "finished":
            return True
        if event["type"] == "run_started":
            return False
    return False


def record_for(run_dir: Path) -> RunRecord | None:
    """Summarize a run directory; None for folders that are not runs."""
    rd = RunDir(run_dir)
    if not rd.config.is_file():
        return None
    events = read_events(rd.events)
    summary = summarize(events)
    started = next((e for e in events if e["type"] == "run_started"), None)
    config = (started or {}).get("config") or _config_dict(rd)
    status = summary.status
    if not _finished(events):
        status = "running" if worker_pid(run_dir) is not None else ("crashed" if events else "not started")
        if status == "not started" and _recent(rd):
            status = "starting"
    evals = [e["eval_loss"] for e in events if e["type"] == "eval" and e.get("eval_loss") is not None]
    return RunRecord(
        path=rd.path, name=rd.path.name, started=_start_time(rd, events), status=status,
        last_step=summary.last_step, total_steps=summary.total_steps, last_loss=summary.last_loss,
        eval_loss=evals[-1] if evals else None,
        model=Path(str((config.get("model") or {}).get("name_or_path", "?"))).name or "?",
        method=str(config.get("method", "?")), error=summary.error,
        has_checkpoint=rd.latest_checkpoint() is not None,
    )


def scan_runs(root: Path) -> list[RunRecord]:
    """Every run under ``root``, newest first."""
    if not Path(root).is_dir():
        return []
    records = [record_for(child) for child in Path(root).iterdir() if child.is_dir()]
    return sorted((r for r in records if r is not None), key=lambda r: r.started, reverse=True)


def live_runs(root: Path) -> list[Path]:
    """Runs whose worker still trains (started by an earlier window or the command line), newest first."""
    return [r.path for r in scan_runs(root) if r.status == "running"]


def _config_dict(rd: RunDir) -> dict:
    try:
        data = yaml.safe_load(rd.config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):  # a torn file must not break the list
        return {}
    return data if isinstance(data, dict) else {}


def _start_time(rd: RunDir, events: list[dict[str, Any]]) -> float:
    if events:
        return float(events[0].get("time", 0.0))
    try:
        return rd.path.stat().st_mtime
    except OSError:
        return 0.0


def _recent(rd: RunDir, seconds: float = 120.0) -> bool:
    try:
        return time.time() - rd.path.stat().st_mtime < seconds
    except OSError:
        return False
