"""Every subprocess studio starts: its command line, its exit codes, and how its result is read.

The app, the command line and the training launcher run the ML side in Python
subprocesses: the worker (``python -m studio.train``), torchrun for several
processes, ``studio export``, ``studio generate``, ``studio estimate --simulate``,
the simulation module, the memory trace and the self-test (``studio doctor`` and its checks). Each builder here takes the Python to run (the app
starts its worker with the windowless one) and returns the whole argv. What a
subprocess leaves behind is read here too: ``last_json_object`` for the JSON it
prints last, ``read_export_record`` for the record an export writes beside it.

A run with ``distributed.num_processes`` > 1, or on several machines, is started by
torchrun (``python -m torch.distributed.run``), which runs the same worker command
once per process with RANK, LOCAL_RANK and WORLD_SIZE set. The worker configures
DDP, DeepSpeed or FSDP itself from the config (through accelerate), so the launcher
never needs an engine-specific config file. A worker that finds itself inside a
launcher trains as its rank instead of launching again.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from studio.core.errors import StudioError, missing_package

DEFAULT_PORT = 29500
WORKER_MODULE = "studio.train"
SIMULATION_MODULE = "studio.train.measure.simulate"
TRACE_MODULE = "studio.train.measure.trace"
DOCTOR_MODULE = "studio.train.doctor"
EXPORT_RECORD = "studio_export.json"  # what an export holds and how it verified, in its folder

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_ABORTED = 0, 1, 2, 130
REFUSED_KINDS = ("usage", "config", "data")  # errors in what was asked for: exit EXIT_USAGE


# ---------------------------------------------------------------- training


@dataclass(frozen=True)
class Cluster:
    """Where the processes of one run go: machines, processes on each, the rendezvous."""

    num_machines: int = 1
    processes_per_machine: int = 1
    main_address: str = "127.0.0.1"
    main_port: int = DEFAULT_PORT

    @property
    def world_size(self) -> int:
        return self.num_machines * self.processes_per_machine


def inside_launcher(env: Mapping[str, str] | None = None) -> bool:
    """True in a process started by torchrun (or accelerate/deepspeed launchers)."""
    env = os.environ if env is None else env
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def needs_launcher(num_processes: int, env: Mapping[str, str] | None = None) -> bool:
    return num_processes > 1 and not inside_launcher(env)


def worker_args(config_path: Path | str | None, run_dir: Path | str, resume: bool = False) -> list[str]:
    """The arguments of ``python -m studio.train`` for a new run or a resume."""
    if resume:
        return ["--resume", str(run_dir)]
    return [str(config_path), "--run-dir", str(run_dir)]


def worker_command(python: str, args: list[str]) -> list[str]:
    """One training worker; it starts torchrun itself when the run needs several processes."""
    return [python, "-m", WORKER_MODULE, *args]


def torchrun_command(python: str, cluster: Cluster, machine_rank: int, args: list[str]) -> list[str]:
    """The command that starts this machine's processes of the run."""
    argv = [python, "-m", "torch.distributed.run", f"--nproc-per-node={cluster.processes_per_machine}"]
    if cluster.num_machines == 1:
        argv.append("--standalone")  # a free local port, no rendezvous server to configure
    else:
        argv += [f"--nnodes={cluster.num_machines}", f"--node-rank={machine_rank}",
                 f"--master-addr={cluster.main_address}", f"--master-port={cluster.main_port}"]
    return argv + ["-m", WORKER_MODULE, *args]


# ---------------------------------------------------------------- helpers of a finished or planned run


def _studio(python: str, *args: str) -> list[str]:
    return [python, "-m", "studio", *args]


def export_command(python: str, run_dir: Path, kind: str, out: Path, dtype: str, quants: tuple[str, ...] = (),
                   push_to: str = "", private: bool = False) -> list[str]:
    """``studio export``: writes the export and its EXPORT_RECORD into ``out``; ``quants``: a GGUF's types;
    ``push_to``: then publishes it to that Hub repository (``private`` if it creates it)."""
    argv = _studio(python, "export", str(run_dir), f"--{kind}", "--out", str(out))
    argv += ["--quant", *quants] if kind == "gguf" else ["--dtype", dtype]
    if push_to:
        argv += ["--push-to-hub", push_to] + (["--private"] if private else [])
    return argv


def gguf_check_command(python: str, run_dir: Path) -> list[str]:
    """``studio export --gguf --check``: exits 0 when llama.cpp can convert the run's model, else prints why."""
    return _studio(python, "export", str(run_dir), "--gguf", "--check")


def generate_command(python: str, run_dir: Path, prompt: str, max_new_tokens: int,
                     image: Path | None = None) -> list[str]:
    """``studio generate --json``: prints one JSON object ``{"base", "tuned", "checkpoint"}``.

    The prompt (and the image) is joined to its option, so a prompt that starts with "-" is not read as an option."""
    asked = (f"--image={image}",) if image is not None else ()
    return _studio(python, "generate", str(run_dir), f"--prompt={prompt}", *asked, "--max-new-tokens",
                   str(max_new_tokens), "--json")


def eval_command(python: str, run_dir: Path) -> list[str]:
    """``studio eval``: writes RUN/evaluation.json (studio.core.run.evaluation) and prints its progress on stderr."""
    return _studio(python, "eval", str(run_dir))


def benchmarks_command(python: str, run_dir: Path, tasks: Sequence[str], include_path: Path | None = None,
                       limit: int | None = None) -> list[str]:
    """``studio eval --tasks``: writes RUN/benchmarks.json (lm-evaluation-harness's metrics) with a progress line."""
    folder = ["--include-path", str(include_path)] if include_path else []
    return eval_command(python, run_dir) + ["--tasks", *tasks, *folder] + (["--limit", str(limit)] if limit else [])


def estimate_simulation_command(python: str, config_path: Path) -> list[str]:
    """``studio estimate --simulate --json``: the estimate as JSON, with the simulated step under "simulated"."""
    return _studio(python, "estimate", str(config_path), "--simulate", "--json")


def simulation_command(python: str, config_path: Path) -> list[str]:
    """The simulation module alone: prints its result, or ``{"error", "hint"}``, as one JSON line."""
    return [python, "-m", SIMULATION_MODULE, str(config_path)]


def trace_command(python: str, config_path: Path, neighbours: bool = True) -> list[str]:
    """The memory trace of a model no family describes (studio.core.memory.derived): stores it in the trace
    cache and prints ``{"trace": PATH, "seconds": S}``, or ``{"error", "hint"}``, as its last line. With
    ``neighbours``, the settings one toggle away too (for a window, or a fit, that will ask for them)."""
    return [python, "-m", TRACE_MODULE, str(config_path)] + ([] if neighbours else ["--alone"])


def self_test_command(python: str, out: Path, only: str = "") -> list[str]:
    """``studio doctor --json``: the self-test (``only``: comma-separated technique names, else all); writes its
    report to ``out`` (Markdown, and JSON beside it), prints progress lines starting with ``doctor:`` on stderr
    and the report as one JSON object."""
    return _studio(python, "doctor", "--json", "--out", str(out), *(["--only", only] if only else []))


def doctor_checks_command(python: str, work: Path, only: str = "", reference: str = "") -> list[str]:
    """The self-test's checks on the device the process sees (studio.train.doctor), keeping their runs in ``work``;
    ``only``: comma-separated technique names; ``reference``: the CPU's run (under ``cpu_only_environment``) of a
    GPU's checks, in that 16-bit precision. Prints what they found as one JSON object."""
    argv = [python, "-m", DOCTOR_MODULE, "--work", str(work)]
    return argv + (["--only", only] if only else []) + (["--reference", reference] if reference else [])


def cpu_only_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every GPU hidden from CUDA: PyTorch, and the worker, then run on the CPU."""
    return {**env, "CUDA_VISIBLE_DEVICES": ""}


# ---------------------------------------------------------------- results


def last_json_object(output: str) -> dict | None:
    """The last JSON object a process printed, on one line or indented over several; libraries print too.

    A candidate starts a line with ``{`` and runs to the end of that line or of the output.
    """
    lines = output.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith("{"):
            for candidate in (lines[index], "\n".join(lines[index:])):
                try:
                    data = json.loads(candidate)
                except ValueError:
                    continue
                if isinstance(data, dict):
                    return data
    return None


def read_export_record(folder: Path) -> dict | None:
    """The EXPORT_RECORD of an export folder; None when it is missing or unreadable."""
    try:
        return json.loads((Path(folder) / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def run_handler(handler: Callable[[object], int], args: object) -> int:
    """A command's exit code, its failures printed the way every studio command prints them.

    A StudioError becomes ``error: MESSAGE`` and ``  hint: HINT`` on stderr (what
    the app reads back from a subprocess's console) and exits EXIT_USAGE for a
    refused request, EXIT_FAILED otherwise; so does a package that studio imports
    where it uses it and that is not installed (``missing_package``). Ctrl+C exits EXIT_ABORTED.
    """
    try:
        return handler(args)
    except StudioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE if exc.kind in REFUSED_KINDS else EXIT_FAILED
    except ModuleNotFoundError as exc:
        if (missing := missing_package(exc)) is None:
            raise
        print(f"error: {missing}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_ABORTED
