"""Kill the worker at random points, resume, repeat: nothing may be lost or torn.

    python benchmarks/kill_resume.py              # 20 kills (about 5-10 minutes on 2 CPU cores)
    python benchmarks/kill_resume.py --kills 3    # the short version the tests run

One uninterrupted reference run, then the same config started, killed hard
(``Popen.kill``: SIGKILL on Linux and macOS, TerminateProcess on Windows) after a
random number of steps plus a random delay, so kills land in forward, backward,
optimizer and checkpoint writes alike, and resumed; the loop repeats until the
asked-for number of kills, then the run is resumed to the end. Every resume must
start from the newest complete checkpoint (never a torn one), and the loss of
every step must match the reference run.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from studio.core.config import RunConfig, save_config  # noqa: E402
from studio.core.run.events import EventReader, read_events  # noqa: E402
from studio.core.run.directory import RunDir  # noqa: E402


@dataclass
class KillReport:
    kills: int = 0
    resumes: list[int] = field(default_factory=list)  # the start step of each resume
    torn_checkpoints_seen: int = 0
    max_loss_error: float = 0.0
    missing_steps: list[int] = field(default_factory=list)
    torn_left_at_end: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing_steps and not self.torn_left_at_end and self.max_loss_error <= 1e-4


def kill_config(data_file: Path, steps: int = 30) -> RunConfig:
    from helpers import quick_config

    return quick_config(data_file, lora={"dropout": 0.1},
                        training={"micro_batch_size": 4, "max_steps": steps, "lr_scheduler": "cosine", "warmup_ratio": 0.1},
                        schedule={"save_every": 2, "keep_checkpoints": 2})


def _worker(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "studio.train", *args], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _step_losses(run_dir: RunDir) -> dict[int, float]:
    """The loss of each step, as the last attempt at that step logged it."""
    return {e["step"]: e["loss"] for e in read_events(run_dir.events) if e["type"] == "step"}


def _kill_after_random_progress(process: subprocess.Popen, run_dir: RunDir, rng: random.Random) -> bool:
    """Kill during startup now and then; else after 0-4 new steps and a random fraction of a step.

    Returns False if the worker ended before the kill.
    """
    reader = EventReader(run_dir.events)
    reader.read_new()
    if rng.random() < 0.15:
        wanted, seen = 0, 0
    else:
        wanted, seen = rng.randint(1, 5), -1  # run_started first, then the steps
    while seen < wanted and process.poll() is None:
        for event in reader.read_new():
            if event["type"] == "run_started" or (event["type"] == "step" and seen >= 0):
                seen += 1
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.4))
    if process.poll() is not None:
        return False
    process.kill()
    process.wait()
    return True


def _check_newest_is_complete(run_dir: RunDir, report: KillReport) -> None:
    """Torn folders may exist after a kill, but must never be what resume picks."""
    from studio.train.checkpoint import TENSORS, read_state

    folders = sorted(run_dir.checkpoints_dir.glob("*")) if run_dir.checkpoints_dir.is_dir() else []
    report.torn_checkpoints_seen += sum(not (f / "COMPLETE").exists() for f in folders)
    latest = run_dir.latest_checkpoint()
    if latest is not None:
        assert (latest / TENSORS).stat().st_size > 0 and read_state(latest)["step"] > 0


def kill_loop(config: RunConfig, workdir: Path, kills: int, seed: int = 0) -> KillReport:
    from studio.train.worker import run

    rng, report = random.Random(seed), KillReport()
    workdir.mkdir(parents=True, exist_ok=True)
    _, reference = run(config, workdir / "reference", watch_stdin=False)
    expected = _step_losses(reference)

    save_config(config, workdir / "run.yaml")
    run_dir = RunDir(workdir / "killed")
    process = _worker([str(workdir / "run.yaml"), "--run-dir", str(run_dir.path)])
    while report.kills < kills:
        if not _kill_after_random_progress(process, run_dir, rng):
            break  # it finished: the run is shorter than the kills asked for
        report.kills += 1
        _check_newest_is_complete(run_dir, report)
        process = _worker(["--resume", str(run_dir.path)])
    process.wait()
    starts = [e for e in read_events(run_dir.events) if e["type"] == "run_started"]
    report.resumes = [e["start_step"] for e in starts[1:]]
    complete = {p.name for p in run_dir.complete_checkpoints()}
    report.torn_left_at_end = sorted(p.name for p in run_dir.checkpoints_dir.iterdir() if p.name not in complete)
    got = _step_losses(run_dir)
    report.missing_steps = sorted(set(expected) - set(got))
    report.max_loss_error = max(abs(got[s] - loss) / max(abs(loss), 1e-6) for s, loss in expected.items() if s in got)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = ROOT / "resources" / "datasets" / "categories_instruction.jsonl"
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        report = kill_loop(kill_config(data, args.steps), Path(tmp), args.kills, args.seed)
    print(json.dumps({**report.__dict__, "ok": report.ok, "seconds": round(time.monotonic() - started)}, indent=1))
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
