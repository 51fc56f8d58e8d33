"""Controls bound to one field of the run config: they show its value, write changes, explain it,
and disable the choices that core validation rejects, saying why."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QComboBox, QDoubleSpinBox, QHBoxLayout, QLabel,
                               QLineEdit, QRadioButton, QSpinBox, QVBoxLayout, QWidget)

from studio.core.choices import CHOICE_WORDS
from studio.core.config import RunConfig, choice_values
from studio.gui.widgets.common import ConfigStore, explanation, set_combo_item_enabled


def read_field(config: RunConfig, path: str) -> Any:
    value: Any = config
    for part in path.split("."):
        value = getattr(value, part)
    return value


def changes_for(path: str, value: Any) -> dict[str, Any]:
    """``training.precision`` -> ``{"training": {"precision": value}}`` for ConfigStore.update."""
    section, _, name = path.rpartition(".")
    return {section: {name: value}} if section else {name: value}


@dataclass(frozen=True)
class Option:
    value: Any
    label: str
    explain: str  # what it saves and what it costs


def options_for(path: str, words: Mapping[Any, tuple[str, str]]) -> list[Option]:
    """The options of the choice field ``path`` in the schema's order, worded by ``words`` (value -> label and
    explanation: studio.core.choices).

    Raises when the words and the schema's values differ, so a choice added to the
    schema without words (or words left for a removed one) fails when the panel is built.
    """
    values = choice_values(path)
    if set(words) != set(values):
        raise ValueError(f"{path}: the GUI words cover {sorted(words)}, the schema allows {list(values)}")
    return [Option(value, *words[value]) for value in values]


class BoundControl(QWidget):
    """Base: a control for ``path`` with an explanation line and a reason line for blocked choices."""

    label = ""  # the field's name as the window shows it (what messages about the field call it)
    names_field = True  # False for a second control of a field shown otherwise: the first one names it

    def __init__(self, store: ConfigStore, path: str, explain: str = "", compact: bool = False,
                 parent: QWidget | None = None):
        super().__init__(parent)
        self.store, self.path, self.compact = store, path, compact
        self.column = QVBoxLayout(self)
        self.column.setContentsMargins(0, 0, 0, 2)
        self.column.setSpacing(2)
        self.explain = explanation("")
        self.reason = explanation("", role="reason")
        self.reason.hide()
        self.self_test_mark = explanation("", role="reason")  # a technique of this field failed the GPU self-test
        self.self_test_mark.hide()
        self.set_explanation(explain)
        store.changed.connect(self.refresh)

    def finish_layout(self) -> None:
        if self.label and self.names_field:
            self.store.labels[self.path] = self.label
        if not self.compact:
            self.column.addWidget(self.explain)
        self.column.addWidget(self.reason)
        self.column.addWidget(self.self_test_mark)
        self.refresh(self.store.config)

    def set_explanation(self, text: str) -> None:
        """Shown under the control, or (compact) as its tooltip where space is short."""
        self.explain.setText(text)
        if self.compact:
            self.setToolTip(text)

    def write(self, value: Any) -> None:
        if self.value_of(self.store.config) != value:
            self.store.update(**self.changes_of(value))

    def value_of(self, config: RunConfig) -> Any:
        """What the control shows of ``config``: its field's value (a control showing the field otherwise
        overrides it)."""
        return read_field(config, self.path)

    def changes_of(self, value: Any) -> dict[str, Any]:
        """What setting the field to ``value`` writes (``ConfigStore.update``'s sections)."""
        return changes_for(self.path, value)

    def show_reason(self, text: str) -> None:
        self.reason.setText(text)
        self.reason.setVisible(bool(text))

    def mark_self_test(self, text: str) -> None:
        """What the GPU self-test found wrong with this field's technique (kept across edits); "" clears it."""
        self.self_test_mark.setText(text)
        self.self_test_mark.setVisible(bool(text))

    def refresh(self, config: RunConfig) -> None:  # pragma: no cover - overridden
        raise NotImplementedError


def labelled_row(label: str, widget: QWidget, width: int = 220, compact: bool = False) -> QHBoxLayout:
    """Label, then the control at a fixed width (full-width spin boxes read badly)."""
    row = QHBoxLayout()
    name = QLabel(label)
    name.setMinimumWidth(0 if compact else 150)
    row.addWidget(name)
    widget.setFixedWidth(width)
    row.addWidget(widget)
    row.addStretch(1)
    return row


class ChoiceControl(BoundControl):
    """A combo box of the field's choices; options that validation rejects are disabled with their reason."""

    def __init__(self, store: ConfigStore, path: str, label: str, extra_rule: Callable[[Any], str] | None = None,
                 compact: bool = False, changes: Callable[[Any], dict[str, Any]] | None = None):
        super().__init__(store, path, compact=compact)
        self.label = label
        self.options = options_for(path, CHOICE_WORDS[path])
        self.extra_rule = extra_rule  # reasons core validation cannot know (e.g. what the tokenizer has)
        self.changes = changes  # what choosing a value writes beside it, when more than the field
        self.combo = QComboBox()
        for option in self.options:
            self.combo.addItem(option.label)
        self.combo.currentIndexChanged.connect(lambda index: self.write(self.options[index].value))
        self.column.addLayout(labelled_row(label, self.combo, 160 if compact else 220, compact))
        self.finish_layout()

    def refresh(self, config: RunConfig) -> None:
        value = read_field(config, self.path)
        index = next((i for i, o in enumerate(self.options) if o.value == value), 0)
        self.combo.blockSignals(True)
        self.combo.setCurrentIndex(index)
        self.combo.blockSignals(False)
        self.set_explanation(self.options[index].explain)
        blocked: dict[str, list[str]] = {}  # reason -> the options it blocks, said once
        for i, option in enumerate(self.options):
            reason = "" if i == index else self._reason(option.value)
            set_combo_item_enabled(self.combo, i, not reason, reason)
            if reason:
                blocked.setdefault(reason, []).append(option.label)
        self.show_reason(unavailable_words(blocked))

    def changes_of(self, value: Any) -> dict[str, Any]:
        return self.changes(value) if self.changes else super().changes_of(value)

    def _reason(self, value: Any) -> str:
        return (self.extra_rule(value) if self.extra_rule else "") or \
            self.store.blocked_reason(**self.changes_of(value))


def unavailable_words(blocked: dict[str, list[str]]) -> str:
    """What a drop-down says under it of the choices it has disabled: their one reason, or, with several, their
    names alone (each item's tooltip in the list says its own reason: a paragraph of them read as noise)."""
    if len(blocked) == 1:
        ((reason, labels),) = blocked.items()
        return f"Not available now — {', '.join(labels)}: {reason}"
    if blocked:
        labels = [label for names in blocked.values() for label in names]
        return f"Not available now: {', '.join(labels)} (point at one in the list for why)"
    return ""


class RadioChoice(BoundControl):
    """Radio buttons, each with its own explanation visible at all times (for the method)."""

    def __init__(self, store: ConfigStore, path: str, options: list[Option], label: str = ""):
        super().__init__(store, path)
        self.label = label
        self.options = options
        self.group = QButtonGroup(self)
        self.buttons: list[QRadioButton] = []
        self.reasons: list[QLabel] = []
        for index, option in enumerate(options):
            button = QRadioButton(option.label)
            self.group.addButton(button, index)
            self.buttons.append(button)
            self.column.addWidget(button)
            line = explanation(option.explain)
            line.setContentsMargins(22, 0, 0, 0)
            self.column.addWidget(line)
            reason = explanation("", role="reason")
            reason.setContentsMargins(22, 0, 0, 0)
            reason.hide()
            self.reasons.append(reason)
            self.column.addWidget(reason)
        self.group.idClicked.connect(lambda index: self.write(self.options[index].value))
        self.explain.hide()
        self.finish_layout()

    def refresh(self, config: RunConfig) -> None:
        value = read_field(config, self.path)
        for index, (option, button) in enumerate(zip(self.options, self.buttons)):
            button.blockSignals(True)
            button.setChecked(option.value == value)
            button.blockSignals(False)
            reason = "" if option.value == value else self.store.blocked_reason(**changes_for(self.path, option.value))
            button.setEnabled(not reason)
            button.setToolTip(reason)
            self.reasons[index].setText(f"Not available: {reason}" if reason else "")
            self.reasons[index].setVisible(bool(reason))


class ToggleControl(BoundControl):
    def __init__(self, store: ConfigStore, path: str, label: str, explain: str, compact: bool = False):
        super().__init__(store, path, explain, compact)
        self.label = label
        self.check = QCheckBox(label)
        self.check.toggled.connect(self.write)
        self.column.addWidget(self.check)
        self.finish_layout()

    def refresh(self, config: RunConfig) -> None:
        self.check.blockSignals(True)
        self.check.setChecked(bool(read_field(config, self.path)))
        self.check.blockSignals(False)


class NumberControl(BoundControl):
    """A spin box for an int or float field; writes when editing finishes or the arrows are used."""

    def __init__(self, store: ConfigStore, path: str, label: str, explain: str, minimum: float, maximum: float,
                 decimals: int = 0, step: float = 1, suffix: str = "", special_zero: str = "", compact: bool = False):
        super().__init__(store, path, explain, compact)
        self.label = label
        self.is_float = decimals > 0
        self.spin = QDoubleSpinBox() if self.is_float else QSpinBox()
        if self.is_float:
            self.spin.setDecimals(decimals)
        self.spin.setRange(minimum, maximum)
        self.spin.setSingleStep(step)
        self.spin.setSuffix(suffix)
        self.spin.setKeyboardTracking(False)  # one update per finished number, not per keystroke
        if special_zero:
            self.spin.setSpecialValueText(special_zero)
        self.spin.valueChanged.connect(lambda value: self.write(float(value) if self.is_float else int(value)))
        self.column.addLayout(labelled_row(label, self.spin, 80 if compact else 140, compact))
        self.finish_layout()

    def refresh(self, config: RunConfig) -> None:
        self.spin.blockSignals(True)
        self.spin.setValue(self.value_of(config))
        self.spin.blockSignals(False)


class ScientificControl(BoundControl):
    """A float typed as text (2e-4): spin boxes cannot show learning rates well."""

    def __init__(self, store: ConfigStore, path: str, label: str, explain: str):
        super().__init__(store, path, explain)
        self.label = label
        self.edit = QLineEdit()
        self.edit.setAlignment(Qt.AlignmentFlag.AlignRight)
        self.edit.editingFinished.connect(self._commit)
        self.column.addLayout(labelled_row(label, self.edit, 140))
        self.finish_layout()

    def _commit(self) -> None:
        try:
            value = float(self.edit.text())
        except ValueError:
            self.show_reason(f"'{self.edit.text()}' is not a number; write it like 2e-4 or 0.0002")
            return
        self.show_reason("")
        self.write(value)

    def refresh(self, config: RunConfig) -> None:
        if not self.edit.hasFocus():
            self.edit.setText(f"{read_field(config, self.path):g}")
