"""The techniques: method, objective (GRPO's sampling and rewards with it), LoRA, precision, memory savers, batch
and length, optimizer, training length.

Each control says in one line what it saves and what it costs; choices that
core validation rejects in the current combination are disabled with the
reason (see controls.BoundControl).
"""

from __future__ import annotations

from PySide6.QtWidgets import QCheckBox, QGridLayout, QGroupBox, QLabel, QVBoxLayout, QWidget

from studio.core.config import RunConfig
from studio.core.errors import StudioError
from studio.core.methods import (ADALORA_BUDGET, ALPHA, DORA, DROPOUT, LORA_SETTINGS, METHOD_SPECS, RANK, RSLORA,
                                 VIRTUAL_TOKEN_COUNT)
from studio.core.model.info import model_shape
from studio.core.presets import objective_changes
from studio.gui.widgets.rewards import RewardFile, RewardsEditor
from studio.gui.state.memory import (BASE_WEIGHTS_GROUP, SAVER_SPECS, SAVERS_GROUP, SPEED_GROUP, model_config_of,
                                     panel_order, savers_in)
from studio.gui.widgets.common import ConfigStore, SettingsColumn, explanation, group_box
from studio.gui.widgets.controls import (BoundControl, ChoiceControl, NumberControl, Option, RadioChoice,
                                         ScientificControl, ToggleControl)

METHODS = [Option(name, spec.label, spec.explanation) for name, spec in METHOD_SPECS.items()]
ALL_LINEAR = "all-linear"


class TechniquesPanel(SettingsColumn):
    def __init__(self, store: ConfigStore, parent: QWidget | None = None):
        super().__init__(store, parent)
        self.savers: dict[str, ToggleControl] = {}  # the memory savers' switches, by their table's names
        self.method = RadioChoice(store, "method", METHODS, "Method")
        method_group = group_box("Method", self.method, self._quantization())
        self.objective_group = self._objective_group()
        self.lora_group = self._lora_group()
        self.virtual_group = self._virtual_tokens_group()
        self.adalora_group = self._adalora_group()
        self.grpo_group = self._grpo_group()
        for group in (method_group, self.objective_group, self.grpo_group, self.lora_group, self.virtual_group, self.adalora_group,
                      self._qat_group(), self._precision_group(), self._batch_group(), self._speed_group(),
                      self._length_group()):
            self.column.addWidget(group)
        self.finish(self._refresh_groups)

    def mark_self_test(self, marks: dict[str, str]) -> None:
        """Each control whose field a failed technique of the GPU self-test switches says so (``marks``: field ->
        words, from ``SelfTestReport.marks``); the others are cleared."""
        for control in self.findChildren(BoundControl):
            control.mark_self_test(marks.get(control.path, ""))

    def _quantization(self) -> QWidget:
        box = QWidget()
        layout = QVBoxLayout(box)
        layout.setContentsMargins(0, 4, 0, 0)
        self.load_in = ChoiceControl(self.store, "quantization.load_in", "Base weights")
        self.quant_type = ChoiceControl(self.store, "quantization.quant_type", "4-bit type")
        self.double_quant = ToggleControl(self.store, "quantization.double_quant", "Double quantization",
                                          "Quantizes the 4-bit scales too: saves about 0.4 bits per weight, costs nothing noticeable.")
        for widget in (self.load_in, self.quant_type, self.double_quant, *self._saver_toggles(BASE_WEIGHTS_GROUP)):
            layout.addWidget(widget)
        return box

    def _objective_group(self) -> QGroupBox:
        """What training minimizes: the responses (SFT), or preference pairs with their few settings."""
        store = self.store
        self.objective = ChoiceControl(store, "objective", "Learn from",
                                       changes=lambda value: objective_changes(store.config, value))
        self.beta = NumberControl(store, "preference.beta", "Beta", "DPO: how far the model may move from the "
                                  "reference (higher: less). ORPO: the odds-ratio term's weight. SimPO: the margin's "
                                  "scale.", 0.001, 100.0, decimals=3, step=0.05)
        self.dpo_loss = ChoiceControl(store, "preference.dpo_loss", "DPO loss")
        self.label_smoothing = NumberControl(store, "preference.label_smoothing", "Label smoothing", "The chance that "
                                             "a pair's label is wrong (robust DPO, SimPO).", 0.0, 0.49, decimals=2,
                                             step=0.05)
        self.sft_weight = NumberControl(store, "preference.sft_weight", "SFT weight", "Also learn the chosen "
                                        "responses by cross-entropy, with this weight (DPO, SimPO; ORPO always does).",
                                        0.0, 100.0, decimals=2, step=0.1)
        self.simpo_gamma = NumberControl(store, "preference.simpo_gamma", "Target margin", "SimPO: the margin of "
                                         "average log-likelihoods the chosen response must win by.", 0.0, 100.0,
                                         decimals=2, step=0.1)
        self.desirable_weight = NumberControl(store, "preference.desirable_weight", "Desirable weight", "KTO: the "
                                              "weight of each desirable row's loss; with more desirable rows than "
                                              "undesirable ones, lower it.", 0.01, 100.0, decimals=2, step=0.1)
        self.undesirable_weight = NumberControl(store, "preference.undesirable_weight", "Undesirable weight",
                                                "KTO: the weight of each undesirable row's loss.", 0.01, 100.0,
                                                decimals=2, step=0.1)
        self.reference = ChoiceControl(store, "preference.reference", "Reference")
        self.preference_settings = (self.beta, self.dpo_loss, self.label_smoothing, self.sft_weight, self.simpo_gamma,
                                    self.desirable_weight, self.undesirable_weight, self.reference)
        return group_box("Objective", self.objective, *self.preference_settings)

    def _grpo_group(self) -> QGroupBox:
        """GRPO's sampling, loss and rewards, shown when it is the objective."""
        store = self.store
        self.group_size = NumberControl(store, "grpo.group_size", "Completions per prompt", "Each is judged against "
                                        "its group's mean: more compare better and cost generation time and memory. "
                                        "A step's completions (micro-batch x accumulation) are whole groups.", 2, 1024)
        self.max_completion = NumberControl(store, "grpo.max_completion_length", "Completion length", "The most "
                                            "tokens a completion may have; the prompt gets the rest of the sequence "
                                            "length. Generation memory grows with it.", 1, 1_000_000,
                                            suffix=" tokens")
        self.temperature = NumberControl(store, "grpo.temperature", "Temperature", "Sampling temperature: higher "
                                         "gives more varied completions to compare.", 0.01, 10.0, decimals=2,
                                         step=0.1)
        self.top_p = NumberControl(store, "grpo.top_p", "Top-p", "Sample among the likeliest tokens whose "
                                   "probability reaches this (1: all).", 0.01, 1.0, decimals=2, step=0.05)
        self.grpo_loss = ChoiceControl(store, "grpo.loss_type", "Loss")
        self.grpo_beta = NumberControl(store, "grpo.beta", "KL weight (beta)", "How strongly the model is held to "
                                       "where it started; 0 (TRL's default) runs no reference and saves its "
                                       "forward.", 0.0, 100.0, decimals=3, step=0.01)
        self.epsilon = NumberControl(store, "grpo.epsilon", "Clip below", "A token's probability ratio to the "
                                     "sampling model counts no lower than 1 - this.", 0.0, 10.0, decimals=2, step=0.01)
        self.epsilon_high = NumberControl(store, "grpo.epsilon_high", "Clip above", "...and no higher than 1 + this "
                                          "(DAPO's clip-higher: 0.28).", 0.0, 10.0, decimals=2, step=0.01)
        self.iterations = NumberControl(store, "grpo.num_iterations", "Steps per generation", "Optimizer steps on "
                                        "each batch of sampled completions: more reuse them (cheaper) and move "
                                        "further from the model that sampled them.", 1, 1000)
        self.generation_backend = ChoiceControl(store, "grpo.generation_backend", "Sampling with")
        self.vllm_fraction = NumberControl(store, "grpo.vllm_memory_fraction", "vLLM's share of the GPU", "Taken "
                                           "when vLLM starts, for its copy of the base and its KV cache; training "
                                           "has the rest.", 0.05, 0.95, decimals=2, step=0.05)
        self.rewards, self.reward_file = RewardsEditor(store), RewardFile(store)
        return group_box("GRPO: sampling, loss and rewards", self.group_size, self.max_completion, self.temperature,
                         self.top_p, self.generation_backend, self.vllm_fraction, self.grpo_loss, self.grpo_beta,
                         self.epsilon, self.epsilon_high, self.iterations, self.rewards, self.reward_file)

    def _show_objective_settings(self, config: RunConfig) -> None:
        """Only the settings the objective reads; those its loss ignores stay shown, greyed, with the reason."""
        objective, loss = config.objective, config.preference.dpo_loss
        shown = {"dpo": (self.beta, self.dpo_loss, self.label_smoothing, self.sft_weight, self.reference),
                 "orpo": (self.beta,), "simpo": (self.beta, self.label_smoothing, self.sft_weight, self.simpo_gamma),
                 "kto": (self.beta, self.desirable_weight, self.undesirable_weight, self.reference)}
        self.grpo_group.setVisible(objective == "grpo")
        self.vllm_fraction.setVisible(config.grpo.generation_backend == "vllm")
        visible = shown.get(objective, ())
        for control in self.preference_settings:
            control.setVisible(control in visible)
        smoothing = objective == "simpo" or loss == "robust"
        self.label_smoothing.setEnabled(smoothing)
        self.label_smoothing.setToolTip("" if smoothing else "Only robust DPO and SimPO smooth their labels.")

    def _lora_group(self) -> QGroupBox:
        store = self.store
        self.rank = NumberControl(store, "lora.r", "Rank", "Capacity of the adapter: higher learns more and costs "
                                  "more memory (8 to 64 is typical).", 1, 1024)
        self.alpha = NumberControl(store, "lora.alpha", "Alpha", "Scales the update by alpha / rank: about 2 x rank "
                                   "is a good start. No memory cost.", 0.5, 4096, decimals=1)
        self.dropout = NumberControl(store, "lora.dropout", "Dropout", "Regularizes small datasets; costs a little "
                                     "activation memory when above 0.", 0.0, 0.9, decimals=2, step=0.05)
        self.targets = TargetModules(store)
        self.rslora = ToggleControl(store, "lora.use_rslora", "rsLoRA (rank-stabilized)",
                                    "Scales by alpha / sqrt(rank): high ranks keep learning. No memory cost.")
        self.dora = ToggleControl(store, "lora.use_dora", "DoRA (weight-decomposed)",
                                  "Learns magnitude and direction apart: often a little better; costs memory and "
                                  "about 20 % speed.")
        self.lora_note = explanation("", role="reason")
        return group_box("LoRA adapter", self.lora_note, self.rank, self.alpha, self.dropout, self.targets,
                      self.rslora, self.dora)

    def _virtual_tokens_group(self) -> QGroupBox:
        self.virtual_tokens = NumberControl(self.store, "peft.num_virtual_tokens", "Virtual tokens",
                                            "Trained tokens in front of every example: more learn more and make "
                                            "every sequence longer.", 1, 4096)
        return group_box("Virtual tokens (prefix and prompt tuning)", self.virtual_tokens)

    def _adalora_group(self) -> QGroupBox:
        store = self.store
        self.adalora_target = NumberControl(store, "peft.adalora_target_r", "Target rank", "Average rank per layer "
                                            "after pruning; it starts from the rank above.", 1, 1024)
        self.adalora_warmup = NumberControl(store, "peft.adalora_warmup_ratio", "Warmup", "Fraction of the steps at "
                                            "the full rank before pruning starts.", 0.0, 0.95, decimals=2, step=0.05)
        self.adalora_final = NumberControl(store, "peft.adalora_final_ratio", "Final phase", "Fraction of the steps "
                                           "at the end with the ranks fixed.", 0.0, 0.95, decimals=2, step=0.05)
        self.adalora_every = NumberControl(store, "peft.adalora_update_every", "Re-allocate every", "Steps between "
                                           "two rank re-allocations.", 1, 100_000, suffix=" steps")
        return group_box("AdaLoRA rank budget", self.adalora_target, self.adalora_warmup, self.adalora_final,
                      self.adalora_every)

    def _qat_group(self) -> QGroupBox:
        store = self.store
        self.qat_weights = ChoiceControl(store, "qat.weights", "QAT weights")
        self.qat_activations = ChoiceControl(store, "qat.activations", "QAT activations")
        self.qat_group_size = NumberControl(store, "qat.group_size", "Group size", "Weights sharing one scale: "
                                            "smaller groups are more accurate and store more scales.", 1, 8192)
        return group_box("Quantization-aware training (for a quantized export)", self.qat_weights,
                      self.qat_activations, self.qat_group_size)

    def _precision_group(self) -> QGroupBox:
        store = self.store
        self.precision = ChoiceControl(store, "training.precision", "Precision")
        self.weight_dtype = ChoiceControl(store, "model.dtype", "Weights dtype")
        self.optimizer = ChoiceControl(store, "training.optimizer", "Optimizer")
        return group_box("Precision and memory savers", self.precision, self.weight_dtype, self.optimizer,
                         *self._saver_toggles(SAVERS_GROUP))

    def _saver_toggles(self, group: str) -> list[ToggleControl]:
        """The switches of the table of memory savers in ``group``, each right under the one it acts through."""
        toggles = {spec.name: ToggleControl(self.store, spec.field, spec.label, spec.explanation)
                   for spec in savers_in(group)}
        self.savers.update(toggles)
        return [toggles[name] for name in panel_order(savers_in(group))]

    def _batch_group(self) -> QGroupBox:
        store = self.store
        self.micro_batch = NumberControl(store, "training.micro_batch_size", "Micro-batch", "Examples per forward and "
                                         "backward pass: the biggest lever on activation memory.", 1, 4096)
        self.accumulation = NumberControl(store, "training.gradient_accumulation_steps", "Gradient accumulation",
                                          "Micro-batches added up per optimizer step: a bigger batch for no memory, "
                                          "costs time per step.", 1, 4096)
        self.effective_batch = QLabel()
        self.effective_batch.setProperty("role", "heading")  # bold: the number the two controls make
        self.max_length = NumberControl(store, "data.max_length", "Sequence length", "Tokens per example; longer "
                                        "examples are cut. Activation memory grows with it.", 8, 1_000_000, suffix=" tokens")
        return group_box("Batch and sequence length", self.micro_batch, self.accumulation, self.effective_batch, self.max_length)

    def _speed_group(self) -> QGroupBox:
        store = self.store
        self.packing = ChoiceControl(store, "data.packing", "Batch layout")
        self.torch_compile = ToggleControl(store, "training.torch_compile", "torch.compile",
                                           "Compiles the model: faster steps after a slow first one (minutes for "
                                           "big models). Not with 4/8-bit weights or DeepSpeed.")
        return group_box("Speed", self.packing, *self._saver_toggles(SPEED_GROUP), self.torch_compile)

    def _length_group(self) -> QGroupBox:
        store = self.store
        self.max_steps = NumberControl(store, "training.max_steps", "Steps", "Optimizer steps to run; "
                                       "\"by epochs\" derives them from the epochs below.", 0, 10_000_000,
                                       special_zero="by epochs")
        self.epochs = NumberControl(store, "training.epochs", "Epochs", "Passes over the training data "
                                    "(used when Steps is \"by epochs\").", 0.01, 1000, decimals=2, step=0.5)
        self.learning_rate = ScientificControl(store, "training.learning_rate", "Learning rate",
                                               "Peak learning rate: about 2e-4 for LoRA, 1e-5 for full fine-tuning.")
        self.log_every = NumberControl(store, "schedule.log_every", "Chart a point every", "Steps between points on "
                                       "the charts; 1 shows every step.", 1, 100_000, suffix=" steps")
        self.save_every = NumberControl(store, "schedule.save_every", "Checkpoint every", "Steps between saved "
                                        "checkpoints (disk space and a few seconds each); a stop always saves.",
                                        0, 10_000_000, suffix=" steps", special_zero="end only")
        return group_box("Training length", self.max_steps, self.epochs, self.learning_rate, self.log_every, self.save_every)

    def _refresh_groups(self, config: RunConfig) -> None:
        """Sections that do not apply to the current method are disabled, and say why."""
        self._show_objective_settings(config)
        spec = config.method_spec
        adapts_linears = spec.adapts_linears
        for control in (self.rank, self.alpha, self.dropout, self.targets, self.rslora, self.dora):
            control.setEnabled(adapts_linears)
        # full fine-tuning shows LoRA's basic settings greyed out, under the note saying why
        shown = spec.settings if spec.uses_adapter else LORA_SETTINGS
        for control, setting in ((self.rank, RANK), (self.alpha, ALPHA), (self.dropout, DROPOUT),
                                 (self.rslora, RSLORA), (self.dora, DORA)):
            control.setVisible(setting in shown)
        self.lora_note.setText("" if adapts_linears else "Only for adapter methods: full fine-tuning trains the "
                               "weights themselves.")
        self.lora_note.setVisible(not adapts_linears)
        self.lora_group.setTitle(spec.group_title)
        self.lora_group.setVisible(not spec.trains_virtual_tokens)  # nothing of it applies to virtual tokens
        self.virtual_group.setVisible(VIRTUAL_TOKEN_COUNT in spec.settings)
        self.adalora_group.setVisible(ADALORA_BUDGET in spec.settings)
        qat = config.qat.enabled
        for control in (self.qat_activations, self.qat_group_size):
            control.setEnabled(qat)
            control.setToolTip("" if qat else "Turn QAT on first (choose int4 or int8 weights).")
        four_bit = config.effective_load_in == "4bit"
        for control in (self.quant_type, self.double_quant):
            control.setEnabled(four_bit)
            control.setToolTip("" if four_bit else "Only for 4-bit base weights (QLoRA).")
        t = config.training
        for name, toggle in self.savers.items():
            needs = SAVER_SPECS[name].needs
            ready = not needs or getattr(t, needs)
            toggle.setEnabled(ready)
            label = SAVER_SPECS[needs].label if needs else ""
            toggle.setToolTip("" if ready else f"Turn {label[:1].lower()}{label[1:]} on first.")
        self.effective_batch.setText(f"Effective batch: {t.micro_batch_size} x {t.gradient_accumulation_steps} = "
                                     f"{config.effective_batch_size} examples per optimizer step")


class TargetModules(BoundControl):
    """Which linear layers get an adapter: all of them, or a choice among the model's own module names."""

    label = "Target modules"

    def __init__(self, store: ConfigStore):
        super().__init__(store, "lora.target_modules", "Attention-only adapters (q, v) use the least memory; all "
                         "linear layers learn the most.")
        self.all_linear = QCheckBox("All linear layers")
        self.all_linear.toggled.connect(self._on_all_toggled)
        self.column.addWidget(QLabel("Target modules"))
        self.column.addWidget(self.all_linear)
        self.grid = QGridLayout()
        self.grid.setContentsMargins(22, 0, 0, 0)
        self.column.addLayout(self.grid)
        self.module_checks: dict[str, QCheckBox] = {}
        self._model = None
        self.finish_layout()

    def refresh(self, config: RunConfig) -> None:
        self._rebuild_modules(config)
        targets = config.lora.target_modules
        every = tuple(targets) == (ALL_LINEAR,)
        self.all_linear.blockSignals(True)
        self.all_linear.setChecked(every)
        self.all_linear.blockSignals(False)
        for name, check in self.module_checks.items():
            check.blockSignals(True)
            check.setChecked(every or name in targets)
            check.setEnabled(not every)
            check.blockSignals(False)
        self.show_reason("" if targets else "Choose at least one module (or all linear layers).")

    def _rebuild_modules(self, config: RunConfig) -> None:
        if self._model == config.model.name_or_path:
            return
        self._model = config.model.name_or_path
        for check in self.module_checks.values():
            self.grid.removeWidget(check)
            check.hide()
            check.deleteLater()
        self.module_checks = {}
        for index, name in enumerate(_module_names(config)):
            check = QCheckBox(name)
            check.toggled.connect(self._on_module_toggled)
            self.grid.addWidget(check, index // 4, index % 4)
            self.module_checks[name] = check

    def _on_all_toggled(self, checked: bool) -> None:
        if checked:
            self.write((ALL_LINEAR,))
        else:
            self.write(tuple(self.module_checks) or (ALL_LINEAR,))

    def _on_module_toggled(self) -> None:
        self.write(tuple(name for name, check in self.module_checks.items() if check.isChecked()))


def _module_names(config: RunConfig) -> list[str]:
    """The distinct linear layer names of the model's blocks (q_proj, ..., down_proj); none when unknown."""
    try:
        shape = model_shape(model_config_of(config))
    except StudioError:
        return []
    return list(dict.fromkeys(layer.name for layer in shape.block_linears))
