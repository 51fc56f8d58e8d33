"""Stopping a real worker process saves a checkpoint; resuming continues the loss curve exactly."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import losses, quick_config
from studio.core.config import save_config
from studio.core.run.commands import EXIT_OK
from studio.core.run.directory import RunDir
from studio.core.run.events import EventReader, read_events
from studio.train.worker import run


def start_worker(config, tmp_path) -> tuple[subprocess.Popen, RunDir]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_config(config, tmp_path / "run.yaml")
    run_dir = RunDir(tmp_path / "run")
    process = subprocess.Popen([sys.executable, "-m", "studio.train", str(tmp_path / "run.yaml"), "--run-dir", str(run_dir.path)],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    return process, run_dir


def wait_for_step(run_dir: RunDir, step: int, process: subprocess.Popen, timeout: float = 180) -> None:
    reader, deadline = EventReader(run_dir.events), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["type"] == "step" and e["step"] >= step for e in reader.read_new()):
            return
        assert process.poll() is None, "the worker ended before reaching the step"
        time.sleep(0.05)
    raise AssertionError(f"no step {step} within {timeout} s")


def finished(run_dir: RunDir) -> dict:
    return [e for e in read_events(run_dir.events) if e["type"] == "finished"][-1]


@pytest.fixture
def resumable_config(small_data):
    # Dropout makes the test also prove that the random state is restored.
    return quick_config(small_data, lora={"dropout": 0.1}, training={"micro_batch_size": 4, "max_steps": 40,
                                                                      "lr_scheduler": "cosine", "warmup_ratio": 0.1})


@pytest.mark.heavy  # test_faults resumes killed runs to the same losses; test_stdin_stop stops by file
@pytest.mark.slow
def test_stop_file_saves_and_resume_matches_an_uninterrupted_run(tmp_path, resumable_config):
    code, reference = run(resumable_config, tmp_path / "reference", watch_stdin=False)
    assert code == EXIT_OK
    expected = losses(reference)

    process, run_dir = start_worker(resumable_config, tmp_path)
    wait_for_step(run_dir, 3, process)
    run_dir.request_stop()
    assert process.wait(timeout=120) == EXIT_OK
    stopped = finished(run_dir)
    assert stopped["status"] == "stopped" and 3 <= stopped["step"] < 40
    assert run_dir.latest_checkpoint().name == f"step-{stopped['step']:06d}"

    code, _ = run(None, run_dir.path, resume=True, watch_stdin=False)
    assert code == EXIT_OK and finished(run_dir)["status"] == "completed"
    starts = [e for e in read_events(run_dir.events) if e["type"] == "run_started"]
    assert starts[-1]["start_step"] == stopped["step"]
    steps = {e["step"]: e["loss"] for e in read_events(run_dir.events) if e["type"] == "step"}
    assert sorted(steps) == list(range(1, 41))
    assert [steps[s] for s in range(1, 41)] == pytest.approx(expected, rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_stdin_stop_saves_and_abort_file_exits_at_once(tmp_path, resumable_config):
    process, run_dir = start_worker(resumable_config.replace(training={"max_steps": 10_000}), tmp_path)
    wait_for_step(run_dir, 2, process)
    process.stdin.write("stop\n")
    process.stdin.flush()
    assert process.wait(timeout=120) == EXIT_OK
    assert finished(run_dir)["status"] == "stopped" and run_dir.latest_checkpoint() is not None

    process, run_dir = start_worker(resumable_config.replace(training={"max_steps": 10_000}), tmp_path / "again")
    wait_for_step(run_dir, 2, process)
    run_dir.request_stop(abort=True)
    assert process.wait(timeout=60) == 130
    assert finished(run_dir)["status"] == "aborted" and run_dir.latest_checkpoint() is None


@pytest.mark.slow
@pytest.mark.skipif(os.name == "nt", reason="SIGTERM is not a stop channel on Windows")
def test_sigterm_stops_cleanly(tmp_path, resumable_config):
    process, run_dir = start_worker(resumable_config.replace(training={"max_steps": 10_000}), tmp_path)
    wait_for_step(run_dir, 2, process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == EXIT_OK
    assert finished(run_dir)["status"] == "stopped" and run_dir.latest_checkpoint() is not None
