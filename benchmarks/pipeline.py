"""Throughput of a pipeline (2 processes, one stage each) against the layer split (1 process), on the CPU.

    python benchmarks/pipeline.py                      # the demo model, 8 micro-batches a step, 6 steps
    python benchmarks/pipeline.py --layers 8 --micro-batches 4

Trains the same LoRA run five ways, each a `studio train` in a subprocess: one plain process, the layer split
(its blocks run one after another in one process; on the CPU through accelerate's hooks), and a pipeline of 2
stages with GPipe, with 1F1B and interleaved (2 chunks per process) (both stages compute at once on different
micro-batches). Prints the tokens per
second of each (the mean of the step events after the first, which includes the set-up of the schedule) and its
ratio to the layer split. The pipeline pads every micro-batch to data.max_length (counted as work, not as tokens),
and torchrun gives each of its processes one thread, where one process uses every core.
"""

from __future__ import annotations

import argparse
import statistics
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

LAYOUTS = {
    "one process": {},
    "layer split": {"layer_split": True, "max_cpu_memory_gib": 1.0},
    "pipeline gpipe": {"num_processes": 2, "pipeline_stages": 2, "pipeline_schedule": "gpipe"},
    "pipeline 1f1b": {"num_processes": 2, "pipeline_stages": 2, "pipeline_schedule": "1f1b"},
    "pipeline interleaved": {"num_processes": 2, "pipeline_stages": 2, "pipeline_schedule": "interleaved"},
}


def tokens_per_second(folder: Path, model: str, micro_batches: int, steps: int, distributed: dict) -> float:
    config = quick_config(DEMO_TRAIN, model={"name_or_path": model}, data={"packing": "none", "max_length": 64},
                          training={"micro_batch_size": 4, "gradient_accumulation_steps": micro_batches,
                                    "max_steps": steps}, distributed=distributed)
    folder.mkdir(parents=True)
    save_config(config, folder / "run.yaml")
    subprocess.run([sys.executable, "-m", "studio.train", str(folder / "run.yaml"), "--run-dir", str(folder / "run")],
                   check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd=ROOT)
    rates = [e["tokens_per_s"] for e in read_events(folder / "run" / "events.jsonl") if e["type"] == "step"]
    return statistics.mean(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=0, help="a random llama of this many blocks (0: the demo model)")
    parser.add_argument("--micro-batches", type=int, default=8, help="gradient_accumulation_steps: the pipeline's")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = quick_config(DEMO_TRAIN).model.name_or_path
        if args.layers:
            model = str(with_demo_tokenizer(make_tiny_model("llama", Path(scratch) / "model", num_hidden_layers=args.layers,
                                                            hidden_size=256, intermediate_size=1024, vocab_size=1200)))
        rates = {name: tokens_per_second(Path(scratch) / name.replace(" ", "-"), model, args.micro_batches, args.steps,
                                         distributed) for name, distributed in LAYOUTS.items()}
    split = rates["layer split"]
    for name, rate in rates.items():
        print(f"{name:15} {rate:9.0f} tokens/s   {rate / split:5.2f} x the layer split")


if __name__ == "__main__":
    main()
