"""Shared helpers for tests that run the real worker or check the commands that start it."""

import argparse
from pathlib import Path

from studio.cli import build_parser
from studio.core.presets import demo_config
from studio.core.run.commands import WORKER_MODULE
from studio.core.run.events import read_events
from studio.train import entry


def quick_config(data_file: Path, **sections):
    base = demo_config().replace(
        data={"train_files": (str(data_file),), "eval_files": (), "max_length": 48},
        training={"micro_batch_size": 8, "max_steps": 12, "learning_rate": 3e-3, "warmup_ratio": 0.0,
                  "lr_scheduler": "constant"},
        schedule={"log_every": 1, "save_every": 0, "sample_every": 0},
    )
    return base.replace(**sections)


def with_demo_tokenizer(folder: Path) -> Path:
    """A tiny model folder with the demo's tokenizer (it fits in a vocabulary of 1200 tokens or more)."""
    import shutil

    from studio.core.presets import DEMO_MODEL

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO_MODEL / name, folder / name)
    return folder


def losses(run_dir) -> list[float]:
    return [e["loss"] for e in read_events(run_dir.events) if e["type"] == "step"]


def parse_command(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """The module ``python -m MODULE ARGS`` runs, and ARGS as that module's own parser reads them."""
    assert argv[1] == "-m", argv
    parser = {"studio": build_parser, WORKER_MODULE: entry.build_parser}[argv[2]]()
    return argv[2], parser.parse_args(argv[3:])


def loss_and_gradients(config):
    """One micro-batch of the worker's step (its loss, autocast and checkpointing) on full-length random rows:
    the loss and every trained parameter's .grad."""
    import torch

    from studio.core.memory.regime import loss_impl_for
    from studio.train.measure.simulate import full_length_batches, loss_sum, target_tokens
    from studio.train.model.build import build_model, compute_dtype
    from studio.train.objectives.next_token import lean_output_layer

    torch.manual_seed(config.training.seed)
    model = build_model(config, torch.device("cpu"))
    model.train()
    batch = full_length_batches(config, model.config.get_text_config().vocab_size, torch.device("cpu"))[0]
    output_layer = lean_output_layer(model) if loss_impl_for(config) == "chunked" else None
    with torch.autocast("cpu", dtype=compute_dtype(config), enabled=config.training.precision != "fp32"):
        loss = loss_sum(model, batch, output_layer) / target_tokens([batch])
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
