"""Render the app's main states to docs/screenshots/*.png at 1280x720, with real runs of the demo model.

It trains (two short runs), exports and generates for real, so it takes a few
minutes on a CPU. Settings and runs go to a temporary folder: your own are not
touched.

    python packaging/render_screenshots.py [--out docs/screenshots]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

ROOT = Path(__file__).resolve().parents[1]
SIZE = (1280, 720)  # a small laptop screen's window: what fits there fits everywhere
SIMULATED_GPU_ENV = "STUDIO_SIMULATE_GPU_MEMORY"  # studio.train.measure.oom's (importing it here would load torch)


def wait_until(app, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        app.processEvents()
        time.sleep(0.03)
    for _ in range(10):  # let the 100 ms chart timer catch up
        app.processEvents()
        time.sleep(0.02)


class Shooter:
    def __init__(self, app, window, out: Path):
        self.app, self.window, self.out = app, window, out

    def __call__(self, name: str) -> None:
        for _ in range(5):
            self.app.processEvents()
        path = self.out / f"{name}.png"
        self.window.grab().save(str(path))
        print(f"wrote {path}")


def setup_states(app, window, shot) -> None:
    from studio.core.presets import DEMO_MODEL

    window.model_panel.use_model(str(DEMO_MODEL))
    wait_until(app, lambda: not window.data_panel.task.busy, 30, "the data preview")
    window.setup_tabs.setCurrentWidget(window.model_panel)
    shot("setup-model")
    window.setup_tabs.setCurrentWidget(window.data_panel)
    shot("setup-data")
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    store, estimate = window.store, window.estimate_panel
    store.update(training={"micro_batch_size": 64}, data={"max_length": 256})
    estimate.picker.select_custom(round(0.8 * estimate.estimate.peak_bytes / 1024**3, 2))
    shot("estimate-does-not-fit")
    estimate.fit_button.click()
    shot("estimate-fit-to-gpu")
    window.setup_tabs.setCurrentWidget(window.scale_panel)
    store.update(method="full", distributed={"num_processes": 2, "sharding": "zero2", "offload_optimizer": "cpu"})
    shot("setup-scale-out")
    store.update(method="lora", distributed={"num_processes": 1, "sharding": "none", "offload_optimizer": "none"})


def training_states(app, window, shot) -> tuple[Path, Path]:
    from studio.core.presets import demo_config
    from studio.gui.state.job_state import State

    combo = window.estimate_panel.picker.combo  # by the card's name: its title says its MiB and the display's share
    combo.setCurrentIndex(next(i for i in range(combo.count())
                               if getattr(combo.itemData(i), "name", "") == "GeForce RTX 4090"))
    window.store.set(demo_config().replace(training={"max_steps": 80, "micro_batch_size": 8},
                                           data={"eval_fraction": 0.05}, schedule={"log_every": 1, "eval_every": 20}))
    window.setup_tabs.setCurrentWidget(window.model_panel)
    window.start_action.trigger()
    started = time.monotonic()
    wait_until(app, lambda: time.monotonic() - started > 4, 30, "the worker to print something")
    shot("run-loading-model")
    controller = window.controller
    wait_until(app, lambda: controller.series.step_count >= 45, 900, "45 training steps")
    shot("run-training")
    wait_until(app, lambda: controller.job.state is State.FINISHED, 900, "the end of the run")
    shot("run-completed")
    first = controller.run_dir.path

    window.store.update(name="slower-lr", training={"learning_rate": 5e-4})
    window.start_action.trigger()
    wait_until(app, lambda: controller.series.step_count >= 30, 900, "the second run")
    window.stop_action.trigger()
    wait_until(app, lambda: controller.job.state is State.FINISHED, 300, "the stop")
    return first, controller.run_dir.path


def held_out_prompt() -> str:
    """A question from the demo's held-out rows: the base model fails it, the fine-tune should not."""
    from studio.core.presets import DEMO_HELDOUT, DEMO_TRAIN

    source = DEMO_HELDOUT if DEMO_HELDOUT.is_file() else DEMO_TRAIN
    row = json.loads(source.read_text(encoding="utf-8").splitlines()[0])
    return "\n\n".join(part for part in (row.get("instruction", ""), row.get("input", "")) if part)


def run_tabs(app, window, shot, first: Path, second: Path) -> None:
    window.run_tabs.setCurrentWidget(window.history)
    window.history.refresh_now()
    window.history.select(first, second)
    shot("history-compare")

    export = window.export_panel
    export.set_run(first)
    window.run_tabs.setCurrentWidget(export)
    export.export_button.click()
    wait_until(app, lambda: not export._process.running, 600, "the export")
    shot("export-verified")

    try_it = window.try_panel
    try_it.set_run(first)
    window.run_tabs.setCurrentWidget(try_it)
    try_it.prompt.setPlainText(held_out_prompt())
    try_it.generate_button.click()
    wait_until(app, lambda: not try_it._process.running, 600, "the generation")
    shot("try-it")


def failure_states(app, window, shot, scratch: Path) -> None:
    from studio.core.presets import DEMO_MODEL, demo_config
    from studio.gui.state.job_state import State

    broken = scratch / "model-without-weights"
    broken.mkdir()
    for source in DEMO_MODEL.iterdir():
        if source.suffix != ".safetensors":
            shutil.copy(source, broken / source.name)
    window.model_panel.use_model(str(broken))
    window.setup_tabs.setCurrentWidget(window.model_panel)
    shot("setup-model-cannot-load")  # Start is off, with the reason beside it

    # A run that does not fit: the worker behaves as on a GPU of 12 MiB (studio.train.measure.oom) and runs out.
    window.store.set(demo_config().replace(training={"max_steps": 20, "micro_batch_size": 8}))
    os.environ[SIMULATED_GPU_ENV] = "12MiB"
    window.run_tabs.setCurrentWidget(window.charts)
    window.start_action.trigger()
    wait_until(app, lambda: window.controller.job.state is State.FAILED, 300, "the failure")
    del os.environ[SIMULATED_GPU_ENV]
    shot("run-failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "screenshots")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        os.environ["STUDIO_CONFIG_DIR"] = str(scratch / "config")
        os.environ["STUDIO_RUNS_DIR"] = str(scratch / "runs")
        from studio.gui.app import create_app
        from studio.gui.main_window import MainWindow

        app = create_app([])
        window = MainWindow()
        window.ask_close_choice = lambda: "stop"
        window.resize(*SIZE)
        window.show()
        shot = Shooter(app, window, args.out)
        setup_states(app, window, shot)
        first, second = training_states(app, window, shot)
        run_tabs(app, window, shot, first, second)
        failure_states(app, window, shot, scratch)
        window.close()


if __name__ == "__main__":
    main()
