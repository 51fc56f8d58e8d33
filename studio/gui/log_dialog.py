"""The full log of a run (train.log) and the worker's console output, one click from the window."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QUrl
from PySide6.QtGui import QDesktopServices, QFontDatabase
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QPlainTextEdit, QPushButton, QTabWidget, QVBoxLayout, QWidget

from studio.core.run.directory import RunDir
from studio.gui.state.console import CONSOLE_FILE

MAX_CHARS = 2_000_000  # the end of a huge log is what matters


def read_tail(path: Path) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, 2)
            size = file.tell()
            file.seek(max(0, size - MAX_CHARS))
            return file.read().decode("utf-8", errors="replace")
    except OSError:
        return f"({path.name} does not exist yet)"


class LogDialog(QDialog):
    def __init__(self, run_dir: Path, parent: QWidget | None = None):
        super().__init__(parent)
        rd = RunDir(run_dir)
        self.setWindowTitle(f"Log — {rd.path.name}")
        self.resize(900, 600)
        self.tabs = QTabWidget()
        for title, path in (("train.log", rd.log), ("Console output", rd.path / CONSOLE_FILE)):
            view = QPlainTextEdit(read_tail(path))
            view.setReadOnly(True)
            view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
            view.moveCursor(view.textCursor().MoveOperation.End)
            self.tabs.addTab(view, title)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        folder = QPushButton("Open run folder")
        folder.clicked.connect(lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(rd.path))))
        buttons.addButton(folder, QDialogButtonBox.ButtonRole.ActionRole)
        layout = QVBoxLayout(self)
        layout.addWidget(self.tabs)
        layout.addWidget(buttons)
