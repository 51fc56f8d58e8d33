"""The live memory estimate: a stacked bar per GPU against its capacity, the verdict, the peak phase,
"Fit to my GPU" and a simulated check in a subprocess."""

from __future__ import annotations

import html
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QRectF, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QPainter, QPen
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QGroupBox, QHBoxLayout, QLabel, QProgressBar,
                               QPushButton, QVBoxLayout, QWidget)

from studio.core.config import RunConfig, save_config
from studio.core.errors import StudioError
from studio.core.machine import available_ram
from studio.core.sizes import GIB, format_bytes
from studio.gui.process import LineProcess
from studio.gui.state import memory
from studio.gui.state.console import console_error
from studio.gui.state.hardware import COMMON_CARDS, DEFAULT_CARD, Gpu, detect_gpus
from studio.gui.state.memory import OVERHEAD_PARTS, PART_LABELS, PHASE_LABELS, Estimate, TraceNeededError, kind_text
from studio.gui.widgets.common import BAD, GOOD, MUTED, WARN, ConfigStore, explanation

PART_COLORS = {  # one per memory part (studio.core.memory.parts.PARTS)
    "weights": "#4e79a7", "adapter_weights": "#a0cbe8", "gradients": "#f28e2b", "optimizer_state": "#e15759",
    "master_weights": "#ff9d9a", "activations": "#59a14f", "logits_loss": "#8cd17d", "temporaries": "#b6992d",
    "communication": "#499894", "cuda_context": "#9d7660", "blas_workspaces": "#d4a6c8", "allocator_margin": "#bab0ac",
}
VERDICT_COLORS = {"fits": GOOD, "tight": WARN, "does not fit": BAD}
CUSTOM = "custom"


class StackedBar(QWidget):
    """One device's estimate: a segment per part, scaled to the card's capacity (drawn as the outline)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.parts: dict[str, int] = {}
        self.capacity = 1
        self.setMinimumHeight(26)

    def sizeHint(self) -> QSize:
        return QSize(300, 28)

    def set_parts(self, parts: dict[str, int], capacity: int) -> None:
        self.parts, self.capacity = {k: v for k, v in parts.items() if v > 0}, max(capacity, 1)
        self.setToolTip("\n".join(f"{PART_LABELS[k]}: {format_bytes(v)}" for k, v in self.parts.items()))
        self.update()

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        frame = QRectF(self.rect()).adjusted(1, 1, -1, -1)
        painter.fillRect(frame, QColor("#f3f4f6"))
        total = sum(self.parts.values())
        scale = frame.width() / max(self.capacity, total)
        x = frame.left()
        for name, value in self.parts.items():
            width = value * scale
            painter.fillRect(QRectF(x, frame.top(), width, frame.height()), QColor(PART_COLORS[name]))
            x += width
        capacity_x = frame.left() + self.capacity * scale
        painter.setPen(QPen(QColor("#111827"), 2))
        painter.drawLine(int(capacity_x), int(frame.top()), int(capacity_x), int(frame.bottom()))
        painter.setPen(QPen(QColor("#9ca3af"), 1))
        painter.drawRect(frame)


CUSTOM_UNITS = {"GiB": GIB, "GB": 10**9}


class GpuPicker(QWidget):
    """The GPU to compare against: the detected ones, a common card, or a typed size."""

    changed = Signal()

    def __init__(self, detected: list[Gpu], card: str = "", custom_gib: float = 0.0, custom_unit: str = "GiB"):
        super().__init__()
        self.detected = detected
        self.combo = QComboBox()
        self.combo.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.combo.setMinimumContentsLength(22)  # long card names are elided, not widening the window
        for gpu in detected:
            self.combo.addItem(gpu.title, gpu)
        for gpu in COMMON_CARDS:
            self.combo.addItem(gpu.title, gpu)
        self.combo.addItem("Custom size…", CUSTOM)
        self.custom = QDoubleSpinBox()
        self.custom.setRange(1, 4096)
        self.unit = QComboBox()  # what the card's box says (GB) or what tools report (GiB)
        self.unit.addItems(list(CUSTOM_UNITS))
        self.unit.setToolTip("GB: 10^9 bytes, as on a card's box; GiB: 2^30 bytes, as nvidia-smi counts")
        self.unit.setCurrentText(custom_unit if custom_unit in CUSTOM_UNITS else "GiB")
        self.custom.setValue((custom_gib or 24) * GIB / CUSTOM_UNITS[self.unit.currentText()])
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(QLabel("GPU:" if detected else "Target GPU:"))
        layout.addWidget(self.combo, 1)
        layout.addWidget(self.custom)
        layout.addWidget(self.unit)
        self._select(card)
        self.combo.currentIndexChanged.connect(self._on_change)
        self.custom.valueChanged.connect(self._on_change)
        self.unit.currentTextChanged.connect(self._on_change)
        self._on_change()

    def _select(self, card: str) -> None:
        names = [self.combo.itemData(i).name if isinstance(self.combo.itemData(i), Gpu) else self.combo.itemData(i)
                 for i in range(self.combo.count())]
        wanted = card or (None if self.detected else DEFAULT_CARD)
        if wanted in names:
            self.combo.setCurrentIndex(names.index(wanted))

    def _on_change(self) -> None:
        for widget in (self.custom, self.unit):
            widget.setVisible(self.combo.currentData() == CUSTOM)
        self.changed.emit()

    @property
    def card_name(self) -> str:
        data = self.combo.currentData()
        return data.name if isinstance(data, Gpu) else CUSTOM

    @property
    def capacity_bytes(self) -> int:
        """What a run may take on the chosen GPU: a card's memory less what the display and other processes hold,
        or the typed size as it is."""
        data = self.combo.currentData()
        if isinstance(data, Gpu):
            return data.usable_bytes
        return int(self.custom.value() * CUSTOM_UNITS[self.unit.currentText()])

    @property
    def custom_gib(self) -> float:
        """The typed size in GiB (as the app's settings keep it)."""
        return self.custom.value() * CUSTOM_UNITS[self.unit.currentText()] / GIB

    def select_custom(self, gibibytes: float) -> None:
        self.combo.setCurrentIndex(self.combo.count() - 1)
        self.unit.setCurrentText("GiB")
        self.custom.setValue(gibibytes)


def _scale_out_text(estimate: Estimate, available_ram: int) -> str:
    """Where a layer split puts the layers, the CPU RAM that offloading takes beside what the machine has, and what
    each process holds while loading."""
    text = f" Layer split: {estimate.placement.summary()}." if estimate.placement is not None else ""
    host = next((d for d in estimate.devices if d.device == "host"), None)
    return text + _host_text(host, available_ram) + _loading_text(estimate)


# What the estimate's host parts hold (weights: the embedding kept there, or ZeRO's offloaded parameters)
_HOST_CONTENTS = {"weights": "offloaded weights", "activations": "offloaded activations"}


def _host_text(host, available_ram: int) -> str:
    if host is None:
        return ""
    held = [_HOST_CONTENTS.get(part, "offloaded optimizer state") for part, size in host.parts.items() if size]
    need = f" CPU RAM for {' and '.join(dict.fromkeys(held))}: {format_bytes(host.total_bytes)} of the " \
           f"{format_bytes(available_ram)} available."
    if host.total_bytes <= available_ram:
        return need
    return f"<b style='color:{BAD}'>{need} More than this machine has free: the run would not start.</b>"


def _loading_text(estimate: Estimate) -> str:
    if not estimate.loading:
        return ""
    each = [f"{entry.processes}: {format_bytes(entry.weights_bytes)} of weights"
            + (f", and the {format_bytes(entry.checkpoint_bytes)} checkpoint read into CPU RAM"
               if entry.checkpoint_bytes else "")
            for entry in estimate.loading]
    return " While the model loads: " + "; ".join(each) + "."


def _bar_title(device: str, total_bytes: int, layer_split: bool, config: RunConfig) -> str:
    """A bar's title when there are several: the device of a layer split, the stage of a pipeline with the ranks
    that run it (one in each replica), or the rank of the process on it."""
    index = int(device.rsplit(":", 1)[-1])
    stages = config.distributed.pipeline_stages
    if layer_split:
        who = device
    elif stages > 0:
        ranks = [str(index + replica * stages) for replica in range(memory.pipeline_replicas(config))]
        shown = ", ".join(ranks[:3]) + (", …" if len(ranks) > 3 else "")
        who = f"stage {index} (rank{'s' if len(ranks) > 1 else ''} {shown})"
    else:
        who = f"rank {index} ({device})"
    return f"{who}: {format_bytes(total_bytes)}"


class EstimatePanel(QGroupBox):
    """Recomputes on every config change (about a millisecond: no delay to hide)."""

    def __init__(self, store: ConfigStore, card: str = "", custom_gib: float = 0.0, custom_unit: str = "GiB",
                 parent: QWidget | None = None):
        super().__init__("Memory estimate", parent)
        self.store = store
        self.estimate: Estimate | None = None
        self.error: str = ""
        self.detected = detect_gpus()
        self.simulate_command = memory.simulate_command  # tests point this at a stand-in
        self.picker = GpuPicker(self.detected, card, custom_gib, custom_unit)
        self.picker.changed.connect(self.recompute)
        self.bars: list[tuple[QLabel, StackedBar]] = []
        self.bar_area = QVBoxLayout()
        self.verdict = QLabel()
        self.verdict.setTextFormat(Qt.TextFormat.RichText)
        self.verdict.setWordWrap(True)  # "No estimate: ..." says why in a sentence
        self.phase = explanation("")
        # The parts in one wrapping line: as many side by side as the column has room for (a narrow window too)
        self.legend = explanation("")
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend_labels: list[QLabel] = [self.legend]
        self.machine_note = explanation("" if self.detected else
                                        "No NVIDIA GPU here (training uses the CPU): the estimate is for the card you pick.")
        self.machine_note.setVisible(not self.detected)
        self.fit_button = QPushButton("Fit to my GPU")
        self.fit_button.setToolTip("Change the fewest settings needed to fit the chosen GPU, and say what and why")
        self.fit_button.clicked.connect(self.fit_to_gpu)
        self.simulate_button = QPushButton("Simulate")
        self.simulate_button.setToolTip("Run the training step on fake tensors in a separate process to check the estimate")
        self.simulate_button.clicked.connect(self.toggle_simulation)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.setMaximumWidth(90)
        self.progress.hide()
        self.result = explanation("")
        self.result.setTextFormat(Qt.TextFormat.RichText)
        self.data_lengths: tuple[int, ...] | None = None  # the data preview's token lengths (set_data_lengths)
        self.data_complete = False
        self.data_peak = explanation("")  # the run's own data beside the worst case at max_length
        self.ways = explanation("")  # a pipeline's comparison with the other ways over its GPUs, as a table
        self.ways.setTextFormat(Qt.TextFormat.RichText)
        self._build_layout()
        self._simulation = LineProcess(self)
        self._simulation.done.connect(self._simulation_done)
        self._simulation_started = 0.0
        self._simulation_dir: tempfile.TemporaryDirectory | None = None
        self._simulated: tuple[RunConfig, Estimate | None] | None = None  # what the running simulation was asked for
        self._applying_fit = False
        self._clock = QTimer(self)
        self._clock.timeout.connect(self._tick)
        store.changed.connect(self.recompute)
        self.recompute()

    def _build_layout(self) -> None:
        layout = QVBoxLayout(self)
        layout.setSpacing(3)
        layout.setContentsMargins(8, 4, 8, 6)
        # What can change length as the setup changes (the bars, the legend, the notes) is below the controls: they
        # stay where they are under the pointer.
        layout.addWidget(self.picker)
        layout.addWidget(self.machine_note)
        verdict_row = QHBoxLayout()
        verdict_row.addWidget(self.verdict, 1)
        for widget in (self.progress, self.fit_button, self.simulate_button):  # not moved by a verdict that wraps
            verdict_row.addWidget(widget, 0, Qt.AlignmentFlag.AlignTop)
        layout.addLayout(verdict_row)
        layout.addLayout(self.bar_area)
        layout.addWidget(self.legend)
        layout.addWidget(self.phase)
        layout.addWidget(self.ways)
        layout.addWidget(self.data_peak)
        layout.addWidget(self.result)

    # ------------------------------------------------------------ the estimate
    def recompute(self, *_args) -> None:
        if self.simulating and self.store.config != self._simulated[0]:
            self._simulation.stop()  # its result would describe the config before this change: dropped when it ends
        elif not self._applying_fit and not self.simulating:
            self.result.setText("")  # a fit or simulation result describes the config before this change
        try:
            self.estimate, self.error = memory.estimate_run(self.store.config, gpu_bytes=self.picker.capacity_bytes,
                                                            gpu_count=max(1, len(self.detected))), ""
        except TraceNeededError as exc:  # a family the estimate does not describe: measure its step, once
            failure = memory.trace_in_background(self.store.config, exc.path, exc.regime)
            self.estimate, self.error = None, failure or "measuring the model's memory (a traced training step)..."
            if not failure:
                QTimer.singleShot(2000, self.recompute)
        except StudioError as exc:
            self.estimate, self.error = None, exc.message
        self._show()

    def _show(self) -> None:
        capacity = self.picker.capacity_bytes
        estimate = self.estimate
        self.fit_button.setEnabled(estimate is not None)
        self._update_simulate_button()
        if estimate is None:
            self._set_bars([])
            self._set_legend({})
            self.data_peak.setText("")
            self.ways.setText("")
            self.verdict.setText(f"<span style='color:{MUTED}'>No estimate: {html.escape(self.error)}</span>")
            self.phase.setText("")
            return
        gpus = [d for d in estimate.devices if d.device != "host"]
        split = estimate.placement is not None
        self._set_bars([(_bar_title(d.device, d.total_bytes, split, self.store.config), d.parts)
                        for d in gpus])  # titled when several
        self._set_legend(gpus[0].parts)
        verdict = estimate.verdict(capacity)
        color = VERDICT_COLORS[verdict.status]
        self.verdict.setText(
            f"<b style='color:{color}; font-size:14px'>{verdict.status.capitalize()}</b>"
            f"&nbsp; {format_bytes(estimate.peak_bytes)} of {format_bytes(capacity)} "
            f"({estimate.peak_bytes / capacity:.0%})")
        headroom = verdict.headroom_bytes
        self.phase.setText(f"Peak during {PHASE_LABELS.get(estimate.peak_phase, estimate.peak_phase)}; "
                           f"{format_bytes(abs(headroom))} {'to spare' if headroom >= 0 else 'short'}; "
                           f"{estimate.trainable_parameters:,} trainable parameters."
                           + _scale_out_text(estimate, available_ram())
                           + ("" if not (notes := memory.shown_notes(self.store.config, estimate))
                              else " Note: " + "; ".join(notes) + ".")
                           + f" Estimate: {kind_text(estimate)}.")
        self.data_peak.setText(self._data_peak_text(estimate))
        self.ways.setText(html.escape(memory.ways_caption(self.store.config, estimate))
                          + _ways_table(estimate.comparison))
        self.ways.setVisible(bool(estimate.comparison))

    def set_data_lengths(self, lengths: tuple[int, ...] | None, complete: bool) -> None:
        """The token lengths of the data's rows (all of them when ``complete``), for the estimate of its own peak."""
        self.data_lengths, self.data_complete = lengths, complete
        self.recompute()

    def _longest_row(self) -> int | None:
        """The data's longest row when every row's length is known (fit then fits the data itself)."""
        return max(self.data_lengths) if self.data_complete and self.data_lengths else None

    def _data_peak_text(self, worst: Estimate) -> str:
        """The peak of the data's largest possible micro-batch, when its rows make it smaller than the worst case."""
        config = self.store.config
        own = memory.data_peak(config, self.data_lengths, self.picker.capacity_bytes, max(1, len(self.detected)))
        if own is None:
            return ""
        rows = "its rows" if self.data_complete else f"its first {len(self.data_lengths):,} rows"
        micro, longest = config.training.micro_batch_size, config.data.max_length
        return (f"Your data: {format_bytes(own.peak_bytes)} ({rows} make micro-batches of at most {own.tokens:,} "
                f"tokens); the verdict above is the worst case, micro-batches of {micro * longest:,} tokens "
                f"({micro} {'row' if micro == 1 else 'rows'} of {longest:,}).")

    def _update_simulate_button(self) -> None:
        """Simulate needs what the estimate needs (a known model); while it runs, the button cancels it."""
        self.simulate_button.setEnabled(self.simulating or self.estimate is not None)
        self.simulate_button.setText("Cancel simulation" if self.simulating else "Simulate")

    @property
    def verdict_status(self) -> str:
        return self.estimate.verdict(self.picker.capacity_bytes).status if self.estimate else ""

    def _set_bars(self, bars: list[tuple[str, dict[str, int]]]) -> None:
        while len(self.bars) < len(bars):
            title, bar = QLabel(), StackedBar()
            self.bar_area.addWidget(title)
            self.bar_area.addWidget(bar)
            self.bars.append((title, bar))
        for index, (title, bar) in enumerate(self.bars):
            visible = index < len(bars)
            title.setVisible(visible and len(bars) > 1)
            bar.setVisible(visible)
            if visible:
                title.setText(bars[index][0])
                bar.set_parts(bars[index][1], self.picker.capacity_bytes)

    def _set_legend(self, parts: dict[str, int]) -> None:
        """One entry per non-zero part, each kept on one line, the entries wrapping as the column's width allows."""
        shown = [(name, value) for name, value in parts.items() if value > 0]
        entries = [f"<span style='color:{PART_COLORS[name]}'>■</span>&nbsp;"
                   + f"{PART_LABELS[name]} {format_bytes(value)}".replace(" ", "&nbsp;") for name, value in shown]
        self.legend.setText(" &nbsp; ".join(entries))
        self.legend.setVisible(bool(shown))

    # ------------------------------------------------------------ fit
    def fit_to_gpu(self) -> None:
        """Apply the solver's fastest configuration that fits, and list what it changed and what each saves."""
        longest_row = self._longest_row()
        try:
            suggestion = memory.suggest_fit(self.store.config, self.picker.capacity_bytes, longest_row)
        except StudioError as exc:
            self.result.setText(f"<span style='color:{BAD}'>Cannot fit: {html.escape(self.store.words(exc.message))}</span>")
            return
        own_data = longest_row is not None and longest_row < self.store.config.data.max_length
        if not suggestion.changes:
            text = suggestion.explanation
            if own_data:  # the verdict above is the worst case: say which one this is
                text = (f"For your data (rows of at most {longest_row:,} tokens): {text[:1].lower()}{text[1:]} "
                        f"The verdict above is for rows of {self.store.config.data.max_length:,} tokens.")
            self.result.setText(html.escape(self.store.words(text)))
            return
        fitted_before = self.verdict_status in ("fits", "tight")
        self._applying_fit = True
        try:
            self.store.set(suggestion.config)
        finally:
            self._applying_fit = False
        lines = "".join(f"<li>{html.escape(self.store.words(change))}</li>" for change in suggestion.changes)
        what = "your data" if own_data else "it"
        outcome = {"fits": f"Now {what} fits", "tight": f"Now {what} fits, tightly"}.get(suggestion.verdict,
                                                                                         "Still does not fit")
        if fitted_before and suggestion.verdict != "does not fit":  # there was room: fit made it faster
            outcome = f"Faster, and {what} still fits" + (", tightly" if suggestion.verdict == "tight" else "")
        speed = f"; {suggestion.speed}" if suggestion.speed else ""
        advice = "" if suggestion.verdict != "does not fit" else \
            f"<br>{html.escape(self.store.words(suggestion.explanation.splitlines()[-1]))}"
        self.result.setText(f"<b>{outcome}</b> ({format_bytes(suggestion.peak_bytes)}{speed}). Changed:"
                            f"<ul style='margin:0'>{lines}</ul>{advice}")

    # ------------------------------------------------------------ simulation
    def toggle_simulation(self) -> None:
        if self._simulation.running:
            self._simulation.stop()
            return
        self._simulation_dir = tempfile.TemporaryDirectory(prefix="studio-simulate-")
        path = Path(self._simulation_dir.name) / "config.yaml"
        save_config(self.store.config, path)
        self._simulated = (self.store.config, self.estimate)
        self._simulation.start(self.simulate_command(path))
        self._simulation_started = time.monotonic()
        self._update_simulate_button()
        self.progress.show()
        self._clock.start(500)
        self._tick()

    @property
    def simulating(self) -> bool:
        return self._simulation.running

    def _tick(self) -> None:
        seconds = time.monotonic() - self._simulation_started
        self.result.setText(f"Simulating one training step on fake tensors (loading torch and the model layout)… {seconds:.0f} s")

    def _simulation_done(self, exit_code: int, error: str) -> None:
        self._simulation_dir.cleanup()
        self._clock.stop()
        self.progress.hide()
        self._update_simulate_button()
        asked_config, asked_estimate = self._simulated
        if asked_config != self.store.config:
            self.result.setText(f"<span style='color:{MUTED}'>Simulation dropped: the setup changed while it ran. "
                                "Simulate again to check this one.</span>")
            return
        result = memory.parse_simulation("\n".join(self._simulation.stdout_lines))
        if result.peak_bytes is None:
            printed = console_error("\n".join(self._simulation.all_lines))
            message, hint = (printed.message, printed.hint) if printed else (error or result.error, result.hint)
            self.result.setText(f"<span style='color:{BAD}'>Simulation failed: {html.escape(message)}</span>"
                                + (f"<br>{html.escape(hint)}" if hint else ""))
            return
        analytic = ""
        if asked_estimate is not None:  # the estimate of the config simulated, for the GPU picked then
            tensors = asked_estimate.peak_bytes - sum(asked_estimate.parts.get(k, 0) for k in OVERHEAD_PARTS)
            analytic = (f"; the estimate's tensors: {format_bytes(tensors)} "
                        f"({(result.peak_bytes - tensors) / max(tensors, 1):+.0%})")
        phase = PHASE_LABELS.get(result.peak_phase, result.peak_phase)
        self.result.setText(f"Simulated peak: <b>{format_bytes(result.peak_bytes)}</b> of tensors, during "
                            f"{phase}{analytic}.")


def _ways_table(comparison) -> str:
    """A pipeline's comparison (studio.core.memory.placement.WayCost) as a small table: per GPU, idle, links."""
    if not comparison:
        return ""
    cell = "<td style='padding:0 8px 0 0'>{}</td>"
    head = "".join(cell.format(f"<b>{title}</b>") for title in ("Way over the GPUs", "Per GPU", "Idle",
                                                                  "Over the links a step"))
    rows = "".join("<tr>" + "".join(cell.format(text) for text in (
        html.escape(way.way), format_bytes(way.peak_bytes), f"{way.idle:.0%}",
        format_bytes(way.link_bytes) + ("" if way.overlapped else " (not overlapped)"))) + "</tr>"
        for way in comparison)
    return f"<table cellspacing='0'><tr>{head}</tr>{rows}</table>"
