"""Several training processes on this machine: the parent that torchrun's children report to.

``studio train`` with ``distributed.num_processes`` > 1 prepares the run directory
once, then runs torchrun (studio.core.run.commands.torchrun_command) as a subprocess and
waits. Stop requests reach the children through the run directory, the one channel
every OS shares: the parent keeps its StopController (stdin, signals, the control
files) and turns a stop into the STOP file and an abort into the ABORT file, which
each child polls; the children agree on the step to stop at (studio.train.distributed.engine).
torchrun runs in its own process group, so a terminal's Ctrl+C reaches only the
parent, which turns it into a clean stop like the one-process worker does.

A failing rank records its error in the run directory and exits; the others see it
(studio.train.distributed.rankwatch) and exit within a second, and the parent writes one
``error`` event naming the rank, its host and the cause (the earliest failure that
is not just "the other side went away"), and one ``finished`` event.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

from studio.core.run.commands import EXIT_ABORTED, EXIT_FAILED, EXIT_OK, Cluster, torchrun_command, worker_args
from studio.core.run.directory import RunDir
from studio.core.run.events import EventWriter
from studio.train.control import StopController
from studio.train.distributed import rankwatch

log = logging.getLogger("studio.train")

PARENT_ENV = "STUDIO_LAUNCH_PARENT"  # set for the children: a parent reports failures and aborts
ABORT_GRACE_S = 30.0  # after an abort, how long the children get to exit before they are killed


def launched_by_studio() -> bool:
    return PARENT_ENV in os.environ


def launch(run_dir: RunDir, num_processes: int, resume: bool, watch_stdin: bool = True) -> int:
    """Run the children to the end; returns the exit code (0 ok, 1 failed, 130 aborted)."""
    rankwatch.clear(run_dir.path)
    argv = torchrun_command(sys.executable, Cluster(processes_per_machine=num_processes), 0,
                            worker_args(run_dir.config, run_dir.path, resume))
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    log.info("starting %d training processes: %s", num_processes, " ".join(argv))
    events = EventWriter(run_dir.events)
    control = StopController(run_dir, watch_stdin=watch_stdin)
    process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **_own_process_group())
    aborted = False
    try:
        _wait_forwarding_stops(process, run_dir, control)
    except KeyboardInterrupt:
        aborted = True
        _abort(process, run_dir)
    finally:
        control.close()
    try:
        if process.returncode == 0 and not aborted:
            return EXIT_OK
        if aborted or control.aborting:
            events.emit("finished", status="aborted")
            return EXIT_ABORTED
        failure = _first_failure(run_dir, process.returncode)
        log.error("%s\n  hint: %s", failure["message"], failure["hint"])
        events.emit("error", **failure)
        events.emit("finished", status="failed")
        return EXIT_FAILED
    finally:
        events.close()


def _own_process_group() -> dict:
    if sys.platform == "win32":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def _wait_forwarding_stops(process: subprocess.Popen, run_dir: RunDir, control: StopController) -> None:
    forwarded = False
    while process.poll() is None:
        if control.stop_requested and not forwarded:
            forwarded = True
            if not run_dir.stop_file.exists():
                run_dir.request_stop()
        time.sleep(0.2)


def _abort(process: subprocess.Popen, run_dir: RunDir) -> None:
    """Ask the ranks to exit; kill torchrun and every rank (each in its own session) if they have not
    after the grace period, or at once on another Ctrl+C."""
    import psutil

    run_dir.request_stop(abort=True)
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.Error:  # torchrun already ended
        tree = []
    try:
        process.wait(timeout=ABORT_GRACE_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        for member in tree:
            try:
                member.kill()
            except psutil.Error:
                pass
        process.wait()


def _first_failure(run_dir: RunDir, returncode: int) -> dict:
    """The error event's fields: the cause the ranks recorded, or the exit code when none did."""
    first = rankwatch.first_failure(rankwatch.read_failures(run_dir.path))
    if first is None:
        return {"kind": "internal", "message": f"a training process ended with exit code {returncode} without reporting why",
                "hint": f"see {run_dir.log}; a process killed by the system (out of memory) ends like this"}
    details = {k: v for k, v in first.items() if k not in ("time", "message")}
    return {**details, "message": rankwatch.described(first)}
