"""A failure on any rank ends the whole run within seconds, and the run says which rank, on which host, and why.

Two training processes (torchrun over gloo on the CPU); rank 1 fails in setup, in the
forward (out of memory), while saving a checkpoint, or is killed outright. The fault is
injected from outside the code under test: a ``sitecustomize`` module on PYTHONPATH
patches rank 1's worker when that process starts.
"""

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pytest
from helpers import quick_config

from studio.core.config import save_config
from studio.core.run.commands import EXIT_FAILED
from studio.core.run.directory import RunDir
from studio.core.run.events import read_events
from studio.gui.state.job_state import Job, State

pytestmark = pytest.mark.slow

INJECT = '''
import os
if os.environ.get("RANK") == "1":
    import studio.train.distributed.engine as distributed
    import studio.train.worker as worker
    fault = os.environ["STUDIO_TEST_FAULT"]
    if fault == "setup":
        def build_model(*args, **kwargs):
            raise RuntimeError("injected: the model cannot be built")
        worker.build_model = build_model
    elif fault == "forward":
        import torch
        from studio.train.objectives.next_token import NextToken
        real, calls = NextToken.loss_sum, []
        def loss_sum(self, model, batch):
            calls.append(1)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return real(self, model, batch)
        NextToken.loss_sum = loss_sum
    elif fault == "save":
        def save_optimizer(self, folder):
            raise OSError(28, "No space left on device")
        distributed.AccelerateEngine.save_optimizer = save_optimizer
'''

EXPECTED = {  # fault -> what the error event says, and its kind
    "setup": ("RuntimeError: injected: the model cannot be built", "internal"),
    "forward": ("out of memory in the forward pass", "oom"),
    "save": ("No space left on device", "internal"),
    "killed": ("ended without reporting an error", "killed"),
}
ENDS_WITHIN_S = 15.0


def start_run(data, folder, fault: str) -> tuple[subprocess.Popen, RunDir]:
    config = quick_config(data, training={"micro_batch_size": 4, "max_steps": 100},
                          schedule={"save_every": 2}, distributed={"num_processes": 2})
    folder.mkdir(parents=True, exist_ok=True)
    save_config(config, folder / "run.yaml")
    (folder / "inject").mkdir()
    (folder / "inject" / "sitecustomize.py").write_text(INJECT)
    env = {**os.environ, "STUDIO_TEST_FAULT": fault,
           "PYTHONPATH": os.pathsep.join([str(folder / "inject"), *sys.path])}
    run_dir = RunDir(folder / "run")
    process = subprocess.Popen([sys.executable, "-m", "studio.train", str(folder / "run.yaml"), "--run-dir", str(run_dir.path)],
                               env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, run_dir


def rank_record(run_dir: RunDir, name: str) -> dict | None:
    try:
        return json.loads((run_dir.path / "ranks" / name).read_text())
    except (OSError, ValueError):
        return None


def kill_rank_1_after_step_2(process, run_dir: RunDir) -> None:
    deadline = time.monotonic() + 120
    while not any(e["type"] == "step" and e["step"] >= 2 for e in read_events(run_dir.events)):
        assert process.poll() is None and time.monotonic() < deadline, "the run never reached step 2"
        time.sleep(0.1)
    psutil.Process(rank_record(run_dir, "rank-1.json")["pid"]).kill()  # SIGKILL; TerminateProcess on Windows


# the exception in the forward pass and the killed process stay in CI; setup and save are heavy
@pytest.mark.parametrize("fault", [pytest.param(fault, marks=pytest.mark.heavy) if fault in ("setup", "save") else fault
                                   for fault in EXPECTED])
def test_a_failing_rank_ends_the_run_within_seconds_and_is_named(small_data, tmp_path, fault):
    process, run_dir = start_run(small_data, tmp_path, fault)
    try:
        if fault == "killed":
            kill_rank_1_after_step_2(process, run_dir)
        assert process.wait(timeout=180) == EXIT_FAILED
        ended = time.time()
    finally:
        if process.poll() is None:
            process.kill()
    pids = [rank_record(run_dir, f"rank-{rank}.json")["pid"] for rank in (0, 1)]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)

    failed_at = rank_record(run_dir, "rank-1.error.json")["time"]
    assert ended - failed_at < ENDS_WITHIN_S, f"the run took {ended - failed_at:.1f} s to end after rank 1 failed"

    events = read_events(run_dir.events)
    errors = [e for e in events if e["type"] == "error"]
    cause, kind = EXPECTED[fault]
    host = socket.gethostname()
    assert len(errors) == 1 and errors[0]["rank"] == 1 and errors[0]["host"] == host and errors[0]["kind"] == kind
    assert errors[0]["message"].startswith(f"rank 1 on {host}: ") and cause in errors[0]["message"]
    assert [e["status"] for e in events if e["type"] == "finished"] == ["failed"]
    if fault == "forward":
        assert "fix" in errors[0] and "forward" in errors[0]["part"]  # rank 1's out-of-memory details reach the app

    job = Job()  # what the app shows for the run
    job.attach()
    for event in events:
        job.apply(event)
    assert job.state is State.FAILED and job.error.message == errors[0]["message"]
