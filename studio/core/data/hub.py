"""Hugging Face Hub datasets named in ``data.train_files`` / ``data.eval_files``, beside local files.

Syntax: ``hub:NAME`` where NAME is the dataset's Hub id (``OWNER/NAME``, or a
bare canonical name), optionally followed by ``@CONFIG`` (the dataset's
configuration, or subset) and ``:SPLIT`` (default ``train``)::

    hub:tatsu-lab/alpaca                    the train split
    hub:HuggingFaceH4/ultrachat_200k:train_sft
    hub:openai/gsm8k@main:test              configuration main, split test

The worker loads the split through ``datasets`` (its cache, so a dataset
downloaded once trains offline) and writes its rows once to a Parquet file in
``rows_file``'s folder; the pure-Python reader (``studio.core.data.dataset``) reads
that file like any other, naming rows ``hub:OWNER/NAME row 7``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from studio.core.data.row_formats import DataError

HUB_PREFIX = "hub:"
_SPEC = re.compile(r"hub:(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<config>[\w.-]+))?(?::(?P<split>[\w.\[\]%:-]+))?")
SPEC_HINT = "write hub:OWNER/NAME, hub:OWNER/NAME:SPLIT or hub:OWNER/NAME@CONFIG:SPLIT"


@dataclass(frozen=True)
class HubDataset:
    repo: str
    config: str = ""  # "" : the dataset's default configuration
    split: str = "train"

    def __str__(self) -> str:
        return HUB_PREFIX + self.repo + (f"@{self.config}" if self.config else "") + f":{self.split}"


def is_hub_spec(name: str) -> bool:
    return str(name).startswith(HUB_PREFIX)


def parse_hub_spec(name: str, where: str = "data.train_files") -> HubDataset:
    """``hub:OWNER/NAME[@CONFIG][:SPLIT]`` as a HubDataset; a DataError naming ``where`` if it is malformed."""
    match = _SPEC.fullmatch(str(name))
    if not match:
        raise DataError(where, f"{name!r} is not a Hub dataset name", SPEC_HINT)
    return HubDataset(match["repo"], match["config"] or "", match["split"] or "train")


def hub_dataset_id(name: str) -> str:
    """The Hub id of a ``hub:`` entry, "" for a local file (or a malformed entry: validation names it)."""
    match = _SPEC.fullmatch(str(name)) if is_hub_spec(name) else None
    return match["repo"] if match else ""


def rows_folder() -> Path:
    """Where the rows of Hub datasets are kept as Parquet: beside the ``datasets`` cache."""
    home = Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
    return Path(os.environ.get("STUDIO_HUB_ROWS") or home / "studio-rows")


def rows_file(dataset: HubDataset) -> Path:
    """The Parquet file holding one split of a Hub dataset, once the worker has loaded it."""
    safe = re.sub(r"[^\w.@-]", "_", f"{dataset.repo.replace('/', '--')}@{dataset.config}--{dataset.split}")
    return rows_folder() / f"{safe}.parquet"
