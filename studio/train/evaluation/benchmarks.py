"""``studio eval RUN --tasks TASK ...``: standard benchmarks through lm-evaluation-harness, base vs fine-tuned.

The harness (the optional ``lm-eval`` extra) evaluates the run's model object as it is, once with its
newest checkpoint and once as the base (the adapter switched off). Its tasks read their datasets through the
datasets library: from the Hugging Face cache, or from local files named in a task's YAML in a folder given with
``--include-path``. Instruction and chat runs are asked through the tokenizer's chat template, as they trained.
Each task runs on its own, so a task whose dataset is missing is named.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from studio.core.errors import StudioError
from studio.core.run.directory import RunDir
from studio.core.run.evaluation import BENCHMARKS_FILE
from studio.train.evaluation.compare import Progress, record_event, write_result
from studio.train.evaluation.generate import base_model, load_run_model, row_format

_UNREACHABLE = re.compile(r"Couldn't reach '([^']+)'")


def benchmark_run(run_dir: Path, tasks: Sequence[str], include_path: Path | None = None,
                  limit: int | None = None) -> dict[str, Any]:
    """Every task's metrics for the base and the fine-tuned model; written to RUN/benchmarks.json and an event."""
    simple_evaluate, HFLM, manager = _harness(include_path)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        raise StudioError(f"lm-evaluation-harness has no task {', '.join(unknown)}",
                          "see `lm-eval ls tasks` for its tasks, or give --include-path FOLDER with your task's YAML",
                          kind="usage")
    config, tokenizer, model, checkpoint = load_run_model(run_dir)
    chat = row_format(config) in ("instruction", "chat") and bool(getattr(tokenizer, "chat_template", None))

    def scores(task: str, evaluated) -> dict[str, float]:
        try:
            found = simple_evaluate(model=HFLM(pretrained=evaluated, tokenizer=tokenizer, batch_size=8), tasks=[task],
                                    task_manager=manager, limit=limit, apply_chat_template=chat)
        except ConnectionError as exc:
            raise _dataset_missing(task, exc) from None
        return metrics_of(found["results"][task])

    results, progress = {}, Progress("benchmarks", 2 * len(tasks))  # counted in models scored on a task
    for task in tasks:
        tuned = scores(task, model)
        progress.advance(1)
        with base_model(model, config) as base:
            results[task] = {"base": scores(task, base), "tuned": tuned}
        progress.advance(1)
    progress.done()
    result = {"checkpoint": checkpoint.name, "limit": limit, "chat_template": chat, "tasks": results}
    rd = RunDir(run_dir)
    write_result(rd.path / BENCHMARKS_FILE, result)
    record_event(rd, "benchmarks", **result)
    return result


def _harness(include_path: Path | None):
    """lm-eval's entry points and its task index (with the user's task folder), or what to install."""
    try:
        from lm_eval import simple_evaluate
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ModuleNotFoundError as exc:
        raise StudioError(f"standard benchmarks need lm-evaluation-harness, which is not installed ({exc})",
                          'pip install "finetune-studio[lm-eval]"', kind="runtime") from None
    if include_path is not None and not Path(include_path).is_dir():
        raise StudioError(f"--include-path {include_path}: no such folder", "name the folder that holds your task "
                          "YAML files", kind="usage")
    return simple_evaluate, HFLM, TaskManager(include_path=str(include_path) if include_path else None)


def metrics_of(task_result: dict[str, Any]) -> dict[str, float]:
    """{"acc": 0.61, "exact_match (strict-match)": 0.4} from the harness's {"acc,none": 0.61, "acc_stderr,none": ...}."""
    found = {}
    for key, value in task_result.items():
        name, _, filter_name = key.partition(",")
        if filter_name and "_stderr" not in name and isinstance(value, (int, float)):
            found[name if filter_name == "none" else f"{name} ({filter_name})"] = float(value)
    return found


def _dataset_missing(task: str, exc: ConnectionError) -> StudioError:
    found = _UNREACHABLE.search(str(exc))
    dataset = found.group(1) if found else "its dataset"
    download = f"hf download {found.group(1)} --repo-type dataset" if found else "download its dataset"
    return StudioError(f"task {task}: {dataset} is not in the Hugging Face cache, and the Hub cannot be reached ({exc})",
                       f"while online, run once: {download}; or give the task local files in a YAML of your own "
                       "(--include-path FOLDER)", kind="data")
