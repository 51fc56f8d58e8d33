"""Export a run (adapter, merged model or GGUF; dtype or GGUF types; destination) with `studio export` in a
subprocess, optionally publishing it to the Hugging Face Hub, and show the verification it wrote (its export
record). Whether a publish can work (a login, online, a valid name) is asked before the subprocess starts;
whether llama.cpp can convert the run's model (`studio export --gguf --check`, seconds) when GGUF is chosen."""

from __future__ import annotations

import html
import sys
import time
from functools import partial
from pathlib import Path

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (QButtonGroup, QCheckBox, QComboBox, QFileDialog, QFormLayout, QGridLayout, QGroupBox, QHBoxLayout,
                               QLabel, QLineEdit, QProgressBar, QPushButton, QRadioButton, QVBoxLayout, QWidget)

from studio.core.config import load_config
from studio.core.errors import StudioError
from studio.core.export.gguf import DEFAULT_QUANT, NEEDS_LLAMA_CPP, QUANT_TYPES, LLAMA_CPP_INSTALL
from studio.core.export.publishing import check_can_push
from studio.core.run.commands import export_command, gguf_check_command, read_export_record
from studio.core.run.directory import RunDir
from studio.gui.process import LineProcess
from studio.gui.state.console import console_error
from studio.gui.widgets.common import BAD, GOOD, MUTED, explanation

DTYPES = ("auto", "float32", "bfloat16", "float16")


def verification_html(info: dict) -> str:
    v = info.get("verification") or {}
    passed = bool(v.get("passed"))
    color, verdict = (GOOD, "Verified") if passed else (BAD, "Verification FAILED")
    files = (info.get("files") or {}).values()  # a GGUF export: each file against its type's threshold
    form = [f"Form: {html.escape(info['form'])}."] if info.get("form") else []
    if files:
        return "<br>".join(form + [
            f"<b style='color:{color}'>{verdict}</b>: each file read back by transformers' GGUF reader and compared "
            f"with the merged model on {v.get('samples', '?')} held-out examples."] + [
            f"{html.escape(f['file'])}: {f['bytes'] / 1e6:.1f} MB, same next token "
            f"{f['verification']['top1_agreement']:.1%} of the time; Ollama: "
            f"<code>ollama create NAME -f {html.escape(f['modelfile']['file'])}</code>" for f in files] + [
            f"<span style='color:{MUTED}'>Modelfile: {html.escape(note)}.</span>" for note in _modelfile_notes(files)])
    lines = form + [f"<b style='color:{color}'>{verdict}</b>: reloaded the way you would load it and compared with "
                    f"the trained model on {v.get('samples', '?')} examples.",
                    f"Max logit difference {v.get('max_abs_diff', float('nan')):.3g}; same next token "
                    f"{v.get('top1_agreement', 0):.1%} of the time."]
    if v.get("base_max_abs_diff") is not None:
        lines.append(f"It differs from the untrained base model by up to {v['base_max_abs_diff']:.3g} "
                     "(training changed the model).")
    return "<br>".join(lines)


def _modelfile_notes(files) -> list[str]:
    """What the Modelfiles say they left out or left to Ollama, each said once."""
    return list(dict.fromkeys(f["modelfile"]["note"] for f in files if f["modelfile"].get("note")))


class ExportPanel(QWidget):
    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.run_dir: Path | None = None
        self.full_fine_tune = False
        self.cannot_merge = ""  # why the run's method cannot be merged, if it cannot
        self.result_info: dict | None = None
        self.choose_folder_dialog = lambda: QFileDialog.getExistingDirectory(self, "Export to")
        self.command = partial(export_command, sys.executable)  # tests point this at a stand-in
        self.check_command = partial(gguf_check_command, sys.executable)  # this one too
        self.gguf_verdicts: dict[Path, str] = {}  # run folder -> "" (llama.cpp can convert it) or why not, in words
        self.run_label = QLabel("No run chosen: finish a run, or choose one in History and press Export.")
        self.run_label.setWordWrap(True)
        self.adapter = QRadioButton("Adapter")
        self.merged = QRadioButton("Merged model")
        self.gguf = QRadioButton("GGUF")
        # What each is for beside it, wrapping: a narrow window keeps it whole
        self.kind_notes = {self.adapter: "small, PEFT loads it on the base model",
                           self.merged: "the adapter built in, for transformers alone",
                           self.gguf: "for llama.cpp, Ollama and LM Studio, each file with an Ollama Modelfile"}
        self.kind_group = QButtonGroup(self)
        for button in (self.adapter, self.merged, self.gguf):
            self.kind_group.addButton(button)
        self.adapter.setChecked(True)
        self.kind_reason = explanation("", role="reason")
        self.dtype = QComboBox()
        self.dtype.addItems(DTYPES)
        self.quants = {quant: QCheckBox(quant) for quant in QUANT_TYPES}
        self.quants[DEFAULT_QUANT].setChecked(True)
        for quant in NEEDS_LLAMA_CPP:
            self.quants[quant].setToolTip(f"Made by llama.cpp's quantizer: {LLAMA_CPP_INSTALL}")
        self.repo = QLineEdit()
        self.repo.setPlaceholderText("your-name/my-fine-tune")
        self.private = QCheckBox("Private")
        self.publish_button = QPushButton("Export and publish")
        self.publish_button.clicked.connect(self.start_publish)
        self.destination = QLineEdit()
        self.destination.setPlaceholderText("default: inside the run folder, exports/<kind>")
        browse = QPushButton("Browse…")
        browse.clicked.connect(self._browse)
        self.export_button = QPushButton("Export")
        self.export_button.clicked.connect(self.start_export)
        self.progress = QProgressBar()
        self.progress.setRange(0, 0)
        self.progress.hide()
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.RichText)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._process = LineProcess(self)
        self._process.line.connect(self._on_line)
        self._process.done.connect(self._on_done)
        self._check = LineProcess(self)
        self._check.done.connect(self._on_checked)
        self._checking: Path | None = None  # the run the GGUF check running is about
        self._started = 0.0
        self._last_line = ""
        self._asked: tuple | None = None  # (run, kind, folder, dtype, quants) of the export running
        self._publishing = ""  # the Hub repository the running export goes to
        self._clock = QTimer(self)
        self._clock.timeout.connect(self._show_progress)
        self._build_layout(browse)
        self.merged.toggled.connect(self._update_form)
        self.gguf.toggled.connect(self._update_form)
        self.gguf.toggled.connect(self._check_gguf)
        self._update_form()

    def _build_layout(self, browse: QPushButton) -> None:
        group = QGroupBox("Export")
        form = QFormLayout(group)
        form.addRow("Run:", self.run_label)
        kinds = QGridLayout()
        kinds.setVerticalSpacing(2)
        for row, (button, note) in enumerate(self.kind_notes.items()):
            kinds.addWidget(button, row, 0, Qt.AlignmentFlag.AlignTop)
            kinds.addWidget(explanation(note), row, 1)
        kinds.setColumnStretch(1, 1)
        kinds.addWidget(self.kind_reason, len(self.kind_notes), 0, 1, 2)
        form.addRow("What:", kinds)
        form.addRow("Dtype:", self.dtype)
        quants = QHBoxLayout()
        for box in self.quants.values():
            quants.addWidget(box)
        quants.addStretch(1)
        form.addRow("GGUF types:", quants)
        destination = QHBoxLayout()
        destination.addWidget(self.destination, 1)
        destination.addWidget(browse)
        form.addRow("Destination:", destination)
        buttons = QHBoxLayout()
        buttons.addWidget(self.export_button)
        buttons.addWidget(self.progress, 1)
        form.addRow("", buttons)
        publish = QGroupBox("Publish to the Hugging Face Hub")
        hub = QHBoxLayout(publish)
        hub.addWidget(QLabel("Repository:"))
        hub.addWidget(self.repo, 1)
        hub.addWidget(self.private)
        hub.addWidget(self.publish_button)
        layout = QVBoxLayout(self)
        layout.addWidget(group)
        layout.addWidget(publish)
        layout.addWidget(self.status)
        layout.addStretch(1)

    def set_run(self, run_dir: Path | None) -> None:
        self.run_dir = Path(run_dir) if run_dir else None
        self.full_fine_tune, self.cannot_merge = False, ""
        if self.run_dir is not None:
            try:
                config = load_config(RunDir(self.run_dir).config)
            except StudioError:
                config = None
            if config is not None:
                self.full_fine_tune = not config.uses_adapter
                if not config.can_merge:
                    self.cannot_merge = (f"{config.method.replace('_', ' ')} trains {config.method_spec.trains}, "
                                         "which cannot be merged into the weights: export the adapter.")
            has_checkpoint = RunDir(self.run_dir).latest_checkpoint() is not None
            self.run_label.setText(f"<b>{html.escape(self.run_dir.name)}</b>" +
                                   ("" if has_checkpoint else f" <span style='color:{BAD}'>(no checkpoint yet)</span>"))
        if self.full_fine_tune:
            self.merged.setChecked(True)
        if self.cannot_merge:
            self.adapter.setChecked(True)
        self._update_form()
        self._check_gguf()

    def _update_form(self) -> None:
        self.adapter.setEnabled(not self.full_fine_tune)
        for button in (self.merged, self.gguf):
            button.setEnabled(not self.cannot_merge)
            button.setToolTip(self.cannot_merge)
        reason = "A full fine-tune has no adapter: export the merged model." if self.full_fine_tune else self.cannot_merge
        ready = self._has_checkpoint()
        gguf_waits = self._gguf_waits()
        if gguf_waits:
            reason = self._gguf_reason()
        self.kind_reason.setText(reason)
        self.kind_reason.setVisible(bool(reason))
        self.dtype.setEnabled(self.merged.isChecked())
        self.dtype.setToolTip("" if self.merged.isChecked() else "An adapter keeps the dtype it was trained in; "
                              "a GGUF has its types")
        for box in self.quants.values():
            box.setEnabled(self.gguf.isChecked() and not gguf_waits)
        for button in (self.export_button, self.publish_button):
            button.setEnabled(ready and not gguf_waits and not self._process_running())
            button.setToolTip("" if ready else "Needs a run with a saved checkpoint")

    def _has_checkpoint(self) -> bool:
        return self.run_dir is not None and RunDir(self.run_dir).latest_checkpoint() is not None

    def _gguf_waits(self) -> bool:
        """GGUF is chosen for a run that can export, and its check has not said yes (yet)."""
        return self.gguf.isChecked() and self._has_checkpoint() and self.gguf_verdicts.get(self.run_dir) != ""

    def _gguf_reason(self) -> str:
        """Why the GGUF export waits: its check runs, or found that llama.cpp cannot convert this run."""
        verdict = self.gguf_verdicts.get(self.run_dir)
        if verdict is None:
            return "Checking that llama.cpp can convert this run's model and tokenizer (a few seconds)…"
        return f"No GGUF for this run: {verdict}"

    def _check_gguf(self) -> None:
        """Ask `studio export --gguf --check` once per run, when GGUF is chosen, whether llama.cpp converts it."""
        run = self.run_dir
        if not self._gguf_waits() or run in self.gguf_verdicts or self._check.running:
            return
        self._checking = run
        self._check.start(self.check_command(run))
        self._update_form()

    def _on_checked(self, exit_code: int, error: str) -> None:
        found = console_error("\n".join(self._check.all_lines))
        if exit_code == 0 and not error:
            verdict = ""
        elif found:
            verdict = f"{found.message}. To do: {found.hint}." if found.hint else f"{found.message}."
        else:
            verdict = f"the check failed ({error or f'exit code {exit_code}'})."
        self.gguf_verdicts[self._checking] = verdict
        self._checking = None
        self._check_gguf()  # another run was chosen meanwhile
        self._update_form()

    def _process_running(self) -> bool:
        return self._process.running

    def _browse(self) -> None:
        folder = self.choose_folder_dialog()
        if folder:
            self.destination.setText(folder)

    @property
    def kind(self) -> str:
        return "gguf" if self.gguf.isChecked() else "merged" if self.merged.isChecked() else "adapter"

    def chosen_quants(self) -> tuple[str, ...]:
        return tuple(quant for quant, box in self.quants.items() if box.isChecked())

    def output_folder(self) -> Path:
        text = self.destination.text().strip()
        return Path(text) if text else RunDir(self.run_dir).exports_dir / self.kind

    def _request(self) -> tuple:
        return self.run_dir, self.kind, self.output_folder(), self.dtype.currentText(), self.chosen_quants()

    def start_publish(self) -> None:
        """Export and publish to the repository named, once the Hub can take it (said in words if not)."""
        repo = self.repo.text().strip()
        try:
            check_can_push(repo)
        except StudioError as exc:
            self.status.setText(f"<b style='color:{BAD}'>Cannot publish:</b> {html.escape(exc.message)}"
                                + (f"<br>{html.escape(exc.hint)}" if exc.hint else ""))
            return
        self.start_export(push_to=repo)

    def start_export(self, push_to: str = "") -> None:
        if self.run_dir is None:
            return
        if self.kind == "gguf" and not self.chosen_quants():
            self.status.setText(f"<b style='color:{BAD}'>Choose at least one GGUF type.</b>")
            return
        if self.kind == "gguf" and self._gguf_waits():
            self.status.setText(f"<b style='color:{BAD}'>{html.escape(self._gguf_reason())}</b>")
            return
        self.result_info = None
        self._asked = self._request()
        self._publishing = push_to
        self._started, self._last_line = time.monotonic(), "starting"
        self._process.start(self.command(self.run_dir, self.kind, self.output_folder(), self.dtype.currentText(),
                                         self.chosen_quants(), push_to, self.private.isChecked()))
        self.progress.show()
        self._clock.start(500)
        self._show_progress()
        self._update_form()

    def _on_line(self, stream: str, text: str) -> None:
        if text.strip() and not text.startswith(("W1", "I1", "Failed to load")):  # torch/torchao import chatter
            self._last_line = text.strip()[:140]

    def _show_progress(self) -> None:
        seconds = time.monotonic() - self._started
        then = f", then publishing to {html.escape(self._publishing)}" if self._publishing else ""
        self.status.setText(f"Exporting… {seconds:.0f} s — loading, saving, then reloading to verify{then} "
                            f"<span style='color:{MUTED}'>({html.escape(self._last_line)})</span>")

    def _on_done(self, exit_code: int, error: str) -> None:
        self._clock.stop()
        self.progress.hide()
        self._update_form()
        run_dir, kind, folder, *_ = self._asked
        if self._asked != self._request():
            self.status.setText(f"<span style='color:{MUTED}'>The export of {html.escape(run_dir.name)} to "
                                f"{html.escape(str(folder))} ended while other choices were made here: its result "
                                "is not shown. Export again to see it verified.</span>")
            return
        info = read_export_record(folder) if exit_code == 0 and not error else None
        if info is not None:
            self.result_info = info
            published = next((line.split(":", 1)[1].strip() for line in self._process.all_lines
                              if line.startswith("published:")), "")
            where = f"<br>Published to <b>{html.escape(published)}</b>" if published else ""
            what = {"gguf": "GGUF files", "merged": "the merged model"}.get(kind, f"the {kind}")
            self.status.setText(f"Exported {what} to <b>{html.escape(str(folder))}</b>{where}<br>"
                                f"{verification_html(info)}")
            return
        found = console_error("\n".join(self._process.all_lines))
        message, hint = (found.message, found.hint) if found else (error or f"the export exited with code {exit_code}", "")
        self.status.setText(f"<b style='color:{BAD}'>Export failed:</b> {html.escape(message)}"
                            + (f"<br>{html.escape(hint)}" if hint else ""))
