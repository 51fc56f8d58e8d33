"""Several GPUs or machines: processes, sharding, offload, layer split, pipeline, and the cluster bundle.

A view over the config's ``distributed`` section: choices that validation refuses
in the current combination are disabled with the reason (controls.BoundControl);
the memory estimate redraws on every change like for any other field.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFileDialog, QFormLayout, QHBoxLayout, QLineEdit,
                               QMessageBox, QPushButton, QSpinBox, QWidget)

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.presets import pipeline_changes, pipeline_replicas, pipeline_replicas_changes
from studio.core.run.bundle import Bundle, parse_hosts, write_bundle
from studio.core.run.commands import DEFAULT_PORT
from studio.gui.state.memory import pipeline_layout
from studio.gui.widgets.common import ConfigStore, SettingsColumn, explanation, group_box
from studio.gui.widgets.controls import BoundControl, ChoiceControl, NumberControl, ToggleControl, read_field



class PathControl(BoundControl):
    """A folder or file path with a Choose… button; disabled with the reason when it does not apply."""

    def __init__(self, store: ConfigStore, path: str, label: str, explain: str, folder: bool,
                 applies: callable, reason: str):
        super().__init__(store, path, explain)
        self.label = label
        self.folder, self.applies, self.reason_text = folder, applies, reason
        self.edit = QLineEdit()
        self.edit.setPlaceholderText("(none)")
        self.edit.editingFinished.connect(lambda: self.write(self.edit.text().strip()))
        self.browse = QPushButton("Choose…")
        self.browse.clicked.connect(self._choose)
        row = QHBoxLayout()
        row.addWidget(explanation(label), 0)
        row.addWidget(self.edit, 1)
        row.addWidget(self.browse)
        self.column.addLayout(row)
        self.finish_layout()

    def refresh(self, config: RunConfig) -> None:
        self.edit.blockSignals(True)
        self.edit.setText(read_field(config, self.path))
        self.edit.blockSignals(False)
        enabled = self.applies(config) or bool(read_field(config, self.path))  # a set path can always be cleared
        for widget in (self.edit, self.browse):
            widget.setEnabled(enabled)
            widget.setToolTip("" if enabled else self.reason_text)
        self.show_reason("" if enabled else self.reason_text)

    def _choose(self) -> None:
        if self.folder:
            chosen = QFileDialog.getExistingDirectory(self, "Choose a folder on a fast SSD")
        else:
            chosen, _ = QFileDialog.getOpenFileName(self, "Choose a DeepSpeed config", "", "DeepSpeed config (*.json)")
        if chosen:
            self.write(chosen)


class ScalePanel(SettingsColumn):
    def __init__(self, store: ConfigStore, parent: QWidget | None = None):
        super().__init__(store, parent)
        for group in (self._data_parallel_group(), self._offload_group(), self._layer_split_group(),
                      self._pipeline_group(), self._cluster_group()):
            self.column.addWidget(group)
        self.finish(self._refresh)

    def _data_parallel_group(self):
        store = self.store
        self.processes = NumberControl(store, "distributed.num_processes", "GPUs (processes)",
                                       "One training process per GPU of this machine, each on its share of every "
                                       "batch (started with torchrun). Without GPUs they run on the CPU.", 1, 256)
        self.sharding = ChoiceControl(store, "distributed.sharding", "Sharding")
        return group_box("Several GPUs", self.processes, self.sharding)

    def _offload_group(self):
        store = self.store
        self.offload_optimizer = ChoiceControl(store, "distributed.offload_optimizer", "Optimizer state to")
        self.offload_params = ChoiceControl(store, "distributed.offload_params", "Weights to")
        self.nvme_path = PathControl(store, "distributed.nvme_path", "NVMe folder",
                                     "Where DeepSpeed swaps state offloaded to NVMe; pick it before choosing NVMe above.",
                                     True, lambda c: c.distributed.deepspeed_stage is not None,
                                     "Only for NVMe offload with ZeRO sharding.")
        self.deepspeed_config = PathControl(store, "distributed.deepspeed_config", "DeepSpeed JSON",
                                            "Optional: your own DeepSpeed config; its keys override the generated ones.",
                                            False, lambda c: c.distributed.deepspeed_stage is not None,
                                            "Only with ZeRO sharding (DeepSpeed).")
        return group_box("Offload (DeepSpeed ZeRO)", self.offload_optimizer, self.offload_params, self.nvme_path,
                      self.deepspeed_config)

    def _layer_split_group(self):
        store = self.store
        self.layer_split = ToggleControl(store, "distributed.layer_split", "Split the layers over this machine's GPUs",
                                         "For a LoRA/QLoRA base larger than one GPU: one process, the layers spread "
                                         "over the GPUs in order, the rest in CPU RAM. Slower than sharding, no "
                                         "setup; turn on gradient checkpointing when layers go to CPU RAM.")
        self.max_gpu = NumberControl(store, "distributed.max_gpu_memory_gib", "Weights per GPU at most",
                                     "0: each GPU's free memory minus room for activations (from the estimate).",
                                     0, 4096, decimals=1, step=1, suffix=" GiB", special_zero="automatic")
        self.max_cpu = NumberControl(store, "distributed.max_cpu_memory_gib", "CPU RAM for layers",
                                     "Layers that fit on no GPU are kept here and fetched for each step (slow).",
                                     0, 65536, decimals=1, step=4, suffix=" GiB", special_zero="none")
        self.split_note = explanation("", role="reason")
        return group_box("Layer split (model parallel)", self.layer_split, self.split_note, self.max_gpu, self.max_cpu)

    def _pipeline_group(self):
        store = self.store
        self.pipeline_stages = PipelineStages(store)
        self.pipeline_replicas = PipelineReplicas(store)
        self.pipeline_schedule = ChoiceControl(store, "distributed.pipeline_schedule", "Schedule")
        self.pipeline_chunks = NumberControl(store, "distributed.pipeline_chunks", "Chunks per GPU",
                                             "The interleaved schedule cuts the model into stages x this many "
                                             "chunks, each GPU taking every stages-th: a bubble as many times "
                                             "smaller, more hidden states sent.", 1, 64)
        return group_box("Pipeline (model parallel, every GPU busy)", self.pipeline_stages, self.pipeline_replicas,
                         self.pipeline_schedule, self.pipeline_chunks)

    def _cluster_group(self):
        self.bundle_button = QPushButton("Export cluster bundle…")
        self.bundle_button.setToolTip("Write a folder to copy to every machine, with each machine's launch command")
        self.bundle_button.clicked.connect(self._open_bundle_dialog)
        return group_box("Several machines", explanation(
            "Train on several machines: the bundle holds this config with its data, a DeepSpeed hostfile, and a "
            "launch script per machine (README.txt says what goes where)."), self.bundle_button)

    def _refresh(self, config: RunConfig) -> None:
        reason = self.store.blocked_reason(distributed={"layer_split": True}) if not config.distributed.layer_split else ""
        self.layer_split.check.setEnabled(not reason)
        self.layer_split.check.setToolTip(reason)
        self.split_note.setText(f"Not available now — {reason}" if reason else "")
        self.split_note.setVisible(bool(reason))
        for control in (self.max_gpu, self.max_cpu):
            control.setEnabled(config.distributed.layer_split)
            control.setToolTip("" if config.distributed.layer_split else "Only with the layer split.")
        bundle_reason = "a layer split runs on one machine" if config.distributed.layer_split else ""
        self.bundle_button.setEnabled(not bundle_reason)
        self.bundle_button.setToolTip(bundle_reason.capitalize() or self.bundle_button.toolTip())
        self._say_once(self.offload_optimizer, self.offload_params)
        piped = config.distributed.pipeline_stages > 0
        for control in (self.pipeline_replicas, self.pipeline_schedule):
            control.setEnabled(piped)
            control.setToolTip("" if piped else "Only with a pipeline.")
        interleaved = piped and config.distributed.pipeline_schedule == "interleaved"
        self.pipeline_chunks.setEnabled(interleaved)
        self.pipeline_chunks.setToolTip("" if interleaved else "Only with the interleaved schedule.")
        self.pipeline_replicas.say_layout(config)

    @staticmethod
    def _say_once(above: BoundControl, below: BoundControl) -> None:
        """The weights' offload says what the optimizer state's, right above, says already in a word (their choices
        are the same): every sentence once in the window. Runs after the controls' own refresh."""
        if below.explain.text() == above.explain.text():
            below.explain.setText("As for the optimizer state, above.")
        if below.reason.text() and below.reason.text() == above.reason.text():
            below.show_reason("Not available now: as for the optimizer state, above.")

    def _open_bundle_dialog(self) -> None:
        dialog = BundleDialog(self.store.config.distributed.num_processes, self)
        if dialog.exec() != QDialog.DialogCode.Accepted:
            return
        try:
            bundle = self.export_bundle(dialog.hosts.text(), dialog.gpus.value(), dialog.port.value(),
                                        Path(dialog.folder.text()))
        except StudioError as exc:
            QMessageBox.warning(self, "Cluster bundle", f"{exc.message}\n\n{exc.hint}")
            return
        QMessageBox.information(self, "Cluster bundle", f"Wrote {bundle.folder}.\nCopy it to every machine and run "
                                                        "launch-node-RANK there; README.txt says what goes where.")

    def export_bundle(self, hosts: str, gpus_per_host: int, port: int, folder: Path) -> Bundle:
        return write_bundle(self.store.config, parse_hosts(hosts), gpus_per_host, folder, port)


class BundleDialog(QDialog):
    """The machines of the cluster and where to write the bundle."""

    def __init__(self, gpus: int, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Export cluster bundle")
        self.hosts = QLineEdit()
        self.hosts.setPlaceholderText("10.0.0.1, 10.0.0.2 (the main machine first)")
        self.gpus = QSpinBox()
        self.gpus.setRange(1, 256)
        self.gpus.setValue(gpus)
        self.port = QSpinBox()
        self.port.setRange(1, 65535)
        self.port.setValue(DEFAULT_PORT)
        self.folder = QLineEdit()
        browse = QPushButton("Choose…")
        browse.clicked.connect(self._choose)
        folder_row = QHBoxLayout()
        folder_row.addWidget(self.folder, 1)
        folder_row.addWidget(browse)
        form = QFormLayout(self)
        form.addRow("Machines", self.hosts)
        form.addRow("GPUs per machine", self.gpus)
        form.addRow("Main machine's port", self.port)
        form.addRow("New folder", folder_row)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def _choose(self) -> None:
        chosen = QFileDialog.getExistingDirectory(self, "Where to create the bundle folder")
        if chosen:
            self.folder.setText(str(Path(chosen) / "cluster-bundle"))


class PipelineStages(NumberControl):
    """distributed.pipeline_stages, with one process per stage (studio.core.presets.pipeline_changes)."""

    def __init__(self, store: ConfigStore):
        super().__init__(store, "distributed.pipeline_stages", "Stages", "The model's blocks cut into this many "
                         "stages, one GPU (process) each, the micro-batches flowing through them: every GPU busy, "
                         "only activations cross the link. LoRA and SFT; 0: off.", 0, 256, special_zero="off")

    def changes_of(self, value) -> dict:
        return pipeline_changes(self.store.config, int(value))


class PipelineReplicas(NumberControl):
    """The pipeline's data replicas: distributed.num_processes as a multiple of the stages, shown divided by them
    (messages about the field name the processes' own control)."""

    names_field = False

    EXPLAIN = ("Copies of the whole pipeline, each on its share of every batch: one process (GPU) per stage of each. "
               "A copy's stages exchange activations all the time, the copies only gradients once a step: put a "
               "copy's GPUs on one machine.")

    def __init__(self, store: ConfigStore):
        super().__init__(store, "distributed.num_processes", "Replicas", self.EXPLAIN, 1, 256)

    def value_of(self, config: RunConfig) -> int:
        return pipeline_replicas(config)

    def changes_of(self, value) -> dict:
        return pipeline_replicas_changes(self.store.config, int(value))

    def say_layout(self, config: RunConfig) -> None:
        """The explanation, ending with the processes the stages and replicas make."""
        stages, processes = config.distributed.pipeline_stages, config.distributed.num_processes
        whole = stages > 0 and processes % stages == 0
        layout = f" Now {processes} processes: {pipeline_layout(stages, processes)}." if whole else ""
        self.set_explanation(self.EXPLAIN + layout)
