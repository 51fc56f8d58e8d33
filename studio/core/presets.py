"""Ready-made run configs: the embedded demo that works offline on any machine."""

from __future__ import annotations

from pathlib import Path

from studio.core.config import RunConfig

RESOURCES = Path(__file__).resolve().parents[2] / "resources"
DEMO_MODEL = RESOURCES / "models" / "tiny-llama"
DEMO_DATASETS = RESOURCES / "datasets"
DEMO_TRAIN = DEMO_DATASETS / "reverse_instruction.jsonl"
DEMO_HELDOUT = DEMO_DATASETS / "reverse_heldout.jsonl"


def demo_config() -> RunConfig:
    """LoRA on the embedded tiny Llama: teaches it to reverse word order (see resources/README.md)."""
    return RunConfig(name="demo").replace(
        model={"name_or_path": str(DEMO_MODEL)},
        data={"train_files": (str(DEMO_TRAIN),), "format": "instruction", "max_length": 64},
        lora={"r": 16, "alpha": 32.0, "dropout": 0.0},
        training={"precision": "fp32", "micro_batch_size": 16, "gradient_accumulation_steps": 1,
                  "max_steps": 300, "learning_rate": 2e-3, "lr_scheduler": "cosine", "warmup_ratio": 0.05},
        schedule={"log_every": 5, "save_every": 100},
    )
