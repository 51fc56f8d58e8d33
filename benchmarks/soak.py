"""Soak: thousands of steps of the real worker while the app follows them.

    python benchmarks/soak.py                 # 5000 steps (about 10 minutes on 2 CPU cores)
    python benchmarks/soak.py --steps 200     # a quick look

The app (offscreen) starts the run and follows it as a user's window would. Every
few seconds this records the app's resident memory, the bytes its chart buffers
hold, the size of events.jsonl and how late a 20 ms timer fired (the event loop's
responsiveness). It prints the samples and a summary: memory growth beyond the
chart buffers per 1000 steps, event bytes per step, and the timer lateness.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

MIB = 1024**2
TICK_MS = 20


@dataclass
class Sample:
    seconds: float
    step: int
    app_rss_mib: float
    chart_buffers_mib: float
    events_mib: float
    worst_timer_lateness_ms: float


class LatenessProbe:
    """A 20 ms timer that records how late it fires: the longest the event loop was blocked."""

    def __init__(self):
        from PySide6.QtCore import QTimer

        self.worst_ms = 0.0
        self._last = time.perf_counter()
        self._timer = QTimer()
        self._timer.timeout.connect(self._tick)
        self._timer.start(TICK_MS)

    def _tick(self) -> None:
        now = time.perf_counter()
        self.worst_ms = max(self.worst_ms, (now - self._last) * 1000 - TICK_MS)
        self._last = now

    def take_worst(self) -> float:
        worst, self.worst_ms = self.worst_ms, 0.0
        return worst


def chart_buffer_bytes(series) -> int:
    return sum(s._x.nbytes + s._y.nbytes for s in series.all_series() if s._x is not None)  # None: no point yet


def soak(steps: int, sample_every_s: float, workdir: Path) -> list[Sample]:
    import psutil

    from helpers import quick_config
    from studio.gui.app import create_app
    from studio.gui.main_window import MainWindow

    os.environ["STUDIO_CONFIG_DIR"] = str(workdir / "config")
    os.environ["STUDIO_RUNS_DIR"] = str(workdir / "runs")
    app = create_app([])
    window = MainWindow(attach_live_runs=False)
    window.ask_close_choice = lambda: "stop"
    window.resize(1280, 800)
    window.show()
    data = ROOT / "resources" / "datasets" / "categories_instruction.jsonl"
    window.store.set(quick_config(data, training={"max_steps": steps, "micro_batch_size": 2},
                                  data={"train_files": (str(data),), "max_length": 32},
                                  schedule={"save_every": 1000, "keep_checkpoints": 1}))
    window.start_action.trigger()
    probe, me, samples = LatenessProbe(), psutil.Process(), []
    started = next_sample = time.monotonic()

    def take_sample() -> None:
        events = window.controller.run_dir.events
        samples.append(Sample(round(time.monotonic() - started, 1), window.controller.job.step,
                              me.memory_info().rss / MIB, chart_buffer_bytes(window.controller.series) / MIB,
                              events.stat().st_size / MIB if events.exists() else 0.0, probe.take_worst()))

    while window.controller.job.active:
        app.processEvents()
        time.sleep(0.005)
        if time.monotonic() >= next_sample:
            next_sample += sample_every_s
            take_sample()
    take_sample()
    window.close()
    return samples


def summary(samples: list[Sample]) -> dict:
    """Growth is measured while the run goes, from the first sample with 10 % of the steps (after imports
    and warm-up) to the last one before the end (the finished run then loads its export and try panels)."""
    last = samples[-2] if len(samples) > 2 else samples[-1]
    first = next(s for s in samples if s.step >= last.step * 0.1)
    steps = max(last.step - first.step, 1)
    growth = (last.app_rss_mib - first.app_rss_mib) - (last.chart_buffers_mib - first.chart_buffers_mib)
    training = [s for s in samples if s.step > 0]
    return {
        "steps": samples[-1].step,
        "app_rss_mib": [round(first.app_rss_mib, 1), round(last.app_rss_mib, 1)],
        "chart_buffers_mib": round(last.chart_buffers_mib, 2),
        "rss_growth_beyond_chart_buffers_mib_per_1000_steps": round(growth / steps * 1000, 2),
        "event_bytes_per_step": round(samples[-1].events_mib * MIB / samples[-1].step),
        "worst_timer_lateness_ms": round(max(s.worst_timer_lateness_ms for s in training), 1),
        "median_worst_timer_lateness_ms": round(sorted(s.worst_timer_lateness_ms for s in training)[len(training) // 2], 1),
    }


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        samples = soak(args.steps, args.sample_every, Path(tmp))
    for sample in samples:
        print(json.dumps(asdict(sample)))
    print(json.dumps(summary(samples), indent=1))


if __name__ == "__main__":
    main()
