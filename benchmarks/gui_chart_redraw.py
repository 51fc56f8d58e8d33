"""Redraw cost of the live charts with 100k points per curve (the four charts of the Training tab).

A frame is what the charts' timer does while a run streams in: append points,
hand the buffers to pyqtgraph (only the curves that changed), and paint. It is
measured with peak downsampling and clip-to-view on (as the app runs) and,
for comparison, with both off.

    python benchmarks/gui_chart_redraw.py [--points 100000] [--frames 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import numpy as np  # noqa: E402
from PySide6.QtWidgets import QApplication  # noqa: E402

from studio.gui.widgets.charts import ChartsPanel  # noqa: E402
from studio.core.sizes import GIB  # noqa: E402
from studio.gui.state.series import RunSeries  # noqa: E402


def filled_run(points: int) -> RunSeries:
    run = RunSeries("bench")
    steps = np.arange(1, points + 1, dtype=float)
    noise = np.random.default_rng(0).normal(0, 0.05, points)
    run.add({"type": "step", "step": 0, "loss": 3.0, "lr": 0.0, "tokens_per_s": 0.0, "memory": [
        {"device": "cuda:0", "kind": "cuda", "label": "GPU", "allocated_bytes": GIB, "reserved_bytes": GIB,
         "nvml_used_bytes": GIB, "nvml_total_bytes": 24 * GIB}]})
    for series, values in ((run.loss, 2 + np.exp(-steps / 2e4) + noise), (run.loss_smoothed, 2 + np.exp(-steps / 2e4)),
                           (run.lr, np.full(points, 2e-4)), (run.tokens_per_s, 5000 + 100 * noise)):
        series.extend(steps, values)
    for series in run.memory["cuda:0"].series.values():
        series.extend(steps, 10 + noise)
    run.estimate_bytes = 12 * GIB
    return run


def frame_times(charts: ChartsPanel, run: RunSeries, frames: int, per_frame: int) -> list[float]:
    app = QApplication.instance()
    step = run.loss.x[-1]
    times = []
    for _ in range(frames):
        started = time.perf_counter()
        for _ in range(per_frame):
            step += 1
            run.add({"type": "step", "step": step, "loss": 2.0, "lr": 2e-4, "tokens_per_s": 5000.0, "memory": [
                {"device": "cuda:0", "kind": "cuda", "allocated_bytes": GIB, "reserved_bytes": GIB, "nvml_used_bytes": GIB}]})
        charts.redraw()
        charts.repaint()
        app.processEvents()
        times.append((time.perf_counter() - started) * 1000)
    return times


def measure(points: int, frames: int, fast: bool) -> tuple[float, float, float]:
    charts = ChartsPanel(redraw_ms=3_600_000)  # frames are driven by hand here
    charts.resize(1000, 700)
    charts.show()
    for card in charts.cards:
        card.plot.getPlotItem().setDownsampling(auto=fast, mode="peak")
        card.plot.getPlotItem().setClipToView(fast)
    run = filled_run(points)
    started = time.perf_counter()
    charts.show_runs([run])
    for card in charts.cards:
        for curve in card.curves.values():
            curve.setDownsampling(auto=fast, method="peak")
            curve.setClipToView(fast)
    charts.repaint()
    QApplication.instance().processEvents()
    first = (time.perf_counter() - started) * 1000
    times = sorted(frame_times(charts, run, frames, per_frame=10))
    charts.close()
    return first, statistics.median(times), times[int(0.95 * (len(times) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000)
    parser.add_argument("--frames", type=int, default=40)
    args = parser.parse_args()
    QApplication.instance() or QApplication([])
    for label, fast in (("downsampling + clip to view (the app)", True), ("plain (both off)", False)):
        first, median, p95 = measure(args.points, args.frames, fast)
        print(f"{label}: first draw {first:.0f} ms; per frame median {median:.1f} ms, p95 {p95:.1f} ms "
              f"({args.points:,} points x 8 curves, 10 new points a frame)")
    print("the charts redraw every 100 ms: a frame must stay well under that")


if __name__ == "__main__":
    main()
