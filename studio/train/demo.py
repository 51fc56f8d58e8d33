"""``studio demo``: a real LoRA fine-tune of the embedded tiny model, with before/after accuracy.

The base model was pretrained on plain facts ("a plum is a kind of fruit .") but has
never been asked a question (resources/build_demo_assets.py). The demo measures
held-out exact match of the base on "What kind of thing is a plum?", trains an
adapter like any other run, measures again and exports the adapter.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from studio.core.data.dataset import inspect_files
from studio.core.presets import DEMO_HELDOUT, demo_config
from studio.core.run.commands import EXIT_OK
from studio.core.run.directory import RunDir
from studio.core.run.events import EventWriter
from studio.train.checkpoint import load_weights
from studio.train.evaluation.exact_match import exact_match
from studio.train.export.hf_format import export_run
from studio.train.model.build import build_model, load_base_model, load_tokenizer
from studio.train.worker import run

log = logging.getLogger("studio.train")


def heldout_accuracy(config, checkpoint: Path | None) -> float:
    """Exact match on the held-out file: of the base model, or of a checkpoint's adapter."""
    device = torch.device("cpu")
    tokenizer = load_tokenizer(config)
    if checkpoint is None:
        model = load_base_model(config, device)
    else:
        model = build_model(config, device, for_inference=True)
        load_weights(checkpoint, model)
    examples = inspect_files((str(DEMO_HELDOUT),), config.data.format).examples
    return exact_match(model, tokenizer, examples, config.data.template)


def run_demo(run_dir: Path | None = None) -> int:
    """Train, measure and export the demo; returns the exit code."""
    config = demo_config()
    print("Finetune Studio demo: teach the embedded tiny model to answer questions about what it knows (LoRA)")
    before = heldout_accuracy(config, None)
    print(f"held-out exact match before training: {before:.1%}")
    code, rd = run(config, run_dir, watch_stdin=False)
    if code != EXIT_OK or rd.latest_checkpoint() is None:
        print(f"training did not finish; see {rd.log}")
        return code or 1
    after = heldout_accuracy(config, rd.latest_checkpoint())
    _record_accuracy(rd, before, after)
    print(f"held-out exact match after training:  {after:.1%}")
    export_run(rd.path, "adapter")  # logs where it went and how it verified
    print(f"run directory: {rd.path}")
    return 0


def _record_accuracy(rd: RunDir, before: float, after: float) -> None:
    """Append the accuracies to the run's events, so the history shows them."""
    events = EventWriter(rd.events)
    try:
        events.emit("eval", step=None, heldout_exact_match_before=before, heldout_exact_match=after)
    finally:
        events.close()
