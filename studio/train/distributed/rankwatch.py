"""One failing training process ends the whole run within seconds, and the run says which one and why.

The processes of a run meet in its run directory (on several machines, the shared
run folder), in ``ranks/``:

- ``rank-N.json``: rank N's host, pid and start time, a heartbeat it rewrites every
  second, and ``ended`` once it has finished normally (it then stops being watched);
- ``rank-N.error.json``: why rank N failed: written by rank N itself (an exception,
  an out-of-memory), or by whoever noticed it was gone without one (killed, or taken
  by the system's out-of-memory killer).

Each rank watches the others from a thread (``RankWatch``): a peer's error record,
or a peer that vanished (its pid is gone on this host; its heartbeat stalled on
another) ends this process at once, even when its main thread waits inside a
collective that would otherwise block until the backend's timeout (NCCL's is
minutes). The run's one ``error`` event is written by the studio launcher when
there is one (studio.train.distributed.launcher), otherwise by the reporting rank: rank 0, or
the lowest rank without a record when rank 0 died. Files, pids and a thread: no
signal is involved, so it works the same on Windows.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from studio.core.run.directory import write_atomically

log = logging.getLogger("studio.train")

RANKS_FOLDER = "ranks"
POLL_S = 0.5  # how often a rank looks at the others
BEAT_S = 1.0  # how often a rank rewrites its heartbeat
SILENT_AFTER_S = 15.0  # a peer on another machine whose heartbeat stalls this long is presumed dead
EARLIER_ATTEMPT_S = 60.0  # a peer's record from a process started this long before this one is left over
LOST_CONTACT = "peer"  # the kind of a failure that only says another rank went away


def ranks_folder(run_dir: Path) -> Path:
    return Path(run_dir) / RANKS_FOLDER


def clear(run_dir: Path) -> None:
    """Forget every rank of an earlier attempt (the launcher, before it starts the ranks)."""
    for path in ranks_folder(run_dir).glob("rank-*.json"):
        path.unlink(missing_ok=True)


def record_failure(run_dir: Path, rank: int, kind: str, message: str, hint: str, host: str | None = None,
                   **details) -> bool:
    """Rank ``rank``'s failure; the first record of a rank wins (False: there already was one)."""
    entry = {"time": time.time(), "rank": rank, "host": host or socket.gethostname(), "kind": kind,
             "message": message, "hint": hint, **details}
    folder = ranks_folder(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with open(folder / f"rank-{rank}.error.json", "x", encoding="utf-8") as f:
            f.write(json.dumps(entry, default=str))
    except FileExistsError:
        return False
    return True


def read_failures(run_dir: Path, since: float = 0.0) -> list[dict]:
    """Every failure recorded for this attempt (written after ``since``)."""
    failures = []
    for path in ranks_folder(run_dir).glob("rank-*.error.json"):
        entry = _read(path)
        if entry is not None and entry.get("time", 0) >= since:
            failures.append(entry)
    return failures


def first_failure(failures: list[dict]) -> dict | None:
    """The cause: the earliest failure that is not just another rank's lost contact."""
    if not failures:
        return None
    return min(failures, key=lambda f: (f.get("kind") == LOST_CONTACT, f["time"]))


def described(failure: dict) -> str:
    return f"rank {failure['rank']} on {failure['host']}: {failure['message']}"


def is_lost_contact(exc: BaseException) -> bool:
    """Whether an exception only says another process of the run went away (its cause is elsewhere)."""
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc).lower()
    return any(s in text for s in ("connection closed by peer", "connection reset", "broken pipe", "gloo", "nccl"))


class RankWatch:
    """This rank's heartbeat, and its watch over the others (see the module docstring)."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, on_failure: Callable[[dict], None]):
        self.run_dir, self.rank, self.world_size = Path(run_dir), rank, world_size
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.boot = psutil.boot_time()  # with the host name, tells machines apart (cloned ones share a name)
        self.started = psutil.Process().create_time()
        self._on_failure = on_failure
        self._beat = 0
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (its last heartbeat, when it changed, our clock)
        self._closed = threading.Event()
        folder = ranks_folder(self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{rank}.error.json").unlink(missing_ok=True)  # this rank's record of an earlier attempt
        self._write_presence(ended=False)
        self._thread = threading.Thread(target=self._watch, daemon=True, name="rank-watch")
        self._thread.start()

    def close(self) -> None:
        """This rank ended normally: the others stop watching it."""
        self._closed.set()
        self._write_presence(ended=True)

    def stop_watching(self) -> None:
        """The run failed here (its record is written): no heartbeat, no watch."""
        self._closed.set()

    def check(self) -> dict | None:
        """A peer's failure: its own record, or one written now for a peer that vanished."""
        failures = [f for f in read_failures(self.run_dir, self.started - EARLIER_ATTEMPT_S) if f["rank"] != self.rank]
        if failures:
            return first_failure(failures)
        for peer in range(self.world_size):
            if peer != self.rank and (presence := self._presence(peer)) is not None and self._vanished(peer, presence):
                record_failure(self.run_dir, peer, "killed",
                               f"the process (pid {presence['pid']}) ended without reporting an error",
                               "it was killed, or the system ran out of memory and ended it (see the system log); "
                               "resume the run from its last checkpoint", host=presence["host"])
                return first_failure([f for f in read_failures(self.run_dir, self.started - EARLIER_ATTEMPT_S)
                                      if f["rank"] != self.rank])
        return None

    def wait_for_cause(self, timeout: float) -> dict | None:
        """After losing contact with the others: the peer failure that explains it, if one appears in time."""
        deadline = time.monotonic() + timeout
        while True:
            failure = self.check()
            if failure is not None or time.monotonic() > deadline:
                return failure
            time.sleep(POLL_S / 2)

    def reports(self, failed: dict) -> bool:
        """Whether this rank writes the run's error event (without a studio launcher): rank 0, or the lowest
        rank without a record when rank 0 is gone."""
        if failed["rank"] != 0 or failed.get("kind") != "killed":
            return self.rank == 0
        recorded = {f["rank"] for f in read_failures(self.run_dir, self.started - EARLIER_ATTEMPT_S)}
        return self.rank == min((r for r in range(self.world_size) if r not in recorded), default=self.rank)

    # ------------------------------------------------------------ internals
    def _watch(self) -> None:
        last_beat = 0.0
        while not self._closed.wait(POLL_S):
            if time.monotonic() - last_beat >= BEAT_S:
                last_beat = time.monotonic()
                self._beat += 1
                self._write_presence(ended=False)
            try:
                failure = self.check()
            except OSError as exc:  # a shared folder that hiccups is no reason to end the run
                log.warning("cannot read the other ranks' state in %s: %s", ranks_folder(self.run_dir), exc)
                continue
            if failure is not None and not self._closed.is_set():
                self._on_failure(failure)
                return

    def _write_presence(self, ended: bool) -> None:
        entry = {"rank": self.rank, "host": self.host, "boot": self.boot, "pid": self.pid, "started": self.started,
                 "beat": self._beat, "ended": ended}
        path = ranks_folder(self.run_dir) / f"rank-{self.rank}.json"
        try:
            write_atomically(path, json.dumps(entry))
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)

    def _presence(self, peer: int) -> dict | None:
        """The peer's record of this attempt; None before it registered, or after it ended normally."""
        entry = _read(ranks_folder(self.run_dir) / f"rank-{peer}.json")
        if entry is None or entry.get("ended") or entry.get("started", 0) < self.started - EARLIER_ATTEMPT_S:
            return None
        return entry

    def _vanished(self, peer: int, presence: dict) -> bool:
        if presence["host"] == self.host and abs(presence.get("boot", 0) - self.boot) < 2:  # this machine: its pid?
            try:
                process = psutil.Process(presence["pid"])
                reused = abs(process.create_time() - presence["started"]) > 1.0
                return reused or process.status() == psutil.STATUS_ZOMBIE  # a zombie waits only for its parent
            except psutil.NoSuchProcess:
                return True
            except psutil.Error:
                return False
        beat, since = self._seen.get(peer, (-1, time.monotonic()))  # another machine: does its heartbeat go on?
        if presence["beat"] != beat:
            self._seen[peer] = (presence["beat"], time.monotonic())
            return False
        return time.monotonic() - since > SILENT_AFTER_S


def _read(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None
