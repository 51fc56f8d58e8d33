"""How training processes are started: one command per machine, built from the config.

A run with ``distributed.num_processes`` > 1, or on several machines, is started by
torchrun (``python -m torch.distributed.run``), which runs the same worker command
once per process with RANK, LOCAL_RANK and WORLD_SIZE set. The worker configures
DDP, DeepSpeed or FSDP itself from the config (through accelerate), so the launcher
never needs an engine-specific config file. A worker that finds itself inside a
launcher trains as its rank instead of launching again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 29500


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


def torchrun_argv(cluster: Cluster, machine_rank: int, args: list[str], python: str | None = None) -> list[str]:
    """The command that starts this machine's processes of the run."""
    argv = [python or sys.executable, "-m", "torch.distributed.run",
            f"--nproc-per-node={cluster.processes_per_machine}"]
    if cluster.num_machines == 1:
        argv.append("--standalone")  # a free local port, no rendezvous server to configure
    else:
        argv += [f"--nnodes={cluster.num_machines}", f"--node-rank={machine_rank}",
                 f"--master-addr={cluster.main_address}", f"--master-port={cluster.main_port}"]
    return argv + ["-m", "studio.train", *args]
