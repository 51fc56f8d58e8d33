"""What the worker checks before it loads anything heavy, and the safe way to load weights.

The data is read and validated first (seconds, no tokenizer; Hub datasets are
loaded before), then a local model
folder is checked file by file, then whether this transformers knows the
architecture: a bad input is refused with its file and line before minutes of
model loading. The security-relevant load options live here too: remote code
runs only when the config asks for it (with a warning naming the revision), and
weights load from safetensors, or from pickle files only through torch's
``weights_only=True`` loader.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from studio.core.config import RunConfig
from studio.core.data.dataset import DatasetReport, image_rows_refusal, inspect_files, objective_refusal
from studio.core.errors import Problem, ProblemsError, StudioError
from studio.core.model.check import is_local_model, raise_for_model, remote_code_warning, weight_format
from studio.core.model.info import SUPPORTED_MODEL_TYPES, cached_config, load_model_config
from studio.core.model.vision import image_training_refusal
from studio.core.run.events import EventWriter
from studio.train.data.hub import load_hub_datasets

log = logging.getLogger("studio.train")

DataReports = tuple[DatasetReport, DatasetReport | None]


def check_inputs(config: RunConfig, events: EventWriter) -> DataReports:
    """Validate the data and the model; warn about remote code and pickle weights.

    Returns the (train, eval) data reports for studio.train.data.prepare.prepare_data.
    Raises ProblemsError (kind "data" or "model") naming the file and line.
    """
    load_hub_datasets(config)  # hub: entries become rows files that inspect_files reads
    train, evaluation = inspect_data(config)
    check_model(config)
    if any(report is not None and report.image_rows for report in (train, evaluation)):
        refusal = image_training_refusal(load_model_config(config.model.name_or_path, config.model.revision))
        if refusal is not None:
            raise refusal
    for message, hint in load_warnings(config):
        log.warning("%s (%s)", message, hint)
        events.emit("warning", message=message, hint=hint)
    return train, evaluation


def inspect_data(config: RunConfig) -> DataReports:
    """The (train, eval) reports of the run's data files, read as its objective reads them: every problem named
    by file and line, pairs refused for an objective that learns from responses, and images for one that does not
    train on them."""
    data = config.data
    reports = (inspect_files(data.train_files, config.row_format, keep=0),
               inspect_files(data.eval_files, config.row_format, keep=0) if data.eval_files else None)
    for files, report in zip((data.train_files, data.eval_files), reports):
        if report is None:
            continue
        where = Path(files[0]).name
        refusal = objective_refusal(report.format, config.objective, config.learns_preferences, where)
        if refusal is None and report.image_rows:
            refusal = image_rows_refusal(config.objective, config.distributed.pipeline_stages, where)
        if refusal is not None:
            raise refusal
    return reports


def check_model(config: RunConfig) -> None:
    """A local folder file by file (a Hub id: in the cache when offline), then whether transformers knows
    its architecture."""
    name = config.model.name_or_path
    raise_for_model(name, config.model.revision)
    if is_local_model(name):
        config_path = Path(name).expanduser() / "config.json"
    else:
        config_path = cached_config(name, config.model.revision)
    if config_path is not None:
        check_architecture(config_path, config.model.trust_remote_code)


def check_architecture(config_path: Path, trust_remote_code: bool) -> None:
    """Refuse a model_type this transformers cannot build, unless the model brings (trusted) code."""
    try:
        settings = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return  # a cached Hub config transformers reads itself; local folders were checked already
    model_type = settings.get("model_type") if isinstance(settings, dict) else None
    if not isinstance(model_type, str) or model_type in SUPPORTED_MODEL_TYPES:
        return  # the estimator's families are all transformers architectures: no need to import it
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type in CONFIG_MAPPING_NAMES or ("auto_map" in settings and trust_remote_code):
        return
    architectures = ", ".join(map(str, settings.get("architectures") or [])) or "none named"
    if "auto_map" in settings:
        hint = ("the model ships its own Python code (auto_map): if you trust it, turn on model.trust_remote_code; "
                "otherwise choose a model of a supported architecture")
    else:
        hint = "update transformers (pip install -U transformers), or choose a model of a supported architecture"
    raise ProblemsError([Problem(str(config_path), f"model_type '{model_type}' (architectures: {architectures}) "
                                 f"is not an architecture transformers {transformers.__version__} knows", hint)],
                        "model", str(config_path.parent))


def load_warnings(config: RunConfig) -> list[tuple[str, str]]:
    """(message, hint) pairs the run should show before it loads the model."""
    model = config.model
    warnings = []
    if model.trust_remote_code:
        warnings.append(remote_code_warning(model.name_or_path, model.revision))
    if is_local_model(model.name_or_path) and weight_format(model.name_or_path) == "pickle":
        warnings.append((f"{model.name_or_path} has only PyTorch pickle weights (pytorch_model.bin): they load with "
                         "torch's weights_only=True loader, which runs no code from the file", "convert them to safetensors"))
    return warnings


def weight_load_kwargs(config: RunConfig) -> dict:
    """from_pretrained options for the weights: safetensors when there are any; pickle only weights_only.

    transformers 5 already prefers safetensors and passes weights_only=True to
    torch.load; saying both explicitly keeps that true if a default ever changes,
    and ``use_safetensors=True`` refuses to fall back to a pickle file beside them.
    """
    kwargs: dict = {"weights_only": True}
    name = config.model.name_or_path
    if is_local_model(name) and weight_format(name) == "safetensors":
        kwargs["use_safetensors"] = True
    return kwargs



def refused_pickle_error(name_or_path: str, exc: Exception) -> StudioError:
    """A pickle weights file that holds more than tensors: said plainly, without torch's advice to load it unsafely."""
    lines = str(exc).splitlines()
    detail = next((line.strip() for line in lines if "WeightsUnpickler error" in line), type(exc).__name__)
    return StudioError(f"refused to load the weights of {name_or_path}: the PyTorch pickle file holds Python objects "
                       f"that could run code, not only tensors ({detail})",
                       "use the model's safetensors weights, or convert a copy you trust to safetensors", kind="model")
