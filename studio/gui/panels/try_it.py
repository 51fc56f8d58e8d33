"""Try it: one prompt, answered by the base model and by the fine-tuned one, side by side.

Generation runs in a subprocess through the command line,

    python -m studio generate RUN_DIR --prompt TEXT [--image FILE] --max-new-tokens N --json

which prints one JSON object ``{"base": ..., "tuned": ..., "checkpoint": ...}``;
a failure exits non-zero with ``error: ...`` and ``hint: ...`` on stderr.
"""

from __future__ import annotations

import html
import sys
import time
from functools import partial
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QPixmap
from PySide6.QtWidgets import (QFileDialog, QGroupBox, QHBoxLayout, QLabel, QPlainTextEdit, QProgressBar,
                               QPushButton, QSpinBox, QVBoxLayout, QWidget)

from studio.core.config import load_config
from studio.core.errors import StudioError
from studio.core.model.vision import is_vision_language
from studio.core.run.commands import generate_command, last_json_object
from studio.core.run.directory import RunDir
from studio.gui.process import LineProcess
from studio.gui.state.console import console_error
from studio.gui.state.memory import model_config_of
from studio.gui.widgets.common import BAD, MUTED, explanation


class TryPanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.run_dir: Path | None = None
        self.command = partial(generate_command, sys.executable)  # tests point this at a stand-in
        self.prompt = QPlainTextEdit()
        self.prompt.setPlaceholderText("Write a prompt, e.g. an instruction from your dataset…")
        self.prompt.setMaximumHeight(90)
        self.max_tokens = QSpinBox()
        self.max_tokens.setRange(1, 4096)
        self.max_tokens.setValue(64)
        self.image: Path | None = None  # the image the prompt asks about (a vision-language run's)
        self.image_button = QPushButton("Image…")
        self.image_button.setToolTip("An image the prompt asks about, for a run of a vision-language model")
        self.image_button.clicked.connect(self.choose_image)
        self.image_label = QLabel()
        self.thumbnail = QLabel()  # the chosen image, small, so the user sees which one the prompt asks about
        self.clear_image_button = QPushButton("No image")
        self.clear_image_button.clicked.connect(lambda: self.set_image(None))
        self.generate_button = QPushButton("Generate with both")
        self.generate_button.clicked.connect(self.generate)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.setMaximumWidth(120)
        self.progress.hide()
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.answers = {"base": self._answer_box(), "tuned": self._answer_box()}
        self.titles = {"base": QLabel("<b>Base model</b>"), "tuned": QLabel("<b>Fine-tuned</b>")}
        self._process = LineProcess(self)
        self._process.done.connect(self._on_done)
        self._started = 0.0
        self._asked: tuple | None = None  # (run, prompt, max tokens, image) of the generation running
        self._clock = QTimer(self)
        self._clock.timeout.connect(self._tick)
        self._build_layout()
        self.set_image(None)
        self.set_run(None)

    @staticmethod
    def _answer_box() -> QPlainTextEdit:
        box = QPlainTextEdit()
        box.setReadOnly(True)
        return box

    def _build_layout(self) -> None:
        group = QGroupBox("Try it")
        layout = QVBoxLayout(group)
        layout.addWidget(explanation("The same prompt goes through the chat template the run trained with; greedy "
                                     "decoding, so the difference is the fine-tuning."))
        layout.addWidget(self.prompt)
        row = QHBoxLayout()
        row.addWidget(QLabel("Max new tokens:"))
        row.addWidget(self.max_tokens)
        row.addWidget(self.image_button)
        row.addWidget(self.thumbnail)
        row.addWidget(self.image_label)
        row.addWidget(self.clear_image_button)
        row.addWidget(self.generate_button)
        row.addWidget(self.progress)
        row.addStretch(1)
        layout.addLayout(row)
        layout.addWidget(self.status)
        answers = QHBoxLayout()
        for key in ("base", "tuned"):
            column = QVBoxLayout()
            column.addWidget(self.titles[key])
            column.addWidget(self.answers[key], 1)
            answers.addLayout(column)
        layout.addLayout(answers, 1)
        outer = QVBoxLayout(self)
        outer.addWidget(group)

    def set_run(self, run_dir: Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        if self._process.running and self._asked[0] != self.run_dir:
            self._process.stop()  # answers of the run no longer shown: dropped when it ends
        name = self.run_dir.name if self.run_dir else "no run chosen"
        self.titles["tuned"].setText(f"<b>Fine-tuned</b> <span style='color:{MUTED}'>({html.escape(name)})</span>")
        reads_images = self.run_dir is None or run_reads_images(self.run_dir)
        self.image_button.setVisible(reads_images)
        if not reads_images:
            self.set_image(None)
        self._update_button()

    def choose_image(self) -> None:
        name, _ = QFileDialog.getOpenFileName(self, "An image for the prompt", "",
                                              "Images (*.png *.jpg *.jpeg *.webp *.bmp *.gif);;All files (*)")
        if name:
            self.set_image(Path(name))

    def set_image(self, image: Path | None) -> None:
        self.image = image
        self.image_label.setText(html.escape(image.name) if image else "")
        self.clear_image_button.setVisible(image is not None)
        picture = QPixmap(str(image)) if image else QPixmap()
        self.thumbnail.setPixmap(picture.scaled(48, 48, Qt.AspectRatioMode.KeepAspectRatio,
                                                Qt.TransformationMode.SmoothTransformation) if not picture.isNull()
                                 else QPixmap())
        self.thumbnail.setVisible(not picture.isNull())

    def _update_button(self) -> None:
        reason = "" if self.run_dir is not None else "Finish a run, or choose one in History, to try it."
        self.generate_button.setEnabled(not reason and not self._process.running)
        self.status.setText(f"<span style='color:{MUTED}'>{html.escape(reason)}</span>" if reason else "")

    def generate(self) -> None:
        prompt = self.prompt.toPlainText().strip()
        if not prompt or self.run_dir is None:
            self.status.setText("Write a prompt first." if not prompt else "")
            return
        for box in self.answers.values():
            box.setPlainText("")
        self._asked = self._request()
        self._process.start(self.command(self.run_dir, prompt, self.max_tokens.value(), self.image))
        self._started = time.monotonic()
        self.progress.show()
        self._clock.start(500)
        self._tick()
        self._update_button()

    def _request(self) -> tuple:
        return self.run_dir, self.prompt.toPlainText().strip(), self.max_tokens.value(), self.image

    def _tick(self) -> None:
        self.status.setText(f"Loading both models and generating… {time.monotonic() - self._started:.0f} s")

    def _show_answers(self, data: dict) -> None:
        for key in ("base", "tuned"):
            if key in data:
                self.answers[key].setPlainText(str(data[key]))
        if data.get("checkpoint"):
            self.titles["tuned"].setText(f"<b>Fine-tuned</b> <span style='color:{MUTED}'>({html.escape(self.run_dir.name)}, "
                                         f"{html.escape(str(data['checkpoint']))})</span>")

    def _on_done(self, exit_code: int, error: str) -> None:
        self._clock.stop()
        self.progress.hide()
        self._update_button()
        if self._asked != self._request():
            self.status.setText(f"<span style='color:{MUTED}'>Answers dropped: the run or the prompt changed while "
                                "they were generated. Press Generate again.</span>")
            return
        self._show_answers(last_json_object("\n".join(self._process.stdout_lines)) or {})
        if exit_code == 0 and not error:
            self.status.setText("")
            return
        found = console_error("\n".join(self._process.all_lines))
        message, hint = (found.message, found.hint) if found else (error or f"generation exited with code {exit_code}", "")
        self.status.setText(f"<span style='color:{BAD}'>Generation failed: {html.escape(message)}</span>"
                            + (f"<br>{html.escape(hint)}" if hint else ""))


def run_reads_images(run_dir: Path) -> bool:
    """Whether the run's model is a vision-language one (Try it then offers an image); True when its config or the
    model's files cannot be read offline, so that the choice is never hidden from a run that needs it."""
    try:
        return is_vision_language(model_config_of(load_config(RunDir(run_dir).config)))
    except (StudioError, OSError, ValueError):
        return True
