"""The GPU self-test (``studio doctor``): the techniques it trains, how their losses are judged, and what it
found in plain words with the fix; its report, in Markdown and JSON, is a file to attach to a bug report.

``studio.train.doctor`` trains every technique of ``TECHNIQUES`` for ``STEPS`` steps of a small model on the
device its process sees, then the same steps in a second process that sees no GPU (the reference), and prints
what it saw as one JSON object (its docstring gives the format). ``judge`` turns that into a ``SelfTestReport``:

* a technique trains when its loss falls by ``FALL`` or more over the steps (every step trains the same
  micro-batch, so a working technique's loss goes down);
* on a GPU its losses must match the CPU's: at every step the relative difference is within ``TOLERANCES`` of
  the precision it ran in. Each is at least ten times the difference that the precision's own rounding makes
  over these steps on the CPU (bf16 against fp32: 0.04 %; fp16: 0.01 %; fp32 runs differ only in the order of
  their sums), since the GPU rounds as much again, and far below what computing something else makes (QLoRA's
  4-bit base against LoRA's: 8 % by the last step). ``tests/test_doctor.py`` holds the first of these;
* without a GPU both runs are on the CPU: the same program on the same machine must agree within ``AGREEMENT``.

On a GPU the test also measures what the memory estimate adds there (``studio.core.memory.sharding``): the
CUDA context with what libraries hold outside PyTorch's allocator, and the allocator's margin at a steady step.
``finish`` saves them as this machine's calibration, which the estimate then uses and names in its notes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from studio import __version__
from studio.core.config import TrainingConfig
from studio.core.errors import StudioError
from studio.core.folders import data_folder
from studio.core.memory.savers import SAVER_SPECS
from studio.core.memory.sharding import save_calibration
from studio.core.sizes import format_bytes

STEPS = 5
FALL = 0.05  # the last step's loss is at least this fraction below the first's
TOLERANCES = {"fp32": 5e-4, "fp16": 2e-3, "bf16": 1e-2}
AGREEMENT = 1e-6
HALF = "half"  # a technique's precision: bf16 where the device computes it, else fp16

REPAIR = "in the desktop download, Runtime ▸ Training runtime… and Repair"
INSTALL = {"bitsandbytes": "pip install bitsandbytes"}


@dataclass(frozen=True)
class Technique:
    name: str
    label: str
    precision: str  # fp32, fp16, bf16 or HALF
    changes: dict  # RunConfig.replace sections over the self-test's LoRA run
    fields: tuple[str, ...]  # the config fields whose controls the window marks when it fails
    fix: str  # what a user does while it fails
    needs: tuple[str, ...] = ()  # the libraries it imports (import names)


def _saver_techniques() -> tuple[Technique, ...]:
    """Every memory saver of the savers' table that is off by default, switched on with the one it acts through
    (those on by default, the lean loss and weights, run in every check)."""
    defaults, techniques = TrainingConfig(), []
    for spec in SAVER_SPECS.values():
        if not getattr(defaults, spec.name):
            switches = {spec.name: True, **({spec.needs: True} if spec.needs else {})}
            techniques.append(Technique(spec.name, spec.label, HALF, {"training": switches}, (spec.field,),
                                        f"turn {spec.label[:1].lower()}{spec.label[1:]} off"))
    return tuple(techniques)


TECHNIQUES: tuple[Technique, ...] = (
    Technique("lora_fp32", "LoRA in fp32", "fp32", {}, ("method",), "train on the CPU, or repair the runtime"),
    Technique("lora_bf16", "LoRA in bf16", "bf16", {}, ("training.precision",), "choose fp16 or fp32 precision"),
    Technique("lora_fp16", "LoRA in fp16", "fp16", {}, ("training.precision",), "choose bf16 or fp32 precision"),
    Technique("qlora_nf4", "QLoRA (4-bit NF4 base)", HALF, {"method": "qlora"}, ("method",),
              "choose LoRA instead of QLoRA", ("bitsandbytes",)),
    Technique("adamw_8bit", "8-bit AdamW", HALF, {"training": {"optimizer": "adamw_8bit"}}, ("training.optimizer",),
              "choose the AdamW optimizer", ("bitsandbytes",)),
    *_saver_techniques(),
    Technique("torch_compile", "torch.compile", HALF, {"training": {"torch_compile": True}},
              ("training.torch_compile",),
              "turn torch.compile off (it needs a C++ compiler for the CPU and Triton for the GPU)"),
)
BY_NAME = {technique.name: technique for technique in TECHNIQUES}


def techniques_named(names: str) -> tuple[Technique, ...]:
    """The techniques of a comma-separated list (empty: all of them); an unknown name is refused."""
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in wanted if name not in BY_NAME]
    if unknown:
        raise StudioError(f"no self-test technique {', '.join(unknown)}",
                          f"choose among {', '.join(BY_NAME)}", kind="usage")
    return tuple(BY_NAME[name] for name in wanted) if wanted else TECHNIQUES


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class Result:
    """One technique: ``status`` passed, failed or skipped, what happened and the fix, and the numbers."""

    name: str
    label: str
    status: str
    words: str
    fix: str = ""
    precision: str = ""
    losses: tuple[float, ...] = ()
    reference_losses: tuple[float, ...] = ()
    difference: float | None = None  # the largest relative difference of a step's loss from the reference's
    tolerance: float | None = None


@dataclass(frozen=True)
class SelfTestReport:
    made_at: str
    on_gpu: bool
    gpu: dict  # name, uuid, driver, cuda, total_bytes, capability; empty without one
    versions: dict
    results: tuple[Result, ...]
    calibration: dict = field(default_factory=dict)  # the overheads measured, and where they were saved
    notes: tuple[str, ...] = ()  # what else a reader must know: no GPU, the reference's own failure

    @property
    def failed(self) -> tuple[Result, ...]:
        return tuple(result for result in self.results if result.status == "failed")

    @property
    def summary(self) -> str:
        passed = sum(result.status == "passed" for result in self.results)
        where = f"on {self.gpu.get('name', 'the GPU')}" if self.on_gpu else "on the CPU (PyTorch sees no GPU)"
        failed = ", ".join(result.label for result in self.failed)
        return f"Self-test {where}: {passed} of {len(self.results)} techniques work" + (
            f"; failed: {failed}." if failed else ".")

    def marks(self) -> dict[str, str]:
        """Each config field of a failed technique, with what the window says beside its control."""
        marks: dict[str, list[str]] = {}
        for result in self.failed:
            for path in BY_NAME[result.name].fields if result.name in BY_NAME else ():
                marks.setdefault(path, []).append(f"{result.label} failed the GPU self-test: {result.words} "
                                                  f"Fix: {result.fix}.")
        return {path: " ".join(lines) for path, lines in marks.items()}

    def as_text(self) -> str:
        """The summary, then one line per technique (✓ passed, ✗ failed, – skipped) with its fix."""
        lines = [self.summary, *self.notes]
        for result in self.results:
            mark = {"passed": "✓", "failed": "✗"}.get(result.status, "–")
            lines.append(f"{mark} {result.label}: {result.words}" + (f" Fix: {result.fix}." if result.fix else ""))
        lines += self.calibration_lines()
        return "\n".join(lines)

    def calibration_lines(self) -> list[str]:
        """What was measured of CUDA and where it was saved, or why nothing was."""
        measured = self.calibration
        if "context_bytes" not in measured:
            return [measured.get("why_not", "No CUDA calibration.")]
        lines = [f"Measured on this GPU: {format_bytes(measured['context_bytes'])} outside PyTorch's tensors (the CUDA "
                 f"context {format_bytes(measured['bare_context_bytes'])}, libraries "
                 f"{format_bytes(measured['library_bytes'])}) and an allocator margin of "
                 f"{measured['allocator_fraction']:.1%} over the tensors at a steady step."]
        if measured.get("saved_to"):
            lines.append(f"Saved as this machine's calibration in {measured['saved_to']}: the memory estimate on CUDA "
                         "uses it from now on and says so in its notes.")
        return lines

    def as_markdown(self) -> str:
        gpu = self.gpu
        machine = (f"{gpu.get('name')} ({format_bytes(gpu.get('total_bytes', 0))}), driver {gpu.get('driver', '?')}, "
                   f"CUDA {gpu.get('cuda', '?')}, compute capability {gpu.get('capability', '?')}"
                   if self.on_gpu else "no GPU seen by PyTorch: the checks ran on the CPU")
        lines = ["# Finetune Studio self-test", "",
                 f"Made {self.made_at} by `studio doctor` (Finetune Studio {self.versions.get('studio', '?')}).", "",
                 f"**{self.summary}**", "", *(f"- {note}" for note in self.notes), "", "## Machine", "",
                 f"- GPU: {machine}",
                 "- Versions: " + ", ".join(f"{name} {version}" for name, version in self.versions.items()), "",
                 "## Techniques", "",
                 "| technique | result | precision | loss, first → last | difference | tolerance |",
                 "|---|---|---|---|---|---|"]
        for result in self.results:
            losses = f"{result.losses[0]:.4f} → {result.losses[-1]:.4f}" if result.losses else ""
            lines.append(f"| {result.label} | {result.status} | {result.precision} | {losses} | "
                         f"{_percent(result.difference)} | {_percent(result.tolerance)} |")
        lines += ["", *(f"- **{r.label}** ({r.status}): {r.words}" + (f" Fix: {r.fix}." if r.fix else "")
                        for r in self.results), "", "## CUDA calibration", "",
                  *(f"- {line}" for line in self.calibration_lines()), "", "## How the losses are judged",
                  "", f"Each technique trains {STEPS} steps on one micro-batch of a small random Llama; it passes when "
                  f"the loss falls by {FALL:.0%} or more and, on a GPU, every step's loss is within the tolerance of "
                  f"its precision ({', '.join(f'{p} {_percent(t)}' for p, t in TOLERANCES.items())}) of the same "
                  f"steps on the CPU; without a GPU two CPU runs must agree within {AGREEMENT:g}.", ""]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> SelfTestReport:
        results = tuple(Result(**{**r, "losses": tuple(r["losses"]), "reference_losses": tuple(r["reference_losses"])})
                        for r in data["results"])
        return cls(**{**data, "results": results, "notes": tuple(data.get("notes", ()))})


def _percent(value: float | None) -> str:
    if value is None:
        return ""
    return "0" if value == 0 else f"{value:.2%}" if value >= 1e-4 else f"{value:.1e}"


# ---------------------------------------------------------------- judging what the checks saw


def judge(found: dict, made_at: str = "") -> SelfTestReport:
    """The report of ``studio.train.doctor``'s output (see its docstring); ``{}`` when it printed nothing."""
    if not found.get("techniques"):
        raise StudioError("the self-test's checks gave no answer", found.get("error", "see the output above"),
                          kind="internal")
    reference = found.get("reference", {})
    on_gpu = bool(found.get("gpu"))
    results = tuple(_result(BY_NAME[name], outcome, reference.get("techniques", {}).get(name), on_gpu, found)
                    for name, outcome in found["techniques"].items())
    notes = []
    if not on_gpu:
        build = " (a CPU-only build of PyTorch)" if "+cpu" in found.get("versions", {}).get("torch", "") else ""
        notes.append(f"PyTorch sees no GPU here{build}: each technique trained on the CPU, and a second run on the CPU "
                     "must give the same losses. The GPU's own checks (its kernels, its losses against the CPU's, the "
                     "CUDA overheads) did not run.")
    if "error" in reference:
        notes.append(f"The CPU reference gave no answer ({reference['error']}): nothing was compared with it.")
    return SelfTestReport(made_at or time.strftime("%Y-%m-%d %H:%M:%S"), on_gpu, found.get("gpu", {}),
                          {"studio": __version__, **found.get("versions", {})}, results,
                          _calibration(found, on_gpu), tuple(notes))


def _calibration(found: dict, on_gpu: bool) -> dict:
    if not on_gpu:
        return {"why_not": "No CUDA calibration saved: there is no GPU to measure."}
    overheads = found.get("overheads", {})
    if "error" in overheads or "context_bytes" not in overheads:
        return {"why_not": f"No CUDA calibration saved: {overheads.get('error', 'nothing was measured')}."}
    return overheads


def _result(technique: Technique, outcome: dict, reference: dict | None, on_gpu: bool, found: dict) -> Result:
    base = Result(technique.name, technique.label, "failed", "", fix=technique.fix,
                  precision=outcome.get("precision", ""))
    if "skipped" in outcome:
        return replace(base, status="skipped", words=outcome["skipped"], fix="")
    if "missing" in outcome:
        return replace(base, words=_missing_words(outcome["missing"], outcome["because"], found), fix=_install(outcome))
    if "error" in outcome:
        error = outcome["error"]
        hint = f" ({error['hint']})" if error.get("hint") else ""
        return replace(base, words=f"it fails: {error['message']}{hint}")
    return _judged(replace(base, losses=tuple(outcome["losses"])), technique, reference, on_gpu)


def _judged(base: Result, technique: Technique, reference: dict | None, on_gpu: bool) -> Result:
    """A technique that trained: whether its loss fell, and how far its losses are from the reference's."""
    losses = base.losses
    trained = f"loss {losses[0]:.4f} → {losses[-1]:.4f} over {len(losses)} steps"
    if not losses[-1] <= (1 - FALL) * losses[0]:
        return replace(base, words=f"it runs, but the loss did not fall ({trained}).",
                       fix=f"{technique.fix}, and attach this report to a bug report")
    if not reference or "losses" not in reference:
        why = _reference_trouble(reference)
        return replace(base, status="passed", fix="", words=f"it trains ({trained}); not compared: {why}.")
    tolerance = TOLERANCES[base.precision] if on_gpu else AGREEMENT
    difference = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
    compared = replace(base, reference_losses=tuple(reference["losses"]), difference=difference, tolerance=tolerance)
    against = "the CPU" if on_gpu else "a second run"
    if difference > tolerance:
        return replace(compared, words=f"it trains ({trained}), but its losses differ from {against}'s by "
                                       f"{_percent(difference)} (at most {_percent(tolerance)} allowed).",
                       fix=f"{technique.fix}, and attach this report to a bug report")
    agrees = f"the same losses as {against}" if difference == 0 else \
        f"within {_percent(difference)} of {against}'s losses"
    return replace(compared, status="passed", fix="", words=f"it trains ({trained}); {agrees}.")


def _reference_trouble(reference: dict | None) -> str:
    if reference is None:
        return "the CPU reference did not run it"
    if "missing" in reference:
        return f"the CPU reference lacks {reference['missing']}"
    if "error" in reference:
        return f"it fails on the CPU ({reference['error']['message']})"
    return reference.get("skipped", "the CPU reference did not run it")


def _missing_words(library: str, because: str, found: dict) -> str:
    needing = [BY_NAME[name].label for name in found["techniques"] if library in BY_NAME[name].needs]
    return f"{library} is not installed ({because}): {' and '.join(needing)} cannot run."


def _install(outcome: dict) -> str:
    command = INSTALL.get(outcome["missing"], f"pip install {outcome['missing']}")
    return f"install it with `{command}` ({REPAIR})"


# ---------------------------------------------------------------- the files


def report_folder() -> Path:
    return data_folder() / "self-test"


def default_report_path(made_at: float | None = None) -> Path:
    return report_folder() / time.strftime("self-test-%Y%m%d-%H%M%S.md", time.localtime(made_at))


def finish(found: dict, out: Path) -> SelfTestReport:
    """Judge what the checks found, save a GPU's measured overheads as this machine's calibration, and write
    the report to ``out`` (Markdown) and beside it as JSON."""
    report = judge(found)
    if "context_bytes" in report.calibration:
        saved = save_calibration({**_calibration_entry(report), **report.calibration})
        report = replace(report, calibration={**report.calibration, "saved_to": str(saved)})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report.as_markdown(), encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps(report.to_json(), indent=2), encoding="utf-8")
    return report


def _calibration_entry(report: SelfTestReport) -> dict:
    gpu = report.gpu
    return {"name": gpu.get("name", ""), "uuid": gpu.get("uuid", ""), "driver": gpu.get("driver", ""),
            "cuda": gpu.get("cuda", ""), "torch": report.versions.get("torch", ""),
            "measured_at": report.made_at, "measured_by": "studio doctor"}


def latest_report() -> SelfTestReport | None:
    """The newest report in the report folder, None without one (or when it cannot be read)."""
    reports = sorted(report_folder().glob("self-test-*.json"))
    if not reports:
        return None
    try:
        return SelfTestReport.from_json(json.loads(reports[-1].read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, KeyError):
        return None
