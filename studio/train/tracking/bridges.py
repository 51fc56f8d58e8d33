"""The opt-in experiment trackers (``schedule.trackers``): Trackio, Weights & Biases and MLflow, each fed the
run's figures (``figures``) as they are written, or later from ``events.jsonl``.

Each is an optional extra of finetune-studio, imported only here. Their logins are their own (environment
variables, their login commands), read by the library and never by studio, and what they keep on this machine
goes to their own folders or studio's data folder (``studio.core.folders``), never into the run directory. The
tracker's run is named after the run directory and continued under that name: a resumed run, ``studio eval``
and ``studio track --to`` add to it.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from studio.core.config import RunConfig, to_dict
from studio.core.folders import trackers_folder
from studio.core.run.directory import RunDir
from studio.train.tracking.figures import SAMPLE_COLUMNS, Tracker, sample_markdown, sample_row

# What a library's error may quote of its login: the values of these variables, a URL's user:password@
SECRET_VARIABLES = ("WANDB_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "MLFLOW_TRACKING_PASSWORD",
                    "MLFLOW_TRACKING_TOKEN", "DATABRICKS_TOKEN", "TRACKIO_WRITE_TOKEN")
_URL_LOGIN = re.compile(r"(\w+://)[^/\s@]+@")
_TOKEN_PARAMETER = re.compile(r"(token=)[^&\s]+", re.IGNORECASE)


def without_secrets(error: BaseException | str) -> str:
    """An error's text fit for the run's events and log: any login it quotes replaced by ***."""
    text = _TOKEN_PARAMETER.sub(r"\1***", _URL_LOGIN.sub(r"\1***@", str(error)))
    for name in SECRET_VARIABLES:
        if secret := os.environ.get(name):
            text = text.replace(secret, "***")
    return text


def run_key(run_name: str) -> str:
    """The run directory's name as a tracker's run id (W&B's id, an MLflow tag): the characters both take."""
    return re.sub(r"[^A-Za-z0-9_-]+", "-", run_name)[:64]


class Bridge(Tracker):
    """An opt-in tracker: its ``name`` is its value in schedule.trackers and the name of its extra."""

    @classmethod
    def open(cls, rd: RunDir, config: RunConfig, step: int = 0) -> Bridge:
        """Each bridge takes the project, the run's name, the config as its settings, and the step to begin at."""
        return cls(config.schedule.tracker_project, rd.path.name, to_dict(config), step)

    @classmethod
    def install_hint(cls) -> str:
        return f'pip install "finetune-studio[{cls.name}]", or take {cls.name} out of schedule.trackers'


class WeightsAndBiases(Bridge):
    name, label, package = "wandb", "Weights & Biases", "wandb"
    failure_hint = "log in with wandb login or WANDB_API_KEY (WANDB_MODE=offline keeps the run on this machine)"

    def __init__(self, project: str, run_name: str, settings: dict[str, Any], step: int = 0):
        import wandb

        super().__init__(step)
        self.wandb, self.exit_code = wandb, 0
        offline = wandb.setup().settings.mode in ("offline", "dryrun")
        if not offline and not wandb.login(prompt=False, verify=False):  # a prompt would wait on the worker's stdin
            raise RuntimeError("not logged in")
        folder = trackers_folder("wandb")
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, name=run_name, id=run_key(run_name), resume="allow", dir=folder, config=settings,
            # The figures come from the events alone, the same live and replayed: not this machine's load or code.
            settings=wandb.Settings(console="off", silent=True, disable_git=True, disable_code=True,
                                    x_disable_stats=True, x_save_requirements=False))
        # Drawn over the run's own step: W&B's would refuse an evaluation drawn at an earlier step than the last.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.where = f"offline in {self.run.settings.sync_dir} (wandb sync uploads it)" if offline else self.run.url

    def write_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, "step": step})

    def write_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[sample_row(sample) for sample in samples])
        self.run.log({"samples": table, "step": step})

    def finished(self, status: str) -> None:
        self.exit_code = 1 if status == "failed" else 0

    def close(self) -> None:
        self.run.finish(exit_code=self.exit_code)


class MLflow(Bridge):
    name, label, package = "mlflow", "MLflow", "mlflow"
    failure_hint = ("check MLFLOW_TRACKING_URI and its login (MLFLOW_TRACKING_USERNAME and _PASSWORD, or "
                    "MLFLOW_TRACKING_TOKEN)")
    STATUSES = {"completed": "FINISHED", "stopped": "KILLED", "aborted": "KILLED", "failed": "FAILED"}
    KEY = "finetune_studio.run"  # the tag a run directory's MLflow run is found by
    PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch
    # A server down costs the run seconds, once, before MLflow is dropped, where MLflow's own retries wait for
    # minutes; what the user set wins.
    PATIENCE = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}

    def __init__(self, project: str, run_name: str, settings: dict[str, Any], step: int = 0):
        from mlflow import MlflowClient

        super().__init__(step)
        server = bool(os.environ.get("MLFLOW_TRACKING_URI"))
        for variable, value in self.PATIENCE.items():
            os.environ.setdefault(variable, value)
        folder = trackers_folder("mlflow")
        if not server:  # not MLflow's default, ./mlruns or ./mlflow.db in whatever folder the worker started in
            folder.mkdir(parents=True, exist_ok=True)
        uri = None if server else "sqlite:///" + (folder / "mlflow.db").as_posix()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(
            project, artifact_location=None if server else (folder / "artifacts").as_uri())
        self.run_id = self._continued(experiment_id, run_name) or self._created(experiment_id, run_name, settings)
        self.status = "FINISHED"
        self.where = "the server of MLFLOW_TRACKING_URI" if server else f'mlflow ui --backend-store-uri "{uri}"'

    def _continued(self, experiment_id: str, run_name: str) -> str | None:
        found = self.client.search_runs([experiment_id], filter_string=f"tags.`{self.KEY}` = '{run_key(run_name)}'",
                                        max_results=1)
        return found[0].info.run_id if found else None

    def _created(self, experiment_id: str, run_name: str, settings: dict[str, Any]) -> str:
        """A new run with the config as its parameters (an MLflow parameter never changes: only when created)."""
        from mlflow.entities import Param

        run_id = self.client.create_run(experiment_id, run_name=run_name, tags={self.KEY: run_key(run_name)}).info.run_id
        params = [Param(key, str(value)[:6000]) for key, value in _flat(settings).items()]
        for start in range(0, len(params), self.PARAMS_PER_CALL):
            self.client.log_batch(run_id, params=params[start:start + self.PARAMS_PER_CALL])
        return run_id

    def write_scalars(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(tag), float(value), now, step)
                                                    for tag, value in values.items()])

    def write_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        text = "\n\n---\n\n".join(sample_markdown(sample) for sample in samples)
        self.client.log_text(self.run_id, text, f"samples/step-{step:06d}.md")

    def finished(self, status: str) -> None:
        self.status = self.STATUSES.get(status, "FINISHED")

    def close(self) -> None:
        self.client.set_terminated(self.run_id, self.status)


def _flat(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"training": {"seed": 42}}`` as ``{"training.seed": 42}``."""
    found: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            found |= _flat(value, f"{prefix}{key}.")
        else:
            found[f"{prefix}{key}"] = value
    return found


def _mlflow_key(tag: str) -> str:
    """A tag in the characters MLflow takes for a metric (a benchmark's "exact_match (strict-match)" has others)."""
    return re.sub(r"[^\w./ :-]", "_", tag)


class Trackio(Bridge):
    name, label, package = "trackio", "Trackio", "trackio"
    failure_hint = "a Space (TRACKIO_SPACE_ID) needs the login of HF_TOKEN or hf auth login"

    def __init__(self, project: str, run_name: str, settings: dict[str, Any], step: int = 0):
        import trackio
        from trackio.utils import TRACKIO_DIR

        super().__init__(step)
        self.trackio = trackio
        # The figures come from the events alone, the same live and replayed: not this machine's load.
        self.run = trackio.init(project=project, name=run_name, config=settings, resume="allow",
                                auto_log_cpu=False, auto_log_gpu=False)
        space = os.environ.get("TRACKIO_SPACE_ID")
        self.where = f"the Space {space}" if space else f'trackio show --project "{project}" (its files: {TRACKIO_DIR})'

    def write_scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def write_samples(self, samples: list[dict[str, Any]], step: int) -> None:
        table = self.trackio.Table(columns=list(SAMPLE_COLUMNS), data=[sample_row(sample) for sample in samples])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


BRIDGES: dict[str, type[Bridge]] = {bridge.name: bridge for bridge in (Trackio, WeightsAndBiases, MLflow)}
