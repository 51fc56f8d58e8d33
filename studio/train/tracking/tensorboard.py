"""TensorBoard event files in ``RUN/tensorboard``: the run's figures (``figures``) as scalars, its samples as text.

``tensorboardX`` writes the files (no TensorFlow); without it the run trains and a warning says what to install.
Nothing in them is secret, so they live in the run directory, beside the events they are made from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from studio.core.config import RunConfig
from studio.core.run.directory import RunDir
from studio.train.tracking.figures import Tracker, sample_markdown


class TensorBoard(Tracker):
    name, label, package = "tensorboard", "TensorBoard", "tensorboardX"
    failure_hint = "check that the run directory can be written"

    def __init__(self, folder: Path, step: int = 0):
        super().__init__(step)
        self.folder = folder
        self.writer = self._new_writer()
        self.where = f'tensorboard --logdir "{folder}"'

    def record(self, event: dict[str, Any]) -> None:
        if event.get("type") == "run_started" and event.get("start_step"):
            self.resume_at(int(event["start_step"]))
        super().record(event)

    def resume_at(self, step: int) -> None:
        """A resumed run trains again after ``step``: TensorBoard is told to hide what the lost steps wrote."""
        self.writer.close()
        self.writer = self._new_writer(purge_step=step + 1)

    def _new_writer(self, purge_step: int | None = None):
        """A writer to a file of its own. tensorboardX names a file by the second it opens, so a run resumed (or
        evaluated) within that second would write over the last file; the count of files before it keeps the
        name new and sorts it after them, as TensorBoard reads them."""
        from tensorboardX import SummaryWriter

        earlier = len(list(self.folder.glob("events.out.tfevents.*"))) if self.folder.is_dir() else 0
        suffix = f".{earlier:04d}" + (f".resumed-at-{purge_step - 1}" if purge_step else "")
        return SummaryWriter(str(self.folder), flush_secs=10, purge_step=purge_step, filename_suffix=suffix)

    @classmethod
    def open(cls, rd: RunDir, config: RunConfig, step: int = 0) -> TensorBoard:
        return cls(rd.tensorboard_dir, step)

    @classmethod
    def install_hint(cls) -> str:
        return "pip install tensorboardX, or set schedule.tensorboard to false"

    def write_scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def write_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        for number, sample in enumerate(samples, 1):
            self.writer.add_text(f"samples/{number}", sample_markdown(sample), step)

    def finished(self, status: str) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
