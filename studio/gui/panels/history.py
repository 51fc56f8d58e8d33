"""Past runs: a list with status and key numbers; selecting one rebuilds its charts from events.jsonl,
selecting two overlays them."""

from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QUrl, Qt, Signal
from PySide6.QtGui import QColor, QDesktopServices
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QHeaderView, QPushButton, QSplitter, QTreeWidget,
                               QTreeWidgetItem, QVBoxLayout, QWidget)

from studio.core.run.directory import RunDir
from studio.core.run.events import read_events
from studio.gui.state.run_history import RunRecord, scan_runs
from studio.gui.state.series import RunSeries
from studio.gui.tasks import BackgroundTask
from studio.gui.widgets.charts import ChartsPanel, run_letter
from studio.gui.widgets.common import ACCENT, BAD, GOOD, MUTED, WARN, explanation

COLUMNS = ("Run", "Started", "Status", "Steps", "Loss", "Eval loss", "Model", "Method")
NO_SELECTION = "Select a run in the list above to see its charts; select two to compare them."
STATUS_COLORS = {"completed": GOOD, "running": ACCENT, "starting": ACCENT, "stopped": WARN, "aborted": WARN,
                 "failed": BAD, "crashed": BAD, "not started": MUTED}


class HistoryPanel(QWidget):
    resume_requested = Signal(object)  # Path
    export_requested = Signal(object)  # Path

    def __init__(self, runs_root: Path, parent: QWidget | None = None):
        super().__init__(parent)
        self.runs_root = runs_root
        self.records: list[RunRecord] = []
        self.table = QTreeWidget()
        self.table.setHeaderLabels(COLUMNS)
        self.table.setRootIsDecorated(False)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.itemSelectionChanged.connect(self._show_selected)
        self.table.header().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.header().setStretchLastSection(True)
        self.charts = ChartsPanel(no_run_text=NO_SELECTION)
        self.hint = explanation("")
        self.buttons: dict[str, QPushButton] = {}
        self._scan = BackgroundTask(self)
        self._scan.result.connect(self._fill)
        self._build_layout()
        self.hint.setText(f"Reading the runs under {runs_root}…")  # the scan starts after the first frame
        self.refresh()

    def _build_layout(self) -> None:
        row = QHBoxLayout()
        for name, slot in (("Refresh", self.refresh), ("Resume", self._resume), ("Export…", self._export),
                           ("Open folder", self._open_folder)):
            button = QPushButton(name)
            button.clicked.connect(slot)
            row.addWidget(button)
            self.buttons[name] = button
        row.addWidget(self.hint, 1)
        top = QWidget()
        top_layout = QVBoxLayout(top)
        top_layout.setContentsMargins(0, 0, 0, 0)
        top_layout.addLayout(row)
        top_layout.addWidget(self.table)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(top)
        splitter.addWidget(self.charts)
        splitter.setSizes([170, 480])
        layout = QVBoxLayout(self)
        layout.addWidget(splitter)
        self._update_buttons()

    def refresh(self) -> None:
        root = self.runs_root
        self._scan.submit(lambda: scan_runs(root))

    def refresh_now(self) -> None:
        self._fill(scan_runs(self.runs_root))

    def _fill(self, records: list[RunRecord]) -> None:
        selected = {r.path for r in self.selected_records()}
        self.records = records
        self.table.blockSignals(True)
        self.table.clear()
        for record in records:
            item = QTreeWidgetItem([
                record.name, time.strftime("%Y-%m-%d %H:%M", time.localtime(record.started)), record.status,
                f"{record.last_step}/{record.total_steps}" if record.total_steps else str(record.last_step),
                _number(record.last_loss), _number(record.eval_loss), record.model, record.method,
            ])
            item.setForeground(2, QColor(STATUS_COLORS.get(record.status, MUTED)))
            item.setData(0, Qt.ItemDataRole.UserRole, str(record.path))
            if record.error:
                item.setToolTip(2, record.error)
            self.table.addTopLevelItem(item)
            item.setSelected(record.path in selected)
        self.table.blockSignals(False)
        self._show_selected()

    def selected_records(self) -> list[RunRecord]:
        paths = {item.data(0, Qt.ItemDataRole.UserRole) for item in self.table.selectedItems()}
        return [r for r in self.records if str(r.path) in paths]

    def select(self, *paths: Path) -> None:
        wanted = {str(p) for p in paths}
        for index in range(self.table.topLevelItemCount()):
            item = self.table.topLevelItem(index)
            item.setSelected(item.data(0, Qt.ItemDataRole.UserRole) in wanted)

    def _show_selected(self) -> None:
        records = self.selected_records()[:2]
        self.charts.show_runs([RunSeries.from_events(read_events(RunDir(r.path).events), r.name) for r in records])
        self._update_buttons()
        self._update_hint(records)

    def _update_hint(self, shown: list[RunRecord]) -> None:
        if not self.records:
            self.hint.setText(f"No runs yet under {self.runs_root}.")
        elif len(shown) == 2:
            self.hint.setText("Comparing " + ", ".join(f"<b>{run_letter(i)}</b> = {r.name}" for i, r in enumerate(shown)))
        else:
            self.hint.setText("Select a run to see its charts; select two (Ctrl+click) to compare them.")

    def _update_buttons(self) -> None:
        records = self.selected_records()
        one = records[0] if len(records) == 1 else None
        self.buttons["Resume"].setEnabled(bool(one and one.resumable))
        self.buttons["Resume"].setToolTip("" if one and one.resumable else
                                          "Select one stopped, cancelled, failed or crashed run that has a checkpoint")
        self.buttons["Export…"].setEnabled(bool(one and one.has_checkpoint))
        self.buttons["Open folder"].setEnabled(one is not None)

    def _resume(self) -> None:
        records = self.selected_records()
        if len(records) == 1:
            self.resume_requested.emit(records[0].path)

    def _export(self) -> None:
        records = self.selected_records()
        if len(records) == 1:
            self.export_requested.emit(records[0].path)

    def _open_folder(self) -> None:
        records = self.selected_records()
        if records:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(records[0].path)))


def _number(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"

