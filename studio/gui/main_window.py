"""The main window: setup on the left (model, data, techniques, memory estimate), the run on the right
(live charts, history, export, try it), run controls in the toolbar, progress in the status bar."""

from __future__ import annotations

import html
from pathlib import Path

from PySide6.QtCore import QPoint, QRect, QSettings, QSize, Qt
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QIcon, QKeySequence
from PySide6.QtWidgets import (QApplication, QLabel, QMainWindow, QMessageBox, QSizePolicy, QSplitter, QTabWidget,
                               QToolBar, QVBoxLayout, QWidget)

from studio.core.config import RunConfig, differences
from studio.core.errors import Problem
from studio.core.presets import (RESOURCES, demo_config, grpo_demo_config, preference_demo_config,
                                  vision_demo_config, with_demo_model)
from studio.core.run.directory import default_runs_root
from studio.core.runtime.self_test import SelfTestReport, latest_report
from studio.core.validation import machine_problems
from studio.gui.log_dialog import LogDialog
from studio.gui.panels.data import DataPanel
from studio.gui.panels.estimate import EstimatePanel
from studio.gui.panels.evaluate import EvaluatePanel
from studio.gui.panels.export import ExportPanel
from studio.gui.panels.history import HistoryPanel
from studio.gui.panels.model import ModelPanel
from studio.gui.panels.samples import SamplesPanel
from studio.gui.panels.scale import ScalePanel
from studio.gui.panels.techniques import TechniquesPanel
from studio.gui.panels.try_it import TryPanel
from studio.gui.runs import RunController
from studio.gui.runtime.dialog import open_runtime_dialog
from studio.gui.runtime.self_test import SelfTestDialog
from studio.gui.state import settings as app_settings
from studio.gui.state.changes import change_lines
from studio.gui.state.hardware import detect_gpus
from studio.gui.state.job_state import TERMINAL, State, status_text
from studio.gui.state.memory import has_gpu_calibration
from studio.gui.state.run_history import live_runs
from studio.gui.tasks import FirstFrameGate, GuiThreadGarbageCollector, wait_for_background_work
from studio.gui.widgets.charts import WAITING, ChartsPanel, TensorBoardHint
from studio.gui.widgets.common import Banner, ConfigStore, VerticalScroll, WheelNeedsFocus, problems_html

ICON = RESOURCES / "icons" / "finetune-studio.png"
CLOSE_STOP, CLOSE_LEAVE, CLOSE_CANCEL = "stop", "leave", "cancel"
PREFERRED_SIZE = QSize(1280, 800)  # the first window's size where the screen has room for it
FRAME_ALLOWANCE = QSize(16, 40)  # what a window manager's frame and title bar add around the window (a guess:
# before the first show it is not known)
START_REASON_WIDTH = 420  # the Start-off reason in the toolbar: one line, elided beyond this


def available_geometry(window: QWidget) -> QRect:
    """The room on the screen the window opens on, less panels and taskbars (tests give another screen)."""
    screen = window.screen() or QGuiApplication.primaryScreen()
    return screen.availableGeometry()


def first_geometry(available: QRect) -> QRect:
    """Where the first window goes (no saved geometry): the preferred size, shrunk to what the screen leaves with
    the frame around it, centred. Its corner is the frame's (as ``move`` takes it), its size the window's own (as
    ``resize`` takes it)."""
    room = available.size() - FRAME_ALLOWANCE
    size = PREFERRED_SIZE.boundedTo(room)
    corner = available.topLeft() + QPoint((room.width() - size.width()) // 2, (room.height() - size.height()) // 2)
    return QRect(corner, size)


class MainWindow(QMainWindow):
    def __init__(self, runs_root: Path | None = None, attach_live_runs: bool = True):
        super().__init__()
        WheelNeedsFocus.install(QApplication.instance())  # before any control is shown (polished)
        with FirstFrameGate(self):  # the data preview and the run history are read once the window is painted
            self._build(runs_root, attach_live_runs)

    def _build(self, runs_root: Path | None, attach_live_runs: bool) -> None:
        self.garbage_collector = GuiThreadGarbageCollector(self)
        self.setWindowTitle("Finetune Studio")
        if ICON.is_file():
            self.setWindowIcon(QIcon(str(ICON)))
        self.settings = app_settings.load_settings()
        config, self.unreadable_choices = app_settings.read_last_config()
        self.store = ConfigStore(config, self)
        self.runs_root = Path(runs_root) if runs_root else default_runs_root()
        self.controller = RunController(self.runs_root, self)
        self.ask_close_choice = self._ask_close_choice  # tests answer the question themselves
        self._shown_state: State | None = None

        self.model_panel = ModelPanel(self.store, self.settings)
        self.data_panel = DataPanel(self.store)
        self.techniques_panel = TechniquesPanel(self.store)
        self.scale_panel = ScalePanel(self.store)
        self.estimate_panel = EstimatePanel(self.store, self.settings.gpu_card, self.settings.gpu_custom_gib,
                                            self.settings.gpu_custom_unit)
        self.charts = ChartsPanel()
        self.tensorboard_hint = TensorBoardHint()
        self.samples_panel = SamplesPanel()
        self.history = HistoryPanel(self.runs_root)
        self.export_panel = ExportPanel()
        self.try_panel = TryPanel()
        self.evaluate_panel = EvaluatePanel()
        self.run_banner = Banner()
        self.notice = Banner()
        self.changes_notice = Banner()  # what a preset, or a choice that rules a saver out, changed
        self.self_test_offer = Banner()
        self.self_test_dialog: SelfTestDialog | None = None
        self.problems = QLabel()
        self.status = QLabel()

        self._build_actions()
        self._build_layout()
        self._connect()
        self.data_panel.set_model(self.model_panel.summary)
        self._show_unreadable_choices()
        self.show_self_test(latest_report())
        self._restore_window_state()
        self._on_config_changed()
        self._on_run_changed()
        if attach_live_runs:
            self._attach_to_live_run()

    # ------------------------------------------------------------ building
    def _show_unreadable_choices(self) -> None:
        """Say why the last choices are gone instead of silently opening the demo preset."""
        error = self.unreadable_choices
        if error is None:
            return
        path = app_settings.choices_path()
        problems = getattr(error, "problems", None) or [Problem(str(path), error.message, error.hint)]
        self.notice.show_message(self.store.words(problems_html(
            "Your last choices could not be read", problems,
            f"The file was kept as {path.name}.broken; the window opens with the demo preset.")), error=True)
        self.notice.add_button("Dismiss", self.notice.hide)

    def _build_actions(self) -> None:
        toolbar = QToolBar("Run")
        toolbar.setObjectName("run-toolbar")
        toolbar.setMovable(False)
        toolbar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextOnly)
        self.addToolBar(toolbar)
        self.start_action = self._action(toolbar, "▶  Start", self.start_run, "Ctrl+Return")
        self.stop_action = self._action(toolbar, "■  Stop and save", self.controller.stop)
        self.cancel_action = self._action(toolbar, "✕  Cancel", self.controller.cancel)
        self.start_reason = QLabel()  # why Start is off, next to it, in a line; the problems are listed elsewhere
        self.start_reason.setProperty("role", "reason")
        self.start_reason.setTextFormat(Qt.TextFormat.PlainText)
        self.start_reason.setMaximumWidth(START_REASON_WIDTH)
        self.start_reason.setContentsMargins(4, 0, 8, 0)
        self.start_reason_action = toolbar.addWidget(self.start_reason)  # a toolbar shows it through its action
        self.resume_action = self._action(toolbar, "↻  Resume", lambda: self.resume_run())
        toolbar.addSeparator()
        self.log_action = self._action(toolbar, "Log", self.show_log, "Ctrl+L")
        self.run_name = QLabel()
        self.run_name.setContentsMargins(12, 0, 8, 0)
        spacer = QWidget()
        spacer.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Preferred)
        toolbar.addWidget(spacer)
        toolbar.addWidget(self.run_name)
        setup_menu = self.menuBar().addMenu("&Setup")
        self.new_setup_action = setup_menu.addAction("New setup (the demo's settings and data)", self.new_setup)
        self.new_setup_action.setShortcut(QKeySequence.StandardKey.New)
        self.preference_setup_action = setup_menu.addAction("New preference setup (DPO on the demo's pairs)",
                                                            self.new_preference_setup)
        self.grpo_setup_action = setup_menu.addAction("New GRPO setup (a format reward on the demo's prompts)",
                                                      self.new_grpo_setup)
        self.vision_setup_action = setup_menu.addAction("New vision setup (the tiny vision model names colours)",
                                                        self.new_vision_setup)
        runtime_menu = self.menuBar().addMenu("&Runtime")
        self.runtime_action = runtime_menu.addAction("Training runtime…", lambda: open_runtime_dialog(self))
        self.self_test_action = runtime_menu.addAction("GPU self-test…", self.open_self_test)

    def _action(self, toolbar: QToolBar, text: str, slot, shortcut: str = "") -> QAction:
        action = QAction(text, self)
        action.triggered.connect(slot)
        if shortcut:
            action.setShortcut(QKeySequence(shortcut))
        toolbar.addAction(action)
        return action

    def _build_layout(self) -> None:
        # Each container is put in its place before it is filled: under the app's style sheet, a polished
        # widget given a new parent is polished again with all its children (built bottom-up: 0.2 s more).
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.setCentralWidget(self.splitter)
        left, right = QWidget(), QWidget()
        self.splitter.addWidget(left)
        self.splitter.addWidget(right)
        self._build_setup_column(left)
        self._build_run_column(right)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([520, 760])
        self.statusBar().addWidget(self.status, 1)

    def _build_setup_column(self, left: QWidget) -> None:
        """The notices, then the setup tabs and the estimate in a splitter."""
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(6, 6, 0, 6)
        left_layout.addWidget(self.notice)
        left_layout.addWidget(self.changes_notice)
        self.changes_notice.add_button("Dismiss", self.changes_notice.hide)
        self.changes_notice.hide()
        left_layout.addWidget(self.self_test_offer)
        self.self_test_offer.add_button("Run the GPU self-test", self._accept_self_test_offer)
        self.self_test_offer.add_button("Not now", self.self_test_offer.hide)
        # The tabs and the estimate share the column in a splitter: its sizes change when the window is resized or
        # the handle dragged, never as the estimate's text grows or shrinks (the controls stay under the pointer).
        self.setup_splitter = QSplitter(Qt.Orientation.Vertical, left)
        self.setup_splitter.setChildrenCollapsible(False)
        left_layout.addWidget(self.setup_splitter, 1)
        self.setup_tabs = QTabWidget()
        self.setup_splitter.addWidget(self.setup_tabs)
        self.setup_tabs.addTab(self.model_panel, "1  Model")
        self.setup_tabs.addTab(self.data_panel, "2  Data")
        self.setup_tabs.addTab(self.techniques_panel, "3  Techniques")
        self.setup_tabs.addTab(self.scale_panel, "4  Scale out")
        self.setup_tabs.setMinimumHeight(240)  # a long estimate scrolls rather than squeeze the setup away
        self.under_tabs = VerticalScroll(QWidget())  # scrolls on a short screen when the estimate has much to say
        self.setup_splitter.addWidget(self.under_tabs)
        self.under_tabs.setMinimumHeight(120)
        # Its scroll bar always there: one that came and went with the text's length would move the buttons sideways
        self.under_tabs.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOn)
        self.setup_splitter.setStretchFactor(0, 1)
        self.setup_splitter.setStretchFactor(1, 0)
        self.problems.setWordWrap(True)
        self.problems.setTextFormat(Qt.TextFormat.RichText)  # escaped text: an apostrophe is &#x27; until rendered
        self.problems.setProperty("role", "reason")
        under_layout = QVBoxLayout(self.under_tabs.widget())
        under_layout.setContentsMargins(0, 0, 0, 0)
        under_layout.addWidget(self.problems)
        under_layout.addWidget(self.estimate_panel)
        under_layout.addStretch(1)

    def _build_run_column(self, right: QWidget) -> None:
        """The run's banner, then its tabs: charts, samples, history, export, try it, evaluate."""
        self.run_tabs = QTabWidget(right)
        training = QWidget()
        training_layout = QVBoxLayout(training)
        training_layout.setContentsMargins(0, 0, 0, 0)
        training_layout.addWidget(self.charts, 1)
        training_layout.addWidget(self.tensorboard_hint)
        self.run_tabs.addTab(training, "Training")
        self.run_tabs.addTab(self.samples_panel, "Samples")
        self.run_tabs.addTab(self.history, "History")
        self.run_tabs.addTab(self.export_panel, "Export")
        self.run_tabs.addTab(self.try_panel, "Try it")
        self.run_tabs.addTab(self.evaluate_panel, "Evaluate")
        right_layout = QVBoxLayout(right)
        right_layout.setContentsMargins(0, 6, 6, 6)
        right_layout.addWidget(self.run_banner)
        right_layout.addWidget(self.run_tabs, 1)
        self.apply_fix_button = self.run_banner.add_button("Apply the suggested change", self.apply_suggested_fix)
        self.apply_fix_button.hide()
        self.run_banner.add_button("Open log", self.show_log)

    def _connect(self) -> None:
        self.store.changed.connect(self._on_config_changed)
        self.store.switched_off.connect(lambda text: self.changes_notice.show_message(html.escape(text, quote=False), error=False))
        self.model_panel.summary_changed.connect(self.data_panel.set_model)
        self.model_panel.demo_requested.connect(self.use_demo_preset)
        self.data_panel.lengths_changed.connect(self.estimate_panel.set_data_lengths)
        self.data_panel.problems_changed.connect(self._on_config_changed)  # Start waits for the data's problems
        self.model_panel.summary_changed.connect(self._on_config_changed)  # its problems may have changed
        self.controller.changed.connect(self._on_run_changed)
        self.controller.run_replaced.connect(lambda series: self.charts.show_runs([series]))
        self.controller.run_replaced.connect(self.samples_panel.show_run)
        self.controller.changed.connect(self.samples_panel.refresh)
        self.history.resume_requested.connect(self.resume_run)
        self.history.export_requested.connect(self._export_from_history)

    # ------------------------------------------------------------ the GPU self-test
    def open_self_test(self) -> SelfTestDialog:
        """Runtime ▸ GPU self-test…: its dialog (one, kept), whose results mark the techniques that failed."""
        if self.self_test_dialog is None:
            self.self_test_dialog = SelfTestDialog(self)
            self.self_test_dialog.report_ready.connect(self.show_self_test)
        self.self_test_dialog.show()
        self.self_test_dialog.raise_()
        return self.self_test_dialog

    def show_self_test(self, report: SelfTestReport | None) -> None:
        """Each technique that failed the last self-test is marked beside its control, with the reason and fix."""
        self.techniques_panel.mark_self_test(report.marks() if report is not None else {})

    def offer_self_test(self) -> None:
        """On the first start with an NVIDIA GPU and no calibration of it, offer the self-test, once (remembered)."""
        gpus = [] if self.settings.self_test_offered or has_gpu_calibration() else detect_gpus()
        if not gpus:
            return
        self.settings.self_test_offered = True
        app_settings.save_settings(self.settings)
        self.self_test_offer.show_message(
            f"This machine has an NVIDIA GPU ({html.escape(gpus[0].name)}). The GPU self-test checks every technique "
            "on it in about a minute and measures what CUDA itself takes, so that the memory estimate is this "
            "machine's own (also any time from Runtime ▸ GPU self-test…).", error=False)

    def _accept_self_test_offer(self) -> None:
        self.self_test_offer.hide()
        self.open_self_test().start()

    def use_demo_preset(self) -> None:
        """The demo model with the settings it trains with (not a big model's 4-bit base, bf16 or savers), the
        user's data kept."""
        self._apply_preset(with_demo_model(self.store.config), "The demo model, with the settings it trains with.")

    def new_setup(self) -> None:
        """Start over from the demo preset: its model, data and settings."""
        self._apply_preset(demo_config(), "A new setup: the demo's model, data and settings.")

    def new_preference_setup(self) -> None:
        """Start over from the preference demo: the demo model learns a style of answer from chosen/rejected pairs."""
        self._apply_preset(preference_demo_config(), "A new setup: DPO on the demo's preference pairs.")

    def new_grpo_setup(self) -> None:
        """Start over from the GRPO demo: the demo model learns a format from prompts and a reward alone."""
        self._apply_preset(grpo_demo_config(), "A new setup: GRPO on the demo's prompts, a format reward scoring "
                           "the completions.")

    def new_vision_setup(self) -> None:
        """Start over from the vision demo: the tiny vision-language model learns to name the colour of a drawing."""
        self._apply_preset(vision_demo_config(), "A new setup: the tiny vision-language model on drawn shapes, asked "
                           "their colour.")

    def _apply_preset(self, config: RunConfig, title: str) -> None:
        """Set ``config`` and say what that changed, in the window's words."""
        before = self.store.config
        self.store.set(config)
        lines = change_lines(differences(before, config), self.store.labels)
        self.changes_notice.show_message(f"<b>{html.escape(title, quote=False)}</b>"
                                        + (_bullet_columns(lines) if lines else " Nothing changed."), error=False)

    # ------------------------------------------------------------ runs
    def start_blockers(self) -> list[Problem]:
        """What must be fixed before Start: the config's problems, the model's (``studio config check``'s), the
        data's (what its preview found), and what this machine cannot run correctly."""
        config = self.store.config
        return (self.store.problems() + self.model_panel.problems + self.data_panel.problems
                + machine_problems(config, nvidia_gpu=bool(self.estimate_panel.detected)))

    def start_run(self) -> None:
        if self.controller.job.active or self.start_blockers():
            return
        app_settings.save_last_config(self.store.config)
        self.controller.start(self.store.config)
        self.run_tabs.setCurrentWidget(self.charts)

    def resume_run(self, run_dir: Path | None = None) -> None:
        if self.controller.job.active:
            return
        self.controller.resume(run_dir)
        self.run_tabs.setCurrentWidget(self.charts)

    def show_log(self) -> None:
        if self.controller.run_dir is not None:
            LogDialog(self.controller.run_dir.path, self).exec()

    def _attach_to_live_run(self) -> None:
        """A run left running by an earlier window (or started from the command line) is followed again."""
        running = live_runs(self.runs_root)
        if running:
            self.controller.attach(running[0])

    def _export_from_history(self, run_dir: Path) -> None:
        self._choose_run(run_dir)
        self.run_tabs.setCurrentWidget(self.export_panel)

    def _choose_run(self, run_dir: Path) -> None:
        """The run to export, try and evaluate."""
        for panel in (self.export_panel, self.try_panel, self.evaluate_panel):
            panel.set_run(run_dir)

    def _on_run_changed(self) -> None:
        controller, job = self.controller, self.controller.job
        active = job.active
        self.status.setText(status_text(job, controller.loading_note))
        self.charts.set_waiting_text(self._waiting_text())
        problems = self.start_blockers()
        self.start_action.setEnabled(not active and not problems)
        self.start_action.setToolTip("A run is in progress" if active else
                                     ("Fix first: " + "; ".join(self.store.words(str(p)) for p in problems)
                                      if problems else "Start training"))
        self._show_start_reason("" if active or not problems else self._start_reason(problems))
        self.start_reason_action.setVisible(not active and bool(problems))
        self.stop_action.setEnabled(active)
        self.stop_action.setText("■  Stop now (abort)" if job.state is State.STOPPING else "■  Stop and save")
        self.cancel_action.setEnabled(active)
        resumable = job.state in (State.FAILED, State.CRASHED) or job.final_status in ("stopped", "aborted")
        has_checkpoint = controller.run_dir is not None and controller.run_dir.latest_checkpoint() is not None
        self.resume_action.setEnabled(not active and resumable and has_checkpoint)
        self.log_action.setEnabled(controller.run_dir is not None)
        self.run_name.setText(controller.run_dir.path.name if controller.run_dir else "")
        self.tensorboard_hint.set_folder(controller.run_dir.tensorboard_dir if controller.run_dir else None)
        self._show_run_banner()
        if job.state is not self._shown_state and controller.run_dir is not None:
            self._on_run_state_changed(job.state, controller.run_dir.path)
        self._shown_state = job.state

    def _on_run_state_changed(self, state: State, run_dir: Path) -> None:
        """History lists the run's new status; a run that ended becomes the one to export, try and evaluate."""
        self.history.refresh()
        if state in TERMINAL:
            self._choose_run(run_dir)

    def listed_problems(self) -> list[Problem]:
        """The problems listed under the tabs: the setup's and this machine's. The model's are listed in 1 Model and
        the data's in 2 Data, where they are fixed; the window says each once."""
        config = self.store.config
        problems = self.store.problems() + machine_problems(config, nvidia_gpu=bool(self.estimate_panel.detected))
        shown = {str(p) for p in self.model_panel.problems + self.data_panel.problems}
        return [p for p in problems if str(p) not in shown]

    def _start_reason(self, problems: list[Problem]) -> str:
        """A short pointer to where the problems are listed: one line, never their text."""
        listed = len(self.listed_problems())
        where = {"1 Model": len(self.model_panel.problems), "2 Data": len(self.data_panel.problems),
                 "under the tabs": listed}
        where = {place: count for place, count in where.items() if count}
        if list(where) == ["1 Model"]:
            return "⚠ Cannot start: the model cannot be loaded (see 1 Model)"
        if list(where) == ["2 Data"]:
            return "⚠ Cannot start: the data has problems (see 2 Data)"
        count = sum(where.values()) or len(problems)
        places = list(where) or ["under the tabs"]
        places = ", ".join(places[:-1]) + " and " + places[-1] if len(places) > 1 else places[0]
        places = places if places.startswith("under") else "in " + places
        return f"⚠ Cannot start: {count} problem{'s' if count > 1 else ''}, listed {places}"

    def _show_start_reason(self, text: str) -> None:
        """The reason in one line: elided to the room it has beside Start, whole in its tooltip."""
        metrics = self.start_reason.fontMetrics()
        room = START_REASON_WIDTH - self.start_reason.contentsMargins().left() - self.start_reason.contentsMargins().right()
        self.start_reason.setText(metrics.elidedText(text, Qt.TextElideMode.ElideRight, room))
        self.start_reason.setToolTip(text)

    def _waiting_text(self) -> str:
        job = self.controller.job
        if job.state is State.STARTING:
            note = self.controller.loading_note
            return note[:1].upper() + note[1:]
        if job.state in (State.FAILED, State.CRASHED):
            return "The run ended before its first step: see the message above and the log."
        return WAITING

    def _show_run_banner(self) -> None:
        job = self.controller.job
        fix = job.error.fix if job.state is State.FAILED and job.error is not None else None
        self.apply_fix_button.setVisible(fix is not None)
        if fix is not None:
            self.apply_fix_button.setToolTip(f"Change the setup on the left: {fix['description']}")
        if job.state in (State.FAILED, State.CRASHED) and job.error is not None:
            title = "Training failed" if job.state is State.FAILED else "The training worker crashed"
            words = self.store.words  # the worker's message names settings by config keys: here, by their labels
            hint = f"<br><b>What to do:</b> {html.escape(words(job.error.hint))}" if job.error.hint else ""
            self.run_banner.show_message(f"<b>{title}:</b> {html.escape(words(job.error.message))}{hint}", error=True)
        elif job.state is State.FINISHED:
            messages = {"completed": f"Completed {job.step} steps. Export it, try it or evaluate it in the tabs on the right.",
                        "stopped": f"Stopped and saved at step {job.step}. Resume continues from there.",
                        "aborted": f"Cancelled at step {job.step}; nothing was saved after the last checkpoint."}
            self.run_banner.show_message(messages[job.final_status], error=False)
        elif job.warnings:
            self.run_banner.show_message(self._warning_html(job.warnings), error=False)
        else:
            self.run_banner.hide()

    def _warning_html(self, warnings: list[tuple[str, str]]) -> str:
        """While a run trains: what it warned of last (a reward file failing on a row, a reward that teaches
        nothing, prompts left out), with what to do and how many warnings the log has."""
        message, hint = (html.escape(self.store.words(text)) for text in warnings[-1])
        more = f" ({len(warnings)} warnings so far: Open log shows each)" if len(warnings) > 1 else ""
        return f"<b>The run warns:</b> {message}" + (f"<br><b>What to do:</b> {hint}" if hint else "") + more

    def apply_suggested_fix(self) -> None:
        """Apply the failed run's suggested config change to the setup; the user starts the new run."""
        job = self.controller.job
        if job.error is None or job.error.fix is None:
            return
        self.store.update(**job.error.fix["changes"])
        self.apply_fix_button.hide()
        self.run_banner.show_message(f"Applied: {html.escape(job.error.fix['description'])}. "
                                     "Check the estimate, then start a new run.", error=False)

    # ------------------------------------------------------------ config
    def _on_config_changed(self, *_args) -> None:
        listed = self.listed_problems()
        words = [html.escape(self.store.words(str(p)), quote=False) for p in listed]
        if len(words) > 1:
            items = "".join(f"<li>{line}</li>" for line in words)
            text = f"⚠ Fix before starting:<ul style='margin:0; margin-left:-24px'>{items}</ul>"
        else:
            text = "".join(f"⚠ Fix before starting: {line}" for line in words)
        if text and text != self.problems.text():
            self.under_tabs.verticalScrollBar().setValue(0)  # a new problem shows, even where the estimate was scrolled
        self.problems.setText(text)
        self.problems.setVisible(bool(listed))
        self._on_run_changed()

    # ------------------------------------------------------------ window state
    def _window_state(self) -> QSettings:
        return QSettings(str(app_settings.window_state_path()), QSettings.Format.IniFormat)

    def _restore_window_state(self) -> None:
        state = self._window_state()
        if state.value("geometry") is not None:
            self.restoreGeometry(state.value("geometry"))
        else:  # the first start: as large as the screen leaves room for, up to 1280x800
            first = first_geometry(available_geometry(self))
            self.resize(first.size())
            self.move(first.topLeft())
        column = max(self.height() - 100, 400)  # the setup column, less the menu, toolbar and status bar
        estimate = min(300, int(column * 0.45))
        self.setup_splitter.setSizes([column - estimate, estimate])
        if state.value("splitter") is not None:
            self.splitter.restoreState(state.value("splitter"))
        if state.value("setup_splitter") is not None:
            self.setup_splitter.restoreState(state.value("setup_splitter"))
        self.setup_tabs.setCurrentIndex(self.settings.left_tab)
        self.run_tabs.setCurrentIndex(self.settings.right_tab)

    def save_state(self) -> None:
        state = self._window_state()
        state.setValue("geometry", self.saveGeometry())
        state.setValue("splitter", self.splitter.saveState())
        state.setValue("setup_splitter", self.setup_splitter.saveState())
        state.sync()
        self.settings.left_tab = self.setup_tabs.currentIndex()
        self.settings.right_tab = self.run_tabs.currentIndex()
        self.settings.gpu_card = self.estimate_panel.picker.card_name
        self.settings.gpu_custom_gib = self.estimate_panel.picker.custom_gib
        self.settings.gpu_custom_unit = self.estimate_panel.picker.unit.currentText()
        app_settings.save_settings(self.settings)
        app_settings.save_last_config(self.store.config)

    def closeEvent(self, event: QCloseEvent) -> None:
        if self.controller.job.active:
            choice = self.ask_close_choice()
            if choice == CLOSE_CANCEL:
                event.ignore()
                return
            if choice == CLOSE_STOP and self.controller.job.state is not State.STOPPING:
                self.controller.stop()
        self.save_state()
        self.controller.shutdown()
        wait_for_background_work()
        self.garbage_collector.stop()
        event.accept()

    def _ask_close_choice(self) -> str:
        box = QMessageBox(QMessageBox.Icon.Question, "A run is in progress",
                          "Training runs in its own process. Stop it and save a checkpoint, or leave it running? "
                          "A run left running is picked up again the next time the app opens.", parent=self)
        stop = box.addButton("Stop and save", QMessageBox.ButtonRole.AcceptRole)
        leave = box.addButton("Leave it running", QMessageBox.ButtonRole.DestructiveRole)
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.exec()
        clicked = box.clickedButton()
        return CLOSE_STOP if clicked is stop else CLOSE_LEAVE if clicked is leave else CLOSE_CANCEL


def _bullet_columns(lines: list[str], per_column: int = 7) -> str:
    """The lines as bullets, side by side in columns of ``per_column`` when there are more (a preset changes many
    fields, and the notice sits above the tabs the user needs to see)."""
    columns = [lines[start:start + per_column] for start in range(0, len(lines), per_column)]
    cells = "".join("<td valign='top'><ul style='margin:0'>"
                    + "".join(f"<li>{html.escape(line)}</li>" for line in column) + "</ul></td>" for column in columns)
    return f"<table cellspacing='0' cellpadding='0'><tr>{cells}</tr></table>"
