"""The training runtime of the desktop download: a Python environment of its own, in the user's data folder,
with the PyTorch build that fits the machine and the rest of the ML stack at pinned versions.

The download is the window alone (no torch, see packaging/). The worker, export and generate run in this
runtime's Python instead (``runtime_invocation``). Everything here decides, nothing here downloads:

- which PyTorch build fits (``torch_build``: the CUDA build the NVIDIA driver supports, read through NVML;
  CPU-only without an NVIDIA GPU; PyPI's build on a Mac, which uses the Apple GPU);
- the steps that make the runtime (``RuntimePlan.steps``: uv makes the environment, installs torch from its
  index, then the pinned packages; then the runtime checks itself);
- what state a runtime on disk is in (``runtime_state``): a marker file is written only after a successful
  check (``record_ready``), so a setup that was cancelled, crashed or failed its check is never used;
  a marker with another requirement hash means this app version needs other packages, which are then
  installed in place (only the changed ones are downloaded).

The app's GUI runs the steps (studio.gui.runtime.setup); ``studio.train.runtime_check`` is the check that runs
inside the runtime, and ``studio.core.runtime.report`` turns its answer into plain words.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import studio
from studio.core.errors import StudioError

RUNTIME_PYTHON = "3.11"  # uv finds it on the machine or fetches a standalone build
TORCH_VERSION = "2.13.0"
PYTORCH_INDEX = "https://download.pytorch.org/whl"
PYPI_INDEX = "https://pypi.org/simple"
# The CUDA builds PyTorch publishes for TORCH_VERSION (pytorch.org, "Get started"), oldest first.
TORCH_CUDA_BUILDS: tuple[tuple[int, int], ...] = ((12, 6), (12, 8), (13, 0))
# The rest of the ML stack and the `gguf` extra at the versions the tests run (tests/test_runtime.py holds
# them to pyproject's ranges). Changing any line changes the requirement hash: installed runtimes are then updated in place.
RUNTIME_PINS: tuple[str, ...] = (
    "transformers==5.24.0", "peft==0.21.2", "accelerate==1.15.0", "bitsandbytes==0.50.2",
    "deepspeed==0.19.8; platform_system == 'Linux'", "torchao==0.18.0", "datasets==5.2.0",
    "safetensors==0.8.0", "tokenizers==0.23.3", "nvidia-ml-py==13.615.71", "pyyaml==6.0.3",
    "platformdirs==4.14.9", "psutil==7.2.2", "tensorboardX==2.6.5", "pillow==12.3.0",
    "gguf==0.19.0", "sentencepiece==0.2.3", "protobuf==7.36.2",  # the `gguf` extra: GGUF exports
)
BUILD_TOOLS = ("setuptools",)  # deepspeed ships only a source archive; it builds against the installed torch
MARKER = "studio-runtime.json"
CHECK_MODULE = "studio.train.runtime_check"  # run inside the runtime as its last step
GB = 1000**3
# About how much a runtime takes on disk, by PyTorch build (measured: CPU-only on Linux 1.3 GB; CUDA on Linux
# 6.3 GB, the measurement of the pip install). The download is about half of it.
DISK_BYTES = {"cuda": int(6.3 * GB), "cpu": int(1.3 * GB), "mac": int(1.0 * GB)}


# ---------------------------------------------------------------- the machine and its PyTorch build


@dataclass(frozen=True)
class Machine:
    system: str  # platform.system(): Linux, Windows, Darwin
    cuda_driver: tuple[int, int] | None = None  # the CUDA version the NVIDIA driver supports; None: no NVIDIA GPU
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class TorchBuild:
    kind: str  # cuda | cpu | mac
    label: str  # "CUDA 12.8", "CPU only", "macOS"
    index_url: str | None  # None: PyPI's build
    note: str = ""  # why this build, when it is not the obvious one

    @property
    def torch_requirement(self) -> str:
        """torch at TORCH_VERSION with the build's local tag (``+cu128``), so that a new build replaces the old."""
        local = self.index_url.rsplit("/", 1)[-1] if self.index_url else ""
        return f"torch=={TORCH_VERSION}+{local}" if local else f"torch=={TORCH_VERSION}"


def torch_build(machine: Machine) -> TorchBuild:
    """The PyTorch build for ``machine``: the newest CUDA build its driver supports, else CPU-only."""
    if machine.system == "Darwin":
        return TorchBuild("mac", "macOS (Apple GPU through MPS)", None)
    if machine.cuda_driver is None:
        return TorchBuild("cpu", "CPU only", f"{PYTORCH_INDEX}/cpu")
    fitting = [build for build in TORCH_CUDA_BUILDS if build <= machine.cuda_driver]
    if not fitting:
        oldest = "%d.%d" % TORCH_CUDA_BUILDS[0]
        driver = "%d.%d" % machine.cuda_driver
        return TorchBuild("cpu", "CPU only", f"{PYTORCH_INDEX}/cpu",
                          f"the NVIDIA driver supports CUDA {driver}, but PyTorch {TORCH_VERSION} needs CUDA {oldest} "
                          f"or newer: update the driver (nvidia.com/drivers), then repair the runtime to train on the GPU")
    major, minor = fitting[-1]
    return TorchBuild("cuda", f"CUDA {major}.{minor}", f"{PYTORCH_INDEX}/cu{major}{minor}")


def cuda_version_of(driver_value: int) -> tuple[int, int]:
    """NVML's ``nvmlSystemGetCudaDriverVersion`` (12080) as (12, 8)."""
    return driver_value // 1000, driver_value % 1000 // 10


def detect_machine() -> Machine:
    """This machine, its NVIDIA GPUs and driver read through NVML (none when NVML is missing or fails)."""
    system = platform.system()
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # no library, no driver, or no GPU: all mean "no NVIDIA GPU to use"
        return Machine(system)
    try:
        names = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        driver = cuda_version_of(pynvml.nvmlSystemGetCudaDriverVersion()) if names else None
        return Machine(system, driver, tuple(names))
    except pynvml.NVMLError:
        return Machine(system)
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Step:
    key: str  # environment | torch | packages | check
    label: str  # what the user reads while it runs
    argv: tuple[str, ...]


@dataclass(frozen=True)
class RuntimePlan:
    root: Path
    build: TorchBuild
    wheels: Path | None = None  # a folder of wheels to install from instead of the indexes (offline)
    pins: tuple[str, ...] = RUNTIME_PINS
    python_request: str = RUNTIME_PYTHON

    @property
    def env(self) -> Path:
        return self.root / "env"

    @property
    def cache(self) -> Path:
        """uv's cache: every finished download stays here, so a cancelled setup resumes where it stopped."""
        return self.root / "cache"

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def python(self) -> Path:
        return python_in(self.env)

    @property
    def torch_requirement(self) -> str:
        return self.build.torch_requirement

    @property
    def requirements_hash(self) -> str:
        """What this runtime must contain; a runtime recorded with another hash is updated."""
        text = "\n".join([self.python_request, self.build.index_url or "pypi", self.torch_requirement,
                          *BUILD_TOOLS, *sorted(self.pins)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def disk_bytes(self) -> int:
        return DISK_BYTES[self.build.kind]

    def sources(self) -> list[str]:
        """Where the packages come from, for the message that says what an offline setup needs."""
        if self.wheels is not None:
            return [str(self.wheels)]
        return [self.build.index_url, PYPI_INDEX] if self.build.index_url else [PYPI_INDEX]

    def steps(self, uv: str) -> list[Step]:
        """The commands that make (or complete, or update) the runtime, in order; each may run again."""
        common = ["--python", str(self.python), "--cache-dir", str(self.cache)]
        if self.wheels is not None:
            torch_from = main_from = ["--no-index", "--find-links", str(self.wheels)]
        else:
            torch_from = ["--index-url", self.build.index_url, "--extra-index-url", PYPI_INDEX] if self.build.index_url else []
            main_from = []
        return [
            Step("environment", f"Making the Python {self.python_request} environment",
                 (uv, "venv", str(self.env), "--python", self.python_request, "--allow-existing",
                  "--cache-dir", str(self.cache))),
            Step("torch", f"Installing PyTorch {TORCH_VERSION} ({self.build.label})",
                 (uv, "pip", "install", *common, *torch_from, self.torch_requirement, *BUILD_TOOLS)),
            Step("packages", "Installing transformers, peft, bitsandbytes and the rest",
                 (uv, "pip", "install", *common, *main_from, "--no-build-isolation-package", "deepspeed",
                  f"torch=={TORCH_VERSION}", *self.pins)),  # any local tag: keeps the build installed above
            Step("check", "Checking the runtime", (str(self.python), "-m", CHECK_MODULE)),
        ]


def python_in(env: Path) -> Path:
    return env / "Scripts" / "python.exe" if sys.platform == "win32" else env / "bin" / "python"


def default_runtime_root() -> Path:
    """``STUDIO_RUNTIME_DIR``, else ``runtime`` in the user's data folder (e.g. ~/.local/share/finetune-studio)."""
    override = os.environ.get("STUDIO_RUNTIME_DIR")
    if override:
        return Path(override)
    import platformdirs  # here, not at the top: a process given its folders needs no platformdirs

    return platformdirs.user_data_path("finetune-studio", appauthor=False) / "runtime"


def plan_for_this_machine(root: Path | None = None, wheels: Path | None = None) -> RuntimePlan:
    wheels = wheels or (Path(os.environ["STUDIO_RUNTIME_WHEELS"]) if os.environ.get("STUDIO_RUNTIME_WHEELS") else None)
    return RuntimePlan(root or default_runtime_root(), torch_build(detect_machine()), wheels)


# ---------------------------------------------------------------- the runtime on disk


class State(Enum):
    ABSENT = "absent"
    INCOMPLETE = "incomplete"  # a setup was cancelled, crashed or failed its check: resume it
    BROKEN = "broken"  # it was ready, and its Python is gone: make the environment again
    OUTDATED = "outdated"  # this app version pins other packages: update in place
    READY = "ready"


@dataclass(frozen=True)
class RuntimeState:
    state: State
    message: str
    action: str  # the button that fixes it: "Set up", "Resume", "Repair", "Update"; "" when ready
    recorded: dict = field(default_factory=dict)  # the marker's content, when there is one


def read_marker(plan: RuntimePlan) -> dict | None:
    try:
        data = json.loads(plan.marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def runtime_state(plan: RuntimePlan) -> RuntimeState:
    size = f"about {plan.disk_bytes / GB:.1f} GB on disk"
    if not plan.env.exists():
        return RuntimeState(State.ABSENT, f"The training runtime is not set up yet (PyTorch {plan.build.label}, "
                                          f"{size}).", "Set up")
    marker = read_marker(plan)
    if marker is None:
        return RuntimeState(State.INCOMPLETE, "The training runtime is half made: its setup was interrupted or "
                                              "did not pass its check. Resuming keeps every finished download.", "Resume")
    if not plan.python.is_file():
        return RuntimeState(State.BROKEN, f"The training runtime is broken: its Python ({plan.python}) is missing. "
                                          "Repairing makes the environment again from the kept downloads.", "Repair", marker)
    if marker.get("requirements_hash") != plan.requirements_hash:
        return RuntimeState(State.OUTDATED, "This version of the app needs other packages in the training runtime; "
                                            "updating installs only what changed.", "Update", marker)
    return RuntimeState(State.READY, f"The training runtime is ready (PyTorch {marker.get('torch', '?')}, "
                                     f"{marker.get('build', plan.build.label)}).", "", marker)


def must_rebuild(plan: RuntimePlan, state: RuntimeState) -> bool:
    """Whether the environment is deleted before the steps run: when it is broken, or made with another
    Python than this version asks for; any other runtime is completed or updated in place."""
    if state.state is State.BROKEN:
        return True
    recorded = str(state.recorded.get("python") or "")
    return state.state is State.OUTDATED and plan.python_request[:1].isdigit() and \
        not recorded.startswith(plan.python_request + ".")


def begin_setup(plan: RuntimePlan) -> None:
    """Called before the steps run: whatever happens next, the runtime is not ready until checked again."""
    plan.root.mkdir(parents=True, exist_ok=True)
    plan.marker.unlink(missing_ok=True)


def record_ready(plan: RuntimePlan, check: dict) -> None:
    """Write the marker (only after a passing check), atomically: a crash leaves the old state or the new."""
    marker = {"requirements_hash": plan.requirements_hash, "app_version": studio.__version__,
              "build": plan.build.label, "torch": check.get("torch"), "python": check.get("python"),
              "checked_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    partial = plan.marker.with_suffix(".partial")
    partial.write_text(json.dumps(marker, indent=2), encoding="utf-8")
    os.replace(partial, plan.marker)


# ---------------------------------------------------------------- which Python trains


def is_bundle() -> bool:
    """True in the desktop download (a PyInstaller bundle), where the ML stack lives in the runtime."""
    return bool(getattr(sys, "frozen", False))


def studio_source_root() -> Path:
    """The folder holding the ``studio`` package the runtime imports: the bundle's copy, or this checkout."""
    if is_bundle():
        return Path(getattr(sys, "_MEIPASS")) / "studio-src"
    return Path(studio.__file__).resolve().parents[1]


def runtime_environment(base: dict[str, str]) -> dict[str, str]:
    """The environment of a process in the runtime: studio importable, nothing of the bundle's own libraries."""
    env = {key: value for key, value in base.items() if key != "PYTHONHOME"}
    if "LD_LIBRARY_PATH_ORIG" in base:  # PyInstaller changed it for the bundle and kept the user's own value here
        env["LD_LIBRARY_PATH"] = env.pop("LD_LIBRARY_PATH_ORIG")
    env["PYTHONPATH"] = str(studio_source_root())
    env["PYTHONUNBUFFERED"] = "1"
    return env


def runtime_invocation(args: list[str], plan: RuntimePlan) -> list[str]:
    """``python ARGS`` in the runtime; a StudioError saying how to fix it when the runtime is not ready."""
    state = runtime_state(plan)
    if state.state is not State.READY:
        raise StudioError(state.message, hint=f"Open Finetune Studio and use Runtime ▸ Training runtime… "
                                              f"({state.action}).", kind="runtime")
    return [str(plan.python), *args]


def find_uv() -> str | None:
    """The uv binary: the bundle's own, else the `uv` package's (pip install uv), else one on PATH."""
    name = "uv.exe" if sys.platform == "win32" else "uv"
    if is_bundle():
        bundled = Path(getattr(sys, "_MEIPASS")) / "bin" / name
        return str(bundled) if bundled.is_file() else None
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        return shutil.which("uv")


# ---------------------------------------------------------------- offline

OFFLINE_SIGNS = ("failed to fetch", "dns error", "failed to lookup address", "could not connect", "connection refused",
                 "network is unreachable", "timed out", "error sending request", "tcp connect error")


def looks_offline(output: list[str]) -> bool:
    """Whether uv's output says it could not reach an index (rather than that a package is wrong)."""
    text = "\n".join(output).lower()
    return any(sign in text for sign in OFFLINE_SIGNS)


def offline_message(plan: RuntimePlan) -> str:
    sources = " and ".join(dict.fromkeys(plan.sources()))
    return (f"No connection: setting up needs to download about {plan.disk_bytes / 2 / GB:.1f} GB from {sources}. "
            "Connect to the internet and press Resume (finished downloads are kept), or install from a folder of "
            f"wheels: on a connected machine with the same system run `pip download --dest WHEELS "
            f"{plan.torch_requirement} --index-url {plan.build.index_url or PYPI_INDEX}` and "
            "`pip download --dest WHEELS -r requirements.txt` (Save requirements… writes it), then pick that folder here.")


def requirements_text(plan: RuntimePlan) -> str:
    """The runtime's requirements as a requirements.txt (for `pip download` on another machine)."""
    return "\n".join([plan.torch_requirement, *BUILD_TOOLS, *plan.pins]) + "\n"
