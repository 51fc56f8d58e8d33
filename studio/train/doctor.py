"""The self-test's checks on the device this process sees (``studio doctor`` starts them); prints one JSON object
that studio.core.runtime.self_test judges.

    python -m studio.train.doctor --work DIR [--only NAMES] [--reference PRECISION]

Each technique of ``self_test.TECHNIQUES`` trains ``self_test.STEPS`` steps with the real worker
(``studio.train.worker.run``), every step on the same eight rows of the demo data, of a random Llama of the
embedded model's shape with an output layer of its own (so that keeping it in CPU RAM does something). A
library a technique needs that does not import is reported without running it; a technique that fails is
reported with the worker's error event, never a traceback (that stays in its run's train.log under DIR).

With CUDA the checks also measure, through NVML, what the process holds on the GPU outside PyTorch's
allocator: the context right after CUDA starts, then the most after any run (the kernels and libraries the
runs loaded), and cuBLAS's workspaces inside it; and, from a LoRA run of a 60M-parameter model on all the
demo rows (micro-batches of varying width, as real data makes), the allocator's margin: peak reserved over
peak allocated bytes, less one, from the measured (second) step to the end. The same checks then run in a
second process with CUDA hidden (``--reference``, in the GPU's 16-bit precision): the CPU's losses to compare.
Without CUDA that second process runs after this one's checks, and its losses must equal these.

What it prints::

    {"device": "cuda:0" or "cpu", "half": "bf16" or "fp16", "versions": {...},
     "gpu": {"name", "uuid", "driver", "cuda", "total_bytes", "capability"},          (with CUDA)
     "techniques": {NAME: {"precision", "losses": [...], "seconds"}
                        | {"precision", "missing": LIBRARY, "because": ITS IMPORT ERROR}
                        | {"precision", "error": {"message", "hint"}} | {"skipped": WHY}},
     "overheads": {"context_bytes", "bare_context_bytes", "library_bytes", "allocator_fraction",
                   "allocated_bytes", "reserved_bytes", "how"} or {"error": WHY},          (with CUDA)
     "reference": the same from the CPU, or {"error": WHY}}                            (not in the reference)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from studio.core.config import RunConfig
from studio.core.presets import DEMO_MODEL, DEMO_TRAIN, demo_config
from studio.core.run.commands import EXIT_OK, cpu_only_environment, doctor_checks_command, last_json_object
from studio.core.run.events import read_events
from studio.core.runtime.self_test import HALF, STEPS, Technique, techniques_named
from studio.train.measure.metrics import library_versions
from studio.train.runtime_check import first_line
from studio.train.worker import run, use_expandable_segments

ROWS = 8  # one micro-batch, trained at every step
MARGIN_SHAPE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 12,
                "num_key_value_heads": 12, "head_dim": 64}  # 60M parameters: big tensors, as real models have
REFERENCE_TIMEOUT_S = 900


def progress(text: str) -> None:
    """A line for whoever watches (``studio doctor`` shows these, the window its latest)."""
    print(f"doctor: {text}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- what is trained


def make_model(folder: Path, dtype: torch.dtype = torch.float32, **shape) -> Path:
    """A Llama of the embedded model's config with ``shape`` changed and an output layer of its own, its weights
    random (the same in every process), with the embedded model's tokenizer. Made once per folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        config = AutoConfig.from_pretrained(DEMO_MODEL, tie_word_embeddings=False, **shape)
        AutoModelForCausalLM.from_config(config).to(dtype).save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(DEMO_MODEL / name, folder / name)
    return folder


def rows_file(folder: Path) -> Path:
    path = folder / "rows.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(DEMO_TRAIN.read_text(encoding="utf-8").splitlines(keepends=True)[:ROWS]),
                        encoding="utf-8")
    return path


def base_config(model: Path, data: Path, precision: str) -> RunConfig:
    """LoRA on ``data`` in one micro-batch per step, at a constant rate that lowers the loss in every step."""
    return demo_config().replace(
        name="self-test", model={"name_or_path": str(model)},
        data={"train_files": (str(data),), "eval_files": (), "max_length": 64},
        training={"precision": precision, "micro_batch_size": ROWS, "max_steps": STEPS, "learning_rate": 3e-3,
                  "lr_scheduler": "constant", "warmup_ratio": 0.0},
        schedule={"log_every": 1, "save_every": 0, "sample_every": 0})


def half_precision() -> str:
    """The 16-bit type the device computes in: bf16 on the CPU and on Ampere or newer, else fp16."""
    if torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp16"
    return "bf16"


def check(technique: Technique, config: RunConfig, half: str, runs: Path) -> dict:
    """Train one technique; its losses, or why it did not train."""
    precision = half if technique.precision == HALF else technique.precision
    if precision == "bf16" and half != "bf16":
        major, minor = torch.cuda.get_device_capability()
        return {"skipped": f"this GPU does not compute in bfloat16 (compute capability {major}.{minor}; bf16 needs "
                           f"8.0, Ampere, or newer): the other 16-bit checks ran in fp16"}
    for library in technique.needs:
        try:
            importlib.import_module(library)
        except Exception as exc:  # ImportError, or a library that fails while it loads its binaries
            return {"precision": precision, "missing": library, "because": first_line(exc)}
    started = time.perf_counter()
    try:
        code, run_dir = run(config.replace(training={"precision": precision}).replace(**technique.changes),
                            runs / technique.name, watch_stdin=False)
    except Exception as exc:  # refused before it started (StudioError), or a fault outside the run's own handling
        return {"precision": precision, "error": {"message": first_line(exc), "hint": ""}}
    events = read_events(run_dir.events)
    error = next((event for event in events if event["type"] == "error"), None)
    if code != EXIT_OK or error is not None:
        error = error or {"message": f"the run exited with code {code}"}
        return {"precision": precision, "error": {"message": error["message"], "hint": error.get("hint", "")}}
    return {"precision": precision, "losses": [event["loss"] for event in events if event["type"] == "step"],
            "seconds": round(time.perf_counter() - started, 1)}


# ---------------------------------------------------------------- CUDA's overheads


def _nvml_devices() -> tuple:
    """pynvml once initialized and the GPUs by UUID; (None, {}) without nvidia-ml-py or a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(index) for index in range(pynvml.nvmlDeviceGetCount())]
        return pynvml, {_text(pynvml.nvmlDeviceGetUUID(handle)): handle for handle in handles}
    except Exception:  # ImportError, pynvml.NVMLError (no driver)
        return None, {}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class CudaMeter:
    """What this process holds on its GPU outside PyTorch's allocator. Made before CUDA starts: it reads the
    device's used bytes (NVML), starts CUDA, and keeps the context's size; ``note`` after each run keeps the most
    seen since. The process's own bytes where NVML reports them (not in a container), else the device's growth."""

    def __init__(self):
        use_expandable_segments()  # as the worker's runs allocate: the setting is read when CUDA first allocates
        self.nvml, devices = _nvml_devices()
        before = {uuid: self._device_used(handle) for uuid, handle in devices.items()}
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        properties = torch.cuda.get_device_properties(0)
        uuid = "GPU-" + str(getattr(properties, "uuid", "")).removeprefix("GPU-")
        if uuid not in devices and len(devices) == 1:  # a UUID NVML spells otherwise (MIG): the only GPU there is
            uuid = next(iter(devices))
        self.handle, self.device_before = devices.get(uuid), before.get(uuid)
        self.gpu = {"name": properties.name, "uuid": uuid, "cuda": torch.version.cuda,
                    "total_bytes": properties.total_memory, "capability": f"{properties.major}.{properties.minor}",
                    "driver": self._driver()}
        self.per_process = False
        self.bare_context = self.most_outside = self.outside_bytes()
        self.workspaces = cublas_workspaces()

    def _driver(self) -> str:
        try:
            return _text(self.nvml.nvmlSystemGetDriverVersion())
        except Exception:  # no NVML: pynvml is None; pynvml.NVMLError
            return ""

    def _device_used(self, handle) -> int | None:
        try:
            return int(self.nvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:  # pynvml.NVMLError: a driver that does not say
            return None

    def _process_used(self) -> int | None:
        """NVML's bytes of this process; None where it does not list them (a container's own process ids, Windows)."""
        try:
            return next((int(p.usedGpuMemory) for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
                         if p.pid == os.getpid() and p.usedGpuMemory), None)
        except Exception:  # pynvml.NVMLError, or a library older than the driver
            return None

    def outside_bytes(self) -> int | None:
        """NVML's bytes of this process (or the device's growth since it started) less what PyTorch reserved."""
        if self.handle is None:
            return None
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        used = self._process_used()
        self.per_process = used is not None
        if used is None:
            device = self._device_used(self.handle)
            if device is None or self.device_before is None:
                return None
            used = device - self.device_before
        return max(0, used - reserved)

    def note(self) -> None:
        outside = self.outside_bytes()
        if outside is not None and self.most_outside is not None:
            self.most_outside = max(self.most_outside, outside)

    def overheads(self, margin: dict) -> dict:
        if self.bare_context is None:
            why = "nvidia-ml-py is not installed (pip install nvidia-ml-py)" if self.nvml is None else \
                "NVML does not show the memory of the GPU PyTorch uses"
            return {"error": f"{why}, so the CUDA context was not measured"}
        if "error" in margin:
            return margin
        libraries = self.most_outside - self.bare_context + self.workspaces
        how = ("NVML's bytes of this process" if self.per_process else "the growth of the GPU's used bytes (NVML) "
               "since the self-test started") + " less PyTorch's reserved; cuBLAS's workspaces from its allocator"
        return {"context_bytes": self.bare_context + libraries, "bare_context_bytes": self.bare_context,
                "library_bytes": libraries, **margin, "how": how}


def cublas_workspaces() -> int:
    """What cuBLAS keeps of PyTorch's allocator after its first products (fp32, and the 16-bit types)."""
    before = torch.cuda.memory_allocated()
    bf16 = [torch.bfloat16] if torch.cuda.is_bf16_supported(including_emulation=False) else []
    for dtype in (torch.float32, torch.float16, *bf16):
        torch.mm(*[torch.ones(64, 64, device="cuda", dtype=dtype)] * 2)  # the operands and product go at once
    torch.cuda.synchronize()
    return max(0, torch.cuda.memory_allocated() - before)


def allocator_margin(work: Path, half: str) -> dict:
    """Peak reserved over peak allocated bytes, less one, from the measured step to the end of a LoRA run of a
    60M-parameter model on all the demo rows, with what earlier runs left cached given back first."""
    model = make_model(work / "inputs" / "margin-model", torch.bfloat16, **MARGIN_SHAPE)
    config = base_config(model, DEMO_TRAIN, half).replace(training={"micro_batch_size": 48, "max_steps": 6})
    gc.collect()
    torch.cuda.empty_cache()
    try:
        code, run_dir = run(config, work / "checks" / "allocator-margin", watch_stdin=False)
    finally:
        shutil.rmtree(model, ignore_errors=True)  # 120 MB nobody needs again
    if code != EXIT_OK:
        return {"error": f"the run that measures the allocator's margin failed (see {run_dir.log})"}
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    return {"allocator_fraction": round((reserved - allocated) / allocated, 4), "allocated_bytes": allocated,
            "reserved_bytes": reserved}


# ---------------------------------------------------------------- the CPU's reference


def start_reference(work: Path, only: str, half: str) -> subprocess.Popen:
    """These checks again in a process that sees no GPU, its output in files under ``work``."""
    command = doctor_checks_command(sys.executable, work, only, reference=half)
    with open(work / "reference.out", "w") as out, open(work / "reference.log", "w") as log:
        return subprocess.Popen(command, env=cpu_only_environment(os.environ), stdout=out, stderr=log,
                                stdin=subprocess.DEVNULL)


def reference_result(process: subprocess.Popen, work: Path) -> dict:
    try:
        process.wait(REFERENCE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return {"error": f"it did not finish within {REFERENCE_TIMEOUT_S} s"}
    found = last_json_object((work / "reference.out").read_text(encoding="utf-8", errors="replace"))
    if not found or "techniques" not in found:
        return {"error": f"it exited with code {process.returncode}; its output is in {work / 'reference.log'}"}
    return found


# ---------------------------------------------------------------- the command


def checks(work: Path, only: str, reference_half: str) -> dict:
    """Every check of this process; the reference's result too unless this process is the reference."""
    meter = CudaMeter() if torch.cuda.is_available() else None  # first: before anything starts CUDA
    half = reference_half or half_precision()
    device = "cuda:0" if meter else "cpu"
    config = base_config(make_model(work / "inputs" / "model"), rows_file(work / "inputs"), half)
    # with a GPU the CPU's run goes on meanwhile; it reads the inputs just made
    reference = start_reference(work, only, half) if meter and not reference_half else None
    runs = work / ("reference" if reference_half else "checks")
    found = {"device": device, "half": half, "versions": library_versions(), "techniques": {}}
    for technique in techniques_named(only):
        progress(f"{technique.label} on {device}…")
        found["techniques"][technique.name] = outcome = check(technique, config, half, runs)
        progress(f"{technique.label} on {device}: " + ("trained" if "losses" in outcome else "did not train"))
        if meter:
            meter.note()
    if meter:
        progress("measuring the allocator's margin…")
        margin = allocator_margin(work, half)
        meter.note()
        found.update(gpu=meter.gpu, overheads=meter.overheads(margin))
    if not reference_half:
        if reference is None:
            progress("the same checks again, for a second run on the CPU…")
            reference = start_reference(work, only, half)
        else:
            progress("waiting for the CPU's run of the same checks…")
        found["reference"] = reference_result(reference, work)
        _tidy(work)
    return found


def _tidy(work: Path) -> None:
    """Leave the runs' logs and events for a bug report; the random model and the checkpoints go."""
    for folder in (work / "inputs", *work.glob("*/*/checkpoints")):
        shutil.rmtree(folder, ignore_errors=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m studio.train.doctor", description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the folder for the checks' models and runs")
    parser.add_argument("--only", default="", help="comma-separated technique names (default: all)")
    parser.add_argument("--reference", default="", choices=["", "bf16", "fp16"],
                        help="run as the CPU reference of a GPU's checks, which used this 16-bit precision")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    # the runs' per-machine records (memory-calibration.jsonl) go to the work folder, not beside the user's runs
    os.environ["STUDIO_RUNS_DIR"] = str(args.work / "records" / "runs")
    found = checks(args.work, args.only, args.reference)
    print(json.dumps(found), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
