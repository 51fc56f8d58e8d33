"""The self-test (``studio doctor``): without a GPU every check runs on the CPU for real and two runs agree; a
missing library is named with its fix; what a GPU's checks report is judged by its precision's tolerance; the
CUDA overheads they measure become this machine's calibration, which the estimate then uses and says so."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from studio.core.memory.estimate import estimate
from studio.core.memory.sharding import CudaOverheads, calibration_path, machine_overheads, save_calibration
from studio.core.model.info import load_model_config
from studio.core.presets import DEMO_MODEL, demo_config
from studio.core.run.commands import EXIT_FAILED, EXIT_OK
from studio.core.runtime.self_test import AGREEMENT, STEPS, TOLERANCES, SelfTestReport, finish, judge

ROOT = Path(__file__).resolve().parents[1]
# Makes every import of bitsandbytes fail in the self-test's processes, as where it is not installed.
NO_BITSANDBYTES = '''
import sys

class NoBitsandbytes:
    def find_spec(self, name, path=None, target=None):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")

sys.meta_path.insert(0, NoBitsandbytes())
'''


def doctor(tmp_path: Path, *args: str, inject: str = "") -> subprocess.CompletedProcess:
    """``studio doctor --out tmp_path/report.md ARGS`` in its own process, records kept under tmp_path."""
    paths = [str(ROOT)]
    if inject:
        (tmp_path / "inject").mkdir()
        (tmp_path / "inject" / "sitecustomize.py").write_text(inject)
        paths.insert(0, str(tmp_path / "inject"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "STUDIO_RUNS_DIR": str(tmp_path / "data" / "runs")}
    return subprocess.run([sys.executable, "-m", "studio", "doctor", "--out", str(tmp_path / "report.md"), *args],
                          env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The three LoRA precisions through the whole command, on this machine's CPU."""
    folder = tmp_path_factory.mktemp("doctor")
    completed = doctor(folder, "--only", "lora_fp32,lora_bf16,lora_fp16")
    return folder, completed, json.loads((folder / "report.json").read_text())


@pytest.mark.heavy  # test_gui_self_test runs the self-test; test_train trains each technique
@pytest.mark.slow
def test_without_a_gpu_each_technique_trains_on_the_cpu_and_a_second_run_agrees(cpu_run):
    folder, completed, report = cpu_run
    assert completed.returncode == EXIT_OK, completed.stderr[-3000:]
    assert completed.stdout.startswith("Self-test on the CPU (PyTorch sees no GPU): 3 of 3 techniques work.")
    assert "PyTorch sees no GPU here" in completed.stdout and f"Report: {folder / 'report.md'}" in completed.stdout
    assert "doctor: LoRA in bf16 on cpu: trained" in completed.stderr  # the progress, without the libraries' chatter
    assert not report["on_gpu"] and [r["status"] for r in report["results"]] == ["passed"] * 3
    for result in report["results"]:
        losses = result["losses"]
        assert len(losses) == STEPS and losses[-1] < 0.9 * losses[0], result
        assert result["difference"] <= AGREEMENT == result["tolerance"]  # the second process, on the same CPU
        assert "a second run" in result["words"]
    markdown = (folder / "report.md").read_text()
    assert "| LoRA in fp16 | passed | fp16 |" in markdown and "torch 2." in markdown
    assert "No CUDA calibration saved: there is no GPU to measure." in markdown
    assert not (folder / "data" / calibration_path().name).exists()


@pytest.mark.heavy  # its module fixture is the heavy self-test run; the tolerance rules are tested without it below
@pytest.mark.slow
def test_the_tolerances_have_room_for_a_gpus_rounding(cpu_run):
    """A 16-bit run differs from the fp32 run by its own rounding; the GPU rounds as much again. The tolerance of
    each precision is at least ten times what these CPU runs show (self_test's docstring)."""
    runs = {r["precision"]: r["losses"] for r in cpu_run[2]["results"]}
    for precision in ("bf16", "fp16"):
        gap = max(abs(a - b) / b for a, b in zip(runs[precision], runs["fp32"]))
        assert 0 < gap <= TOLERANCES[precision] / 10, (precision, gap)


@pytest.mark.slow
def test_a_missing_library_is_named_with_its_fix_and_marks_its_controls(tmp_path):
    completed = doctor(tmp_path, "--json", "--only", "qlora_nf4,adamw_8bit", inject=NO_BITSANDBYTES)
    assert completed.returncode == EXIT_FAILED, completed.stderr[-3000:]
    report = SelfTestReport.from_json(json.loads(completed.stdout))
    words = ("bitsandbytes is not installed (ImportError: No module named 'bitsandbytes'): QLoRA (4-bit NF4 base) "
             "and 8-bit AdamW cannot run.")
    assert [(r.name, r.status, r.words) for r in report.results] == [("qlora_nf4", "failed", words),
                                                                      ("adamw_8bit", "failed", words)]
    assert all("pip install bitsandbytes" in r.fix for r in report.results)
    assert report.summary.endswith("failed: QLoRA (4-bit NF4 base), 8-bit AdamW.")
    assert set(report.marks()) == {"method", "training.optimizer"}
    assert "Traceback" not in (tmp_path / "report.md").read_text()


def test_an_unknown_technique_is_refused_before_anything_starts(tmp_path):
    completed = doctor(tmp_path, "--only", "lora_fp32,qlora")
    assert completed.returncode == 2 and "no self-test technique qlora" in completed.stderr
    assert not (tmp_path / "report-runs").exists()


# ---------------------------------------------------------------- a GPU's checks, judged (pure core)


def gpu_found(losses: dict[str, list[float]], reference: dict[str, list[float]], precision: str = "bf16") -> dict:
    """What studio.train.doctor prints on a GPU (its docstring), with these losses."""
    return {"device": "cuda:0", "half": "bf16", "versions": {"torch": "2.11.0+cu128"},
            "gpu": {"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-1234", "driver": "570.86", "cuda": "12.8",
                    "total_bytes": 25_757_220_864, "capability": "8.9"},
            "techniques": {name: {"precision": precision, "losses": curve} for name, curve in losses.items()},
            "overheads": {"context_bytes": 600 * 2**20, "bare_context_bytes": 520 * 2**20, "library_bytes": 80 * 2**20,
                          "allocator_fraction": 0.021, "allocated_bytes": 900 * 2**20, "reserved_bytes": 919 * 2**20,
                          "how": "NVML's bytes of this process less PyTorch's reserved"},
            "reference": {"techniques": {name: {"precision": precision, "losses": curve}
                                         for name, curve in reference.items()}}}


def test_a_gpus_losses_pass_within_their_precisions_tolerance_and_fail_beyond_it():
    cpu = [6.5, 6.1, 5.8, 5.6, 5.4]
    close = [x * (1 + 0.4 * TOLERANCES["bf16"]) for x in cpu]
    off = [x * (1 + 3 * TOLERANCES["bf16"]) for x in cpu]
    report = judge(gpu_found({"lora_bf16": close, "tiled_mlp": off, "activation_offload": [6.5] * 5},
                             {"lora_bf16": cpu, "tiled_mlp": cpu, "activation_offload": [6.5] * 5}))
    lora, tiled, offload = report.results
    assert lora.status == "passed" and "of the CPU's losses" in lora.words
    assert tiled.status == "failed" and "differ from the CPU's by 3.00% (at most 1.00% allowed)" in tiled.words
    assert tiled.fix == "turn tiled MLP (long sequences) off, and attach this report to a bug report"
    assert offload.status == "failed" and "the loss did not fall" in offload.words
    assert report.marks()["training.tiled_mlp"].startswith("Tiled MLP (long sequences) failed the GPU self-test: ")
    assert report.summary == ("Self-test on NVIDIA GeForce RTX 4090: 1 of 3 techniques work; failed: Tiled MLP "
                              "(long sequences), Offload layer inputs to CPU RAM.")


def test_a_gpu_without_bf16_and_a_reference_that_cannot_run_are_said_so():
    found = gpu_found({"lora_fp16": [6.5, 6.1, 5.8, 5.6, 5.4]}, {}, precision="fp16")
    found["techniques"]["lora_bf16"] = {"skipped": "this GPU does not compute in bfloat16"}
    found["reference"] = {"error": "it exited with code 1"}
    report = judge(found)
    assert [(r.name, r.status) for r in report.results] == [("lora_fp16", "passed"), ("lora_bf16", "skipped")]
    assert "not compared: the CPU reference did not run it" in report.results[0].words
    assert any("The CPU reference gave no answer (it exited with code 1)" in note for note in report.notes)


def test_a_gpus_overheads_become_this_machines_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "runs"))
    cpu = [6.5, 6.1, 5.8, 5.6, 5.4]
    report = finish(gpu_found({"lora_bf16": cpu}, {"lora_bf16": cpu}), tmp_path / "report.md")
    assert report.calibration["saved_to"] == str(tmp_path / "gpu-calibration.json")
    entry = json.loads(calibration_path().read_text())["gpus"]["GPU-1234"]
    assert entry["name"] == "NVIDIA GeForce RTX 4090" and entry["context_bytes"] == 600 * 2**20
    assert entry["allocator_fraction"] == 0.021 and entry["driver"] == "570.86" and entry["torch"] == "2.11.0+cu128"
    assert "600.00 MiB outside PyTorch's tensors" in (tmp_path / "report.md").read_text()
    assert SelfTestReport.from_json(json.loads((tmp_path / "report.json").read_text())) == report


# ---------------------------------------------------------------- the estimate reads the calibration


def lora_estimate(device_type: str = "cuda", overheads: CudaOverheads | None = None):
    return estimate(load_model_config(str(DEMO_MODEL)), demo_config(), device_type, overheads=overheads)


def test_the_estimate_on_cuda_uses_this_machines_calibration_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "runs"))
    default = lora_estimate()
    assert default.peak_device.parts["cuda_context"] == CudaOverheads().context_bytes
    assert not any("studio doctor" in note for note in default.notes)

    save_calibration({"name": "NVIDIA GeForce RTX 4090", "uuid": "GPU-1234", "measured_at": "2025-11-30 10:00:00",
                      "context_bytes": 612 * 2**20, "allocator_fraction": 0.021})
    calibrated = lora_estimate()
    parts = calibrated.peak_device.parts
    default_parts = default.peak_device.parts
    tensors = (default.peak_bytes - default_parts["cuda_context"] - default_parts["blas_workspaces"]
               - default_parts["allocator_margin"])
    assert parts["cuda_context"] == 612 * 2**20 and parts["allocator_margin"] == int(0.021 * tensors)
    assert ("CUDA context and allocator margin measured on this machine by studio doctor (NVIDIA GeForce RTX 4090, "
            "2025-11-30): 612.00 MiB outside the tensors, 2.1% over them") in calibrated.notes
    assert lora_estimate(overheads=CudaOverheads()).peak_bytes == default.peak_bytes  # asked for the defaults
    assert "studio doctor" not in " ".join(lora_estimate("cpu").notes)


def test_of_several_gpus_the_estimate_takes_the_costliest_and_a_damaged_file_gives_the_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "runs"))
    for uuid, context in (("GPU-a", 500 * 2**20), ("GPU-b", 700 * 2**20)):
        save_calibration({"name": uuid, "uuid": uuid, "measured_at": "2025-11-30", "context_bytes": context,
                          "allocator_fraction": 0.02})
    assert machine_overheads().context_bytes == 700 * 2**20 and machine_overheads().measured == "GPU-b, 2025-11-30"
    calibration_path().write_text("{not json")
    assert machine_overheads() == CudaOverheads()
