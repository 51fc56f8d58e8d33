"""The GPU-only paths, run on a machine with an NVIDIA GPU: what ran, and its figures.

    python benchmarks/gpu_checks.py --out DIR                     # every part, within 8 minutes on one H200
    python benchmarks/gpu_checks.py --out DIR --parts frontier --budget frontier=400   # some, with more time
    python benchmarks/gpu_checks.py --list                        # the parts, their checks and time budgets

On the borrowed GPU machine, what it lacks travels with the repository: benchmarks/gpu_carry.py prepares it
and names the one command to run there; docs/gpu-results.md records what each run printed.

The parts, most telling first, each in processes of its own and each with a time budget (``PART_SECONDS``)
inside the whole run's (``--minutes``); a check that no longer fits is skipped and says so:

- ``frontier``: benchmarks/gpu_frontier.py, the memory frontier's rows (Llama-3.1-8B at 8, 12, 24 and 80 GiB,
  Llama-3.3-70B at 48 and 80 GiB) on cards emulated with ``torch.cuda.set_per_process_memory_fraction``,
  random NF4 weights made on the GPU, the long rows measured at two and three blocks and scaled by depth: the
  estimate beside the allocated, reserved and NVML-used bytes and the pinned CPU RAM of each, and whether it
  fits the card.
- ``worker``: the embedded tiny model trained for a few steps through ``studio train`` (a real worker
  process) with one GPU-only technique switched on: CUDA memory events from the allocator and NVML,
  bitsandbytes' CUDA kernels (QLoRA, paged 8-bit AdamW, which pages only on CUDA), DeepSpeed ZeRO with CPU
  offload, torch.compile, and with two or more GPUs data parallel over NCCL, FSDP and a layer split.
  ``WORKERS_AT_ONCE`` run together (each process's allocator counts its own; NVML's figures are the GPU's).
  A check whose package is not installed is skipped, naming it.
- ``offload``: a larger random model with gradient checkpointing, with and without
  ``training.activation_offload``: the device peak each reaches against the estimate, and the time of a step
  (the offload's copies run on a side stream: the two times show how well they hide).
- ``self-test``: ``studio doctor`` (issue 24, item 7) where this checkout has the command: its exit and last lines.
- ``throughput``: benchmarks/throughput.py on the GPU: our trainer's tokens per second beside the HF Trainer's.

After every check OUT/gpu-checks.json (every figure) and OUT/gpu-checks.md (the tables) are written again, so a
run stopped at any point leaves what it finished; the workers' memory calibration records go to
OUT/memory-calibration.jsonl. Run folders, models and logs go to a new folder in --work (or a temporary
one). CI never runs this: it needs a GPU
(tests/test_gpu_checks.py runs what a CPU can).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(BENCHMARKS)]

MIB, GIB = 1024**2, 1024**3
PART_SECONDS = {"frontier": 230, "worker": 130, "offload": 50, "self-test": 60, "throughput": 80}
RUN_MINUTES = 8.0
WORKERS_AT_ONCE = 4
CHECK_SECONDS = 90  # one worker check: start, load the tiny model, 8 steps
GRPO_CHECK = {"group_size": 4, "max_completion_length": 16}  # two groups a micro-batch, the prompts' room 32 tokens
SLOW_CHECK_SECONDS = 120  # DeepSpeed (its CPU Adam compiles on first use) and torch.compile
LEAST_SECONDS = 20  # a process given less is not started
POLL_SECONDS = 1.0
VERSIONS = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "datasets", "deepspeed", "platformdirs",
            "pyarrow", "fsspec", "huggingface-hub", "pydantic", "nvidia-ml-py")


# ---------------------------------------------------------------- the worker checks

LAYER_SPLIT_CHECK = "layer split over 2 GPUs"
# a pipeline's step: 4 micro-batches padded to one shape (the stages exchange tensors of one shape); the layer split
# runs the same steps
SPLIT_STEP = {"training": {"gradient_accumulation_steps": 4}, "data": {"packing": "none"}}


def checks(gpus: int) -> dict[str, dict]:
    """name -> config sections changed from the quick tiny-model config."""
    found = {
        "lora bf16 (allocator + nvml memory)": {},
        "qlora nf4 (bitsandbytes CUDA kernels)": {"method": "qlora"},
        "paged_adamw_8bit (paged on CUDA)": {"training": {"optimizer": "paged_adamw_8bit"}},
        "full fine-tune + gradient checkpointing": {"method": "full", "training": {"gradient_checkpointing": True}},
        "qlora + offloaded activation checkpointing (pinned copies on a side stream)": {
            "method": "qlora", "training": {"gradient_checkpointing": True, "activation_offload": True}},
        "lora + tiled MLP (checkpointed tiles on CUDA)": {"training": {"tiled_mlp": True}},
        "zero2 + optimizer offload to CPU": {"distributed": {"sharding": "zero2", "offload_optimizer": "cpu"}},
        "zero3 + weight and optimizer offload to CPU": {
            "distributed": {"sharding": "zero3", "offload_optimizer": "cpu", "offload_params": "cpu"}},
        "torch.compile": {"training": {"torch_compile": True}},
        "grpo, HF generate sampling (its generation phase measured)": {"objective": "grpo", "grpo": GRPO_CHECK},
        "grpo, vLLM sampling": {"objective": "grpo", "grpo": {**GRPO_CHECK, "generation_backend": "vllm"}},
    }
    if gpus >= 2:
        found["data parallel, 2 GPUs (NCCL)"] = {"distributed": {"num_processes": 2}}
        found["zero3, 2 GPUs"] = {"distributed": {"num_processes": 2, "sharding": "zero3"}}
        found["fsdp, 2 GPUs (loaded sharded from rank 0)"] = {"distributed": {"num_processes": 2, "sharding": "fsdp"}}
        found.update(model_split_checks())
    return found


def model_split_checks() -> dict[str, dict]:
    """The layer split and the pipeline over 2 GPUs on the same steps: their tokens per second compare."""
    pipeline = {"num_processes": 2, "pipeline_stages": 2}
    return {LAYER_SPLIT_CHECK: {"distributed": {"layer_split": True}, **SPLIT_STEP},
            **{f"pipeline of 2 stages over 2 GPUs, {schedule}": {
                "distributed": {**pipeline, "pipeline_schedule": schedule}, **SPLIT_STEP} for schedule in ("gpipe", "1f1b", "interleaved")}}



def check_config(sections: dict):
    from helpers import quick_config

    data = ROOT / "resources" / "datasets" / "categories_instruction.jsonl"
    return quick_config(data, training={"max_steps": 8}).replace(**sections)


def needed_packages(sections: dict) -> list[str]:
    """The optional packages a check's run imports: bitsandbytes for k-bit weights and 8-bit optimizers,
    deepspeed for ZeRO, torchao for QAT, vllm for GRPO's vLLM sampling."""
    config = check_config(sections)
    needed = []
    if config.effective_load_in != "none" or "8bit" in config.training.optimizer:
        needed.append("bitsandbytes")
    if config.distributed.sharding.startswith("zero"):
        needed.append("deepspeed")
    if config.qat.enabled:
        needed.append("torchao")
    if config.objective == "grpo" and config.grpo.generation_backend == "vllm":
        needed.append("vllm")
    return needed


def check_seconds(sections: dict) -> int:
    slow = "sharding" in sections.get("distributed", {}) or sections.get("training", {}).get("torch_compile")
    return SLOW_CHECK_SECONDS if slow else CHECK_SECONDS


def folder_name(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def worker_record(name: str, run_dir: Path, outcome: "Outcome") -> dict:
    """What a worker check's events say: status, last loss, the measured and predicted peak, the error."""
    from studio.core.run.events import read_events, summarize

    events = read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() else []
    summary = summarize(events)
    measured = [e for e in events if e["type"] == "memory_measured"]
    loading = next((e["loading_memory"] for e in events if e["type"] == "run_started"), [])
    first = measured[0] if measured else {}
    return {
        "part": "worker", "check": name, "exit": outcome.exit, "seconds": outcome.seconds,
        "status": outcome.stopped or summary.status, "last_loss": summary.last_loss,
        "error": summary.error or (outcome.tail if outcome.exit else None),
        # like beside like: the allocator's peak beside the estimate's tensors (its allocated reading), NVML's used
        # beside the estimate with the CUDA context (its peak)
        "measured_mib": [round(m["peak_bytes"] / MIB, 1) for m in measured],
        "predicted_mib": _mib(first.get("predicted_allocated_bytes")),
        "nvml_used_mib": [_mib(m["nvml_used_bytes"]) for m in measured if m.get("nvml_used_bytes")],
        "predicted_nvml_used_mib": _mib(first.get("predicted_nvml_used_bytes")),
        "memory": next((e["memory"] for e in reversed(events) if e["type"] == "step"), None),
        "tokens_per_s": steady_tokens_per_s(events),
        # each rank's GPU peak while the model loads (several processes): sharded, no GPU receives the whole model
        "loading_gpu_peak_mib": [round(rank["gpu_peak_bytes"] / MIB, 1) for rank in loading
                                 if "gpu_peak_bytes" in rank],
    }


def _mib(count: int | None) -> float | None:
    return round(count / MIB, 1) if count else None


def steady_tokens_per_s(events: list[dict]) -> float | None:
    """The mean rate of the steps after the first (which holds the set-up: a pipeline's schedule, compilation)."""
    rates = [e["tokens_per_s"] for e in events if e["type"] == "step" and e.get("tokens_per_s")][1:]
    return round(sum(rates) / len(rates)) if rates else None


def worker_jobs(gpus: int, work: Path) -> tuple[list["Job"], list[dict]]:
    """A job per worker check that can run here, and a skipped record for each that needs a missing package."""
    from studio.core.config import save_config

    jobs, skipped = [], []
    for name, sections in checks(gpus).items():
        missing = [p for p in needed_packages(sections) if importlib.util.find_spec(p) is None]
        if missing:
            skipped.append({"part": "worker", "check": name, "status": f"skipped: needs {', '.join(missing)}, not "
                            "installed here (benchmarks/gpu_carry.py carries it)"})
            continue
        folder = work / "runs" / folder_name(name)
        folder.mkdir(parents=True)
        save_config(check_config(sections), folder / "run.yaml")
        argv = [sys.executable, "-m", "studio.train", str(folder / "run.yaml"), "--run-dir", str(folder / "run")]
        jobs.append(Job("worker", name, argv, check_seconds(sections),
                        lambda outcome, name=name, folder=folder: [worker_record(name, folder / "run", outcome)]))
    return sorted(jobs, key=lambda job: -job.seconds), skipped  # the slow ones first: they overlap the rest


# ---------------------------------------------------------------- activation offload

# A model whose block inputs are worth offloading, and whose blocks take long enough to hide the copies.
OFFLOAD_MODEL = {"num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "max_position_embeddings": 8192}


def offload_comparison(device, folder: Path, model: dict = OFFLOAD_MODEL, length: int = 4096,
                       steps: int = 3) -> list[dict]:
    """LoRA with gradient checkpointing, without and with activation offload: measured and predicted device peak
    (tensor bytes), predicted and (on the CPU) measured host RAM, and seconds per optimizer step after a warm-up."""
    import torch

    from helpers import quick_config
    from model_factory import make_tiny_model
    from studio.core.memory.estimate import estimate
    from studio.train.measure.memtrack import tracker_for
    from studio.train.measure.simulate import full_length_batches, run_optimizer_steps, target_tokens
    from studio.train.model.build import build_model
    from studio.train.optim import build_optimizer

    make_tiny_model("llama", folder, **model)
    model_config = json.loads((folder / "config.json").read_text())
    rows = []
    for offload in (False, True):
        config = quick_config(folder / "config.json", model={"name_or_path": str(folder)}, data={"max_length": length},
                              training={"micro_batch_size": 1, "precision": "bf16", "gradient_checkpointing": True,
                                        "activation_offload": offload})
        torch.manual_seed(0)
        trained = build_model(config, device)
        optimizer = build_optimizer(config, [p for p in trained.parameters() if p.requires_grad])
        batches = full_length_batches(config, model_config["vocab_size"], device)
        targets = target_tokens(batches)
        run_optimizer_steps(trained, optimizer, batches, config, tracker_for(device), 1, targets)  # state, warm-up
        with tracker_for(device) as tracker:
            started = time.perf_counter()
            run_optimizer_steps(trained, optimizer, batches, config, tracker, steps, targets)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = (time.perf_counter() - started) / steps
        predicted = estimate(model_config, config, device.type)
        overheads = predicted.parts["cuda_context"] + predicted.parts["allocator_margin"]
        host = next((d.total_bytes for d in predicted.devices if d.device == "host"), 0)
        host_measured = round(tracker.host_report.peak_bytes / MIB, 1) if device.type != "cuda" else None
        rows.append({"activation_offload": offload, "measured_mib": round(tracker.report.peak_bytes / MIB, 1),
                     "predicted_mib": round((predicted.peak_bytes - overheads) / MIB, 1),
                     "host_predicted_mib": round(host / MIB, 1), "host_measured_mib": host_measured,
                     "seconds_per_step": round(seconds, 3)})
        del trained, optimizer
    return rows


def offload_markdown(rows: list[dict]) -> str:
    lines = ["| activation offload | measured MiB | predicted MiB | host predicted MiB | host measured MiB | s/step |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['activation_offload']} | {r['measured_mib']} | {r['predicted_mib']} | {r['host_predicted_mib']} | "
              f"{r['host_measured_mib'] if r['host_measured_mib'] is not None else 'n/a'} | {r['seconds_per_step']} |"
              for r in rows]
    plain, offloaded = rows
    lines.append(f"\ndevice saving {plain['measured_mib'] - offloaded['measured_mib']:.1f} MiB measured, "
                 f"{plain['predicted_mib'] - offloaded['predicted_mib']:.1f} MiB predicted; step time "
                 f"x{offloaded['seconds_per_step'] / plain['seconds_per_step']:.3f} with the offload")
    return "\n".join(lines) + "\n"


def offload_rows(rows_file: Path, work: Path) -> None:
    """The offload part's process: its one record, appended to ``rows_file``."""
    import torch

    rows = offload_comparison(torch.device("cuda"), work / "offload-model")
    record = {"part": "offload", "check": "activation offload, 8 x 1024 Llama at 4,096 tokens", "status": "completed",
              "rows": rows}
    with open(rows_file, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


# ---------------------------------------------------------------- throughput and the self-test


def throughput_record(summary_file: Path, outcome: "Outcome") -> dict:
    """Tokens per wall-clock second of each side (the GPU's time, not the process's CPU time) and ours against
    the HF Trainer's."""
    record = {"part": "throughput", "check": "our trainer beside the HF Trainer (benchmarks/throughput.py)",
              "seconds": outcome.seconds, "status": outcome.stopped or ("completed" if outcome.exit == 0 else "failed")}
    if not summary_file.is_file():
        return {**record, "error": outcome.tail}
    summary = json.loads(summary_file.read_text(encoding="utf-8"))
    sides = {name: {"tokens_per_s": round(side["tokens_per_wall_s"]), "peak_mib": round(side["peak_bytes"] / MIB, 1),
                    "final_loss": round(side["final_loss"], 4)} for name, side in summary["sides"].items()}
    for side in sides.values():
        for baseline in ("hf_padded", "hf_flat"):
            if baseline in sides:
                side[f"vs_{baseline}"] = round(side["tokens_per_s"] / sides[baseline]["tokens_per_s"], 2)
    shape = {key: summary[key] for key in ("precision", "steps", "repeats", "batch", "lengths", "model")}
    return {**record, "shape": shape, "sides": sides}


def studio_commands() -> set[str]:
    from studio.cli import build_parser

    return {name for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction)
            for name in action.choices}


def self_test_record(outcome: "Outcome") -> dict:
    return {"part": "self-test", "check": "studio doctor", "exit": outcome.exit, "seconds": outcome.seconds,
            "status": outcome.stopped or ("completed" if outcome.exit == 0 else "failed"), "output": outcome.tail}


# ---------------------------------------------------------------- processes with time budgets


@dataclass
class Outcome:
    """How a job's process ended: its exit code, seconds, its output's last lines, and ``stopped`` (the reason)
    when it was stopped at its budget."""

    exit: int | None
    seconds: float
    tail: str
    stopped: str | None = None


@dataclass
class Job:
    """One process of a part: its command, its time budget, and what its outcome says (``records``); ``rows``
    is where the process appends its own records as it finishes each, read while it runs."""

    part: str
    name: str
    argv: list[str]
    seconds: float
    records: Callable[[Outcome], list[dict]]
    rows: Path | None = None


class Running:
    """A job's process, started now, its output going to a log file."""

    def __init__(self, job: Job, seconds: float, env: dict, logs: Path):
        self.job, self.seconds, self.read = job, seconds, 0
        self.log = logs / f"{folder_name(job.name)}.log"
        with open(self.log, "w", encoding="utf-8") as log:  # a file, not a pipe: a chatty process never blocks
            self.process = subprocess.Popen(job.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self.started = time.monotonic()

    def new_rows(self) -> list[dict]:
        """The rows the process has finished writing since the last call."""
        if self.job.rows is None or not self.job.rows.is_file():
            return []
        lines = self.job.rows.read_text(encoding="utf-8").splitlines(keepends=True)
        complete = [line for line in lines[self.read:] if line.endswith("\n")]
        self.read += len(complete)
        return [json.loads(line) for line in complete]

    def outcome(self) -> Outcome | None:
        """None while it runs within its budget; else how it ended (stopped, at its budget)."""
        elapsed = time.monotonic() - self.started
        stopped = None
        if self.process.poll() is None:
            if elapsed < self.seconds:
                return None
            self.process.kill()
            self.process.wait()
            stopped = f"stopped at its time budget of {self.seconds:.0f} s"
        tail = self.log.read_text(encoding="utf-8", errors="replace")[-1500:]
        return Outcome(self.process.returncode if stopped is None else None, round(elapsed, 1), tail, stopped)


def run_jobs(jobs: list[Job], results: "Results", deadline: float, env: dict, logs: Path, at_once: int = 1) -> None:
    """Run ``jobs``, ``at_once`` at a time, each stopped at its budget or at ``deadline``; their records go to
    ``results`` as they come (a process's own rows while it runs)."""
    waiting, running = list(jobs), []
    while waiting or running:
        while waiting and len(running) < at_once:
            job = waiting.pop(0)
            left = deadline - time.monotonic()
            if left < LEAST_SECONDS:
                status = f"skipped: {max(left, 0):.0f} s of its part's time left"
                results.add({"part": job.part, "check": job.name, "status": status})
            else:
                running.append(Running(job, min(job.seconds, left), env, logs))
        if running:
            time.sleep(POLL_SECONDS)
        for process in list(running):
            for row in process.new_rows():
                results.add(row)
            outcome = process.outcome()
            if outcome is not None:
                running.remove(process)
                for row in process.new_rows() + process.job.records(outcome):
                    results.add(row)


def part_job(part: str, deadline: float, work: Path) -> Job:
    """This script again, running one part in its own process until a little before ``deadline`` (of
    time.monotonic) and writing its rows to a file."""
    until = time.time() + deadline - time.monotonic() - 5  # a wall-clock time: the process has its own clocks
    (work / f"{part}.jsonl").unlink(missing_ok=True)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", part, "--work", str(work), "--until", str(until)]
    return Job(part, f"the {part} process", argv, deadline - time.monotonic(),
               lambda outcome: [] if outcome.exit == 0 else [failed_part(part, outcome)], work / f"{part}.jsonl")


def failed_part(part: str, outcome: Outcome) -> dict:
    return {"part": part, "check": f"the {part} process", "status": outcome.stopped or f"failed (exit {outcome.exit})",
            "error": outcome.tail, "seconds": outcome.seconds}


CHILD_PARTS = ("frontier", "offload")


def run_child(part: str, work: Path, until: float) -> None:
    """A part's own process: its rows into WORK/PART.jsonl, each when done, planned to end by ``until``."""
    if part == "frontier":
        from gpu_frontier import run_rows

        run_rows(work / f"{part}.jsonl", work, until)
    else:
        offload_rows(work / f"{part}.jsonl", work)


# ---------------------------------------------------------------- results


def environment() -> dict:
    """The machine and the versions the run used (NVML for the GPU: this process makes no CUDA context)."""
    import torch

    found = {"python": sys.version.split()[0], "cuda": torch.version.cuda, "gpus": torch.cuda.device_count(),
             "versions": {}}
    for name in VERSIONS:
        try:
            found["versions"][name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found["versions"][name] = None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        found.update(gpu=str(pynvml.nvmlDeviceGetName(handle)), driver=str(pynvml.nvmlSystemGetDriverVersion()),
                     gpu_mib=pynvml.nvmlDeviceGetMemoryInfo(handle).total // MIB)
    except Exception as exc:  # no NVML: the name from torch is enough
        found.update(gpu=f"(NVML: {exc})")
    return found


def gib(value) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def frontier_line(record: dict) -> str:
    """One frontier row: each measured quantity beside what the estimate predicts for it."""
    if "measured" not in record:
        return f"{record['check']}: {record['status']}"
    measured, predicted = record["measured"], record["predicted"]
    pairs = ", ".join(f"{label} {gib(measured.get(key))} (estimate {gib(predicted[key])})" for key, label in
                      (("allocated", "allocated"), ("reserved", "reserved"), ("nvml_used", "NVML used"),
                       ("host", "host pinned")))
    fits = {True: "fits the card", False: "DOES NOT fit the card"}.get(record.get("fits"), "")
    depths = "".join(f"\n  at {depth} blocks: allocated {gib(m['allocated'])} (estimate {gib(m['predicted']['allocated'])})"
                     f", by phase {', '.join(f'{phase} {gib(value)}' for phase, value in m['phases'].items())}"
                     f"; left by a row before {gib(m.get('allocated_before'))}"
                     for depth, m in record.get("at_depths", {}).items() if "predicted" in m)
    return f"{record['check']}: GiB {pairs}; peak in {measured['peak_phase']}; {fits}; {record['seconds']} s{depths}"


def frontier_markdown(records: list[dict]) -> str:
    lines = ["| row | status | allocated GiB (estimate) | reserved GiB (estimate) | NVML used GiB (estimate) | "
             "host pinned GiB (estimate) | peak phase | fits the card | limit enforced | s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    answer = {True: "yes", False: "no"}
    for r in records:
        measured, predicted = r.get("measured", {}), r.get("predicted", {})
        cells = [f"{gib(measured.get(key))} ({gib(predicted.get(key))})" for key in
                 ("allocated", "reserved", "nvml_used", "host")]
        lines.append(f"| {r['check']} | {r['status'][:160]} | {' | '.join(cells)} | {measured.get('peak_phase', '-')} "
                     f"| {answer.get(r.get('fits'), '-')} | {answer.get(r.get('fraction_enforced'), '-')} "
                     f"| {r.get('seconds', '-')} |")
    return "\n".join(lines) + "\n"


def worker_markdown(records: list[dict]) -> str:
    split = next((r.get("tokens_per_s") for r in records if r["check"] == LAYER_SPLIT_CHECK), None)
    lines = ["| check | status | last loss | allocated MiB | allocated MiB (estimate) | NVML used MiB "
             "| NVML used MiB (estimate) | loading GPU peak MiB per rank | tokens/s | seconds | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        loss = f"{r['last_loss']:.4f}" if isinstance(r.get("last_loss"), float) else "-"
        error = (r.get("error") or "").replace("\n", " ").replace("|", "/")[-160:]
        rate = r.get("tokens_per_s") or "-"
        if split and r.get("tokens_per_s") and r["check"].startswith("pipeline"):
            rate = f"{rate} ({r['tokens_per_s'] / split:.2f}x the layer split)"
        lines.append(f"| {r['check']} | {r['status']} | {loss} | {r.get('measured_mib', '-')} | "
                     f"{r.get('predicted_mib', '-')} | {r.get('nvml_used_mib') or '-'} | "
                     f"{r.get('predicted_nvml_used_mib') or '-'} | {r.get('loading_gpu_peak_mib') or '-'} | {rate} | "
                     f"{r.get('seconds', '-')} | {error} |")
    return "\n".join(lines) + "\n"


def throughput_markdown(record: dict) -> str:
    if "sides" not in record:
        return f"{record['status']}: {(record.get('error') or '')[-300:]}\n"
    lines = [json.dumps(record["shape"]), "", "| side | tokens/s | vs hf_padded | vs hf_flat | peak MiB | final loss |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {name} | {s['tokens_per_s']} | {s.get('vs_hf_padded', '-')} | {s.get('vs_hf_flat', '-')} | "
              f"{s['peak_mib']} | {s['final_loss']} |" for name, s in record["sides"].items()]
    return "\n".join(lines) + "\n"


def part_markdown(part: str, records: list[dict]) -> str:
    if part == "frontier":
        return frontier_markdown(records)
    if part == "worker":
        return worker_markdown(records)
    texts = []
    for record in records:
        if part == "offload" and "rows" in record:
            texts.append(offload_markdown(record["rows"]))
        elif part == "throughput" and record.get("check", "").startswith("our trainer"):
            texts.append(throughput_markdown(record))
        else:
            texts.append(f"{record['check']}: {record['status']}\n" + (f"\n```\n{record['output'][-1200:]}\n```\n"
                                                                    if record.get("output") else ""))
    return "\n".join(texts)


TITLES = {"frontier": "Memory frontier (emulated cards, random NF4 weights)", "worker": "Worker checks (tiny model)",
          "offload": "Activation offload", "self-test": "Self-test (studio doctor)",
          "throughput": "Tokens per second beside the HF Trainer"}


def markdown(header: dict, records: list[dict]) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v)
    lines = [f"# GPU checks: {header.get('gpus')} x {header.get('gpu')} ({header.get('gpu_mib', '?')} MiB), driver "
             f"{header.get('driver', '?')}, CUDA {header.get('cuda')}, Python {header.get('python')}", "",
             f"{versions}; started {header['started']}, {header.get('elapsed_s', 0):.0f} s so far", ""]
    for part, title in TITLES.items():
        found = [r for r in records if r["part"] == part]
        if found:
            lines += [f"## {title}", "", part_markdown(part, found)]
    return "\n".join(lines)


def write_atomically(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


class Results:
    """The records so far, each printed as it comes and all written again (JSON and markdown) after each."""

    def __init__(self, out: Path, header: dict):
        self.out, self.header, self.records = out, header, []
        self.started = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.write()

    def add(self, record: dict) -> None:
        self.records.append(record)
        if record["part"] == "frontier":
            print(frontier_line(record), flush=True)
        else:
            print(json.dumps({k: v for k, v in record.items() if k not in ("memory", "output")}), flush=True)
        self.write()

    def write(self) -> None:
        self.header["elapsed_s"] = round(time.monotonic() - self.started, 1)
        write_atomically(self.out / "gpu-checks.json", json.dumps({**self.header, "records": self.records}, indent=1))
        write_atomically(self.out / "gpu-checks.md", markdown(self.header, self.records))


# ---------------------------------------------------------------- the run


def child_environment(out: Path, work: Path) -> dict:
    """Every process's: studio and the benchmarks importable, no network (the machine has none: no waiting for
    the Hub), the calibration records in OUT (the worker keeps them beside the runs folder)."""
    paths = [str(ROOT), str(ROOT / "tests"), str(BENCHMARKS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "STUDIO_RUNS_DIR": str(out / "runs"), "STUDIO_TRACE_CACHE": str(work / "traces")}


def run_part(part: str, results: Results, args, deadline: float, env: dict) -> None:
    part_deadline = min(deadline, time.monotonic() + args.budgets[part])
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if part == "worker":
        jobs, skipped = worker_jobs(results.header["gpus"], args.work)
        for record in skipped:
            results.add(record)
        run_jobs(jobs, results, part_deadline, env, logs, WORKERS_AT_ONCE)
    elif part in CHILD_PARTS:
        run_jobs([part_job(part, part_deadline, args.work)], results, part_deadline, env, logs)
    elif part == "throughput":
        summary = args.work / "throughput.json"
        argv = [sys.executable, str(BENCHMARKS / "throughput.py"), "--repeats", "1", "--json", str(summary)]
        job = Job(part, "throughput", argv, args.budgets[part], lambda outcome: [throughput_record(summary, outcome)])
        run_jobs([job], results, part_deadline, env, logs)
    elif "doctor" in studio_commands():
        job = Job(part, "studio doctor", [sys.executable, "-m", "studio", "doctor"], args.budgets[part],
                  lambda outcome: [self_test_record(outcome)])
        run_jobs([job], results, part_deadline, env, logs)
    else:
        results.add({"part": part, "check": "studio doctor", "status": "skipped: this checkout has no studio doctor"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-checks"), help="where the results go")
    parser.add_argument("--work", type=Path, help="a new folder in it takes the run folders, models and logs "
                        "(default: a new temporary folder)")
    parser.add_argument("--parts", default=",".join(PART_SECONDS), help="which parts, in this order")
    parser.add_argument("--minutes", type=float, default=RUN_MINUTES, help="the whole run's time budget")
    parser.add_argument("--budget", default="", metavar="PART=SECONDS,...",
                        help="other time budgets for some parts (e.g. frontier=400 for the frontier alone)")
    parser.add_argument("--list", action="store_true", help="print the parts, their checks and budgets")
    parser.add_argument("--child", choices=CHILD_PARTS, help=argparse.SUPPRESS)  # a part's own process
    parser.add_argument("--until", type=float, help=argparse.SUPPRESS)  # when it should be done (time.time)
    args = parser.parse_args(argv)
    if args.list:
        print(plan_text())
        return 0
    if args.child:
        run_child(args.child, args.work, args.until)
        return 0
    import torch

    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: these checks only mean something on one")
    parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    args.budgets = {**PART_SECONDS, **budgets(args.budget)}
    unknown = (set(parts) | set(args.budgets)) - set(PART_SECONDS)
    if unknown:
        sys.exit(f"unknown parts {', '.join(sorted(unknown))}; the parts: {', '.join(PART_SECONDS)}")
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="gpu-checks-", dir=args.work))
    results = Results(args.out, {**environment(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "parts": parts})
    print(f"{results.header['gpus']} x {results.header['gpu']}; work in {args.work}", flush=True)
    deadline = time.monotonic() + args.minutes * 60
    env = child_environment(args.out.resolve(), args.work.resolve())
    for part in parts:
        run_part(part, results, args, deadline, env)
    results.write()
    return 0


def budgets(text: str) -> dict[str, float]:
    """``frontier=400,worker=90`` as {part: seconds}."""
    pairs = [item.split("=", 1) for item in text.split(",") if item.strip()]
    return {part.strip(): float(seconds) for part, seconds in pairs}


def plan_text() -> str:
    lines = [f"{part}: up to {seconds} s" for part, seconds in PART_SECONDS.items()]
    lines += [f"  worker check: {name} (up to {check_seconds(sections)} s)" for name, sections in checks(1).items()]
    return "\n".join(lines) + f"\nthe whole run: up to {RUN_MINUTES:g} minutes"


if __name__ == "__main__":
    sys.exit(main())
