"""Library chatter that says nothing about the user's run, silenced for every command that loads the
training stack (the worker, export, generate, simulate, config check): a user's console and train.log show
only what is about their run.

Each entry names what it hides and why it is noise here; anything else still shows.
"""

from __future__ import annotations

import logging
import warnings

# Loggers that warn at import time about this installation, not about the run.
NOISY_LOGGERS = (
    "torchao",  # "Failed to load .../_C_mxfp8...so": optional CUDA kernels this machine cannot use
    "torch.utils._pytree",  # torchao registering its Enums "is deprecated" (a torch.compile detail)
    "bitsandbytes.backends.cpu.ops",  # an optional CPU kernel package that is not installed
)
# Single messages of loggers that otherwise matter: (logger, message start).
NOISY_MESSAGES = (
    ("DeepSpeed", "Setting accelerator to CPU"),  # imported by peft/accelerate on a machine without a GPU
    # bitsandbytes' optional CPU kernel looked up on the Hub, which the studio keeps offline (kernels >= 0.19)
    ("kernels._internals.hf_hub", "Skipping publisher trust check"),
)
# Warnings about library internals the user cannot act on: (message start, category).
NOISY_WARNINGS = (
    ("`is_gradient_checkpointing` is deprecated", FutureWarning),  # peft asks transformers the old name
    ("`gradient_checkpointing_enable` is deprecated", FutureWarning),  # the name peft (QLoRA) and older releases use
    ("`torch.jit.script_method` is deprecated", DeprecationWarning),
    ("The ``noload`` loader strategy is deprecated", DeprecationWarning),  # MLflow's database tables, SQLAlchemy 2.1
)


def quiet_library_noise() -> None:
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, start in NOISY_MESSAGES:
        logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))
    for message, category in NOISY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


def quiet_progress_bars() -> None:
    """No "Loading weights" or "Writing model shards" bar per model a command loads and saves (export and
    generate load several); the worker keeps its one bar, which the app shows while the model loads."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
