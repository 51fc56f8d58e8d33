"""Samples: each sample prompt with the base model's answer and the answer at every sampled step, newest first,
the reference answer beside them when the data has one; for a GRPO run, the groups of completions its steps
sampled, each completion with the rewards it earned. A view over the followed run's ``samples`` and
``completions`` events."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTextBrowser, QVBoxLayout, QWidget

from studio.core.run.evaluation import answer_scores
from studio.gui.state.series import COMPLETION_STEPS_KEPT, CompletionHistory, RunSeries, SampledGroup, SampleHistory, SamplePrompt
from studio.gui.widgets.common import BAD, GOOD, MUTED, explanation

NO_RUN = ("While a run trains, the model answers a few held-out prompts every “Sample answers every” steps "
          "(Data tab); each answer shows here beside the base model's, newest first.")
NOT_ASKED = "This run takes no samples: set “Sample answers every” on the Data tab before you start a run."
WAITING = "The base model's answers come before the first step; the next ones every {every} steps."
SAMPLED = ("GRPO samples {group} completions of each prompt at every step and learns from how their rewards differ: "
           "here one group of each of the last {kept} samplings, newest first, best reward first.")


class SamplesPanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.series: RunSeries | None = None
        self._shown: tuple[int, int] | None = None
        self.note = explanation(NO_RUN)
        self.note.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)  # alone, it fills the tab
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)
        layout = QVBoxLayout(self)
        layout.addWidget(self.note)
        layout.addWidget(self.view, 1)
        self.view.hide()

    def show_run(self, series: RunSeries) -> None:
        self.series, self._shown = series, None
        self.refresh()

    def refresh(self) -> None:
        """Redraw when the run's samples changed (the window calls this as events arrive)."""
        if self.series is None:
            return
        history, sampled = self.series.samples, self.series.completions
        version = (history.version, sampled.version)
        if version == self._shown:
            return
        self._shown = version
        self.note.setText(_note(history, sampled))
        shown = bool(history.prompts or sampled.groups)
        self.view.setVisible(shown)
        if shown:
            scroll = self.view.verticalScrollBar().value()
            self.view.setHtml("".join(prompt_html(number, prompt) for number, prompt in enumerate(history.prompts, 1))
                              + "".join(group_html(group) for group in sampled.newest_first()))
            self.view.verticalScrollBar().setValue(scroll)


def _note(history: SampleHistory, sampled: CompletionHistory) -> str:
    if history.warning:
        return history.warning
    if sampled.groups and not history.prompts:
        return SAMPLED.format(group=len(sampled.groups[0].completions), kept=COMPLETION_STEPS_KEPT)
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


def group_html(group: SampledGroup) -> str:
    """One sampled group: its step, prompt and reference, then each completion with its reward, best first (the
    same completion sampled again said once, with how often); each function's score beside it when there are
    several."""
    where = f" <span style='color:{MUTED}'>({html.escape(group.location)})</span>" if group.location else ""
    rows = [_row("reference", html.escape(group.reference), f"color:{GOOD}")] if group.reference else []
    ranked = sorted(group.completions, key=lambda c: -c["reward"] if c.get("reward") is not None else float("inf"))
    best = max((c["reward"] for c in ranked if c.get("reward") is not None), default=None)
    distinct: dict[str, tuple[dict, int]] = {}  # text -> its best-ranked completion, how often it was sampled
    for completion in ranked:
        first, times = distinct.get(completion.get("text", ""), (completion, 0))
        distinct[completion.get("text", "")] = (first, times + 1)
    for completion, times in distinct.values():
        rows.append(_row(_reward_label(completion, best) + (f" ×{times}" if times > 1 else ""),
                         _completion(completion)))
    return (f"<p><b>step {group.step}: {html.escape(group.prompt)}</b>{where}</p>"
            f"<table cellspacing='0' cellpadding='3'>{''.join(rows)}</table>")


def _reward_label(completion: dict, best: float | None) -> str:
    reward = completion.get("reward")
    if reward is None:
        return "no reward"
    color = GOOD if best is not None and reward == best and reward > 0 else MUTED
    return f"<span style='color:{color}'>reward {reward:.2f}</span>"


def _completion(completion: dict) -> str:
    text = str(completion.get("text", ""))
    shown = html.escape(text) if text.strip() else f"<i style='color:{MUTED}'>(nothing)</i>"
    scores = completion.get("rewards") or {}
    if len(scores) < 2:  # one function: its score is the reward
        return shown
    parts = ", ".join(f"{html.escape(name)} {'–' if score is None else f'{score:g}'}" for name, score in scores.items())
    return f"{shown} <span style='color:{MUTED}'>({parts})</span>"
