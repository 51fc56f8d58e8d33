"""The GUI's only door to the memory estimator (``studio.core.memory``: the estimate, fit, the table of memory
savers) and the simulation.

Every call the window makes into that code goes through here, so a change in their interface is one edit
(``tests/test_layering.py`` holds the rest of the window to it). No Qt.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from studio.core.config import RunConfig, save_config
from studio.core.errors import StudioError
from studio.core.machine import available_ram
from studio.core.memory.estimate import Estimate, ScaleOut, bubble_words, comparison_note, estimate
from studio.core.memory.placement import pipeline_layout, pipeline_replicas  # noqa: F401 (the window's)
from studio.core.memory.fit import fit, fit_own_data, step_time_words
from studio.core.memory.parts.vision import image_rule, load_preprocessor_config
from studio.core.memory.run_data import config_for_tokens, largest_possible_micro_batch
from studio.core.memory.savers import SaverSpec
from studio.core.memory.sharding import machine_overheads
from studio.core.model.info import load_model_config
from studio.core.run.commands import estimate_simulation_command, last_json_object, trace_command

# what the panels read through this door as it is: an estimate and its words, the table of memory savers
from studio.core.memory.derived import TraceNeededError, kind_text  # noqa: E402, F401
from studio.core.memory.parts import OVERHEAD_PARTS, PART_LABELS, PHASE_LABELS  # noqa: E402, F401
from studio.core.memory.savers import BASE_WEIGHTS_GROUP, SAVER_SPECS, SAVERS_GROUP, SPEED_GROUP  # noqa: E402, F401


def model_config_of(config: RunConfig) -> dict:
    """The model's config.json from disk or the Hugging Face cache; never the network (this runs per keystroke)."""
    path = Path(config.model.name_or_path).expanduser() / "config.json"
    stamp = path.stat().st_mtime if path.is_file() else 0.0
    return _cached_model_config(config.model.name_or_path, config.model.revision, stamp)


@lru_cache(maxsize=16)
def _cached_model_config(name: str, revision: str, stamp: float) -> dict:
    return load_model_config(name, revision, allow_network=False)


def has_gpu_calibration() -> bool:
    """Whether ``studio doctor`` has measured this machine's CUDA overheads (the estimate then uses them)."""
    return bool(machine_overheads().measured)


def estimate_run(config: RunConfig, device_type: str = "cuda", gpu_bytes: int = 0, gpu_count: int = 1) -> Estimate:
    """The estimate of ``config`` with its distributed section (a layer split spreads over ``gpu_count`` GPUs
    of ``gpu_bytes``); raises StudioError when the model or its architecture is unknown."""
    devices = (gpu_bytes,) * gpu_count if gpu_bytes else ()
    return estimate(model_config_of(config), config, device_type=device_type,
                    scale_out=ScaleOut.from_config(config, devices))


@dataclass(frozen=True)
class DataPeak:
    tokens: int  # the most tokens a micro-batch of the data can hold
    peak_bytes: int


def data_peak(config: RunConfig, lengths: list[int] | None, gpu_bytes: int, gpu_count: int) -> DataPeak | None:
    """The estimate of the data's largest possible micro-batch (its rows' token ``lengths``), where its rows make
    it smaller than the worst case of every row at data.max_length; None otherwise."""
    if not lengths:
        return None
    t = config.training
    tokens = largest_possible_micro_batch(lengths, t.micro_batch_size, config.data.max_length,
                                          padded=not config.packs_padding_free)
    if tokens >= t.micro_batch_size * config.data.max_length:
        return None
    try:
        own = estimate_run(config_for_tokens(config, tokens), gpu_bytes=gpu_bytes, gpu_count=gpu_count)
    except StudioError:
        return None
    return DataPeak(tokens, own.peak_bytes)


def savers_in(group: str) -> list[SaverSpec]:
    """The memory savers whose switches the techniques panel shows in ``group``, in their table's order."""
    return [spec for spec in SAVER_SPECS.values() if spec.panel_group == group]


def panel_order(specs: list[SaverSpec]) -> list[str]:
    """The names of ``specs`` as the panel lists them: each right under the switch it acts through."""
    names = [spec.name for spec in specs]
    ordered = [spec.name for spec in specs if spec.needs not in names]
    for spec in specs:
        if spec.needs in names:
            ordered.insert(ordered.index(spec.needs) + 1, spec.name)
    return ordered


# ---------------------------------------------------------------- the trace of a model no family describes


@dataclass
class _Tracing:
    process: subprocess.Popen
    folder: tempfile.TemporaryDirectory

    @property
    def output(self) -> Path:
        return Path(self.folder.name) / "output.txt"


_tracing: dict[tuple[Path, str], _Tracing] = {}


def trace_in_background(config: RunConfig, trace_file: Path, regime: str = "") -> str:
    """Start the memory trace for ``trace_file`` and ``regime`` (studio.core.memory.derived) once, detached
    from the window: it traces these settings and their one-toggle neighbours, so that toggling them later
    needs no trace.

    Returns "" while it runs (ask again later: the estimate appears once the file
    holds the regime), else why no trace came of it.
    """
    tracing = _tracing.get((trace_file, regime))
    if tracing is None and any(f == trace_file and t.process.poll() is None for (f, _), t in _tracing.items()):
        return ""  # the trace running now may well hold this regime too; one writer per trace file
    if tracing is None:
        folder = tempfile.TemporaryDirectory(prefix="studio-trace-")
        path = Path(folder.name) / "config.yaml"
        save_config(config, path)
        with open(Path(folder.name) / "output.txt", "w", encoding="utf-8") as output:
            process = subprocess.Popen(trace_command(sys.executable, path), stdout=output, stderr=subprocess.DEVNULL)
        _tracing[(trace_file, regime)] = tracing = _Tracing(process, folder)
    if tracing.process.poll() is None:
        return ""
    printed = tracing.output.read_text(encoding="utf-8") if tracing.output.is_file() else ""
    result = last_json_object(printed) or {}
    return "the memory trace failed: " + str(result.get("error") or "it left no trace for these settings")


def with_refused_savers_off(before: RunConfig, after: RunConfig) -> tuple[RunConfig, list[tuple[str, str]]]:
    """``after`` with each memory saver switched off that ``before`` could run and ``after`` refuses (the later
    choice wins: ZeRO over the output layer in CPU RAM), and ``[(the saver's field, why)]`` for each."""
    switched = []
    for spec in SAVER_SPECS.values():
        kept_on = getattr(before.training, spec.name) and getattr(after.training, spec.name)
        if kept_on and not spec.refused(before) and (reason := spec.refused(after)):
            after = after.replace(training={spec.name: False})
            switched.append((spec.field, reason))
    return after, switched


# ---------------------------------------------------------------- fit to a GPU


@dataclass(frozen=True)
class FitSuggestion:
    config: RunConfig
    changes: tuple[str, ...]  # each: what changed, and the memory it saves
    verdict: str  # fits | tight | does not fit
    peak_bytes: int
    explanation: str  # the solver's own summary (what stands in the way when nothing fits)
    relative_step_time: float

    @property
    def speed(self) -> str:
        """How long a step takes next to the configuration's before, in words ("" when about the same)."""
        return step_time_words(self.relative_step_time)


def suggest_fit(config: RunConfig, gpu_bytes: int, longest_row: int | None = None) -> FitSuggestion:
    """The fastest configuration that fits ``gpu_bytes`` and the CPU RAM this machine has available
    (studio.core.memory.fit), keeping the effective batch; for the data's own rows when ``longest_row`` (the longest
    of all of them, in tokens) is known.

    Offload is not offered: it needs a ZeRO setup the run config cannot express yet.
    """
    model_config = model_config_of(config)
    host_bytes = available_ram()
    result = (fit(model_config, config, gpu_bytes, host_bytes=host_bytes) if longest_row is None
              else fit_own_data(model_config, config, gpu_bytes, longest_row, host_bytes=host_bytes))
    return FitSuggestion(result.config, tuple(str(change) for change in result.changes),
                         result.estimate.verdict(gpu_bytes).status, result.estimate.peak_bytes, result.explanation,
                         result.relative_step_time)


# ---------------------------------------------------------------- simulation in a subprocess


def simulate_command(config_path: Path) -> list[str]:
    """The subprocess that simulates the training step on fake tensors."""
    return estimate_simulation_command(sys.executable, config_path)


@dataclass(frozen=True)
class Simulation:
    peak_bytes: int | None
    peak_phase: str = ""
    seconds: float | None = None
    error: str = ""
    hint: str = ""


def parse_simulation(stdout: str) -> Simulation:
    """What ``studio estimate --simulate --json`` printed last: the simulated step, or why there is none."""
    data = last_json_object(stdout) or {}
    if "error" in data:
        error = data["error"]
        if isinstance(error, dict):
            return Simulation(None, error=str(error.get("message", error)), hint=str(error.get("hint", "")))
        return Simulation(None, error=str(error), hint=str(data.get("hint", "")))
    found = data.get("simulated")
    if isinstance(found, dict) and "peak_bytes" in found:
        return Simulation(int(found["peak_bytes"]), str(found.get("peak_phase", "")), found.get("seconds"))
    return Simulation(None, error="the simulation printed no result", hint="see its output for details")


class ImageTokens:
    """How many tokens an image of a size becomes: the model's processor's resize (studio.core.memory.parts.vision),
    under the run's vision.max_pixels; unknown (None) for a family without a rule, or files that do not read (the
    preview of the data goes on without the counts)."""

    def __init__(self, model_folder: Path | None, max_pixels: int = 0):
        self.rule, self.preprocessor, self.max_pixels = None, {}, max_pixels
        if model_folder is None:
            return
        try:
            self.rule = image_rule(load_model_config(str(model_folder), allow_network=False))
            self.preprocessor = load_preprocessor_config(str(model_folder)) if self.rule is not None else {}
        except StudioError:
            self.rule = None

    def of(self, width: int, height: int) -> int | None:
        return None if self.rule is None else self.rule.size(self.preprocessor, height, width, self.max_pixels).tokens


def shown_notes(config: RunConfig, estimate: Estimate) -> list[str]:
    """The estimate's notes the window writes out: all but the pipeline's comparison, which it draws as a table
    (``ways_caption`` above it)."""
    table = comparison_note(config, estimate.comparison) if estimate.comparison else None
    return [note for note in estimate.notes if note != table]


def ways_caption(config: RunConfig, estimate: Estimate) -> str:
    """The words above a pipeline's comparison table: its bubble."""
    if not estimate.comparison:
        return ""
    words = bubble_words(config, estimate.comparison)
    return words[0].upper() + words[1:] + ":"
