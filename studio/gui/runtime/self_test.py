"""Runtime ▸ GPU self-test…: ``studio doctor`` in a subprocess, its progress, and what it found per technique,
with the fix of each that failed and the report's file."""

from __future__ import annotations

import html
import sys
from functools import partial
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Signal
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QHBoxLayout, QLabel, QProgressBar, QPushButton, QVBoxLayout,
                               QWidget)

from studio.core.run.commands import last_json_object, self_test_command
from studio.core.runtime.self_test import STEPS, SelfTestReport, default_report_path
from studio.gui.process import LineProcess
from studio.gui.state.console import console_error
from studio.gui.widgets.common import Banner, explanation

PROGRESS = "doctor: "  # the lines of studio doctor's stderr that say how far it has come
MARKS = {"passed": "✓", "failed": "✗"}  # anything else (skipped): –


def result_lines_html(report: SelfTestReport) -> str:
    """One line per technique: its mark and label, what happened, and the fix of one that failed."""
    lines = []
    for result in report.results:
        mark = MARKS.get(result.status, "–")
        fix = f"<br>&nbsp;&nbsp;&nbsp;&nbsp;<i>Fix:</i> {html.escape(result.fix)}." if result.fix else ""
        lines.append(f"{mark} <b>{html.escape(result.label)}</b>: {html.escape(result.words)}{fix}")
    return "<br>".join(lines)


class SelfTestDialog(QDialog):
    """``report_ready(report)`` once a self-test has finished and written its report."""

    report_ready = Signal(object)

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("GPU self-test")
        self.setMinimumWidth(640)
        self.command = partial(self_test_command, sys.executable)  # (report path) -> argv; tests narrow it
        self.report_path: Path | None = None
        self.process = LineProcess(self)
        self.process.line.connect(self._on_line)
        self.process.done.connect(self._on_done)

        heading = QLabel("Check every technique on this machine's GPU")
        heading.setProperty("role", "heading")
        about = explanation(
            f"Each technique (LoRA in fp32, bf16 and fp16, QLoRA, 8-bit AdamW, the memory savers, torch.compile) "
            f"trains {STEPS} steps of a small model on the GPU and again on the CPU, and their losses must match. "
            "It also measures what CUDA itself takes (its context, the libraries, the allocator's margin) and keeps "
            "it as this machine's calibration, which the memory estimate then uses. About a minute with a GPU; "
            "without one the checks run on the CPU. The report is a file to attach to a bug report.")
        self.step_label = QLabel()
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)  # no fraction to show: it moves while the test runs
        self.summary = Banner()
        self.results = QLabel()
        self.results.setWordWrap(True)
        self.results.setTextFormat(Qt.TextFormat.RichText)
        self.where = explanation("")
        self.start_button = QPushButton("Start")
        self.start_button.setDefault(True)
        self.start_button.clicked.connect(self.start)
        self.open_button = QPushButton("Open report")
        self.open_button.clicked.connect(self.open_report)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)

        buttons = QHBoxLayout()
        buttons.addWidget(self.start_button)
        buttons.addWidget(self.open_button)
        buttons.addStretch(1)
        buttons.addWidget(close)
        layout = QVBoxLayout(self)
        for widget in (heading, about, self.step_label, self.busy, self.summary, self.results, self.where):
            layout.addWidget(widget)
        layout.addLayout(buttons)
        self._show_idle()

    @property
    def running(self) -> bool:
        return self.process.running

    def start(self) -> None:
        self.report_path = default_report_path()
        self.summary.hide()
        self.results.clear()
        self.where.clear()
        self.step_label.setText("Starting the self-test…")
        self.process.start(self.command(self.report_path))
        self._show_idle()

    def show_report(self, report: SelfTestReport, path: Path | None) -> None:
        """The summary (an error banner when a technique failed), each technique's line, and the file."""
        notes = "".join(f"<br>{html.escape(note)}" for note in report.notes)
        self.summary.show_message(f"<b>{html.escape(report.summary)}</b>{notes}", error=bool(report.failed))
        calibration = "<br>".join(html.escape(line) for line in report.calibration_lines())
        self.results.setText(f"{result_lines_html(report)}<br><br>{calibration}")
        self.report_path = path
        self.where.setText(f"Report: {path} (and its JSON beside it)." if path else "")
        self._show_idle()
        self.adjustSize()

    def open_report(self) -> None:
        if self.report_path is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.report_path)))

    def reject(self) -> None:
        """Closing while the test runs stops it (its report is then not written)."""
        self.process.stop()
        super().reject()

    # ------------------------------------------------------------ the process
    def _show_idle(self) -> None:
        running = self.running
        self.busy.setVisible(running)
        self.step_label.setVisible(running)
        self.start_button.setEnabled(not running)
        self.start_button.setText("Run again" if self.results.text() else "Start")
        self.open_button.setEnabled(not running and self.report_path is not None and self.report_path.is_file())

    def _on_line(self, stream: str, text: str) -> None:
        if stream == "err" and text.startswith(PROGRESS):
            self.step_label.setText(text[len(PROGRESS):])

    def _on_done(self, _exit_code: int, error: str) -> None:
        found = last_json_object("\n".join(self.process.stdout_lines))
        if found is None:
            printed = console_error("\n".join(self.process.all_lines))
            why = error or (f"{printed.message} ({printed.hint})" if printed else "it printed no report")
            self.summary.show_message(html.escape(f"The self-test stopped: {why}."), error=True)
            self.report_path = None
            self._show_idle()
            return
        report = SelfTestReport.from_json(found)
        self.show_report(report, self.report_path)
        self.report_ready.emit(report)

