"""A launch bundle for a run on several machines: one folder to copy to every node.

The folder holds the run config with its data (and DeepSpeed file) copied beside
it, so relative paths work on every node; a DeepSpeed hostfile when ZeRO shards
the run; ``cluster.json`` with the rendezvous; for each node a
``launch-node-<rank>.sh`` and ``.ps1`` with its exact torchrun command; and a
README.txt saying what must exist where. Pure Python: the CLI and the GUI call it.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from studio.core.config import RunConfig, save_config
from studio.core.data.hub import is_hub_spec
from studio.core.errors import StudioError
from studio.core.memory.placement import pipeline_layout
from studio.core.run.commands import DEFAULT_PORT, Cluster, torchrun_command, worker_args
from studio.core.validation import raise_if_invalid

CONFIG_NAME = "config.yaml"
RUN_DIR = "run"  # relative to the bundle: every node writes its logs beside its launch script


@dataclass(frozen=True)
class Bundle:
    folder: Path
    cluster: Cluster
    hosts: tuple[str, ...]
    required_on_every_node: tuple[str, ...]  # paths the config uses that were not copied


def parse_hosts(text: str) -> tuple[str, ...]:
    hosts = tuple(h.strip() for h in text.split(",") if h.strip())
    if not hosts:
        raise StudioError("no hosts given", "list the machines, the main one first: --hosts 10.0.0.1,10.0.0.2", kind="usage")
    if len(set(hosts)) != len(hosts):
        raise StudioError(f"a host is listed twice in {text}", "list each machine once", kind="usage")
    return hosts


def write_bundle(config: RunConfig, hosts: tuple[str, ...], gpus_per_host: int, out: Path,
                 port: int = DEFAULT_PORT, python: str = "python") -> Bundle:
    """Write the bundle of ``config`` for ``hosts`` (the first is the main node) into ``out``."""
    if gpus_per_host < 1:
        raise StudioError(f"--gpus-per-host must be at least 1, got {gpus_per_host}", "give the GPUs of each machine", kind="usage")
    if not 1 <= port <= 65535:
        raise StudioError(f"port {port} is not a TCP port", "use a free port such as 29500", kind="usage")
    if config.distributed.layer_split:
        raise StudioError("a layer split runs in one process on one machine", "turn distributed.layer_split off, "
                          "or train on one machine", kind="config")
    stages = config.distributed.pipeline_stages
    if stages > 0 and gpus_per_host % stages:
        raise StudioError(f"each machine holds whole replicas of the pipeline (a replica's stages exchange activations "
                          f"at every micro-batch, the replicas only gradients once a step): {stages} stages need a "
                          f"multiple of {stages} GPUs per machine, not {gpus_per_host}",
                          f"give each machine {stages} GPUs or a multiple, or fewer pipeline stages", kind="config")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise StudioError(f"{out} is not empty", "choose a new folder; nothing was overwritten", kind="usage")
    raise_if_invalid(config)
    out.mkdir(parents=True, exist_ok=True)
    config, required = _portable(config.replace(distributed={"num_processes": gpus_per_host}), out)
    save_config(config, out / CONFIG_NAME)
    cluster = Cluster(len(hosts), gpus_per_host, hosts[0], port)
    if config.distributed.deepspeed_stage is not None:
        (out / "hostfile").write_text("".join(f"{host} slots={gpus_per_host}\n" for host in hosts), encoding="utf-8")
    (out / "cluster.json").write_text(json.dumps({
        "hosts": list(hosts), "main_address": cluster.main_address, "main_port": port,
        "processes_per_machine": gpus_per_host, "world_size": cluster.world_size,
        "sharding": config.distributed.sharding}, indent=2) + "\n", encoding="utf-8")
    for rank in range(len(hosts)):
        for name, resume in (("launch", False), ("resume", True)):
            argv = torchrun_command(python, cluster, rank, worker_args(CONFIG_NAME, RUN_DIR, resume))
            _write_scripts(out, f"{name}-node-{rank}", f"node {rank}: run on {hosts[rank]}", argv)
    bundle = Bundle(out, cluster, hosts, tuple(required))
    (out / "README.txt").write_text(_readme(bundle, config), encoding="utf-8")
    return bundle


def _portable(config: RunConfig, out: Path) -> tuple[RunConfig, list[str]]:
    """Copy data files and the DeepSpeed file into the bundle; list what must exist on every node instead."""
    data = out / "data"

    def copied(path: str) -> str:
        if is_hub_spec(path):  # every machine loads it from the Hub (or its own datasets cache)
            return path
        data.mkdir(exist_ok=True)
        target = data / Path(path).name
        if target.exists():  # two files of the same name from different folders
            target = data / f"{len(list(data.iterdir()))}-{Path(path).name}"
        shutil.copy2(path, target)
        return target.relative_to(out).as_posix()

    d = config.distributed
    changes = {
        "data": {"train_files": tuple(copied(p) for p in config.data.train_files),
                 "eval_files": tuple(copied(p) for p in config.data.eval_files)},
        "distributed": {"deepspeed_config": copied(d.deepspeed_config) if d.deepspeed_config else ""},
    }
    required = []
    if Path(config.model.name_or_path).is_absolute():
        required.append(f"model.name_or_path: {config.model.name_or_path} (the model folder, same path)")
    if d.nvme_path:
        required.append(f"distributed.nvme_path: {d.nvme_path} (a folder on a fast local SSD)")
    return config.replace(**changes), required


def _write_scripts(out: Path, name: str, comment: str, argv: list[str]) -> None:
    sh = out / f"{name}.sh"
    sh.write_text(f"#!/bin/sh\n# {comment}\ncd \"$(dirname \"$0\")\" || exit 1\n"
                  f"exec {shlex.join(argv)}\n", encoding="utf-8", newline="\n")
    sh.chmod(0o755)
    quoted = " ".join("'" + arg.replace("'", "''") + "'" for arg in argv)
    (out / f"{name}.ps1").write_text(
        f"# {comment}\r\nSet-Location -Path $PSScriptRoot\r\n& {quoted}\r\nexit $LASTEXITCODE\r\n",
        encoding="utf-8", newline="")


def _layout(config: RunConfig, cluster: Cluster) -> str:
    """How the processes share the model: its sharding, or its pipeline's replicas (each on one machine)."""
    stages = config.distributed.pipeline_stages
    if stages > 0:
        return f"{pipeline_layout(stages, cluster.world_size)}, each replica on one machine"
    return f"sharding: {config.distributed.sharding}"


def _readme(bundle: Bundle, config: RunConfig) -> str:
    cluster = bundle.cluster
    lines = [
        f"Finetune Studio launch bundle: run '{config.name}' on {len(bundle.hosts)} machines x "
        f"{cluster.processes_per_machine} GPUs ({cluster.world_size} processes, {_layout(config, cluster)}).",
        "",
        "1. Install the same Finetune Studio version and Python environment on every machine.",
        "2. Copy this whole folder to every machine (any path).",
    ]
    if bundle.required_on_every_node:
        lines.append("3. Make sure these exist on every machine, at the same path:")
        lines += [f"     {item}" for item in bundle.required_on_every_node]
    else:
        lines.append("3. The model is downloaded from the Hugging Face Hub on each machine (or read from its cache).")
    lines += [
        f"4. Let the machines reach {cluster.main_address} on TCP port {cluster.main_port} (the rendezvous),",
        "   and each other on the ports NCCL picks (or set NCCL_SOCKET_IFNAME to the right network interface).",
        "5. Start one script on each machine, in any order; they wait for each other:",
    ]
    for rank, host in enumerate(bundle.hosts):
        lines.append(f"     {host}: launch-node-{rank}.sh   (Windows: launch-node-{rank}.ps1)")
    lines += [
        "",
        f"The run folder {RUN_DIR}/ beside the scripts must be ONE folder every machine shares (a network",
        "filesystem mounted at the same path): every process writes its part of each checkpoint into it, and a",
        "resume reads them all. To continue a stopped or failed run, start resume-node-<rank>.sh (or .ps1) the same way.",
        "Open that folder in the app to watch or export the run.",
        "",
        "Files: config.yaml (the run; data/ holds its data files), cluster.json (the rendezvous), "
        + ("hostfile (DeepSpeed's list of machines and GPUs), " if (bundle.folder / "hostfile").exists() else "")
        + "launch-node-*.sh / .ps1 and resume-node-*.sh / .ps1 (the torchrun commands of each machine).",
    ]
    return "\n".join(lines) + "\n"
