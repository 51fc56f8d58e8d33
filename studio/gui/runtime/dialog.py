"""The Training runtime dialog: what the runtime is, what it will be on this machine, and the button that
makes it so (Set up, Resume, Repair, Update, or Check again), with progress, size, time left and Cancel."""

from __future__ import annotations

import html
from dataclasses import replace
from pathlib import Path

from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFileDialog, QHBoxLayout, QLabel, QMainWindow,
                               QPlainTextEdit, QProgressBar, QPushButton, QVBoxLayout, QWidget)

from studio.core.runtime.environment import (TORCH_VERSION, Machine, RuntimePlan, State, detect_machine, find_uv,
                                             is_bundle, plan_for_this_machine, requirements_text, runtime_state)
from studio.gui.runtime.setup import RuntimeSetup
from studio.gui.widgets.common import Banner, explanation


def machine_words(machine: Machine, plan: RuntimePlan) -> str:
    """``This machine: Linux, NVIDIA GeForce RTX 4090 (driver for CUDA 12.9). PyTorch 2.13.0, CUDA 12.8 build.``"""
    if machine.gpus:
        driver = "%d.%d" % machine.cuda_driver if machine.cuda_driver else "?"
        hardware = f"{', '.join(machine.gpus)} (driver for CUDA {driver})"
    else:
        hardware = "no NVIDIA GPU" if machine.system != "Darwin" else "Apple silicon or Intel Mac"
    return f"This machine: {machine.system}, {hardware}. Training runtime: PyTorch {TORCH_VERSION}, {plan.build.label} build."


class RuntimeDialog(QDialog):
    def __init__(self, plan: RuntimePlan, uv: str | None, machine: Machine, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Training runtime")
        self.setMinimumWidth(620)
        self.plan, self.uv, self.machine = plan, uv, machine
        self.setup: RuntimeSetup | None = None

        self.state_label = QLabel()
        self.state_label.setWordWrap(True)
        self.state_label.setProperty("role", "heading")
        self.machine_label = explanation("")
        self.where_label = explanation("")
        self.step_label = QLabel()
        self.progress_bar = QProgressBar()
        self.progress_bar.setRange(0, 1000)
        self.detail_label = explanation("")
        self.result = Banner()
        self.log = QPlainTextEdit()
        self.log.setReadOnly(True)
        self.log.setMaximumBlockCount(2000)
        self.log.setPlaceholderText("What the installer prints appears here.")
        self.log.setMinimumHeight(90)
        self.log.setMaximumHeight(160)

        self.action_button = QPushButton()
        self.action_button.setDefault(True)
        self.action_button.clicked.connect(self.run_action)
        self.cancel_button = QPushButton("Cancel setup")
        self.cancel_button.clicked.connect(self.cancel)
        self.wheels_button = QPushButton("Use a folder of wheels…")
        self.wheels_button.setToolTip("Install without a network from wheels downloaded on another machine")
        self.wheels_button.clicked.connect(self.pick_wheels)
        self.save_button = QPushButton("Save requirements…")
        self.save_button.clicked.connect(self.save_requirements)
        close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        close.rejected.connect(self.reject)

        buttons = QHBoxLayout()
        for button in (self.action_button, self.cancel_button, self.wheels_button, self.save_button):
            buttons.addWidget(button)
        buttons.addStretch(1)
        buttons.addWidget(close)
        layout = QVBoxLayout(self)
        for widget in (self.state_label, self.machine_label, self.where_label, self.step_label, self.progress_bar,
                       self.detail_label, self.result, self.log):
            layout.addWidget(widget)
        layout.addLayout(buttons)
        self.refresh()

    # ------------------------------------------------------------ state
    def refresh(self) -> None:
        state = runtime_state(self.plan)
        busy = self.setup is not None and self.setup.running
        self.state_label.setText(html.escape(
            f"Setting up the training runtime (PyTorch {self.plan.build.label}, about "
            f"{self.plan.disk_bytes / 1e9:.1f} GB on disk)…" if busy else state.message))
        note = f" Note: {self.plan.build.note}." if self.plan.build.note else ""
        self.machine_label.setText(machine_words(self.machine, self.plan) + note)
        source = f" Installing from {self.plan.wheels}." if self.plan.wheels else ""
        used = "" if is_bundle() else (" This app runs from a Python installation and trains with that Python; "
                                       "the runtime is what the desktop download uses.")
        self.where_label.setText(f"Folder: {self.plan.root}.{source}{used}")
        self.action_button.setText(state.action or "Check again")
        self.action_button.setEnabled(not busy and self.uv is not None)
        if self.uv is None:
            self.result.show_message("The installer uv is missing: <code>pip install uv</code>.", error=True)
        self.cancel_button.setEnabled(busy)
        self.wheels_button.setEnabled(not busy)
        for widget in (self.step_label, self.progress_bar, self.detail_label):
            widget.setVisible(busy or bool(self.step_label.text()))

    def run_action(self) -> None:
        state = runtime_state(self.plan).state
        self.setup = RuntimeSetup(self.plan, self.uv, self.machine, self)
        self.setup.step_started.connect(self._on_step)
        self.setup.progress.connect(self._on_progress)
        self.setup.output.connect(self.log.appendPlainText)
        self.setup.done.connect(self._on_done)
        self.result.hide()
        self.progress_bar.setValue(0)
        if state is State.READY:
            self.setup.check()
        else:
            self.setup.start()
        self.refresh()

    def cancel(self) -> None:
        if self.setup is not None:
            self.setup.cancel()

    def pick_wheels(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Folder of wheels for the training runtime")
        if folder:
            self.plan = replace(self.plan, wheels=Path(folder))
            self.refresh()

    def save_requirements(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Save the runtime's requirements", "requirements.txt")
        if path:
            Path(path).write_text(requirements_text(self.plan), encoding="utf-8")

    # ------------------------------------------------------------ progress
    def _on_step(self, label: str) -> None:
        self.step_label.setText(label + "…")
        self.refresh()

    def _on_progress(self, text: str, fraction: float) -> None:
        self.detail_label.setText(text)
        self.progress_bar.setValue(int(fraction * 1000))

    def _on_done(self, ok: bool, message: str) -> None:
        self.step_label.setText("Done." if ok else "Stopped.")
        self.show_result(ok, message)

    def show_result(self, ok: bool, message: str) -> None:
        """The outcome of a setup or a check, each finding on its line with its fix."""
        self.result.show_message("<br>".join(html.escape(line) for line in message.splitlines()), error=not ok)
        self.refresh()
        self.adjustSize()  # room for every finding

    def reject(self) -> None:
        """Closing while a setup runs cancels it (a later start resumes it)."""
        if self.setup is not None and self.setup.running:
            self.setup.cancel()
            self.setup.wait(5000)
        super().reject()


def open_runtime_dialog(parent: QWidget | None = None) -> RuntimeDialog:
    """The dialog for this machine's runtime (the one already open, if any), shown without blocking the window."""
    dialog = parent.findChild(RuntimeDialog) if parent is not None else None
    if dialog is None:
        dialog = RuntimeDialog(plan_for_this_machine(), find_uv(), detect_machine(), parent)
    dialog.show()
    dialog.raise_()
    return dialog


def check_runtime_at_start(window: QMainWindow) -> None:
    """The bundle's first step: a runtime that is not ready opens the dialog (first start: Set up); a ready
    one is checked in the background and the result shown in the status bar, or in the dialog when not usable."""
    plan, machine = plan_for_this_machine(), detect_machine()
    if runtime_state(plan).state is not State.READY:
        open_runtime_dialog(window)
        return
    check = RuntimeSetup(plan, find_uv() or "", machine, window)

    def show(ok: bool, message: str) -> None:
        if ok and check.report is not None and not check.report.problems:
            window.statusBar().showMessage(check.report.summary, 30_000)
        else:
            open_runtime_dialog(window).show_result(ok, message)

    check.done.connect(show)
    check.check()
