"""What the borrowed GPU machine lacks for benchmarks/gpu_checks.py, as slim wheels in one git-ignored folder.

    python benchmarks/gpu_carry.py             # here (PyPI reachable): writes .gpu-wheels/, prints what and how much
    python benchmarks/gpu_carry.py --plan      # only the packages it would carry and why (reads no index)

The machine (docs/gpu-results.md) has Python 3.12 with torch 2.11 (CUDA 13.0), transformers, peft, accelerate,
psutil, pyarrow and nvidia-ml-py, and no network. It lacks bitsandbytes (QLoRA, 8-bit and paged AdamW), datasets
(every run's data), platformdirs and deepspeed (ZeRO): they travel as wheels, at the versions the desktop runtime
pins (``studio.core.runtime.environment.RUNTIME_PINS``), with what they require and the machine lacks, at the
versions installed here where those satisfy them. bitsandbytes keeps only its CUDA 13.0 and CPU libraries
(about 40 MB less); deepspeed, which PyPI has only as a source archive, is built here into a wheel (its ops
compile on first use there). torchao (QAT only) does not travel: no check needs it. The wheels and the files of
the repository that travel must fit in the device tool's 64 MiB; the script says if they do not (exit 1).

On the machine, in the repository root (the device tool's ``run`` with ``carry: [".gpu-wheels"]``, timeout_s 600):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu-wheels/*.whl \
      && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 benchmarks/gpu_checks.py --out $OUT
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from studio.core.runtime.environment import RUNTIME_PINS  # noqa: E402

FOLDER = ROOT / ".gpu-wheels"  # in .gitignore
LIMIT_BYTES = 64 * 2**20  # the device tool's limit on what travels: the working tree and the carried folders
MIB = 2**20

# The machine's Python packages ("Python packages already there" of the device tool's KINDS.md, read 2026-11-17),
# with the versions it reported where one was reported.
DEVICE_VERSIONS = {"torch": "2.11.0", "transformers": "5.17.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
                   "numpy": "2.5.2", "safetensors": "0.8.0", "tokenizers": "0.23.2", "triton": "3.6.0"}
DEVICE_PACKAGES = frozenset(canonicalize_name(name) for name in """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
    llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
    nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
    nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec
    patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
    py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
    safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# Where pip's markers are evaluated: the machine's Python, not this one.
DEVICE_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                      "platform_python_implementation": "CPython", "sys_platform": "linux", "os_name": "posix",
                      "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
PLATFORM_TAGS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64")
DEVICE_CUDA = "130"  # torch 2.11.0+cu130: bitsandbytes loads libbitsandbytes_cuda130

# What gpu_checks needs that the machine lacks, and for what.
CARRIED = {"bitsandbytes": "QLoRA, 8-bit and paged AdamW", "datasets": "every run's data",
           "platformdirs": "studio's default folders", "deepspeed": "the ZeRO checks"}
BUILT_HERE = {"deepspeed": {"DS_BUILD_OPS": "0"}}  # PyPI has only a source archive; its ops compile on first use


def native_library_dropped(name: str) -> bool:
    """bitsandbytes' libraries for other CUDA versions, ROCm and XPU: all but the machine's CUDA and the CPU one."""
    library = re.fullmatch(r"bitsandbytes/libbitsandbytes_(\w+)\.(so|dll|dylib)", name)
    return library is not None and library.group(1) not in (f"cuda{DEVICE_CUDA}", "cpu")


SLIMMED = {"bitsandbytes": native_library_dropped}


@dataclass(frozen=True)
class Carried:
    """One package that travels: the requirement pip fetches, and why it travels."""

    requirement: Requirement
    reason: str

    @property
    def name(self) -> str:
        return canonicalize_name(self.requirement.name)


def pinned(name: str) -> Requirement:
    """The desktop runtime's pin of ``name`` (RUNTIME_PINS), markers dropped."""
    for pin in RUNTIME_PINS:
        requirement = Requirement(pin)
        if canonicalize_name(requirement.name) == canonicalize_name(name):
            return Requirement(f"{requirement.name}{requirement.specifier}")
    raise KeyError(f"{name} is not pinned in RUNTIME_PINS")


def device_requirements(requires_dist: list[str]) -> list[Requirement]:
    """The Requires-Dist lines that hold on the machine (extras and other platforms' lines left out)."""
    requirements = [Requirement(line) for line in requires_dist]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(DEVICE_ENVIRONMENT)]


def missing_requirements(requires_dist: list[str], chosen: set[str], wanted_by: str) -> list[Carried]:
    """What a carried package requires that neither the machine nor ``chosen`` has, at the version installed
    here when that satisfies the requirement (this machine's tests run it), else at what pip picks."""
    found = []
    for requirement in device_requirements(requires_dist):
        name = canonicalize_name(requirement.name)
        if name in DEVICE_PACKAGES or name in chosen:
            continue
        here = installed_version(name)
        spec = f"=={here}" if here and requirement.specifier.contains(here, prereleases=True) else requirement.specifier
        found.append(Carried(Requirement(f"{requirement.name}{spec}"), f"required by {wanted_by} ({requirement})"))
        chosen.add(name)
    return found


def conflicts(requires_dist: list[str], wanted_by: str) -> list[str]:
    """Requirements a machine's package of known version does not meet: the install (--no-deps) does not check."""
    found = []
    for requirement in device_requirements(requires_dist):
        version = DEVICE_VERSIONS.get(canonicalize_name(requirement.name))
        if version is not None and not requirement.specifier.contains(Version(version), prereleases=True):
            found.append(f"{wanted_by} requires {requirement}; the machine has {version}")
    return found


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def slim(wheel: Path, dropped) -> int:
    """Rewrite ``wheel`` without the members ``dropped`` names (and their RECORD lines); the bytes saved."""
    before = wheel.stat().st_size
    slimmed = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(slimmed, "w", zipfile.ZIP_DEFLATED) as target:
        for member in source.infolist():
            if dropped(member.filename):
                continue
            data = source.read(member)
            if member.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not dropped(line.decode("utf-8").split(",")[0]))
            target.writestr(member, data)
    slimmed.replace(wheel)
    return before - wheel.stat().st_size


def requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(name).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def fetch(package: Carried, folder: Path) -> Path:
    """The wheel of ``package`` for the machine, into ``folder``: downloaded, or built here (BUILT_HERE)."""
    before = set(folder.glob("*.whl"))
    if package.name in BUILT_HERE:
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(folder),
                   str(package.requirement)]
        environment = {**os.environ, **BUILT_HERE[package.name]}
    else:
        platforms = [flag for tag in PLATFORM_TAGS for flag in ("--platform", tag)]
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
                   "--abi", "none", *platforms, "-d", str(folder), str(package.requirement)]
        environment = None
    subprocess.run(command, check=True, env=environment)
    (wheel,) = set(folder.glob("*.whl")) - before
    return wheel


def carry(folder: Path) -> list[tuple[Carried, Path]]:
    """Fetch every carried package and what it requires that the machine lacks, slimmed; into a fresh ``folder``."""
    shutil.rmtree(folder, ignore_errors=True)  # one version of each: two stop the whole install there
    folder.mkdir(parents=True)
    queue = [Carried(pinned(name), reason) for name, reason in CARRIED.items()]
    chosen = {package.name for package in queue}
    fetched = []
    while queue:
        package = queue.pop(0)
        wheel = fetch(package, folder)
        if package.name in SLIMMED:
            saved = slim(wheel, SLIMMED[package.name])
            print(f"  {wheel.name}: slimmed by {saved / MIB:.1f} MiB")
        needs = requires_dist(wheel)
        for problem in conflicts(needs, package.name):
            print(f"  warning: {problem}")
        queue += missing_requirements(needs, chosen, package.name)
        fetched.append((package, wheel))
    return fetched


def travelling_bytes(root: Path = ROOT) -> int:
    """The bytes of the repository that travel: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                            check=True, capture_output=True).stdout.decode("utf-8").split("\0")
    return sum((root / name).stat().st_size for name in set(listed) if name and (root / name).is_file())


def size_report(wheels_bytes: int, repository_bytes: int) -> tuple[str, bool]:
    total = wheels_bytes + repository_bytes
    fits = total <= LIMIT_BYTES
    verdict = "fits" if fits else "TOO LARGE"
    text = (f"wheels {wheels_bytes / MIB:.1f} MiB + repository {repository_bytes / MIB:.1f} MiB = "
            f"{total / MIB:.1f} MiB of the {LIMIT_BYTES / MIB:.0f} MiB that may travel: {verdict}")
    return text, fits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print the carried packages and why, fetch nothing")
    parser.add_argument("--folder", type=Path, default=FOLDER)
    args = parser.parse_args(argv)
    if args.plan:
        for name, reason in CARRIED.items():
            print(f"{pinned(name)}: {reason}" + (" (built here)" if name in BUILT_HERE else ""))
        print("and what these require that the machine lacks; torchao stays behind (QAT only)")
        return 0
    fetched = carry(args.folder)
    for package, wheel in fetched:
        print(f"{wheel.stat().st_size / MIB:6.2f} MiB  {wheel.name}  ({package.reason})")
    text, fits = size_report(sum(wheel.stat().st_size for _, wheel in fetched), travelling_bytes())
    print(text)
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
