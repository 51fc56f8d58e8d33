"""The dataset picker: files, detected format with an override, row count, a preview rendered as the
model sees it (the loss-masked part set apart), and a token-length histogram with the max-length cut."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QGridLayout, QGroupBox, QHBoxLayout, QLabel, QListWidget,
                               QPushButton, QSplitter, QTextBrowser, QVBoxLayout, QWidget)

from studio.core.config import RunConfig
from studio.core.data.dataset import (SUFFIXES, beyond_max_length_problems, beyond_max_length_warning,
                                     image_rows_refusal, objective_refusal)
from studio.core.data.row_formats import DataError
from studio.core.data.templates import Learning
from studio.core.errors import Problem, ProblemsError, StudioError
from studio.core.presets import DEMO_TRAIN, train_files_changes
from studio.gui.state.data_preview import (PREFERENCE_KINDS, Preview, ShownImage, TokenizerInfo, build_preview,
                                          tokenizer_of)
from studio.gui.state.model_summary import ModelSummary
from studio.gui.tasks import BackgroundTask
from studio.gui.widgets.common import (BAD, MASKED_BG, MUTED, TRAINED_BG, Banner, ConfigStore, explanation,
                                       problems_html, VerticalScroll)
from studio.gui.widgets.controls import ChoiceControl, NumberControl, ToggleControl
from studio.gui.widgets.histogram import LengthHistogram

# The input fields whose change needs the files read again; max_length only moves the cut line.
GRPO_LEARNS = ("GRPO learns the completions the model samples, not the rows' own turns: each row is a prompt, "
               "its answer the reference the rewards compare with.")
_PREVIEW_KEYS = ("train_files", "eval_files", "format", "template", "train_on_prompt", "last_turn_only",
                 "learn_reasoning")
_PREVIEW_SETTINGS = ("objective", "row_format", "learns_preferences")  # what the objective reads and refuses


class DataPanel(VerticalScroll):
    # the token lengths of the preview's rows (None: not counted in tokens) and whether they are all the rows
    lengths_changed = Signal(object, bool)
    problems_changed = Signal()  # the data's problems (``problems``) were found, or went

    def __init__(self, store: ConfigStore, parent: QWidget | None = None):
        super().__init__(parent=parent)
        self.store = store
        self.tokenizer = TokenizerInfo()
        self.images_refusal: StudioError | None = None  # the model's, for rows with images (set_model)
        self.preview: Preview | None = None
        self.problems: list[Problem] = []  # what stops the data training: Start waits for them to be fixed
        self._preview_inputs: tuple | None = None
        self.choose_files_dialog = lambda: QFileDialog.getOpenFileNames(
            self, "Choose training data", "", "Data files (" + " ".join(f"*{s}" for s in SUFFIXES) + ")")[0]
        self.task = BackgroundTask(self)
        self.task.result.connect(self._show_preview)
        self.task.failed.connect(self._show_error)

        self.files = QListWidget()
        self.files.setMaximumHeight(46)
        self.files.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.summary = QLabel()
        self.summary.setTextFormat(Qt.TextFormat.RichText)
        self.banner = Banner()
        # Explanations as tooltips here: the preview needs the height.
        self.format = ChoiceControl(store, "data.format", "Format", compact=True)
        self.template = ChoiceControl(store, "data.template", "Template",
                                      extra_rule=self._template_rule, compact=True)
        self.train_on_prompt = ToggleControl(store, "data.train_on_prompt", "Also learn the prompts",
                                             "Off: the loss covers the responses only (the usual choice). On: prompts "
                                             "are learned too, which suits continued pre-training.", compact=True)
        self.last_turn_only = ToggleControl(store, "data.last_turn_only", "Learn only the last turn",
                                            "Chat rows. Off: every assistant turn is learned, tool calls included. "
                                            "On: only the last; the earlier turns are context. A turn marked train: "
                                            "false is never learned; tool results never are.", compact=True)
        self.learn_reasoning = ToggleControl(store, "data.learn_reasoning", "Learn the reasoning",
                                             "On: an assistant turn's reasoning (reasoning_content, thinking, or "
                                             "<think> tags) is learned with its answer. Off: it is context, and only "
                                             "the answer after it is learned.", compact=True)
        self.eval_fraction = NumberControl(store, "data.eval_fraction", "Held out for eval", "A share of the rows "
                                           "kept out of training to measure eval loss (0 = none).", 0.0, 0.5,
                                           decimals=2, step=0.05, compact=True)
        self.sample_every = NumberControl(store, "schedule.sample_every", "Sample answers every", "While training, "
                                          "the model answers the first three held-out rows greedily every this many "
                                          "steps (and the base before the first): the Samples tab shows them.", 0,
                                          100_000, suffix=" steps", special_zero="off", compact=True)
        self.eval_every = NumberControl(store, "schedule.eval_every", "Evaluate every", "Steps between two "
                                        "measures on the held-out rows (their loss, or a GRPO run's held-out "
                                        "reward); the end always measures.", 0, 100_000, suffix=" steps",
                                        special_zero="end only", compact=True)
        self.examples = QTextBrowser()
        self.examples.setOpenLinks(False)
        self.examples.setMinimumHeight(80)
        self.histogram = LengthHistogram()
        self.cut_note = explanation("")
        self._build_layout()
        store.changed.connect(self._on_config)
        self._on_config(store.config)

    def _build_layout(self) -> None:
        files = QGroupBox("Training data")
        layout = QVBoxLayout(files)
        buttons = QHBoxLayout()
        for text, slot in (("Add files…", self._add_files), ("Remove", self._remove_selected),
                           ("Demo dataset", lambda: self.set_files([str(DEMO_TRAIN)]))):
            button = QPushButton(text)
            button.clicked.connect(slot)
            buttons.addWidget(button)
        buttons.addStretch(1)
        layout.addLayout(buttons)
        layout.addWidget(self.files)
        layout.addWidget(self.summary)
        grid = QGridLayout()
        grid.setContentsMargins(0, 0, 0, 0)
        for index, widget in enumerate((self.format, self.template, self.train_on_prompt, self.last_turn_only,
                                        self.learn_reasoning, self.eval_fraction, self.sample_every, self.eval_every)):
            grid.addWidget(widget, index // 2, index % 2)
        layout.addLayout(grid)

        preview = QWidget()
        preview_layout = QVBoxLayout(preview)
        preview_layout.setContentsMargins(0, 0, 0, 0)
        legend = QLabel(f"Preview as the model sees it: <span style='background:{TRAINED_BG}'>&nbsp;learned (in the "
                        f"loss)&nbsp;</span> <span style='background:{MASKED_BG}; color:{MUTED}'>&nbsp;context only "
                        "(masked)&nbsp;</span>")
        legend.setWordWrap(True)  # a narrow column wraps it
        preview_layout.addWidget(legend)
        preview_layout.addWidget(self.examples, 1)
        histogram = QWidget()
        histogram_layout = QVBoxLayout(histogram)
        histogram_layout.setContentsMargins(0, 0, 0, 0)
        histogram_layout.addWidget(self.histogram, 1)
        histogram_layout.addWidget(self.cut_note)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(preview)
        splitter.addWidget(histogram)
        splitter.setSizes([260, 170])

        content = QWidget()
        layout = QVBoxLayout(content)
        layout.addWidget(files)
        layout.addWidget(self.banner)
        layout.addWidget(splitter, 1)
        self.setWidget(content)

    # ------------------------------------------------------------ choosing files
    def set_files(self, paths: list[str]) -> None:
        self.store.update(data=train_files_changes(self.store.config, tuple(paths)))

    def _add_files(self) -> None:
        chosen = self.choose_files_dialog()
        if chosen:
            self.set_files(list(dict.fromkeys(list(self.store.config.data.train_files) + chosen)))

    def _remove_selected(self) -> None:
        selected = {item.text() for item in self.files.selectedItems()}
        self.set_files([f for f in self.store.config.data.train_files if f not in selected])

    def set_model(self, summary: ModelSummary | None) -> None:
        """The tokenizer the preview renders and counts with."""
        self.tokenizer = tokenizer_of(summary)
        self.images_refusal = summary.images_refusal if summary is not None else None
        self._preview_inputs = None
        self.template.refresh(self.store.config)
        self._on_config(self.store.config)

    def _template_rule(self, value: str) -> str:
        if value == "tokenizer" and not self.tokenizer.chat_template:
            return "this model's tokenizer has no chat template"
        return ""

    # ------------------------------------------------------------ preview
    def _on_config(self, config: RunConfig) -> None:
        data = config.data
        self._show_file_list(data.train_files)
        # held-out files replace a share held out (the two cannot be combined)
        self.eval_fraction.setEnabled(not data.eval_files)
        self.eval_fraction.setToolTip("Rows of the held-out file(s) measure eval loss instead" if data.eval_files
                                      else self.eval_fraction.explain.text())
        self._show_what_is_learned(config)
        inputs = tuple(getattr(data, key) for key in _PREVIEW_KEYS) + tuple(getattr(config, key) for key in
                                                                           _PREVIEW_SETTINGS) + (
            config.vision.max_pixels, self.tokenizer,  # the tokens an image becomes
            config.distributed.pipeline_stages)  # a pipeline refuses images
        if inputs != self._preview_inputs:
            self._preview_inputs = inputs
            self._start_preview(config)
        self._show_cut(data.max_length)

    def _show_what_is_learned(self, config: RunConfig) -> None:
        """GRPO learns the completions it samples, never the rows' own turns: the switches of what in a row is
        learned are off there, saying why."""
        samples = config.objective == "grpo"
        for toggle in (self.train_on_prompt, self.last_turn_only, self.learn_reasoning):
            toggle.setEnabled(not samples)
            toggle.setToolTip(GRPO_LEARNS if samples else toggle.explain.text())

    def _show_file_list(self, files: tuple[str, ...]) -> None:
        if [self.files.item(i).text() for i in range(self.files.count())] != list(files):
            self.files.clear()
            self.files.addItems(files)

    def _start_preview(self, config: RunConfig) -> None:
        data = config.data
        if not data.train_files:
            self.task.cancel()  # a preview of the files just removed must not arrive after this message
            self._show_error(StudioError("no training data", "add a data file or use the demo dataset"))
            return
        tokenizer, row_format = self.tokenizer, config.row_format
        self.summary.setText(f"<span style='color:{MUTED}'>Reading {len(data.train_files)} file(s)…</span>")
        self.task.submit(lambda: build_preview(data.train_files, row_format, data.template, tokenizer,
                                               data.train_on_prompt, Learning.of(data), config.vision.max_pixels))

    def _show_preview(self, preview: Preview) -> None:
        config = self.store.config
        self.format.combo.setItemText(0, f"auto (detected: {preview.format})")
        where = Path(config.data.train_files[0]).name
        refusal = objective_refusal(preview.format, config.objective, config.learns_preferences, where)
        if refusal is None and preview.image_rows:
            refusal = (image_rows_refusal(config.objective, config.distributed.pipeline_stages, where)
                       or self.images_refusal)
        if refusal is not None:  # what the worker would refuse at Start
            self._show_error(refusal)
            return
        self.preview = preview
        self._set_problems([])
        self.banner.hide()
        rows = f"{preview.rows:,} {'row' if preview.rows == 1 else 'rows'}"
        rows += "" if preview.complete else " (at least)"
        template = {"none": "", "tokenizer": " · the tokenizer's chat template"}.get(
            preview.template, f" · {preview.template} template")
        held_out = ", ".join(html.escape(Path(name).name) for name in self.store.config.data.eval_files)
        held_out = f" · held out for eval: <b>{held_out}</b>" if held_out else ""
        self.summary.setText(f"<b>{rows}</b> · format <b>{preview.format}</b>{template}{held_out}")
        self.examples.setHtml(examples_html(preview))
        self._draw_histogram(preview)
        tokens = tuple(int(n) for n in preview.lengths) if preview.unit == "tokens" else None
        self.lengths_changed.emit(tokens, preview.sampled >= preview.rows and preview.complete)

    def _show_error(self, error: Exception) -> None:
        self.preview = None
        self._set_problems(getattr(error, "problems", None) or [_problem_of(error)])
        self.lengths_changed.emit(None, False)
        self.banner.show_message(self.store.words(_readable(error)), error=True)  # settings by their labels
        self.summary.setText("")
        self.examples.setHtml(f"<p style='color:{MUTED}'>No preview: fix the data problem above.</p>")
        self.histogram.show_message("No lengths to show.")
        self.cut_note.setText("")

    def _set_problems(self, problems: list[Problem]) -> None:
        if problems != self.problems:
            self.problems = problems
            self.problems_changed.emit()

    def _draw_histogram(self, preview: Preview) -> None:
        sampled = f"the first {preview.sampled:,} rows" if preview.sampled < preview.rows else f"all {preview.rows:,} rows"
        self.histogram.show_lengths(preview.lengths, preview.unit, f"Length of {sampled}")
        self._show_cut(self.store.config.data.max_length)

    def _show_cut(self, max_length: int) -> None:
        preview = self.preview
        if preview is None:
            return
        if preview.unit != "tokens":
            self.histogram.set_cut(None)
            self.cut_note.setText("Lengths in characters: this model has no tokenizer.json to count tokens with, "
                                  "so the max-length cut cannot be placed.")
            return
        self.histogram.set_cut(max_length)
        self._show_rows_beyond(preview, max_length)
        cut = preview.truncated(max_length)
        share = cut / max(preview.sampled, 1)
        longest = int(preview.lengths.max()) if len(preview.lengths) else 0
        kept = (" Each sequence keeps its start, as TRL's trainers cut it: the prompt, then as much of the response as "
                "fits." if preview.format in PREFERENCE_KINDS else "")
        self.cut_note.setText(f"{cut:,} of {preview.sampled:,} rows ({share:.0%}) are longer than {max_length} "
                              f"tokens and get cut.{kept}" if cut else
                              f"Every row fits in {max_length} tokens (longest: {longest}).")


    def _show_rows_beyond(self, preview: Preview, max_length: int) -> None:
        """Rows whose response starts beyond max_length keep nothing to learn: named, in red when no row is left
        to train on (Start waits), else as a note saying the others train."""
        beyond = preview.beyond(max_length)
        every_row = preview.sampled >= preview.rows and preview.complete
        setting = "the Sequence length (Techniques tab)"
        self._set_problems(beyond_max_length_problems(beyond, max_length, setting) if beyond and every_row and
                           len(beyond) == preview.sampled else [])
        if self.problems:
            self.banner.show_message(self.store.words(problems_html("The data has problems", self.problems)),
                                     error=True)
        elif beyond:
            checked = f"{preview.rows:,} training rows" if every_row else f"the first {preview.sampled:,} rows"
            message, hint = beyond_max_length_warning(beyond, checked, max_length, "the run trains on the others",
                                                      setting)
            self.banner.show_message(f"<b>{html.escape(message)}.</b><br>{html.escape(hint)}.", error=False)
        else:
            self.banner.hide()


def examples_html(preview: Preview) -> str:
    """The first examples, learned text on green and masked context in grey, newlines kept visible."""
    blocks = []
    for example in preview.examples:
        head = f"<div style='color:{MUTED}; font-size:11px'>{html.escape(example.location)}"
        if example.tokens is not None:
            head += f" · {example.tokens} tokens"
        if example.label is not None:
            head += " · desirable ✓" if example.label else " · undesirable ✗"
        head += "</div>"
        if example.error:
            body = f"<div style='color:{BAD}'>{html.escape(example.error)}</div>"
        elif example.rejected:
            body = _pair_html(example)
        else:
            body = _sequence_html(example.segments, ImagesInText(example.images, preview.image_placeholder))
        blocks.append(head + body)
    return "".join(f"<div style='margin-bottom:10px'>{block}</div>" for block in blocks) or \
        f"<p style='color:{MUTED}'>No rows.</p>"


class ImagesInText:
    """A row's images, each drawn where the chat template's placeholder for it stands (in order)."""

    def __init__(self, images: Sequence[ShownImage] = (), placeholder: str = ""):
        self.pending, self.placeholder = iter(images), placeholder

    def html(self, text: str) -> str:
        """``text`` escaped, each placeholder followed by the next image's thumbnail."""
        if not self.placeholder:
            return _escaped(text)
        pieces = text.split(self.placeholder)
        return _escaped(self.placeholder).join([_escaped(pieces[0]), *(self._thumbnail() + _escaped(piece)
                                                                       for piece in pieces[1:])])

    def _thumbnail(self) -> str:
        image = next(self.pending, None)
        if image is None:
            return ""
        source = html.escape(Path(image.path).as_uri(), quote=True)
        tokens = "" if image.tokens is None else f" {image.tokens:,} image token{'' if image.tokens == 1 else 's'}"
        return (f"<img src='{source}' width='{image.width}' height='{image.height}' style='vertical-align:middle'>"
                f"<span style='color:{MUTED}; font-size:11px'>{tokens}</span>")


def _escaped(text: str) -> str:
    return html.escape(text).replace("\n", "↵<br>")


def _sequence_html(segments, images: ImagesInText | None = None) -> str:
    images = images or ImagesInText()
    body = "".join(_segment_html(images.html(text), trainable) for text, trainable in segments)
    return f"<div style='font-family:monospace; white-space:pre-wrap'>{body}</div>"


def _pair_html(example) -> str:
    """A preference pair: the chosen sequence beside the rejected one, each as the model reads it."""
    cells = "".join(f"<td width='50%' valign='top'><div style='color:{MUTED}; font-size:11px'>{label}</div>"
                    f"{_sequence_html(segments)}</td>"
                    for label, segments in (("chosen ✓", example.segments), ("rejected ✗", example.rejected)))
    return f"<table width='100%' cellspacing='4'><tr>{cells}</tr></table>"


def _segment_html(escaped: str, trainable: bool) -> str:
    if trainable:
        return f"<span style='background:{TRAINED_BG}; color:#111'>{escaped}</span>"
    return f"<span style='background:{MASKED_BG}; color:{MUTED}'>{escaped}</span>"


def _problem_of(error: Exception) -> Problem:
    """One error as a problem: a data error names its file and line; anything else says what it was."""
    if isinstance(error, DataError):
        return error.problem
    if isinstance(error, StudioError):
        return Problem("", error.message, error.hint)
    return Problem("", f"the data could not be read: {type(error).__name__}: {error}")


def _readable(error: Exception) -> str:
    if isinstance(error, ProblemsError):
        items = "".join(f"<li>{html.escape(str(p))}</li>" for p in error.problems[:8])
        more = f"<li>… and {len(error.problems) - 8} more</li>" if len(error.problems) > 8 else ""
        return f"<b>The data has problems:</b><ul style='margin:0'>{items}{more}</ul>"
    if isinstance(error, StudioError):
        return f"<b>{html.escape(error.message)}</b><br>{html.escape(error.hint)}"
    return f"<b>Cannot read the data:</b> {html.escape(f'{type(error).__name__}: {error}')}"

