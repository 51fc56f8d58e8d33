"""``studio generate RUN_DIR --prompt TEXT``: the base model and the fine-tuned one answer side by side.

The prompt is rendered the way the run's training data was (chat template for
instruction and chat runs, raw text otherwise), so the answers show what the
fine-tune changed. Runs in its own process: the GUI starts it with QProcess.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from studio.core.config import RunConfig, load_config
from studio.core.data.dataset import inspect_files
from studio.core.data.row_formats import Example
from studio.core.errors import StudioError
from studio.core.run.directory import RunDir
from studio.train.checkpoint import load_weights
from studio.train.data.images import ImageRows
from studio.train.data.prepare import encode_image_prompt
from studio.train.evaluation.exact_match import generate_answers
from studio.train.model.build import build_model, load_base_model, load_tokenizer
from studio.train.quiet import quiet_progress_bars


def prompt_example(config: RunConfig, prompt: str, image: Path | None = None) -> Example:
    """The prompt as the run's rows put it: a completion's prompt, or a user's message (chat, instruction); with an
    image, a user's message of the image and then the prompt, as the rows with images put it."""
    if image is not None:
        parts = ({"type": "image"}, {"type": "text", "text": prompt})
        return Example(kind="chat", messages=({"role": "user", "content": parts},
                                              {"role": "assistant", "content": ""}), images=(str(image),))
    if row_format(config) in ("prompt_completion", "text"):
        return Example(kind="prompt_completion", prompt=prompt, completion="")
    return Example(kind="chat", messages=({"role": "user", "content": prompt}, {"role": "assistant", "content": ""}))


def row_format(config: RunConfig) -> str:
    """The run's row format; for "auto" the one its first training row has (the rest matched it)."""
    if config.data.format != "auto":
        return config.data.format
    return inspect_files(config.data.train_files, "auto", limit=1, keep=0).format


def side_by_side(run_dir: Path, prompt: str, max_new_tokens: int = 64, image: Path | None = None) -> dict[str, str]:
    """{"base": answer, "tuned": answer, "checkpoint": name} for one prompt (about ``image``, when given)."""
    config, tokenizer, model, checkpoint = load_run_model(run_dir)
    ids, images, _ = encode_image_prompt(prompt_example(config, prompt, image), tokenizer, config.data.template,
                                         ImageRows.for_run(config, tokenizer) if image is not None else None)
    tuned = generate_answers(model, tokenizer, [ids], max_new_tokens, [images])[0]
    with base_model(model, config) as base_of_run:
        base = generate_answers(base_of_run, tokenizer, [ids], max_new_tokens, [images])[0]
    return {"base": base.strip(), "tuned": tuned.strip(), "checkpoint": checkpoint.name}


def load_run_model(run_dir: Path) -> tuple[RunConfig, Any, torch.nn.Module, Path]:
    """The run's config, tokenizer, and model with its newest checkpoint's weights, for inference."""
    rd = RunDir(run_dir)
    if not rd.config.is_file():
        raise StudioError(f"{rd.path} is not a run directory (no config.yaml)", "pick a run from the history", kind="usage")
    checkpoint = rd.latest_checkpoint()
    if checkpoint is None:
        raise StudioError("the run has no checkpoint yet", "train (or stop-and-save) it first", kind="usage")
    config = load_config(rd.config).replace(training={"gradient_checkpointing": False})
    quiet_progress_bars()
    tokenizer = load_tokenizer(config)
    model = build_model(config, torch.device("cuda" if torch.cuda.is_available() else "cpu"), for_inference=True)
    load_weights(checkpoint, model)
    return config, tokenizer, model.eval(), checkpoint


@contextmanager
def base_model(model: torch.nn.Module, config: RunConfig) -> Iterator[torch.nn.Module]:
    """The model before fine-tuning: the adapter switched off, or for a full fine-tune the base loaded beside."""
    if config.uses_adapter:
        with model.disable_adapter():
            yield model
    else:
        base = load_base_model(config, model.device).eval()
        yield base
        del base
