"""Samples: each sample prompt with the base model's answer and the answer at every sampled step, newest first,
the reference answer beside them when the data has one. A view over the followed run's ``samples`` events."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTextBrowser, QVBoxLayout, QWidget

from studio.core.run.evaluation import answer_scores
from studio.gui.state.series import RunSeries, SampleHistory, SamplePrompt
from studio.gui.widgets.common import BAD, GOOD, MUTED, explanation

NO_RUN = ("While a run trains, the model answers a few held-out prompts every “Sample answers every” steps "
          "(Data tab); each answer shows here beside the base model's, newest first.")
NOT_ASKED = "This run takes no samples: set “Sample answers every” on the Data tab before you start a run."
WAITING = "The base model's answers come before the first step; the next ones every {every} steps."


class SamplesPanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.series: RunSeries | None = None
        self._shown = -1
        self.note = explanation(NO_RUN)
        self.note.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)  # alone, it fills the tab
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.note)
        layout.addWidget(self.view, 1)
        self.view.hide()

    def show_run(self, series: RunSeries) -> None:
        self.series, self._shown = series, -1
        self.refresh()

    def refresh(self) -> None:
        """Redraw when the run's samples changed (the window calls this as events arrive)."""
        history = self.series.samples if self.series else None
        if history is None or history.version == self._shown:
            return
        self._shown = history.version
        self.note.setText(_note(history))
        self.view.setVisible(bool(history.prompts))
        if history.prompts:
            scroll = self.view.verticalScrollBar().value()
            self.view.setHtml("".join(prompt_html(number, prompt) for number, prompt in enumerate(history.prompts, 1)))
            self.view.verticalScrollBar().setValue(scroll)


def _note(history: SampleHistory) -> str:
    if history.warning:
        return history.warning
    if not history.prompts:
        return WAITING.format(every=history.every) if history.every else NOT_ASKED
    steps = len(history.prompts[0].newest_first())
    return (f"{len(history.prompts)} prompts, answered greedily by the base model and after {steps} sampled "
            f"step(s) (every {history.every}); ✓ marks an answer equal to the reference.")


def prompt_html(number: int, prompt: SamplePrompt) -> str:
    """One prompt: what it asks, where it comes from, the reference, each step's answer newest first, the base's."""
    rows = []
    if prompt.reference is not None:
        rows.append(_row("reference", html.escape(prompt.reference), f"color:{GOOD}"))
    for step, answer in prompt.newest_first():
        rows.append(_row(f"step {step}", _answer(answer, prompt.reference)))
    if prompt.base_answer is not None:
        rows.append(_row("base model", _answer(prompt.base_answer, prompt.reference), f"color:{MUTED}"))
    where = f" <span style='color:{MUTED}'>({html.escape(prompt.location)})</span>" if prompt.location else ""
    return (f"<p><b>{number}. {html.escape(prompt.prompt)}</b>{where}</p>"
            f"<table cellspacing='0' cellpadding='3'>{''.join(rows)}</table>")


def _row(label: str, cell_html: str, style: str = "") -> str:
    return f"<tr><td style='color:{MUTED}' valign='top'>{label}</td><td style='{style}'>{cell_html}</td></tr>"


def _answer(answer: str, reference: str | None) -> str:
    """The answer, marked ✓ or ✗ against the reference when there is one (on words, as `studio eval` scores)."""
    shown = html.escape(answer) if answer else f"<i style='color:{MUTED}'>(nothing)</i>"
    if reference is None:
        return shown
    right = answer_scores(answer, reference)["exact_match"] == 1.0
    return f"{shown} <span style='color:{GOOD if right else BAD}'>{'✓' if right else '✗'}</span>"
