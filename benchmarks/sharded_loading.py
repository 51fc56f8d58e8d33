"""Memory of each process while it loads the model: whole (ZeRO-2) against sharded (ZeRO-3, FSDP), 2 processes on the CPU.

    python benchmarks/sharded_loading.py                 # a 155M-parameter llama (620 MB in fp32), about 5 minutes
    python benchmarks/sharded_loading.py --layers 2      # smaller and quicker

Writes a random llama model folder, trains it one LoRA step with two processes under
ZeRO-2 (every process builds the whole model), under ZeRO-3 (built under zero.Init:
each process holds its shard, rank 0 alone reads the checkpoint) and under FSDP (rank 0
builds the model, the other rank builds it on the meta device, and accelerate hands
each its shards of rank 0's weights), and prints each rank's resident memory before, at
the peak of and after loading (the ``loading_memory`` of the run_started event) beside
the weights each holds and the estimate's loading figures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers import quick_config, with_demo_tokenizer
from model_factory import make_tiny_model

from studio.core.config import save_config
from studio.core.presets import DEMO_TRAIN
from studio.core.run.events import read_events

MIB = 2**20


def run(folder: Path, model: Path, sharding: str) -> tuple[list[dict], list[dict], list[int]]:
    """Each rank's measured loading memory, the estimate's loading figures, and the weights each rank held."""
    config = quick_config(DEMO_TRAIN, model={"name_or_path": str(model)}, training={"micro_batch_size": 2, "max_steps": 1},
                          distributed={"num_processes": 2, "sharding": sharding})
    save_config(config, folder / f"{sharding}.yaml")
    run_dir = folder / f"run-{sharding}"
    subprocess.run([sys.executable, "-m", "studio.train", str(folder / f"{sharding}.yaml"), "--run-dir", str(run_dir)],
                   check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    events = read_events(run_dir / "events.jsonl")
    started = next(e for e in events if e["type"] == "run_started")
    predicted = next(e for e in events if e["type"] == "estimate")["loading"]
    held = {int(line.split(" rank ", 1)[1].split(" ")[0]): int(line.rsplit("holds ", 1)[1].split(" ")[0].replace(",", ""))
            for line in (run_dir / "train.log").read_text().splitlines() if "loaded sharded" in line}
    return started["loading_memory"], predicted, [held.get(rank, started["total_params"]) for rank in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model = with_demo_tokenizer(make_tiny_model(
            "llama", folder / "model", hidden_size=1024, intermediate_size=2816, num_hidden_layers=args.layers,
            num_attention_heads=16, num_key_value_heads=4, vocab_size=32000))
        weights = sum(p.stat().st_size for p in model.glob("*.safetensors"))
        print(f"weights: {weights / MIB:.0f} MiB (fp32), 2 processes")
        print("| loading | rank | weights held | RSS before | peak | after | peak - before |")
        print("|---|---|---|---|---|---|---|")
        for sharding, label in (("zero2", "whole (ZeRO-2)"), ("zero3", "sharded (ZeRO-3)"), ("fsdp", "sharded (FSDP)")):
            measured, predicted, held = run(folder, model, sharding)
            print(f"{label}: estimate {predicted}")
            for entry in measured:
                before, peak, after = (entry[k] / MIB for k in ("rss_before_bytes", "rss_peak_bytes", "rss_after_bytes"))
                print(f"| {label} | {entry['rank']} | {held[entry['rank']]:,} | {before:.0f} MiB | {peak:.0f} MiB | "
                      f"{after:.0f} MiB | {peak - before:.0f} MiB |")


if __name__ == "__main__":
    main()
