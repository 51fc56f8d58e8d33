"""Where a worker's failure, or an abort, is reported.

One process: its ``error`` and ``finished`` events. One rank of several
(studio.train.distributed.rankwatch): a record in the run directory, which ends the other
ranks within a second; the run's one ``error`` event, naming the rank, its host
and the cause, is written by the studio launcher when there is one, otherwise by
the reporting rank. A rank that sees another fail (from its watch thread, or after
a collective broke) reports that cause, not its own lost contact.
"""

from __future__ import annotations

import logging
import os
import threading

from studio.core.run.commands import EXIT_FAILED
from studio.core.run.directory import RunDir
from studio.core.run.events import EventWriter
from studio.train.distributed import rankwatch
from studio.train.distributed.launcher import launched_by_studio

log = logging.getLogger("studio.train")

CAUSE_WAIT_S = 5.0  # after a broken collective, how long to wait for the failing rank's record


class FailureReporter:
    def __init__(self, events, run_dir: RunDir, rank: int | None, world_size: int = 1):
        self.events, self.run_dir, self.rank = events, run_dir, rank
        self.to_parent = rank is not None and launched_by_studio()
        self._lock = threading.Lock()
        self._handled = False
        self.watch = None if rank is None else rankwatch.RankWatch(run_dir.path, rank, world_size, self._end_for_peer)

    def failed(self, kind: str, message: str, hint: str, step: int | None = None, **details) -> None:
        """This process failed; ``details`` (e.g. an out-of-memory fix) go into the error event."""
        log.error("%s\n  hint: %s", message, hint)
        if not self._first():
            return
        if self.watch is None:
            self._emit(self.events, {"kind": kind, "message": message, "hint": hint, **details}, step)
            return
        self.watch.stop_watching()
        rankwatch.record_failure(self.run_dir.path, self.rank, kind, message, hint, host=self.watch.host, **details)
        own = {"rank": self.rank, "host": self.watch.host, "kind": kind, "message": message, "hint": hint, **details}
        self._report(own, step)

    def lost_contact(self, exc: BaseException, step: int) -> None:
        """A collective broke: report the rank that caused it, or, when none is found, the lost contact."""
        cause = self.watch.wait_for_cause(CAUSE_WAIT_S)
        if cause is None:
            self.failed(rankwatch.LOST_CONTACT, f"lost contact with the other training processes: {exc}",
                        "see train.log of every machine: another process ended or its machine became unreachable", step)
        elif self._first():
            self._peer_failed(cause, step)

    def aborted(self, step: int) -> None:
        if not self.to_parent and self.rank in (None, 0):
            self.events.emit("finished", status="aborted", step=step)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()

    # ------------------------------------------------------------ internals
    def _first(self) -> bool:
        """True once: a process reports one failure, its own or the first it saw."""
        with self._lock:
            first, self._handled = not self._handled, True
            return first

    def _end_for_peer(self, failure: dict) -> None:
        """The watch thread saw another rank fail: report it if this rank reports, and end at once (the main
        thread may be blocked in a collective that waits for the failed rank)."""
        if not self._first():
            return  # this process is already reporting its own failure and ends next
        self._peer_failed(failure, None)
        for handler in logging.getLogger("studio").handlers:
            handler.flush()
        os._exit(EXIT_FAILED)

    def _peer_failed(self, failure: dict, step: int | None) -> None:
        self.watch.stop_watching()
        log.error("ending this process: %s", rankwatch.described(failure))
        self._report(failure, step)

    def _report(self, failure: dict, step: int | None) -> None:
        """The run's error event, when no launcher writes it and this rank is the one that reports."""
        if self.to_parent or not self.watch.reports(failure):
            return
        fields = {k: v for k, v in failure.items() if k != "time"}
        writer = EventWriter(self.run_dir.events)  # its own: the watch thread reports too, and only rank 0 has one
        try:
            self._emit(writer, {**fields, "message": rankwatch.described(failure)}, step)
        finally:
            writer.close()

    @staticmethod
    def _emit(events, fields: dict, step: int | None) -> None:
        events.emit("error", **fields)
        events.emit("finished", status="failed", **({} if step is None else {"step": step}))


class SilentEvents:
    """The event writer of ranks other than 0: rank 0 writes the run's events (other ranks'
    memory reaches it through a gather), so one process appends to events.jsonl."""

    def emit(self, type_: str, **fields) -> dict:
        return {}

    def close(self) -> None:
        pass
