"""benchmarks/gpu_carry.py picks what the borrowed GPU machine lacks and slims it, without downloading here."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_carry  # noqa: E402


def test_the_carried_packages_travel_at_the_desktop_runtimes_pinned_versions():
    for name in gpu_carry.CARRIED:
        pin = gpu_carry.pinned(name)
        assert str(pin.specifier).startswith("==") and pin.marker is None, pin
    assert "torch" not in gpu_carry.CARRIED and "torchao" not in gpu_carry.CARRIED  # there, or needed by no check


def test_a_requirement_travels_only_when_the_machine_lacks_it_at_the_version_installed_here(monkeypatch):
    monkeypatch.setattr(gpu_carry, "installed_version", {"dill": "0.4.1", "multiprocess": "0.70.25"}.get)
    requires = ["filelock", "pyarrow>=24.0.0", "dill<0.4.2,>=0.3.0", "multiprocess<0.70.20",
                "pytest; extra == 'tests'", "pywin32; sys_platform == 'win32'", "tomli; python_version < '3.11'",
                "hjson"]
    chosen = {"datasets"}
    found = gpu_carry.missing_requirements(requires, chosen, "datasets")
    assert [str(c.requirement) for c in found] == ["dill==0.4.1", "multiprocess<0.70.20", "hjson"]
    assert all(c.reason.startswith("required by datasets") for c in found)
    assert gpu_carry.missing_requirements(requires, chosen, "deepspeed") == []  # chosen once


def test_requirements_the_machines_known_versions_break_are_named():
    problems = gpu_carry.conflicts(["huggingface-hub<3.0,>=1.31.0", "torch>=2.12", "transformers<5; extra == 'test'"],
                                   "somepackage")
    assert problems == ["somepackage requires torch>=2.12; the machine has 2.11.0"]


def make_wheel(path: Path, members: list[str]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name in members:
            wheel.writestr(name, b"x" * 1000)
        record = "".join(f"{name},sha256=abc,1000\n" for name in members) + "bitsandbytes-0.50.2.dist-info/RECORD,,\n"
        wheel.writestr("bitsandbytes-0.50.2.dist-info/RECORD", record)
    return path


def test_bitsandbytes_keeps_only_the_machines_cuda_library_and_the_cpu_one(tmp_path):
    libraries = [f"bitsandbytes/libbitsandbytes_{kind}.so" for kind in ("cuda128", "cuda130", "cuda132", "rocm64",
                                                                         "xpu2025", "cpu")]
    wheel = make_wheel(tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl",
                       ["bitsandbytes/__init__.py", *libraries, "bitsandbytes-0.50.2.dist-info/METADATA"])
    saved = gpu_carry.slim(wheel, gpu_carry.SLIMMED["bitsandbytes"])
    with zipfile.ZipFile(wheel) as slimmed:
        names = set(slimmed.namelist())
        record = slimmed.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    kept = {"bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so"}
    assert names == {"bitsandbytes/__init__.py", "bitsandbytes-0.50.2.dist-info/METADATA",
                     "bitsandbytes-0.50.2.dist-info/RECORD", *kept}
    assert {line.split(",")[0] for line in record.splitlines()} == names  # pip installs what RECORD lists
    assert saved > 0


def test_requires_dist_is_read_from_the_wheels_metadata(tmp_path):
    wheel = tmp_path / "datasets-5.2.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("datasets-5.2.0.dist-info/METADATA", "Name: datasets\nRequires-Dist: dill<0.4.2\n"
                         "Requires-Dist: pytest; extra == 'tests'\nSummary: x\n")
    assert gpu_carry.requires_dist(wheel) == ["dill<0.4.2", "pytest; extra == 'tests'"]
    assert gpu_carry.device_requirements(gpu_carry.requires_dist(wheel)) == [Requirement("dill<0.4.2")]


def test_the_size_report_says_whether_the_wheels_and_the_repository_fit():
    mib = 2**20
    assert gpu_carry.size_report(9 * mib, 9 * mib) == ("wheels 9.0 MiB + repository 9.0 MiB = 18.0 MiB of the 64 MiB "
                                                       "that may travel: fits", True)
    assert gpu_carry.size_report(60 * mib, 5 * mib)[1] is False


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_what_travels_is_the_tracked_files_and_the_untracked_ones_git_does_not_ignore(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("/.gpu-wheels/\n")
    (tmp_path / "tracked.py").write_bytes(b"a" * 100)
    subprocess.run(["git", "add", "."], cwd=tmp_path, check=True)
    (tmp_path / "untracked.py").write_bytes(b"b" * 10)
    (tmp_path / ".gpu-wheels").mkdir()
    (tmp_path / ".gpu-wheels" / "big.whl").write_bytes(b"c" * 5000)
    assert gpu_carry.travelling_bytes(tmp_path) == 100 + 10 + len("/.gpu-wheels/\n")


def test_the_device_command_is_the_same_in_the_script_and_in_the_results_page():
    def commands(text: str) -> list[str]:
        joined = text.replace("\\\n", " ")
        return [" ".join(line.split()) for line in joined.splitlines() if "pip install" in line]

    script = commands(gpu_carry.__doc__)
    assert len(script) == 1 and "--target /tmp/site .gpu-wheels/*.whl" in script[0] and "gpu_checks.py" in script[0]
    assert script[0] in commands((ROOT / "docs" / "gpu-results.md").read_text(encoding="utf-8"))
    assert "/.gpu-wheels/" in (ROOT / ".gitignore").read_text(encoding="utf-8").splitlines()
