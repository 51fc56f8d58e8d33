"""Loading the Hub datasets a config names (``hub:OWNER/NAME@CONFIG:SPLIT``, see studio.core.data.hub).

Through ``datasets.load_dataset`` and its cache: a dataset downloaded once loads
again offline. The split's rows are written to the Parquet file that the
pure-Python reader (``studio.core.data.dataset``) reads like any data file; rows are
validated there, as a local file's are.
"""

from __future__ import annotations

import logging
import os

from studio.core.config import RunConfig
from studio.core.data.hub import HubDataset, is_hub_spec, parse_hub_spec, rows_file
from studio.core.errors import StudioError

log = logging.getLogger("studio.train")


def load_hub_datasets(config: RunConfig) -> list[HubDataset]:
    """Load every ``hub:`` entry of data.train_files and data.eval_files; the ones loaded, in order."""
    loaded = []
    for key, names in (("data.train_files", config.data.train_files), ("data.eval_files", config.data.eval_files)):
        for index, name in enumerate(names):
            if is_hub_spec(name):
                dataset = parse_hub_spec(name, f"{key}[{index}]")
                load_hub_dataset(dataset)
                loaded.append(dataset)
    return loaded


def load_hub_dataset(dataset: HubDataset) -> None:
    """One split, from the ``datasets`` cache or the Hub, into its rows file."""
    import datasets

    try:
        rows = datasets.load_dataset(dataset.repo, dataset.config or None, split=dataset.split)
    except ValueError as exc:  # datasets names a bad split or configuration, with the valid ones
        raise StudioError(f"{dataset}: {exc}", "check the configuration (@CONFIG) and split (:SPLIT) on the "
                          "dataset's Hub page", kind="data") from None
    except Exception as exc:  # connection, not found, gated: datasets raises many kinds
        offline = datasets.config.HF_HUB_OFFLINE
        hint = ("it is not in the datasets cache and HF_HUB_OFFLINE is set: load it once online" if offline
                else "check the name on huggingface.co/datasets, your network, and `hf auth login` for a gated dataset")
        raise StudioError(f"cannot load the Hub dataset {dataset.repo} ({dataset}): {type(exc).__name__}: {exc}",
                          hint, kind="data") from None
    target = rows_file(dataset)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.partial")  # the processes of a run may write it at once
    rows.to_parquet(str(partial))
    partial.replace(target)  # a reader never sees half a file
    log.info("loaded %s: %d rows", dataset, len(rows))
