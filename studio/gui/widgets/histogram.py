"""The token-length histogram of the data tab, with the max-length cut as a dashed line."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QStackedLayout, QWidget

from studio.gui.widgets.common import BAD
from studio.gui.widgets.plotting import pg, plot_widget

if TYPE_CHECKING:
    import numpy as np


class LengthHistogram(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMinimumHeight(110)
        self.placeholder = QLabel("Reading the data…")
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setProperty("role", "placeholder")
        self.stack = QStackedLayout(self)
        self.stack.addWidget(self.placeholder)
        self.plot = None  # built with the first lengths
        self.bars = None
        self.cut_line = None

    def _ensure_plot(self) -> None:
        if self.plot is not None:
            return
        self.plot = plot_widget("rows")
        self.plot.setMouseEnabled(x=False, y=False)
        self.cut_line = pg().InfiniteLine(angle=90, pen=pg().mkPen(BAD, width=2, style=Qt.PenStyle.DashLine),
                                          label="max length", labelOpts={"position": 0.9, "color": BAD})
        self.stack.addWidget(self.plot)

    def show_message(self, text: str) -> None:
        self.placeholder.setText(text)
        self.stack.setCurrentWidget(self.placeholder)

    def show_lengths(self, lengths: np.ndarray, unit: str, title: str) -> None:
        self._ensure_plot()
        if self.bars is not None:
            self.plot.removeItem(self.bars)
            self.bars = None
        if len(lengths):
            import numpy as np  # with the first lengths, as pyqtgraph is

            edges = np.histogram_bin_edges(lengths, bins=min(40, max(5, len(np.unique(lengths)))))
            counts, edges = np.histogram(lengths, bins=edges)
            self.bars = pg().BarGraphItem(x0=edges[:-1], x1=edges[1:], height=counts, brush="#4e79a7", pen="w")
            self.plot.addItem(self.bars)
        self.plot.setLabel("bottom", f"{unit} per example")
        self.plot.setTitle(title, size="9pt")
        self.stack.setCurrentWidget(self.plot)

    def set_cut(self, max_length: int | None) -> None:
        """The max-length line; None removes it (lengths in characters cannot be compared with it)."""
        if self.cut_line is None:
            return
        if max_length is None:
            if self.cut_line.scene() is not None:
                self.plot.removeItem(self.cut_line)
            return
        if self.cut_line.scene() is None:
            self.plot.addItem(self.cut_line)
        self.cut_line.setValue(max_length)
        self.cut_line.label.setFormat(f"max length {max_length}")
