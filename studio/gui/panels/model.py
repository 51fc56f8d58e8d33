"""The model picker: the embedded demo model, a local folder, a Hub id, or a recent one; and what it is."""

from __future__ import annotations

import html

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel, QLineEdit,
                               QPushButton, QVBoxLayout, QWidget)

from studio.core.config import RunConfig
from studio.core.errors import Problem, StudioError
from studio.core.model.check import is_local_model, model_problems, remote_code_warning
from studio.core.presets import DEMO_MODEL
from studio.core.sizes import format_bytes
from studio.gui.state.model_summary import (WEIGHT_SUFFIXES, ModelSummary, human_count, looks_like_hub_id,
                                            summarize_model)
from studio.gui.state.settings import AppSettings
from studio.gui.widgets.common import BAD, GOOD, WARN, Banner, ConfigStore, explanation, problems_html, VerticalScroll
from studio.gui.widgets.controls import ToggleControl


class ModelPanel(VerticalScroll):
    summary_changed = Signal(object)  # ModelSummary or None
    demo_requested = Signal()  # Demo model: the demo preset, with the settings the tiny model trains with

    def __init__(self, store: ConfigStore, settings: AppSettings, parent: QWidget | None = None):
        super().__init__(parent=parent)
        self.store, self.settings = store, settings
        self.summary: ModelSummary | None = None
        self.problems: list[Problem] = []  # what stops this model loading: Start waits for them to be fixed
        self._shown_model: tuple[str, str] | None = None  # name and revision the facts describe
        self.choose_folder_dialog = lambda: QFileDialog.getExistingDirectory(self, "Choose a model folder")

        self.demo_button = QPushButton("Demo model")
        self.demo_button.setToolTip("The tiny Llama embedded in the app, with the settings it trains with: trains in minutes "
                                    "on a CPU, no download")
        self.demo_button.clicked.connect(self.demo_requested.emit)  # the window applies the demo preset
        self.folder_button = QPushButton("Local folder…")
        self.folder_button.clicked.connect(self._choose_folder)
        self.hub_id = QLineEdit()
        self.hub_id.setPlaceholderText("Hugging Face Hub id, e.g. Qwen/Qwen2.5-0.5B")
        self.hub_id.returnPressed.connect(self._use_hub_id)
        hub_button = QPushButton("Use")
        hub_button.clicked.connect(self._use_hub_id)
        self.recent = QComboBox()
        self.recent.activated.connect(self._use_recent)

        self.current = QLabel()
        self.current.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.current.setWordWrap(True)
        self.banner = Banner()
        self.trust_remote_code = ToggleControl(
            store, "model.trust_remote_code", "Run Python code shipped with the model (trust_remote_code)",
            "Some models need their own code to load. It runs with your user's rights: turn this on only for a "
            "model whose code you have read, pinned to that revision.", compact=True)
        self.remote_code_warning = explanation("", role="reason")
        self.remote_code_warning.hide()
        self.facts: dict[str, QLabel] = {}
        self._build_layout(hub_button)
        store.changed.connect(self._on_config)
        self._fill_recent()
        self._on_config(store.config)

    def _build_layout(self, hub_button: QPushButton) -> None:
        source = QGroupBox("Base model")
        grid = QVBoxLayout(source)
        buttons = QHBoxLayout()
        buttons.addWidget(self.demo_button)
        buttons.addWidget(self.folder_button)
        buttons.addStretch(1)
        grid.addLayout(buttons)
        hub = QHBoxLayout()
        hub.addWidget(self.hub_id, 1)
        hub.addWidget(hub_button)
        grid.addLayout(hub)
        grid.addWidget(explanation("A Hub id is downloaded by the training worker at Start (needs the network once); "
                                   "models already in your Hugging Face cache work offline."))
        recent = QHBoxLayout()
        recent.addWidget(QLabel("Recent:"))
        recent.addWidget(self.recent, 1)
        grid.addLayout(recent)
        grid.addWidget(self.trust_remote_code)
        grid.addWidget(self.remote_code_warning)

        info = QGroupBox("This model")
        form = QFormLayout(info)
        form.addRow("Model:", self.current)
        for key in ("Architecture", "Parameters", "Context length", "Stored dtype", "Vocabulary", "Weights",
                    "Chat template"):
            label = QLabel("–")
            label.setWordWrap(True)  # a long fact (a note beside the count) must not widen the window
            label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.facts[key] = label
            form.addRow(f"{key}:", label)

        content = QWidget()
        layout = QVBoxLayout(content)
        layout.addWidget(source)
        layout.addWidget(self.banner)
        layout.addWidget(info)
        layout.addStretch(1)
        self.setWidget(content)

    # ------------------------------------------------------------ choosing
    def use_model(self, name_or_path: str) -> None:
        name_or_path = name_or_path.strip()
        if not name_or_path:
            return
        if name_or_path == self.store.config.model.name_or_path:
            self._shown_model = None  # chosen again: read its files again (weights copied in meanwhile)
            self._on_config(self.store.config)
        else:
            self.store.update(model={"name_or_path": name_or_path, "revision": ""})

    def _choose_folder(self) -> None:
        folder = self.choose_folder_dialog()
        if folder:
            self.use_model(folder)

    def _use_hub_id(self) -> None:
        self.use_model(self.hub_id.text())

    def _use_recent(self, index: int) -> None:
        self.use_model(self.recent.itemText(index))

    def _fill_recent(self) -> None:
        self.recent.clear()
        self.recent.addItems(self.settings.recent_models or [str(DEMO_MODEL)])

    # ------------------------------------------------------------ showing
    def _on_config(self, config: RunConfig) -> None:
        self._show_remote_code_warning(config)
        name = config.model.name_or_path
        if (name, config.model.revision) == self._shown_model:
            return
        self._shown_model = (name, config.model.revision)
        self.current.setText(name or "(none chosen)")
        self.hub_id.setText(name if looks_like_hub_id(name) and not is_local_model(name) else "")
        problems = self.problems = model_problems(name, config.model.revision)
        try:
            self.summary = summarize_model(name, config.model.revision)
        except StudioError as exc:
            self.summary = None
            self._show_facts(None)
            if not problems:
                self.banner.show_message(self.store.words(f"<b>{html.escape(exc.message)}</b><br>"
                                                          f"{html.escape(exc.hint)}"), error=True)
        else:
            self.banner.hide()
            self._show_facts(self.summary)
            if not problems:
                self.settings.remember_model(name)
                self._fill_recent()
        if problems:
            what = "This model folder" if is_local_model(name) else "This model"
            self.banner.show_message(self.store.words(problems_html(f"{what} cannot be loaded", problems)), error=True)
            if any(p.where.endswith(WEIGHT_SUFFIXES) or p.message.startswith("no weights") for p in problems):
                self.facts["Weights"].setText(f"<span style='color:{BAD}'>damaged or missing</span>: see the problem above")
        self.summary_changed.emit(self.summary)

    def _show_remote_code_warning(self, config: RunConfig) -> None:
        model = config.model
        if model.trust_remote_code:
            message, hint = remote_code_warning(model.name_or_path, model.revision)
            self.remote_code_warning.setText(self.store.words(f"⚠ {message}. To do: {hint}."))
        self.remote_code_warning.setVisible(model.trust_remote_code)

    def _show_facts(self, s: ModelSummary | None) -> None:
        if s is None:
            for label in self.facts.values():
                label.setText("–")
            return
        if s.weights_local:
            weights = f"<span style='color:{GOOD}'>present locally</span> ({format_bytes(s.weights_bytes)})"
        elif s.local_folder:
            weights = f"<span style='color:{BAD}'>missing</span>: the folder has no *.safetensors or *.bin files"
        else:
            weights = f"<span style='color:{WARN}'>not on this machine</span>: downloaded at Start"
        values = {
            "Architecture": f"{s.architecture} ({s.model_type})",
            "Parameters": human_count(s.parameters) + (f" — {s.note}" if s.note else ""),
            "Context length": f"{s.context_length:,} tokens" if s.context_length else "not stated",
            "Stored dtype": s.dtype,
            "Vocabulary": f"{s.vocabulary:,} tokens" if s.vocabulary else "not stated",
            "Weights": weights,
            "Chat template": _chat_template_words(s),
        }
        for key, text in values.items():
            self.facts[key].setText(text)


def _chat_template_words(s: ModelSummary) -> str:
    if not s.has_tokenizer:
        return f"<span style='color:{BAD}'>no tokenizer</span>: no text can go in or out of this model"
    return "its own (chat rows use it)" if s.chat_template else "none (chat rows use ChatML)"
