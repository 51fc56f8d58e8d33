"""The GPU-only paths, run once on a machine with NVIDIA GPUs: what ran, and its figures.

    python benchmarks/gpu_checks.py --out gpu-checks      # about 5-10 minutes on one GPU
    python benchmarks/gpu_checks.py --frontier            # and the memory frontier's 8B rows (+10 minutes)

Each check trains the embedded tiny model for a few steps through ``studio train``
(a real worker process) with one GPU-only technique switched on: CUDA memory
events from the allocator and nvml, bitsandbytes' CUDA kernels (QLoRA, paged
8-bit AdamW, which pages only on CUDA), DeepSpeed ZeRO with CPU offload on
NCCL, and with two or more GPUs data parallel over NCCL and FSDP. Then
``offload_comparison`` trains a larger random model with gradient checkpointing, with and without
``training.activation_offload``: the device peak each reaches against the estimate, and the time of a
step (the offload's copies run on a side stream: the two times show how well they hide; in
``OUT/offload.md``). Then the throughput benchmark runs on the GPU. The table in ``OUT/gpu-checks.md`` (and
``.json``) says for each check whether it completed, its last loss, the
measured and predicted peak memory of a steady step, and the error if any.
CI never runs this: it needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

MIB = 1024**2


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
    }
    if gpus >= 2:
        found["data parallel, 2 GPUs (NCCL)"] = {"distributed": {"num_processes": 2}}
        found["zero3, 2 GPUs"] = {"distributed": {"num_processes": 2, "sharding": "zero3"}}
        found["fsdp, 2 GPUs (loaded sharded from rank 0)"] = {"distributed": {"num_processes": 2, "sharding": "fsdp"}}
        found["layer split over 2 GPUs"] = {"distributed": {"layer_split": True}}
    return found


FRONTIER_CARDS_GIB = (8, 12, 16, 24)  # those one step of a real 8B model measures in minutes


def frontier_checks(model_folder: Path, data_file: Path) -> dict[str, dict]:
    """Llama-3.1-8B (random weights from its config.json) with QLoRA r32 and the lean settings, at the longest
    sequence our estimate fits in each card (benchmarks/memory_frontier.py): the measured peak confirms it."""
    from memory_frontier import LEAN_SETTINGS, LLAMA_31_8B, SETUP, config_with, longest_fitting

    lean = config_with(LEAN_SETTINGS)
    found = {}
    for card in FRONTIER_CARDS_GIB:
        length = longest_fitting(LLAMA_31_8B, lean, card)
        if length:
            sections = {"model": {"name_or_path": str(model_folder)}, "training": {"max_steps": 3},
                        "data": {"train_files": (str(data_file),), "max_length": length}}
            found[f"frontier: Llama-3.1-8B qlora r32, {card} GiB card, {length:,} tokens"] = merged(
                SETUP, LEAN_SETTINGS, sections)
    return found


def merged(*section_sets: dict) -> dict:
    """Config sections, later ones overriding the fields of earlier ones."""
    result: dict = {}
    for sections in section_sets:
        for name, value in sections.items():
            result[name] = {**result.get(name, {}), **value} if isinstance(value, dict) else value
    return result


def write_frontier_inputs(folder: Path) -> tuple[Path, Path]:
    """A Llama-3.1-8B folder with random bf16 weights (its config.json, the demo's tokenizer) and rows longer
    than any frontier length."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from helpers import with_demo_tokenizer
    from memory_frontier import LLAMA_31_8B

    model_folder = folder / "llama-3.1-8b-random"
    if not (model_folder / "config.json").is_file():
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA_31_8B), dtype=torch.bfloat16)
        model.save_pretrained(model_folder)
        with_demo_tokenizer(model_folder)
        del model
        torch.cuda.empty_cache()
    data_file = folder / "long-rows.jsonl"
    words = " ".join(f"w{i % 997}" for i in range(60_000))
    data_file.write_text("\n".join(json.dumps({"text": words}) for _ in range(8)) + "\n", encoding="utf-8")
    return model_folder, data_file


def check_config(sections: dict):
    from helpers import quick_config

    data = ROOT / "resources" / "datasets" / "categories_instruction.jsonl"
    return quick_config(data, training={"max_steps": 8}).replace(**sections)


def run_check(name: str, sections: dict, workdir: Path) -> dict:
    from studio.core.config import save_config
    from studio.core.run.events import read_events, summarize

    folder = workdir / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    folder.mkdir(parents=True)
    save_config(check_config(sections), folder / "run.yaml")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "studio.train", str(folder / "run.yaml"), "--run-dir", str(folder / "run")],
                          capture_output=True, text=True, timeout=900)
    events = read_events(folder / "run" / "events.jsonl") if (folder / "run" / "events.jsonl").exists() else []
    summary = summarize(events)
    measured = [e for e in events if e["type"] == "memory_measured"]
    loading = next((e["loading_memory"] for e in events if e["type"] == "run_started"), [])
    return {
        "check": name, "exit": done.returncode, "status": summary.status, "seconds": round(time.monotonic() - started),
        "last_loss": summary.last_loss, "error": summary.error or (done.stderr[-400:] if done.returncode else None),
        "measured_mib": [round(m["peak_bytes"] / MIB, 1) for m in measured],
        "predicted_mib": round(measured[0]["predicted_bytes"] / MIB, 1) if measured and measured[0].get("predicted_bytes") else None,
        "memory": next((e["memory"] for e in reversed(events) if e["type"] == "step"), None),
        # each rank's GPU peak while the model loads (several processes): sharded, no GPU receives the whole model
        "loading_gpu_peak_mib": [round(rank["gpu_peak_bytes"] / MIB, 1) for rank in loading if "gpu_peak_bytes" in rank],
    }


# A model whose block inputs are worth offloading, and whose blocks take long enough to hide the copies.
OFFLOAD_MODEL = {"num_hidden_layers": 8, "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
                 "num_key_value_heads": 4, "max_position_embeddings": 8192}


def offload_comparison(device, folder: Path, model: dict = OFFLOAD_MODEL, length: int = 4096, steps: int = 3) -> list[dict]:
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
        rows.append({"activation_offload": offload, "measured_mib": round(tracker.report.peak_bytes / MIB, 1),
                     "predicted_mib": round((predicted.peak_bytes - overheads) / MIB, 1),
                     "host_predicted_mib": round(host / MIB, 1),
                     "host_measured_mib": round(tracker.host_report.peak_bytes / MIB, 1) if device.type != "cuda" else None,
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


def markdown(results: list[dict]) -> str:
    lines = ["| check | status | last loss | measured MiB | predicted MiB | loading GPU peak MiB per rank | seconds | error |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        loss = f"{r['last_loss']:.4f}" if isinstance(r["last_loss"], float) else "-"
        error = (r["error"] or "").replace("\n", " ").replace("|", "/")[:160]
        lines.append(f"| {r['check']} | {r['status']} | {loss} | {r['measured_mib']} | {r['predicted_mib']} | "
                     f"{r['loading_gpu_peak_mib'] or '-'} | {r['seconds']} | {error} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-checks"))
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--frontier", action="store_true",
                        help="also Llama-3.1-8B at the longest sequences that fit 8-24 GiB (writes 16 GB of weights)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: these checks only mean something on one")
    args.out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    found = checks(gpus)
    if args.frontier:
        found.update(frontier_checks(*write_frontier_inputs(args.out)))
    results = [run_check(name, sections, args.out / "runs") for name, sections in found.items()]
    for result in results:
        print(json.dumps({k: v for k, v in result.items() if k != "memory"}), flush=True)
    header = f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n\n"
    (args.out / "gpu-checks.md").write_text(header + markdown(results), encoding="utf-8")
    (args.out / "gpu-checks.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    offload = offload_comparison(torch.device("cuda"), args.out / "offload-model")
    (args.out / "offload.md").write_text(header + offload_markdown(offload), encoding="utf-8")
    print(offload_markdown(offload), flush=True)
    if not args.skip_throughput:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--repeats", "2",
                        "--json", str(args.out / "throughput.json")], timeout=1200)


if __name__ == "__main__":
    main()
