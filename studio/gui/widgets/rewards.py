"""GRPO's rewards, in the Techniques tab's GRPO section: the built-in rewards a user picks and weighs, each with
the settings that reward reads (``grpo.rewards``), and a reward file of the user's own, run only once trusted.

The window never runs the file: only the worker calls it (studio.core.rewards).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QCheckBox, QComboBox, QDoubleSpinBox, QFileDialog, QFrame, QGridLayout, QHBoxLayout,
                               QLabel, QLineEdit, QPushButton, QSpinBox, QVBoxLayout, QWidget)

from studio.core.choices import CHOICE_WORDS
from studio.core.config import RewardConfig, RunConfig
from studio.gui.widgets.common import ConfigStore, explanation
from studio.gui.widgets.controls import BoundControl, NumberControl, ToggleControl, labelled_row, options_for

NEW_REWARD = RewardConfig(name="matches_format", pattern=".+")  # what Add starts from: a format to edit
REWARD_FILE_SIGNATURE = ("A Python file of your own defining def reward(completion, prompt, row), returning a number "
                         "(or None: no reward), called once per completion; an error in it skips that row, names the "
                         "line, and ends nothing else.")
TRUST_WORDS = ("The worker runs the file's code, as trust_remote_code runs a model's: it can do anything your user "
               "account can. Read the file first.")


class RewardsEditor(BoundControl):
    """``grpo.rewards``: a row per built-in reward (what it checks, its weight, its settings) and Add a reward."""

    label = "Rewards"

    def __init__(self, store: ConfigStore):
        super().__init__(store, "grpo.rewards", "A completion's reward is the weighted sum of these (and of the "
                         "reward file's, below); GRPO makes the completions that beat their group's mean likelier.")
        self.column.addWidget(QLabel("<b>Rewards</b>"))
        self.rows_column = QVBoxLayout()
        self.rows_column.setSpacing(4)
        self.column.addLayout(self.rows_column)
        self.rows: list[RewardRow] = []
        self.add_button = QPushButton("Add a reward")
        self.add_button.clicked.connect(lambda: self.write((*self.store.config.grpo.rewards, NEW_REWARD)))
        add_row = QHBoxLayout()
        add_row.addWidget(self.add_button)
        add_row.addStretch(1)
        self.column.addLayout(add_row)
        self.finish_layout()

    def write(self, value) -> None:
        if self.store.config.grpo.rewards != value:
            self.store.update(grpo={"rewards": tuple(value)})

    def change_reward(self, index: int, reward: RewardConfig) -> None:
        rewards = list(self.store.config.grpo.rewards)
        rewards[index] = reward
        self.write(rewards)

    def remove_reward(self, index: int) -> None:
        rewards = self.store.config.grpo.rewards
        self.write(rewards[:index] + rewards[index + 1:])

    def refresh(self, config: RunConfig) -> None:
        rewards = config.grpo.rewards
        while len(self.rows) < len(rewards):
            row = RewardRow(self, len(self.rows))
            self.rows.append(row)
            self.rows_column.addWidget(row)
        while len(self.rows) > len(rewards):
            row = self.rows.pop()
            self.rows_column.removeWidget(row)
            row.deleteLater()
        problems = self.store.problems()
        for index, (row, reward) in enumerate(zip(self.rows, rewards)):
            where = f"grpo.rewards[{index}]"
            row.set_reward(reward, [p.message for p in problems  # the hints name fields: the row's are in sight
                                    if p.where == where or p.where.startswith(f"{where}.")])
        self.show_reason("No reward scores the completions: add one, or choose a reward file below."
                         if not rewards and not config.grpo.reward_file else "")


class RewardRow(QFrame):
    """One built-in reward: what it checks and its weight on the first line, the settings that reward reads under
    them (the others hidden: validation refuses a setting its reward does not read), what is wrong in red."""

    def __init__(self, editor: RewardsEditor, index: int):
        super().__init__()
        self.editor, self.index = editor, index
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.reward = RewardConfig()
        self.names = options_for("grpo.rewards.name", CHOICE_WORDS["grpo.rewards.name"])
        self.units = options_for("grpo.rewards.unit", CHOICE_WORDS["grpo.rewards.unit"])
        self.name = QComboBox()
        for option in self.names:
            self.name.addItem(option.label)
        self.name.currentIndexChanged.connect(self._on_name)
        self.weight = _float_box(-100.0, 100.0, 0.1)
        self.weight.valueChanged.connect(lambda value: self._change(weight=float(value)))
        self.remove = QPushButton("Remove")
        self.remove.clicked.connect(lambda: self.editor.remove_reward(self.index))
        self.pattern, self.text = QLineEdit(), QLineEdit()
        self.pattern.setPlaceholderText(r"a regular expression the whole completion matches, e.g. .*\\boxed\{.+\}.*")
        self.text.setPlaceholderText("the text the completion must contain")
        self.pattern.editingFinished.connect(lambda: self._change(pattern=self.pattern.text()))
        self.text.editingFinished.connect(lambda: self._change(text=self.text.text()))
        self.min_length, self.max_length = _int_box(), _int_box()
        self.min_length.valueChanged.connect(lambda value: self._change(min_length=int(value)))
        self.max_length.valueChanged.connect(lambda value: self._change(max_length=int(value)))
        self.unit = QComboBox()
        for option in self.units:
            self.unit.addItem(option.label)
        self.unit.currentIndexChanged.connect(lambda i: self._change(unit=self.units[i].value))
        self.case_sensitive = QCheckBox("Case must match")
        self.case_sensitive.toggled.connect(lambda checked: self._change(case_sensitive=checked))
        self.explain = explanation("")
        self.problems = explanation("", role="reason")
        self._layout()

    def _layout(self) -> None:
        top = QHBoxLayout()
        top.addWidget(self.name, 1)
        top.addWidget(QLabel("weight"))
        top.addWidget(self.weight)
        top.addWidget(self.remove)
        self.settings = QGridLayout()
        self.settings.setContentsMargins(0, 0, 0, 0)
        self.length_row = QWidget()
        lengths = QHBoxLayout(self.length_row)
        lengths.setContentsMargins(0, 0, 0, 0)
        for widget in (QLabel("from"), self.min_length, QLabel("to"), self.max_length, self.unit):
            lengths.addWidget(widget)
        lengths.addStretch(1)
        column = QVBoxLayout(self)
        column.setContentsMargins(6, 4, 6, 4)
        column.setSpacing(2)
        for item in (top, self.pattern, self.text, self.case_sensitive, self.length_row, self.explain, self.problems):
            (column.addLayout if isinstance(item, QHBoxLayout) else column.addWidget)(item)
        self.min_length.setToolTip("0: no lower limit")
        self.max_length.setToolTip("0: no upper limit")

    def set_reward(self, reward: RewardConfig, problems: list[str]) -> None:
        self.reward = reward
        widgets = (self.name, self.weight, self.unit, self.case_sensitive, self.min_length, self.max_length)
        for widget in widgets:
            widget.blockSignals(True)
        self.name.setCurrentIndex(next(i for i, o in enumerate(self.names) if o.value == reward.name))
        self.weight.setValue(reward.weight)
        self.unit.setCurrentIndex(next(i for i, o in enumerate(self.units) if o.value == reward.unit))
        self.case_sensitive.setChecked(reward.case_sensitive)
        self.min_length.setValue(reward.min_length)
        self.max_length.setValue(reward.max_length)
        for widget in widgets:
            widget.blockSignals(False)
        for edit, value in ((self.pattern, reward.pattern), (self.text, reward.text)):
            if not edit.hasFocus():  # never under the user's cursor
                edit.setText(value)
        self.pattern.setVisible(reward.name == "matches_format")
        self.text.setVisible(reward.name == "contains")
        self.case_sensitive.setVisible(reward.name == "contains")
        self.length_row.setVisible(reward.name == "length_within")
        self.explain.setText(next(o.explain for o in self.names if o.value == reward.name))
        self.problems.setText("; ".join(problems))
        self.problems.setVisible(bool(problems))

    def _on_name(self, index: int) -> None:
        """Another reward: its own settings start from their defaults (the old one's would be refused)."""
        self.editor.change_reward(self.index, RewardConfig(name=self.names[index].value, weight=self.reward.weight,
                                                           pattern=NEW_REWARD.pattern
                                                           if self.names[index].value == "matches_format" else ""))

    def _change(self, **fields) -> None:
        self.editor.change_reward(self.index, dataclasses.replace(self.reward, **fields))


class RewardFile(BoundControl):
    """``grpo.reward_file``: the path (typed or chosen), its weight, and the trust it needs to run."""

    label = "Reward file"

    def __init__(self, store: ConfigStore):
        super().__init__(store, "grpo.reward_file", REWARD_FILE_SIGNATURE)
        self.path_edit = QLineEdit()
        self.path_edit.setPlaceholderText("none: only the rewards above")
        self.path_edit.editingFinished.connect(lambda: self.write(self.path_edit.text().strip()))
        self.choose = QPushButton("Choose…")
        self.choose.clicked.connect(self._choose)
        row = labelled_row("Reward file", self.path_edit, 260)
        row.insertWidget(2, self.choose)
        self.column.addLayout(row)
        self.weight = NumberControl(store, "grpo.reward_file_weight", "Its weight", "What the file's reward counts "
                                    "for in the total.", -100.0, 100.0, decimals=2, step=0.1, compact=True)
        self.trust = ToggleControl(store, "grpo.trust_reward_code", "Trust this file's code (run it)", TRUST_WORDS)
        self.column.addWidget(self.weight)
        self.column.addWidget(self.trust)
        self.finish_layout()

    def _choose(self) -> None:
        start = str(Path(self.store.config.grpo.reward_file).parent) if self.store.config.grpo.reward_file else ""
        path, _ = QFileDialog.getOpenFileName(self, "Reward file (Python)", start, "Python files (*.py)")
        if path:
            self.write(path)

    def refresh(self, config: RunConfig) -> None:
        if not self.path_edit.hasFocus():
            self.path_edit.setText(config.grpo.reward_file)
        chosen = bool(config.grpo.reward_file)
        self.weight.setEnabled(chosen)
        self.trust.setEnabled(chosen)
        fields = ("grpo.reward_file", "grpo.trust_reward_code")
        self.show_reason("; ".join(self.store.words(f"{p.message} ({p.hint})" if p.hint else p.message)
                                   for p in self.store.problems() if p.where in fields))


def _float_box(minimum: float, maximum: float, step: float) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(minimum, maximum)
    box.setDecimals(2)
    box.setSingleStep(step)
    box.setKeyboardTracking(False)
    box.setAlignment(Qt.AlignmentFlag.AlignRight)
    return box


def _int_box() -> QSpinBox:
    box = QSpinBox()
    box.setRange(0, 1_000_000)
    box.setSpecialValueText("none")
    box.setKeyboardTracking(False)
    return box
