"""Live charts (pyqtgraph): loss (raw, smoothed, eval), learning rate, tokens/s (with the pauses for sample
answers), memory per device; a GRPO run's reward, its spread within groups, completion length, loss, KL and clip
ratio instead of the loss and learning rate.

Data lives in ``series.RunSeries`` (growing numpy buffers); a QTimer redraws
at a fixed rate and only the curves whose series changed, so a burst of
events costs one redraw. Curves downsample by peaks and clip to the visible
range: 100k points stay smooth. A chart without points shows why (waiting
for the first step, loading the model) instead of an empty plot. Several runs
can be shown at once (History's comparison): each gets its own colors.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QGridLayout, QLabel, QStackedLayout, QVBoxLayout, QWidget

from studio.core.sizes import GIB
from studio.gui.state.series import RunSeries, Series
from studio.gui.widgets.common import BAD
from studio.gui.widgets.plotting import pg, plot_widget

REDRAW_MS = 100
WAITING = "Waiting for the first step…"
NO_RUN = "Start a run (or open one in History) to see it here."
SAMPLE_PAUSE_COLOR = "#9333ea"
FUNCTION_COLORS = ("#6f42c1", "#0b7285", "#b26a00", "#5c940d")  # a GRPO run's reward functions, dashed
CLIPPED_WARNING = 0.05  # a GRPO run with more of its completions cut at the completion length is told so


@dataclass(frozen=True)
class Palette:
    raw: str
    main: str
    eval: str
    other: str


PALETTES = (Palette("#a6c8e8", "#1f6feb", "#e8590c", "#6f42c1"), Palette("#b7e4c7", "#2b8a3e", "#c2255c", "#0b7285"))
MEMORY_STYLES = {"allocated": Qt.PenStyle.SolidLine, "reserved": Qt.PenStyle.DashLine,
                 "nvml used": Qt.PenStyle.DotLine, "process": Qt.PenStyle.SolidLine}


def run_letter(index: int) -> str:
    """How compared runs are told apart in legends: A, B, ..."""
    return chr(ord("A") + index)


class ChartCard(QWidget):
    """A titled plot that shows a placeholder message until it has data (the plot is built then)."""

    def __init__(self, title: str, y_label: str):
        super().__init__()
        self.y_label = y_label
        self.title = QLabel(f"<b>{title}</b>")
        self.placeholder = QLabel(WAITING)
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self.placeholder.setProperty("role", "placeholder")
        self.stack = QStackedLayout()
        self.stack.addWidget(self.placeholder)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(2, 2, 2, 2)
        layout.setSpacing(2)
        layout.addWidget(self.title)
        layout.addLayout(self.stack, 1)
        self._plot = None
        self.legend = None
        self.curves: dict[str, Any] = {}  # key -> pyqtgraph PlotDataItem
        self.lines: dict[str, Any] = {}  # key -> pyqtgraph InfiniteLine

    @property
    def plot(self):
        if self._plot is None:
            self._plot = plot_widget(self.y_label, "step")
            item = self._plot.getPlotItem()
            item.setDownsampling(auto=True, mode="peak")
            item.setClipToView(True)
            # Top left, where the newest points (on the right) never are; translucent, so that the first ones
            # still show through it.
            self.legend = item.addLegend(offset=(8, 8), labelTextSize="8pt", brush=pg().mkBrush(255, 255, 255, 150),
                                         pen=pg().mkPen(208, 215, 222, 160))
            self.stack.addWidget(self._plot)
        return self._plot

    def set_title(self, title: str, y_label: str | None = None) -> None:
        self.title.setText(f"<b>{title}</b>")
        if y_label is not None and y_label != self.y_label:
            self.y_label = y_label
            if self._plot is not None:
                self._plot.getPlotItem().setLabel("left", y_label)

    def show_placeholder(self, text: str) -> None:
        self.placeholder.setText(text)
        self.stack.setCurrentWidget(self.placeholder)

    def show_plot(self) -> None:
        self.stack.setCurrentWidget(self.plot)

    @property
    def showing_plot(self) -> bool:
        return self._plot is not None and self.stack.currentWidget() is self._plot

    def curve(self, key: str, name: str | None, color: str, width: float = 1, style=Qt.PenStyle.SolidLine,
              symbol: str | None = None):
        if key not in self.curves:
            pen = pg().mkPen(color, width=width, style=style)
            options = {"symbol": symbol, "symbolSize": 6, "symbolBrush": color, "symbolPen": None} if symbol else {}
            curve = self.plot.plot(name=name, pen=pen, skipFiniteCheck=True, **options)
            curve.setDownsampling(auto=True, method="peak")
            curve.setClipToView(True)
            self.curves[key] = curve
        return self.curves[key]

    def horizontal_line(self, key: str, value: float, label: str, color: str, style=Qt.PenStyle.SolidLine,
                        label_below: bool = False) -> None:
        """A labelled level; a label below its line stays inside the plot when the line is its top."""
        line = self.lines.get(key)
        if line is None:
            anchor = (0, 0) if label_below else (0, 1)
            line = self.lines[key] = pg().InfiniteLine(
                angle=0, pen=pg().mkPen(color, width=1, style=style), label=label,
                labelOpts={"position": 0.4, "color": color, "anchors": [anchor, anchor]})  # clear of the legend
            self.plot.addItem(line)
        line.setValue(value)
        line.label.setFormat(label)

    def vertical_line(self, key: str, x: float, color: str, tooltip: str) -> None:
        """An unlabelled mark at ``x`` (a moment, not a level): many fit where their labels would not."""
        if key not in self.lines:
            line = self.lines[key] = pg().InfiniteLine(pos=x, angle=90, pen=pg().mkPen(color, width=1,
                                                                                       style=Qt.PenStyle.DotLine))
            line.setToolTip(tooltip)
            self.plot.addItem(line)

    def remove_lines(self, prefix: str) -> None:
        for key in [key for key in self.lines if key.startswith(prefix)]:
            self._plot.removeItem(self.lines.pop(key))

    def clear(self) -> None:
        if self._plot is None:
            return
        for item in list(self.curves.values()) + list(self.lines.values()):
            self._plot.removeItem(item)
        self.legend.clear()
        self.curves, self.lines = {}, {}


class ChartsPanel(QWidget):
    def __init__(self, parent: QWidget | None = None, redraw_ms: int = REDRAW_MS, no_run_text: str = NO_RUN):
        super().__init__(parent)
        self.no_run_text = no_run_text  # what the charts say before any run is shown
        self.loss = ChartCard("Training loss", "loss")
        self.lr = ChartCard("Learning rate", "lr")
        self.throughput = ChartCard("Throughput", "tokens/s")
        self.memory = ChartCard("Memory", "GiB")
        # a GRPO run's two more: what it samples, and how far each step moves the policy
        self.completion_length = ChartCard("Completion length", "tokens")
        self.policy = ChartCard("Loss, KL to the reference and clip ratio", "value")
        self.grid = QGridLayout(self)
        self.grid.setContentsMargins(0, 0, 0, 0)
        self.grid.setSpacing(6)
        self._arranged_for_rewards: bool | None = None
        self._arrange(for_rewards=False)
        self.runs: list[RunSeries] = []
        self.waiting_text = WAITING
        self._drawn: dict[tuple[int, str], int] = {}
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.redraw)
        self._timer.start(redraw_ms)
        self.redraw()

    @property
    def cards(self) -> tuple[ChartCard, ...]:
        return (self.loss, self.lr, self.throughput, self.memory, self.completion_length, self.policy)

    def _arrange(self, for_rewards: bool) -> None:
        """Two rows of two charts; a GRPO run's (reward and its spread; completion length and the policy's moves;
        throughput and memory) three."""
        if for_rewards == self._arranged_for_rewards:
            return
        self._arranged_for_rewards = for_rewards
        shown = self.cards if for_rewards else self.cards[:4]
        order = (self.loss, self.lr, self.completion_length, self.policy, self.throughput, self.memory) \
            if for_rewards else shown
        for card in self.cards:
            self.grid.removeWidget(card)
            card.setVisible(card in shown)
        for index, card in enumerate(order):
            self.grid.addWidget(card, index // 2, index % 2)
        for row, stretch in enumerate((3, 2, 2) if for_rewards else (3, 2, 0)):
            self.grid.setRowStretch(row, stretch)

    def show_runs(self, runs: list[RunSeries]) -> None:
        """Replace what is shown (one live run, or runs to compare)."""
        self.runs = list(runs)
        self._drawn.clear()
        for card in self.cards:
            card.clear()
        self.memory.set_title("Memory")  # until the first step says GPU or CPU
        self.lr.set_title("Learning rate", "lr")  # until a first step shows preference metrics
        self.loss.set_title("Training loss")
        self.completion_length.set_title("Completion length")
        self._arrange(for_rewards=False)  # until a first step shows rewards
        self.redraw()

    def set_waiting_text(self, text: str) -> None:
        """What the charts say before the first step (e.g. "Loading model… 12 s")."""
        self.waiting_text = text
        self.redraw()

    # ------------------------------------------------------------ drawing
    def redraw(self) -> None:
        if not any(run.step_count for run in self.runs):
            # The loss chart says why there is nothing yet; the others say what they will show.
            self.loss.show_placeholder(self.waiting_text if self.runs else self.no_run_text)
            for card, what in ((self.lr, "The learning rate schedule"), (self.throughput, "Tokens per second"),
                               (self.memory, "Memory per device")):
                card.show_placeholder(f"{what} appears with the first step.")
            return
        self._arrange(self.runs[0].learns_from_rewards)
        for card in self.cards:
            card.show_plot()
        several = len(self.runs) > 1
        for index, run in enumerate(self.runs):
            palette = PALETTES[index % len(PALETTES)]
            prefix = f"{run_letter(index)}: " if several else ""  # run names are too long for a legend
            self._draw_run(index, run, palette, prefix)

    def _draw_run(self, index: int, run: RunSeries, palette: Palette, prefix: str) -> None:
        if self.runs[0].learns_from_rewards:
            self._draw_rewards(index, run, palette, prefix)
        else:
            self._draw_loss(index, run, palette, prefix)
        self._update(index, "tps", run.tokens_per_s, self.throughput.curve(f"{index}.tps", None if prefix else "tokens/s",
                                                                      palette.raw))
        self._update(index, "tps_smooth", run.tokens_per_s_smoothed,
                     self.throughput.curve(f"{index}.tps_smooth", f"{prefix}tokens/s (smoothed)", palette.main, 2))
        if index == 0:
            self._draw_sample_pauses(run)
        self._draw_memory(index, run, palette, prefix)

    def _draw_loss(self, index: int, run: RunSeries, palette: Palette, prefix: str) -> None:
        # Pens wider than 1 px are slow to draw with many points: only the smoothed loss gets one.
        raw_name = None if prefix else "loss"  # comparing: the smoothed curves say enough in the legend
        self._update(index, "loss_raw", run.loss, self.loss.curve(f"{index}.raw", raw_name, palette.raw))
        self._update(index, "loss_smooth", run.loss_smoothed,
                     self.loss.curve(f"{index}.smooth", f"{prefix}loss (smoothed)", palette.main, 2))
        if len(run.eval_loss):
            self._update(index, "eval", run.eval_loss,
                         self.loss.curve(f"{index}.eval", f"{prefix}eval loss", palette.eval, symbol="o"))
        if self.runs[0].learns_preferences:
            self._draw_preference(index, run, palette, prefix)
        else:
            self._update(index, "lr", run.lr, self.lr.curve(f"{index}.lr", f"{prefix}learning rate", palette.main))

    def _draw_rewards(self, index: int, run: RunSeries, palette: Palette, prefix: str) -> None:
        """A GRPO run: its reward (total, smoothed, each function's, held-out) where the loss would be; beside it
        the spread within groups, which is what it learns from (a group whose completions all score the same
        teaches nothing), and the tokens' entropy, which sampling needs to find a spread; then its completions'
        length and how far each step moves the policy."""
        if index == 0:
            self.loss.set_title("Reward: total, each function's, held-out", "reward")
            self.lr.set_title("Spread: rewards within groups, the tokens' entropy", "reward, nats")
        self._update(index, "reward_raw", run.reward.raw,
                     self.loss.curve(f"{index}.reward_raw", None if prefix else "reward", palette.raw))
        self._update(index, "reward_smooth", run.reward.smoothed,
                     self.loss.curve(f"{index}.reward_smooth", f"{prefix}reward (smoothed)", palette.main, 2))
        functions = run.reward_functions()
        colors = FUNCTION_COLORS if len(functions) > 1 else (palette.other,)
        for number, name in enumerate(functions if len(functions) > 1 else ()):  # one function: it is the total
            curve = self.loss.curve(f"{index}.fn.{name}", f"{prefix}{name}", colors[number % len(colors)],
                                    style=Qt.PenStyle.DashLine)
            self._update(index, f"fn.{name}", run.rollout[f"rewards/{name}/mean"], curve)
        if "eval_reward" in run.eval_rewards:
            self._update(index, "eval_reward", run.eval_rewards["eval_reward"],
                         self.loss.curve(f"{index}.eval_reward", f"{prefix}held-out reward", palette.eval, symbol="o"))
        for card, key, name, color, style in (
                (self.lr, "reward_std_in_group", "std within groups", palette.main, Qt.PenStyle.SolidLine),
                (self.lr, "frac_reward_zero_std", "groups with no spread (share)", palette.other,
                 Qt.PenStyle.DashLine),
                (self.lr, "entropy", "entropy of the completion tokens", palette.eval, Qt.PenStyle.DotLine),
                (self.completion_length, "completions/mean_length", "mean length (tokens)", palette.main,
                 Qt.PenStyle.SolidLine),
                (self.policy, "loss", "loss", palette.raw, Qt.PenStyle.SolidLine),
                (self.policy, "kl", "KL", palette.main, Qt.PenStyle.SolidLine),
                (self.policy, "clip_ratio/region_mean", "clipped tokens (share)", palette.other,
                 Qt.PenStyle.DashLine)):
            if key in run.rollout:
                self._update(index, key, run.rollout[key],
                             card.curve(f"{index}.{key}", f"{prefix}{name}", color, 2 if key == "kl" else 1, style))
        if index == 0:
            self._title_clipped_completions(run)
            self.policy.set_title("Loss, KL to the reference and clip ratio" if "kl" in run.rollout else
                                  "Loss and clip ratio <span style='font-weight:normal'>(KL weight 0: no "
                                  "reference, no KL)</span>")

    def _title_clipped_completions(self, run: RunSeries) -> None:
        """The share of completions cut at the completion length, latest, in the length chart's title: above a few
        percent the length is too short for the answers."""
        clipped = run.rollout.get("completions/clipped_ratio")
        if clipped is None or not len(clipped):
            return
        share = float(clipped.y[-1])
        color = BAD if share > CLIPPED_WARNING else "inherit"
        self.completion_length.set_title(f"Completion length <span style='font-weight:normal; color:{color}'>"
                                         f"{share:.0%} cut at the completion length</span>")

    def _draw_preference(self, index: int, run: RunSeries, palette: Palette, prefix: str) -> None:
        """Beside the loss, instead of the learning rate: how far the rewards put chosen above rejected (TRL's
        rewards/margins); how often (rewards/accuracies, 0 to 1) on the loss chart, whose scale it shares."""
        if index == 0:
            self.lr.set_title("Reward margin (chosen − rejected)", "margin")
            self.loss.set_title("Training loss and preference accuracy (0 to 1)")
        curves = (("margin", run.margin, self.lr, "margin", None), ("eval_margin", run.eval_margin, self.lr,
                                                                    "held-out margin", "o"),
                  ("accuracy", run.accuracy, self.loss, "accuracy", None),
                  ("eval_accuracy", run.eval_accuracy, self.loss, "held-out accuracy", "t"))
        for key, series, card, name, symbol in curves:
            if len(series):
                color = palette.eval if symbol else (palette.main if card is self.lr else palette.other)
                style = Qt.PenStyle.DashLine if key == "accuracy" else Qt.PenStyle.SolidLine
                curve = card.curve(f"{index}.{key}", f"{prefix}{name}", color, 1 if symbol else 2, style, symbol)
                self._update(index, key, series, curve)

    def _draw_sample_pauses(self, run: RunSeries) -> None:
        """A dotted line where training paused to answer the sample prompts; the title says what they cost (tokens/s
        counts the steps alone)."""
        pauses = run.sample_pauses
        if self._drawn.get((0, "pauses")) == pauses.version:
            return
        self._drawn[(0, "pauses")] = pauses.version
        self.throughput.remove_lines("pause.")  # a resumed run may have dropped some
        if not len(pauses):
            self.throughput.set_title("Throughput")
            return
        for step, seconds in zip(pauses.x, pauses.y):
            self.throughput.vertical_line(f"pause.{step:g}", step, SAMPLE_PAUSE_COLOR,
                                          f"step {step:g}: {seconds:.1f} s answering the sample prompts")
        mean = float(pauses.y.mean())
        self.throughput.set_title(f"Throughput <span style='color:{SAMPLE_PAUSE_COLOR}'>┆</span> "
                                  f"<span style='font-weight:normal'>paused {mean:.1f} s to answer the sample "
                                  f"prompts</span>")

    def _draw_memory(self, index: int, run: RunSeries, palette: Palette, prefix: str) -> None:
        gpu = any(trace.is_gpu for trace in run.memory.values())
        if index == 0:
            self.memory.set_title("GPU memory" if gpu else "Process memory — CPU RAM of the worker (no GPU)")
        colors = (palette.main, palette.other, palette.eval, palette.raw)
        for device_number, trace in enumerate(run.memory.values()):
            color = colors[device_number % len(colors)]
            device = f"{trace.label} " if gpu and len(run.memory) > 1 else ""
            for name, series in trace.series.items():
                label = "process memory (CPU)" if name == "process" else name
                curve = self.memory.curve(f"{index}.{trace.device}.{name}", f"{prefix}{device}{label}", color,
                                          style=MEMORY_STYLES.get(name, Qt.PenStyle.SolidLine))
                self._update(index, f"mem.{trace.device}.{name}", series, curve)
        if index == 0:
            several_gpus = gpu and len(run.memory) > 1
            capacities = [(trace.label, trace.capacity_bytes) for trace in run.memory.values() if trace.capacity_bytes]
            self._grouped_lines("cap", capacities, several_gpus, "capacity {:.0f} GiB", "#111827", label_below=True)
        if gpu and run.estimate_bytes and index == 0:
            self._draw_estimates(run)

    def _draw_estimates(self, run: RunSeries) -> None:
        """The estimate of the reserved curve: beside several GPUs' curves each one's own (ZeRO's ranks, a layer
        split's devices), else the peak's."""
        own = [(device, total) for device, total in run.estimate_by_device.items() if device in run.memory]
        if len(run.memory) > 1 and own:
            self._grouped_lines("estimate", own, True, "reserved estimate {:.1f} GiB", BAD, style=Qt.PenStyle.DashLine)
        else:
            self.memory.horizontal_line("estimate", run.estimate_bytes / GIB,
                                        f"reserved estimate {run.estimate_bytes / GIB:.1f} GiB", BAD,
                                        Qt.PenStyle.DashLine)

    def _grouped_lines(self, key: str, levels: list[tuple[str, int]], several_gpus: bool, text: str, color: str,
                       **style) -> None:
        """One line per level (GPU, bytes): GPUs at the same level share it (their labels would print over each other)."""
        owners: dict[int, list[str]] = {}
        for owner, level in levels:
            owners.setdefault(level, []).append(owner)
        for level, names in owners.items():
            owner = ""
            if several_gpus:
                owner = "each GPU " if len(names) == len(levels) > 1 else f"{', '.join(names)} "
            self.memory.horizontal_line(f"{key}.{level}", level / GIB, owner + text.format(level / GIB), color, **style)

    def _update(self, index: int, key: str, series: Series, curve) -> None:
        if self._drawn.get((index, key)) == series.version:
            return
        self._drawn[(index, key)] = series.version
        curve.setData(series.x, series.y)



class TensorBoardHint(QLabel):
    """Under the live charts: the command that opens the run's TensorBoard files, and a link that copies it."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.command = ""
        self.setProperty("role", "explain")
        self.setWordWrap(True)  # a run folder's path can be long
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                     | Qt.TextInteractionFlag.LinksAccessibleByMouse)
        self.linkActivated.connect(self.copy)
        self.hide()

    def set_folder(self, folder: Path | None) -> None:
        """The run's TensorBoard folder, once the worker has made it; None or no folder: nothing to open."""
        shown = folder is not None and folder.is_dir()
        self.setVisible(shown)
        command = f'tensorboard --logdir "{folder}"'
        if not shown or command == self.command:  # said already (and perhaps copied)
            return
        self.command = command
        self._say("<a href='copy'>Copy</a>")
        self.setToolTip("Run this in a terminal where TensorBoard is installed (pip install tensorboard), "
                        "then open the address it prints.")

    def copy(self) -> None:
        QApplication.clipboard().setText(self.command)
        self._say("copied")

    def _say(self, action_html: str) -> None:
        self.setText(f"Also in TensorBoard: <code>{html.escape(self.command, quote=False)}</code> &nbsp;{action_html}")
