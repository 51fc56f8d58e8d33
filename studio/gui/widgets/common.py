"""Small building blocks shared by the panels: explanations, banners, a config store, colors."""

from __future__ import annotations

import html
from typing import Any

from PySide6.QtCore import QEvent, QObject, QSize, Qt, Signal
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import (QAbstractSlider, QAbstractSpinBox, QApplication, QComboBox, QFrame, QGroupBox,
                               QHBoxLayout, QLabel, QPushButton, QScrollArea, QScrollBar, QSizePolicy, QStyleFactory,
                               QTabBar, QVBoxLayout, QWidget)

from studio.core.config import RunConfig
from studio.core.errors import Problem
from studio.core.validation import validate
from studio.gui.state.changes import in_window_words
from studio.gui.state.memory import with_refused_savers_off

# One palette for every panel: charts, bars and verdicts use the same meaning everywhere.
GOOD, WARN, BAD, MUTED = "#2e7d32", "#b26a00", "#c62828", "#6b7280"
ACCENT = "#1f6feb"
MASKED_BG, TRAINED_BG = "#eceff1", "#d7f5dd"

STYLE_SHEET = f"""
QGroupBox {{ font-weight: 600; border: 1px solid #d0d7de; border-radius: 6px; margin-top: 10px; padding: 8px 6px 6px 6px; }}
QGroupBox::title {{ subcontrol-origin: margin; left: 8px; padding: 0 4px; }}
QLabel[role="explain"] {{ color: {MUTED}; font-size: 11px; }}
QLabel[role="reason"] {{ color: {WARN}; font-size: 11px; }}
QLabel[role="heading"] {{ font-weight: 600; }}
QFrame[role="banner-error"] {{ background: #fdecea; border: 1px solid #f5c2c0; border-radius: 6px; }}
QFrame[role="banner-info"] {{ background: #eef4ff; border: 1px solid #c9dafc; border-radius: 6px; }}
QLabel[role="placeholder"] {{ color: {MUTED}; font-size: 13px; background: #fafbfc; border: 1px dashed #d0d7de; border-radius: 6px; }}
QToolBar QToolButton {{ padding: 4px 10px; }}
"""


def apply_app_style(app: QApplication) -> None:
    app.setStyle(QStyleFactory.create("Fusion"))
    palette = app.palette()
    palette.setColor(QPalette.ColorRole.Highlight, QColor(ACCENT))
    app.setPalette(palette)
    app.setStyleSheet(STYLE_SHEET)


class WheelNeedsFocus(QObject):
    """The wheel over a spin box, drop-down or slider scrolls the page unless the control has focus (a click or
    Tab gave it): scrolling a tab must not change each setting that passes under the cursor (issue 25). Nor does
    the wheel over a tab bar ever switch tabs: the page it would move away from holds what was being read.

    An application-wide event filter, so that it covers every such control, in dialogs and ones made later too.
    """

    @classmethod
    def install(cls, app: QApplication) -> None:
        if app.findChild(cls) is None:
            app.installEventFilter(cls(app))

    @staticmethod
    def is_value_control(widget) -> bool:
        return isinstance(widget, (QAbstractSpinBox, QComboBox, QAbstractSlider, QTabBar)) and \
            not isinstance(widget, QScrollBar)

    def eventFilter(self, watched, event) -> bool:
        if not self.is_value_control(watched):  # first: it sees every event of the app, and most are not theirs
            return False
        kind = event.type()
        if kind not in (QEvent.Type.Wheel, QEvent.Type.Polish):
            return False
        if kind == QEvent.Type.Polish and watched.focusPolicy() == Qt.FocusPolicy.WheelFocus:
            watched.setFocusPolicy(Qt.FocusPolicy.StrongFocus)  # else the wheel itself would give it focus
        if kind == QEvent.Type.Wheel and isinstance(watched, QTabBar):
            return True  # focus is no sign of intent here: a window opens with its first tab bar focused
        if kind == QEvent.Type.Wheel and not watched.hasFocus():
            event.ignore()  # an ignored wheel event goes on to the parents: the scroll area around scrolls
            return True
        return False


def explanation(text: str, role: str = "explain") -> QLabel:
    """A one-line (wrapping) grey explanation under a control."""
    label = QLabel(text)
    label.setProperty("role", role)
    label.setWordWrap(True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def set_role(widget: QWidget, role: str) -> None:
    """Change a styled role at runtime (Qt re-applies the style sheet only when asked)."""
    widget.setProperty("role", role)
    widget.style().unpolish(widget)
    widget.style().polish(widget)


def set_combo_item_enabled(combo: QComboBox, index: int, enabled: bool, reason: str = "") -> None:
    item = combo.model().item(index)
    item.setEnabled(enabled)
    item.setToolTip(reason)


def problems_html(title: str, problems: list[Problem], note: str = "") -> str:
    """A titled list of problems for a banner, each with where it is and what to do."""
    items = "".join(f"<li>{html.escape(str(p))}</li>" for p in problems)
    tail = f"{html.escape(note)}" if note else ""
    return f"<b>{html.escape(title)}:</b><ul style='margin:0'>{items}</ul>{tail}"


class Banner(QFrame):
    """A message box inside the window (an error with its hint, or a note) with optional buttons."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 10, 6)
        self.text = QLabel()
        self.text.setWordWrap(True)
        self.text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.text.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        layout.addWidget(self.text, 1)
        self.buttons = QHBoxLayout()
        layout.addLayout(self.buttons)
        self.hide()

    def show_message(self, html: str, error: bool = True) -> None:
        set_role(self, "banner-error" if error else "banner-info")
        self.text.setText(html)
        self.show()

    def add_button(self, text: str, slot) -> QPushButton:
        button = QPushButton(text)
        button.clicked.connect(slot)
        self.buttons.addWidget(button)
        return button


class ConfigStore(QObject):
    """The run config being edited; every panel reads it and writes changes through ``update``."""

    changed = Signal(object)
    switched_off = Signal(str)  # what a choice switched off that cannot run with it, and why, in the window's words

    def __init__(self, config: RunConfig, parent: QObject | None = None):
        super().__init__(parent)
        self._config = config
        self.labels: dict[str, str] = {}  # field path -> its control's label (each control adds its own)
        self._problems: list[Problem] | None = None
        self._combination_problems: set[Problem] | None = None  # without file checks, for blocked_reason

    @property
    def config(self) -> RunConfig:
        return self._config

    def update(self, **sections: Any) -> None:
        """``store.update(training={"micro_batch_size": 2})``: change fields, notify once. A memory saver the change
        rules out is switched off, and ``switched_off`` says so."""
        config, switched = with_refused_savers_off(self._config, self._config.replace(**sections))
        self.set(config)
        if switched:
            self.switched_off.emit(" ".join(f"{self.labels.get(field, field)} is off now: {self.words(reason)}."
                                            for field, reason in switched))

    def words(self, text: str) -> str:
        """A message written for the config file, with the labels on screen."""
        return in_window_words(text, self.labels)

    def set(self, config: RunConfig) -> None:
        if config != self._config:
            self._config, self._problems, self._combination_problems = config, None, None
            self.changed.emit(config)

    def problems(self) -> list[Problem]:
        if self._problems is None:
            self._problems = validate(self._config)
        return self._problems

    def blocked_reason(self, **sections: Any) -> str:
        """Why changing to ``sections`` would make the config invalid ("" when it would not).

        Only problems the change would add count: the user is told what this
        option conflicts with, not what else is wrong already (nor a memory saver
        the change switches off, as ``update`` does).
        """
        if self._combination_problems is None:
            self._combination_problems = set(validate(self._config, check_files=False))
        after, _ = with_refused_savers_off(self._config, self._config.replace(**sections))  # as update makes it
        new = [p for p in validate(after, check_files=False) if p not in self._combination_problems]
        if not new:
            return ""
        problem = new[0]
        return self.words(f"{problem.message} ({problem.hint})" if problem.hint else problem.message)


def group_box(title: str, *widgets: QWidget) -> QGroupBox:
    group = QGroupBox(title)
    layout = QVBoxLayout(group)
    layout.setSpacing(4)
    for widget in widgets:
        layout.addWidget(widget)
    return group


class VerticalScroll(QScrollArea):
    """A frameless area that scrolls up and down when the window is too short (a laptop screen), so that
    nothing is squeezed below the height its text needs; it is as wide as its content needs, never scrolled
    sideways."""

    def __init__(self, content: QWidget | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        if content is not None:
            self.setWidget(content)

    def _with_scroll_bar(self, size: QSize) -> QSize:
        return QSize(size.width() + self.verticalScrollBar().sizeHint().width(), size.height())

    def minimumSizeHint(self) -> QSize:
        inner = self.widget().minimumSizeHint() if self.widget() else QSize(0, 0)
        return QSize(self._with_scroll_bar(inner).width(), super().minimumSizeHint().height())

    def sizeHint(self) -> QSize:
        """The content's size. Not its height for the width it has: each area scrolls in a tab or a splitter that
        gives it its height, and wrapped text measured at every layout pass cost a third of the start-up."""
        content = self.widget()
        return super().sizeHint() if content is None else self._with_scroll_bar(content.sizeHint())

    def eventFilter(self, watched, event) -> bool:
        if watched is self.widget() and event.type() == QEvent.Type.LayoutRequest:
            self.updateGeometry()  # new text in the content: the column around it asks for the new height
        return super().eventFilter(watched, event)


class SettingsColumn(VerticalScroll):
    """A setup tab: groups of controls in a column that scrolls when the window is short.

    Subclasses add their groups to ``column``, then call ``finish`` with their refresh.
    """

    def __init__(self, store: ConfigStore, parent: QWidget | None = None):
        super().__init__(parent=parent)
        self.store = store
        content = QWidget()
        self.column = QVBoxLayout(content)
        self.column.setSpacing(6)
        self.setWidget(content)

    def finish(self, refresh) -> None:
        """End the column and keep it in step with the config (``refresh(config)``, now and on changes)."""
        self.column.addStretch(1)
        self.store.changed.connect(refresh)
        refresh(self.store.config)
