"""Shared helpers for tests that run the real worker."""

from pathlib import Path

from studio.core.events import read_events
from studio.core.presets import demo_config


def quick_config(data_file: Path, **sections):
    base = demo_config().replace(
        data={"train_files": (str(data_file),), "max_length": 48},
        training={"micro_batch_size": 8, "max_steps": 12, "learning_rate": 3e-3, "warmup_ratio": 0.0,
                  "lr_scheduler": "constant"},
        schedule={"log_every": 1, "save_every": 0},
    )
    return base.replace(**sections)


def losses(run_dir) -> list[float]:
    return [e["loss"] for e in read_events(run_dir.events) if e["type"] == "step"]
