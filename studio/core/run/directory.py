"""The run directory: the unit of everything a run makes.

    RUN_DIR/
      config.yaml          the resolved config the worker ran with
      events.jsonl         the event stream (studio.core.run.events)
      train.log            the human-readable log
      worker.json          pid, host and command of the worker (for re-attaching)
      STOP / ABORT         control files: a stop request saves and exits; abort exits at once
      ranks/               several processes: each rank's host, pid and heartbeat, and why one failed
      prepared/machine-N/  several processes: the data the first process of machine N tokenized for the others
      checkpoints/step-000120/   complete checkpoints (each has a COMPLETE marker)
      exports/adapter/, exports/merged/
      tensorboard/         the run's figures as TensorBoard files (schedule.tensorboard)

Folders that must never be seen half-written (checkpoints, exports) are written
into a staging folder beside their destination, synced, renamed into place, and
only then marked complete.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Iterator

from studio.core.errors import StudioError
from studio.core.folders import data_folder

COMPLETE_MARKER = "COMPLETE"
STOP_FILE = "STOP"
ABORT_FILE = "ABORT"
_CHECKPOINT_RE = re.compile(r"^step-(\d+)$")


def default_runs_root() -> Path:
    """Where runs go when the user names no run directory."""
    override = os.environ.get("STUDIO_RUNS_DIR")
    return Path(override) if override else data_folder() / "runs"


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)

    config = property(lambda self: self.path / "config.yaml")
    events = property(lambda self: self.path / "events.jsonl")
    log = property(lambda self: self.path / "train.log")
    worker_info = property(lambda self: self.path / "worker.json")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")
    exports_dir = property(lambda self: self.path / "exports")
    tensorboard_dir = property(lambda self: self.path / "tensorboard")
    stop_file = property(lambda self: self.path / STOP_FILE)
    abort_file = property(lambda self: self.path / ABORT_FILE)

    @classmethod
    def create(cls, name: str, root: Path | None = None) -> "RunDir":
        """A new, empty run directory ``<root>/<name>-<YYYYmmdd-HHMMSS>`` (suffixed if taken)."""
        root = Path(root) if root else default_runs_root()
        root.mkdir(parents=True, exist_ok=True)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for attempt in range(1000):
            path = root / (f"{safe}-{stamp}" + (f"-{attempt}" if attempt else ""))
            try:
                path.mkdir()
                return cls(path)
            except FileExistsError:
                continue
        raise RuntimeError(f"cannot create a run directory under {root}")

    def checkpoint_path(self, step: int) -> Path:
        return self.checkpoints_dir / f"step-{step:06d}"

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first. Torn or staging folders are never listed."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = []
        for child in self.checkpoints_dir.iterdir():
            match = _CHECKPOINT_RE.match(child.name)
            if match and (child / COMPLETE_MARKER).is_file():
                found.append((int(match.group(1)), child))
        return [path for _, path in sorted(found)]

    def latest_checkpoint(self) -> Path | None:
        complete = self.complete_checkpoints()
        return complete[-1] if complete else None

    def remove_torn_checkpoints(self) -> list[str]:
        """Delete what a killed writer left (staging folders, folders without COMPLETE); returns their names.

        Only for a run no worker is writing to, e.g. at resume.
        """
        if not self.checkpoints_dir.is_dir():
            return []
        complete = set(self.complete_checkpoints())
        torn = [child for child in self.checkpoints_dir.iterdir() if child not in complete]
        for child in torn:
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
        return sorted(child.name for child in torn)

    def prune_checkpoints(self, keep: int) -> None:
        for old in self.complete_checkpoints()[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def write_worker_info(self, command: list[str]) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command, "started": time.time()}
        self.worker_info.write_text(json.dumps(info), encoding="utf-8")

    def request_stop(self, abort: bool = False) -> None:
        """Ask the worker to stop (save, then exit) or abort (exit now). Works on every OS."""
        (self.abort_file if abort else self.stop_file).write_text(str(time.time()), encoding="utf-8")

    def clear_control_files(self) -> None:
        for path in (self.stop_file, self.abort_file):
            path.unlink(missing_ok=True)


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def write_atomically(path: Path, text: str) -> None:
    """Write a file whole or not at all: a reader finds the old text or the new, never half of one. The staging
    file is this process's own, so processes writing the same file at once do not write into each other's."""
    staging = path.with_name(f"{path.name}.{os.getpid()}.partial")
    staging.write_text(text, encoding="utf-8")
    os.replace(staging, path)


@contextlib.contextmanager
def atomic_folder(destination: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a staging folder; on success it becomes ``destination``, COMPLETE marker included.

    The marker is written before the rename, so the folder appears complete or not
    at all. On any exception the staging folder is removed and ``destination`` (if
    it existed) is left untouched; a failed write (disk full, read-only) becomes a
    StudioError naming the folder. With ``replace`` an existing destination is
    swapped out only after the new folder is complete.
    """
    destination = Path(destination)
    staging = destination.parent / f".staging-{destination.name}-{os.getpid()}"
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        yield staging
        (staging / COMPLETE_MARKER).write_text(str(time.time()), encoding="utf-8")
        _fsync_tree(staging)
        _move_into_place(staging, destination, replace)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _write_error(destination, exc) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, destination: Path, replace: bool) -> None:
    if not destination.exists():
        staging.rename(destination)
        return
    if not replace:
        raise FileExistsError(errno.EEXIST, "it already exists", str(destination))
    retired = destination.parent / f".old-{destination.name}-{os.getpid()}"
    shutil.rmtree(retired, ignore_errors=True)
    destination.rename(retired)
    try:
        staging.rename(destination)
    except OSError:
        retired.rename(destination)  # put the earlier folder back
        raise
    shutil.rmtree(retired, ignore_errors=True)


_WRITE_FAILURES = {errno.ENOSPC: "the disk is full", errno.EROFS: "the drive is read-only",
                   errno.EACCES: "there is no permission to write there", errno.EPERM: "there is no permission to write there",
                   errno.EEXIST: "it already exists"}


def _write_error(destination: Path, exc: OSError) -> StudioError:
    reason = _WRITE_FAILURES.get(exc.errno, exc.strerror or str(exc))
    return StudioError(f"cannot write {destination}: {reason}",
                       f"free disk space or choose a writable folder; nothing in {destination.parent} was replaced "
                       "or left half-written", kind="disk")
