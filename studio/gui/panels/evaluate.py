"""Evaluate: the base model and the run's newest checkpoint scored on the held-out rows, side by side.

Runs ``studio eval RUN_DIR`` in a subprocess (it prints its progress on stderr and writes
RUN_DIR/evaluation.json); the table (each measure, base, fine-tuned and the change) and the bar chart compare the
two models, the list below holds every row, the weakest first. A grpo run's rows are its held-out prompts: the
table has each reward function's mean and the weighted total, a row's score is its completion's rewards. Standard
benchmarks run the same way (``studio eval RUN_DIR --tasks ...``, through lm-evaluation-harness, into
RUN_DIR/benchmarks.json), in a table of their own. A run evaluated before shows its last results at once.
"""

from __future__ import annotations

import html
import re
import sys
from functools import partial
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontMetrics
from PySide6.QtWidgets import (QFileDialog, QGridLayout, QHBoxLayout, QHeaderView, QLabel, QLineEdit, QProgressBar, QPushButton,
                               QSpinBox, QSplitter, QTableWidget, QTableWidgetItem, QTreeWidget, QTreeWidgetItem,
                               QVBoxLayout, QWidget)

from studio.core.run.commands import benchmarks_command, eval_command
from studio.core.run.evaluation import (BENCHMARKS_FILE, bar_measures, benchmark_rows, comparison_rows, held_out_words,
                                        progress_of, read_evaluation, reward_words)
from studio.gui.process import LineProcess
from studio.gui.state.console import console_error
from studio.gui.widgets.common import ACCENT, BAD, MUTED, explanation
from studio.gui.widgets.plotting import pg, plot_widget

ROW_COLUMNS = ("Row", "Prompt", "Reference", "Fine-tuned answer", "Base answer", "Fine-tuned score")
TABLE_COLUMNS = ("Measure", "Base", "Fine-tuned", "Change")
AXIS_PADDING = 12  # pixels of the bottom axis beside its labels' lines: its ticks and their offset
BARS = ((-0.2, "base", MUTED), (0.2, "tuned", ACCENT))  # offset, model, colour


class EvaluatePanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.run_dir: Path | None = None
        self.result: dict | None = None
        self.command = partial(eval_command, sys.executable)  # tests may point these elsewhere
        self.benchmarks_command = partial(benchmarks_command, sys.executable)
        self.benchmarks: dict | None = None
        self._build_benchmark_controls()
        self.evaluate_button = QPushButton("Evaluate base vs fine-tuned")
        self.evaluate_button.clicked.connect(self.evaluate)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel)
        self.progress = QProgressBar()
        self.progress.setRange(0, 100)
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.table = QTableWidget(0, len(TABLE_COLUMNS))
        self.table.setHorizontalHeaderLabels(TABLE_COLUMNS)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)  # the figures whole
        self.table.setWordWrap(False)
        self.chart = None  # the bar chart: pyqtgraph, made when there is something to draw
        self.chart_box = QVBoxLayout()
        self.chart_key = QLabel(f"<span style='color:{MUTED}'>■</span> base model &nbsp; "
                                f"<span style='color:{ACCENT}'>■</span> fine-tuned")
        self.chart_key.hide()
        self.chart_box.addWidget(self.chart_key)
        self._cancelled = False
        self._running = ""  # what the process computes: "evaluation" or "benchmarks"
        self.rows = QTreeWidget()
        self.rows.setHeaderLabels(ROW_COLUMNS)
        self.rows.setRootIsDecorated(False)
        self.rows.setWordWrap(True)
        header = self.rows.header()
        for column in range(len(ROW_COLUMNS)):  # the texts share the width; where a row is and its F1 fit theirs
            fits = column in (0, len(ROW_COLUMNS) - 1)
            header.setSectionResizeMode(column, QHeaderView.ResizeMode.ResizeToContents if fits
                                        else QHeaderView.ResizeMode.Stretch)
        header.setStretchLastSection(False)
        self._process = LineProcess(self)
        self._process.line.connect(self._on_line)
        self._process.done.connect(self._on_done)
        self._build_layout()
        self.set_run(None)

    def _build_benchmark_controls(self) -> None:
        self.tasks = QLineEdit()
        self.tasks.setPlaceholderText("Benchmarks: lm-evaluation-harness tasks, e.g. arc_easy hellaswag")
        self.tasks.setToolTip("Task names as `lm-eval ls tasks` lists them, or the tasks of your own folder; "
                              "separated by spaces or commas. Their datasets must be in the Hugging Face cache "
                              "(or be local files your task YAML names).")
        self.tasks.textChanged.connect(self._update_buttons)
        self.limit = QSpinBox()
        self.limit.setRange(0, 100_000)
        self.limit.setValue(100)
        self.limit.setSpecialValueText("all")
        self.limit.setSuffix(" per task")
        self.limit.setToolTip("Examples scored per task: a quick look at 100; all: the whole task.")
        self.task_folder: Path | None = None
        self.task_folder_button = QPushButton("Tasks folder…")
        self.task_folder_button.setToolTip("Optional: a folder of task YAML files of your own (tasks over local files).")
        self.task_folder_button.clicked.connect(self._choose_task_folder)
        self.benchmarks_button = QPushButton("Run benchmarks")
        self.benchmarks_button.clicked.connect(self.run_benchmarks)
        self.benchmark_table = QTableWidget(0, 4)
        self.benchmark_table.setHorizontalHeaderLabels(("Benchmark", "Measure", "Base", "Fine-tuned"))
        self.benchmark_table.verticalHeader().hide()
        self.benchmark_table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Stretch)
        self.benchmark_table.hide()

    def _build_layout(self) -> None:
        benchmarks = QGridLayout()  # two rows: the run column may be narrow
        benchmarks.addWidget(self.tasks, 0, 0, 1, 2)
        benchmarks.addWidget(self.benchmarks_button, 0, 2)
        options = QHBoxLayout()
        options.addWidget(self.limit)
        options.addWidget(self.task_folder_button)
        options.addStretch(1)
        benchmarks.addLayout(options, 1, 0, 1, 3)
        buttons = QHBoxLayout()
        buttons.addWidget(self.evaluate_button)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(self.progress, 1)
        buttons.addStretch(1)
        figures = QWidget()
        side_by_side = QHBoxLayout(figures)
        side_by_side.setContentsMargins(0, 0, 0, 0)
        side_by_side.addWidget(self.table, 3)  # four columns of words beside the chart's few bars
        side_by_side.addLayout(self.chart_box, 2)
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(figures)
        splitter.addWidget(self.benchmark_table)
        splitter.addWidget(self.rows)
        splitter.setSizes([260, 90, 220])
        layout = QVBoxLayout(self)
        layout.addWidget(explanation("Scores the base model and the newest checkpoint on the run's held-out rows: loss "
                                     "and perplexity over the completion tokens; for rows with a reference answer, "
                                     "greedy answers by exact match, whether they contain the reference, and token "
                                     "F1; a grpo run's held-out prompts answered greedily and scored by its own "
                                     "rewards (the same as the command studio eval RUN_DIR)."))
        layout.addLayout(buttons)
        layout.addLayout(benchmarks)
        layout.addWidget(self.status)
        layout.addWidget(splitter, 1)

    # ------------------------------------------------------------ choosing and running
    def set_run(self, run_dir: Path | None) -> None:
        """The run to evaluate (a finished one, or one chosen in History): its last evaluation, if any, shown."""
        if self._process.running and Path(run_dir or "") != self.run_dir:
            self._process.stop()  # a result for a run no longer shown
        self.run_dir = Path(run_dir) if run_dir else None
        self.show_result(read_evaluation(self.run_dir) if self.run_dir else None)
        self.show_benchmarks(read_evaluation(self.run_dir, BENCHMARKS_FILE) if self.run_dir else None)
        self._update_buttons()
        if self.run_dir is None:
            self._say("Finish a run, or choose one in History, to evaluate it.", MUTED)
        elif self.result is None:
            self._say(f"{html.escape(self.run_dir.name)} has not been evaluated yet.", MUTED)

    def evaluate(self) -> None:
        if self.run_dir is not None:
            self._start("evaluation", self.command(self.run_dir))

    def run_benchmarks(self) -> None:
        """The tasks typed, base vs fine-tuned, through lm-evaluation-harness in ``studio eval --tasks``."""
        if self.run_dir is not None and self.task_names():
            self._start("benchmarks", self.benchmarks_command(self.run_dir, self.task_names(), self.task_folder,
                                                              self.limit.value() or None))

    def task_names(self) -> list[str]:
        return re.findall(r"[^\s,]+", self.tasks.text())

    def _choose_task_folder(self) -> None:
        chosen = QFileDialog.getExistingDirectory(self, "The folder of your task YAML files")
        self.task_folder = Path(chosen) if chosen else None
        self.task_folder_button.setText(f"Tasks from {self.task_folder.name}" if chosen else "Tasks folder…")

    def _start(self, what: str, command: list[str]) -> None:
        self._cancelled, self._running = False, what
        self._process.start(command)
        self.progress.setValue(0)
        self._say("Loading both models…", MUTED)
        self._update_buttons()

    def cancel(self) -> None:
        """Stops the evaluation; it writes nothing until it is done, so the run keeps its last result."""
        self._cancelled = True
        self._process.stop()

    def _update_buttons(self) -> None:
        running = self._process.running
        self.evaluate_button.setEnabled(self.run_dir is not None and not running)
        self.benchmarks_button.setEnabled(self.run_dir is not None and not running and bool(self.task_names()))
        self.cancel_button.setVisible(running)
        self.progress.setVisible(running)

    def _on_line(self, stream: str, text: str) -> None:
        fraction = progress_of(text)
        if fraction is not None:
            self.progress.setValue(round(100 * fraction))
            self._say("Scoring the " + html.escape(re.sub(r"\s*\[[#-]*\]", " ·", text.strip())), MUTED)

    def _on_done(self, exit_code: int, error: str) -> None:
        self._update_buttons()
        if exit_code == 0 and not error:
            if self._running == "benchmarks":
                self.show_benchmarks(read_evaluation(self.run_dir, BENCHMARKS_FILE))
                self._say(f"Benchmarks of checkpoint {html.escape(self.benchmarks['checkpoint'])} in the table below.",
                          MUTED)
            else:
                self.show_result(read_evaluation(self.run_dir))
            return
        if self._cancelled:
            self._say("Evaluation cancelled; the run keeps its last result.", MUTED)
            return
        found = console_error("\n".join(self._process.all_lines))
        message, hint = (found.message, found.hint) if found else (error or f"exited with code {exit_code}", "")
        self._say(f"Evaluation failed: {html.escape(message)}" + (f"<br>{html.escape(hint)}" if hint else ""), BAD)

    def _say(self, text_html: str, color: str) -> None:
        self.status.setText(f"<span style='color:{color}'>{text_html}</span>")

    # ------------------------------------------------------------ showing
    def show_result(self, result: dict | None) -> None:
        self.result = result
        self.table.setRowCount(0)
        self.rows.clear()
        if result is None:
            self._draw_bars(None)
            return
        summary = result["summary"]
        for cells in comparison_rows(summary):
            row = self.table.rowCount()
            self.table.insertRow(row)
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(text)  # a measure cut short in a narrow column, whole
                self.table.setItem(row, column, item)
        for row in result["rows"]:
            tuned, base = row["tuned"], row["base"]
            texts = [row["location"], row["prompt"], _reference_text(row), tuned.get("answer", "-"),
                     base.get("answer", "-"), _score_text(tuned)]
            item = QTreeWidgetItem(texts)
            for column, text in enumerate(texts):
                item.setToolTip(column, text)  # a long prompt or answer, whole
            if "rewards" in tuned:  # a grpo completion: each function's reward, base and fine-tuned
                item.setToolTip(len(texts) - 1, f"fine-tuned {reward_words(tuned)}\nbase {reward_words(base)}")
            self.rows.addTopLevelItem(item)
        self._draw_bars(summary)
        self._say(f"{html.escape(held_out_words(summary['tuned']))}; checkpoint {html.escape(result['checkpoint'])}; "
                  "the rows below, the weakest first.", MUTED)

    def show_benchmarks(self, result: dict | None) -> None:
        """lm-evaluation-harness's measures of each task, base beside fine-tuned (none yet: the table hides)."""
        self.benchmarks = result
        rows = benchmark_rows(result) if result else []
        self.benchmark_table.setRowCount(len(rows))
        for row, texts in enumerate(rows):
            for column, text in enumerate(texts):
                self.benchmark_table.setItem(row, column, QTableWidgetItem(text))
        self.benchmark_table.setVisible(bool(rows))

    def _draw_bars(self, summary: dict | None) -> None:
        """Base (grey) and fine-tuned (blue) side by side for each share (answer scores; a grpo run's rewards), in
        percent."""
        measures = bar_measures(summary["tuned"]) if summary else []
        if self.chart is None and not measures:
            return
        if self.chart is None:
            self.chart = plot_widget("%")
            self.chart_box.insertWidget(0, self.chart, 1)
        self.chart.clear()
        self.chart.setVisible(bool(measures))
        self.chart_key.setVisible(bool(measures))
        for offset, model, color in BARS:
            heights = [100 * (summary[model].get(key) or 0.0) for key, _ in measures]
            self.chart.addItem(pg().BarGraphItem(x=[i + offset for i in range(len(measures))], height=heights,
                                                 width=0.38, brush=color))
        labels = [_two_lines(label) for _, label in measures]
        axis = self.chart.getAxis("bottom")
        axis.setTicks([list(enumerate(labels))])
        lines = max((label.count("\n") + 1 for label in labels), default=1)
        axis.setHeight(lines * QFontMetrics(self.chart.font()).lineSpacing() + AXIS_PADDING)  # room for each line
        self.chart.setYRange(0, 100)


def _two_lines(label: str) -> str:
    """A bar's label broken at its middle space or underscore (a reward's name), so that neighbours do not overlap."""
    breaks = [i for i, char in enumerate(label) if char in " _"]
    if not breaks:
        return label
    at = min(breaks, key=lambda i: abs(i - len(label) / 2))
    return f"{label[:at + 1].rstrip()}\n{label[at + 1:]}"


def _reference_text(row: dict) -> str:
    """The reference answer; a preference pair's chosen and rejected responses."""
    if "rejected" in row:
        return f"✓ {row['reference']}   ✗ {row['rejected']}"
    return row["reference"] or "-"


def _score_text(scores: dict) -> str:
    """A pair's margin (log-probability of chosen less rejected), a grpo completion's weighted reward, else the
    answer's token F1."""
    if "rewards" in scores:  # each function's in the tooltip
        return "no reward" if scores["reward"] is None else f"reward {scores['reward']:.3g}"
    if "margin" in scores:
        return f"margin {scores['margin']:+.3g}"
    return f"F1 {scores['f1']:.0%}" if "f1" in scores else "-"
