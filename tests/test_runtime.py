"""The training runtime of the desktop download: which PyTorch build, the steps, the states on disk (half made,
broken, outdated, ready), the check in plain words, progress; and, slow, a real setup from local wheels,
cancelled, resumed, checked, and the demo trained through it."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from studio.core.errors import StudioError
from studio.core.runtime.environment import (BUILD_TOOLS, PYPI_INDEX, RUNTIME_PINS, Machine, RuntimePlan, State,
                                             begin_setup, cuda_version_of, find_uv, looks_offline, must_rebuild,
                                             offline_message, record_ready, requirements_text, runtime_environment,
                                             runtime_invocation, runtime_state, torch_build)
from studio.core.runtime.progress import SetupProgress
from studio.core.runtime.report import diagnose
from wheelhouse import build_wheelhouse

ROOT = Path(__file__).resolve().parents[1]
GUI_ONLY = {"pyside6-essentials", "pyqtgraph"}
LINUX_GPU = Machine("Linux", (12, 9), ("NVIDIA GeForce RTX 4090",))
NO_GPU = Machine("Linux")
# Where this machine's pip finds ready-made wheels (its torch); elsewhere torch is packed from the install too.
PIP_WHEEL_FOLDERS = [folder for folder in (Path("/opt/wheels"),) if folder.is_dir()]


# ---------------------------------------------------------------- which PyTorch


@pytest.mark.parametrize("machine, kind, index", [
    (LINUX_GPU, "cuda", "https://download.pytorch.org/whl/cu128"),  # the newest build the driver supports
    (Machine("Windows", (13, 1), ("RTX 5090",)), "cuda", "https://download.pytorch.org/whl/cu130"),
    (Machine("Linux", (12, 6), ("T4",)), "cuda", "https://download.pytorch.org/whl/cu126"),
    (NO_GPU, "cpu", "https://download.pytorch.org/whl/cpu"),
    (Machine("Darwin"), "mac", None),  # PyPI's macOS build (MPS)
])
def test_torch_build_follows_the_driver(machine, kind, index):
    build = torch_build(machine)
    assert (build.kind, build.index_url) == (kind, index)


def test_a_driver_too_old_gets_the_cpu_build_and_says_to_update():
    build = torch_build(Machine("Linux", (12, 2), ("RTX 3060",)))
    assert build.kind == "cpu"
    assert "CUDA 12.2" in build.note and "update the driver" in build.note


def test_nvml_driver_version_reads_as_major_minor():
    assert cuda_version_of(12080) == (12, 8) and cuda_version_of(13010) == (13, 1)


def test_pins_are_the_pip_route_without_the_window_and_inside_its_ranges():
    """The runtime holds what `pip install finetune-studio[gguf]` holds, minus the GUI, at versions its ranges admit."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {canonicalize_name(Requirement(text).name): Requirement(text)
                for text in project["dependencies"] + project["optional-dependencies"]["gguf"]}
    pinned = {canonicalize_name(Requirement(text).name): Requirement(text) for text in RUNTIME_PINS}
    assert set(pinned) == set(declared) - GUI_ONLY - {"torch"}
    for name, requirement in pinned.items():
        version = next(iter(requirement.specifier)).version
        assert declared[name].specifier.contains(version), f"{name} {version} is outside pyproject's {declared[name]}"


# ---------------------------------------------------------------- the plan


def test_steps_install_torch_from_its_index_then_the_pins(tmp_path):
    plan = RuntimePlan(tmp_path, torch_build(LINUX_GPU))
    steps = {step.key: step.argv for step in plan.steps("uv")}
    assert list(steps) == ["environment", "torch", "packages", "check"]
    torch = steps["torch"]
    assert torch[torch.index("--index-url") + 1] == "https://download.pytorch.org/whl/cu128"
    assert str(plan.cache) in torch and "torch==2.13.0+cu128" in torch  # a runtime with another build changes
    packages = steps["packages"]
    assert "torch==2.13.0" in packages  # any build: keeps the CUDA build, uv does not swap it for PyPI's
    assert set(RUNTIME_PINS) <= set(packages) and "--index-url" not in packages
    assert steps["check"] == (str(plan.python), "-m", "studio.train.runtime_check")


def test_a_wheel_folder_means_no_index_at_all(tmp_path):
    plan = RuntimePlan(tmp_path / "rt", torch_build(LINUX_GPU), wheels=tmp_path / "wheels")
    for step in plan.steps("uv")[1:3]:
        assert "--no-index" in step.argv and str(tmp_path / "wheels") in step.argv
        assert not any(arg.startswith("http") for arg in step.argv)


def test_the_hash_changes_with_the_requirements_only(tmp_path):
    plan = RuntimePlan(tmp_path, torch_build(LINUX_GPU))
    assert RuntimePlan(tmp_path / "elsewhere", torch_build(LINUX_GPU)).requirements_hash == plan.requirements_hash
    assert replace(plan, pins=RUNTIME_PINS[:-1] + ("psutil==7.3.0",)).requirements_hash != plan.requirements_hash
    assert RuntimePlan(tmp_path, torch_build(NO_GPU)).requirements_hash != plan.requirements_hash


def test_requirements_text_lists_everything_for_pip_download(tmp_path):
    text = requirements_text(RuntimePlan(tmp_path, torch_build(NO_GPU)))
    assert text.splitlines() == ["torch==2.13.0+cpu", *BUILD_TOOLS, *RUNTIME_PINS]
    assert requirements_text(RuntimePlan(tmp_path, torch_build(Machine("Darwin")))).startswith("torch==2.13.0\n")


# ---------------------------------------------------------------- the runtime on disk


def fake_python(plan: RuntimePlan) -> None:
    plan.python.parent.mkdir(parents=True, exist_ok=True)
    plan.python.write_text("")


def test_states_from_absent_to_ready_to_broken(tmp_path):
    plan = RuntimePlan(tmp_path / "runtime", torch_build(NO_GPU))
    assert runtime_state(plan).state is State.ABSENT
    begin_setup(plan)
    fake_python(plan)  # everything installed, but the check never passed
    half = runtime_state(plan)
    assert (half.state, half.action) == (State.INCOMPLETE, "Resume")
    with pytest.raises(StudioError, match="half made") as refused:
        runtime_invocation(["-m", "studio.train"], plan)
    assert "Training runtime" in refused.value.hint

    record_ready(plan, {"torch": "2.13.0+cpu", "python": "3.11.7"})
    assert runtime_state(plan).state is State.READY
    assert runtime_invocation(["-m", "studio", "export"], plan) == [str(plan.python), "-m", "studio", "export"]

    plan.python.unlink()
    broken = runtime_state(plan)
    assert (broken.state, broken.action) == (State.BROKEN, "Repair") and must_rebuild(plan, broken)


def test_new_pins_make_a_ready_runtime_outdated_and_a_new_setup_unmarks_it(tmp_path):
    plan = RuntimePlan(tmp_path, torch_build(NO_GPU))
    fake_python(plan)
    record_ready(plan, {"torch": "2.13.0+cpu", "python": "3.11.7"})
    assert runtime_state(plan).state is State.READY
    newer = replace(plan, pins=plan.pins + ("rich==14.0.0",))
    assert (runtime_state(newer).state, runtime_state(newer).action) == (State.OUTDATED, "Update")
    assert not must_rebuild(newer, runtime_state(newer))  # updated in place: only the changes download
    assert must_rebuild(replace(newer, python_request="3.12"), runtime_state(newer))  # another Python: made again
    begin_setup(newer)  # an update that is then cancelled leaves a runtime nobody uses
    assert runtime_state(newer).state is State.INCOMPLETE


def test_the_runtime_imports_studio_and_none_of_the_bundles_libraries():
    env = runtime_environment({"PATH": "/bin", "PYTHONHOME": "/bundle", "LD_LIBRARY_PATH": "/bundle/_internal",
                               "LD_LIBRARY_PATH_ORIG": "/usr/local/cuda/lib64", "PYTHONPATH": "/bundle/_internal"})
    assert env["PYTHONPATH"] == str(ROOT) and "PYTHONHOME" not in env
    assert env["LD_LIBRARY_PATH"] == "/usr/local/cuda/lib64"


# ---------------------------------------------------------------- offline


def test_offline_is_told_apart_and_says_what_it_needs(tmp_path):
    plan = RuntimePlan(tmp_path, torch_build(LINUX_GPU))
    assert looks_offline(["error: Failed to fetch: `https://download.pytorch.org/whl/cu128/torch/`",
                          "  Caused by: dns error: failed to lookup address information"])
    assert not looks_offline(["error: No solution found when resolving dependencies"])
    message = offline_message(plan)
    assert "https://download.pytorch.org/whl/cu128" in message and PYPI_INDEX in message
    assert "about 3.1 GB" in message and "folder of wheels" in message


# ---------------------------------------------------------------- the check in plain words


HEALTHY_GPU = {"python": "3.11.7", "torch": "2.13.0+cu128", "cuda_build": "12.8", "cuda_available": True,
               "devices": ["NVIDIA GeForce RTX 4090"], "bitsandbytes_error": "", "import_errors": {}}


def test_a_healthy_gpu_runtime_says_so_in_one_line():
    report = diagnose(HEALTHY_GPU, LINUX_GPU)
    assert report.healthy and not report.problems
    assert report.summary == ("Training runtime ready: PyTorch 2.13.0+cu128, CUDA 12.8, training on "
                              "NVIDIA GeForce RTX 4090; bitsandbytes works.")


def test_a_cpu_build_on_a_gpu_machine_is_not_usable_and_says_repair():
    check = {**HEALTHY_GPU, "torch": "2.13.0+cpu", "cuda_build": None, "cuda_available": False}
    report = diagnose(check, LINUX_GPU)
    assert not report.healthy
    assert "CPU-only build" in report.problems[0].text and "Repair" in report.problems[0].fix


def test_cuda_that_does_not_see_the_gpu_says_update_the_driver():
    report = diagnose({**HEALTHY_GPU, "cuda_available": False}, LINUX_GPU)
    assert not report.healthy and "Update the NVIDIA driver" in report.problems[0].fix


def test_bitsandbytes_failing_limits_but_does_not_block():
    report = diagnose({**HEALTHY_GPU, "bitsandbytes_error": "no kernel image is available"}, LINUX_GPU)
    assert report.healthy and "QLoRA" in report.problems[0].text and "LoRA instead" in report.problems[0].fix


def test_torch_missing_or_silence_is_not_usable():
    assert not diagnose(None, NO_GPU).healthy
    report = diagnose({"python": "3.11.7", "torch_error": "ModuleNotFoundError: No module named 'torch'"}, NO_GPU)
    assert not report.healthy and "No module named 'torch'" in report.as_text()


def test_no_gpu_is_fine_and_says_cpu():
    check = {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda_build": None, "cuda_available": False,
             "mps_available": False, "import_errors": {}}
    report = diagnose(check, NO_GPU)
    assert report.healthy and "training on the CPU" in report.summary


# ---------------------------------------------------------------- progress


def test_progress_gives_size_rate_and_time_left():
    now = [0.0]
    progress = SetupProgress(6_000_000_000, clock=lambda: now[0])
    progress.note_line("Resolved 59 packages in 1.20s")
    progress.update(0, 0)
    now[0] = 10.0
    progress.update(1_000_000_000, 12)
    assert progress.rate() == pytest.approx(100_000_000)
    assert progress.seconds_left() == pytest.approx(50.0)
    assert progress.text() == "1.0 GB of about 6.0 GB · 12 of 59 packages · 100.0 MB/s · about 1 min left"
    assert progress.fraction == pytest.approx(1 / 6)


# ---------------------------------------------------------------- a real setup, offline


def pins_as_installed_here(pins: tuple[str, ...]) -> tuple[str, ...]:
    """The runtime's pins at the versions installed here, which the offline wheelhouse is made of (a fresh CI
    environment may resolve newer releases than the app pins)."""
    here = []
    for text in pins:
        requirement = Requirement(text)
        applies = requirement.marker is None or requirement.marker.evaluate()
        extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
        marker = f"; {requirement.marker}" if requirement.marker else ""
        here.append(f"{requirement.name}{extras}=={metadata.version(requirement.name)}{marker}" if applies else text)
    return tuple(here)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # about 2 minutes on two idle cores; ten when they are busy with other work
def test_setup_offline_from_local_wheels_cancel_resume_and_train_the_demo(tmp_path, qtbot):
    from studio.gui.runtime.setup import RuntimeSetup

    plan = RuntimePlan(tmp_path / "runtime", torch_build(NO_GPU), wheels=tmp_path / "wheels",
                       pins=pins_as_installed_here(RUNTIME_PINS), python_request=sys.executable)
    assert Requirement(plan.torch_requirement).specifier.contains(metadata.version("torch"))
    build_wheelhouse(requirements_text(plan).splitlines(), plan.wheels, PIP_WHEEL_FOLDERS)
    setup = RuntimeSetup(plan, find_uv(), NO_GPU)

    # Cancelled while PyTorch installs: half made, refused, and the next start resumes it.
    setup.step_started.connect(lambda label: setup.cancel() if "PyTorch" in label else None)
    with qtbot.waitSignal(setup.done, timeout=120_000) as cancelled:
        setup.start()
    assert cancelled.args[0] is False and "Resume" in cancelled.args[1]
    assert runtime_state(plan).state is State.INCOMPLETE
    setup.step_started.disconnect()

    with qtbot.waitSignal(setup.done, timeout=600_000) as finished:
        setup.start()
    assert finished.args[0] is True, finished.args[1]
    assert "training on the CPU" in finished.args[1]
    assert runtime_state(plan).state is State.READY

    # The demo, trained and exported in the runtime's Python, as the bundle's worker would be.
    demo = subprocess.run(runtime_invocation(["-m", "studio", "demo", "--run-dir", str(tmp_path / "demo")], plan),
                          env=runtime_environment(dict(os.environ)), capture_output=True, text=True, timeout=600)
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert any(line.startswith("exact match") for line in demo.stdout.splitlines())  # base vs fine-tuned
    assert (tmp_path / "demo" / "exports" / "adapter").is_dir()
