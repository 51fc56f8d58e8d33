"""The GPU-only paths, run once on a machine with NVIDIA GPUs: what ran, and its figures.

    python benchmarks/gpu_checks.py --out gpu-checks      # about 5-10 minutes on one GPU
    python benchmarks/gpu_checks.py --frontier            # and the memory frontier's 8B rows (+10 minutes)

Each check trains the embedded tiny model for a few steps through ``studio train``
(a real worker process) with one GPU-only technique switched on: CUDA memory
events from the allocator and nvml, bitsandbytes' CUDA kernels (QLoRA, paged
8-bit AdamW, which pages only on CUDA), DeepSpeed ZeRO with CPU offload on
NCCL, and with two or more GPUs data parallel over NCCL and FSDP. Then the
throughput benchmark runs on the GPU. The table in ``OUT/gpu-checks.md`` (and
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
        "zero2 + optimizer offload to CPU": {"distributed": {"sharding": "zero2", "offload_optimizer": "cpu"}},
        "zero3 + weight and optimizer offload to CPU": {
            "distributed": {"sharding": "zero3", "offload_optimizer": "cpu", "offload_params": "cpu"}},
        "torch.compile": {"training": {"torch_compile": True}},
    }
    if gpus >= 2:
        found["data parallel, 2 GPUs (NCCL)"] = {"distributed": {"num_processes": 2}}
        found["zero3, 2 GPUs"] = {"distributed": {"num_processes": 2, "sharding": "zero3"}}
        found["fsdp, 2 GPUs"] = {"distributed": {"num_processes": 2, "sharding": "fsdp"}}
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
    from studio.core.events import read_events, summarize

    folder = workdir / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    folder.mkdir(parents=True)
    save_config(check_config(sections), folder / "run.yaml")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "studio.train", str(folder / "run.yaml"), "--run-dir", str(folder / "run")],
                          capture_output=True, text=True, timeout=900)
    events = read_events(folder / "run" / "events.jsonl") if (folder / "run" / "events.jsonl").exists() else []
    summary = summarize(events)
    measured = [e for e in events if e["type"] == "memory_measured"]
    return {
        "check": name, "exit": done.returncode, "status": summary.status, "seconds": round(time.monotonic() - started),
        "last_loss": summary.last_loss, "error": summary.error or (done.stderr[-400:] if done.returncode else None),
        "measured_mib": [round(m["peak_bytes"] / MIB, 1) for m in measured],
        "predicted_mib": round(measured[0]["predicted_bytes"] / MIB, 1) if measured and measured[0].get("predicted_bytes") else None,
        "memory": next((e["memory"] for e in reversed(events) if e["type"] == "step"), None),
    }


def markdown(results: list[dict]) -> str:
    lines = ["| check | status | last loss | measured MiB | predicted MiB | seconds | error |", "|---|---|---|---|---|---|---|"]
    for r in results:
        loss = f"{r['last_loss']:.4f}" if isinstance(r["last_loss"], float) else "-"
        error = (r["error"] or "").replace("\n", " ").replace("|", "/")[:160]
        lines.append(f"| {r['check']} | {r['status']} | {loss} | {r['measured_mib']} | {r['predicted_mib']} | {r['seconds']} | {error} |")
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
    if not args.skip_throughput:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--repeats", "2",
                        "--json", str(args.out / "throughput.json")], timeout=1200)


if __name__ == "__main__":
    main()
