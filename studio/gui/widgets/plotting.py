"""pyqtgraph, imported on first use.

Importing it and building plot widgets is about half of the app's start-up,
and no plot has anything to show before a run or a dataset preview has data:
the window appears first, the plots when they are needed.
"""

from __future__ import annotations

from types import ModuleType


def pg() -> ModuleType:
    import pyqtgraph

    return pyqtgraph


def plot_widget(y_label: str = "", x_label: str = ""):
    """A white PlotWidget with plain numbers on its axes ("0.59", not "590 (x0.001)")."""
    widget = pg().PlotWidget(background="w")
    item = widget.getPlotItem()
    for side, label in (("left", y_label), ("bottom", x_label)):
        if label:
            item.setLabel(side, label)
        item.getAxis(side).enableAutoSIPrefix(False)
    return widget
