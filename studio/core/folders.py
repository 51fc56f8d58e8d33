"""Where studio keeps its files on this machine: the user's data folder (platformdirs), and the runs in it.

    <data folder>/runs/                     runs started without a run directory (``STUDIO_RUNS_DIR`` moves them,
                                            and then its parent is the data folder: tests keep everything apart)
    <data folder>/memory-calibration.jsonl  each run's predicted and measured peak (the worker appends)
    <data folder>/gpu-calibration.json      this machine's CUDA overheads as ``studio doctor`` measured them
    <data folder>/self-test/                ``studio doctor``'s reports
    <data folder>/trackers/                 the opt-in experiment trackers' local files (wandb's run files, MLflow's
                                            database without MLFLOW_TRACKING_URI): never in a run directory, which
                                            is copied and shared, while a tracker's debug files may name its login
"""

from __future__ import annotations

import os
from pathlib import Path


def data_folder() -> Path:
    """The user's data folder of studio, or the parent of ``STUDIO_RUNS_DIR`` when that moves the runs."""
    override = os.environ.get("STUDIO_RUNS_DIR")
    if override:
        return Path(override).parent
    import platformdirs  # here, not at the top: a process given its folders needs no platformdirs

    return platformdirs.user_data_path("finetune-studio")



def trackers_folder(tracker: str) -> Path:
    """Where the experiment tracker ``tracker`` (wandb, mlflow) keeps its local files."""
    return data_folder() / "trackers" / tracker
