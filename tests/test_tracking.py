"""The run's figures in TensorBoard files beside events.jsonl and in the opt-in trackers (W&B offline, MLflow's
local database, Trackio's folder, all in tmp_path): written as the run trains, and again from the events on request;
a tracker missing or failing never stops the run, and no login reaches the run directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import quick_config
from studio.cli import main
from studio.core.run.directory import RunDir
from studio.core.run.events import EventWriter, read_events
from studio.train.evaluation.compare import record_event
from studio.train.tracking.figures import Tracker
from studio.train.tracking.writer import TrackedEvents
from studio.train.worker import run

pytestmark = pytest.mark.slow


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``folder``: TFRecords (length, its CRC, an Event, its CRC) read back."""
    from tensorboardX.proto import event_pb2

    found: dict[str, list[tuple[int, float]]] = {}
    for file in sorted(folder.glob("events.out.tfevents.*")):
        data = file.read_bytes()
        position = 0
        while position < len(data):
            length = int.from_bytes(data[position:position + 8], "little")
            record = data[position + 12:position + 12 + length]
            position += 12 + length + 4
            event = event_pb2.Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                for tag, points in found.items():  # TensorBoard's purge: a restart hides the later steps
                    found[tag] = [(step, value) for step, value in points if step < event.step]
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    found.setdefault(value.tag, []).append((event.step, value.simple_value))
    return found


def test_the_run_s_losses_reach_tensorboard_and_can_be_written_again(tmp_path, small_data):
    config = quick_config(small_data, training={"max_steps": 4}).replace(data={"eval_fraction": 0.25})
    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0
    losses = [(e["step"], e["loss"]) for e in read_events(rd.events) if e["type"] == "step"]
    written = scalars(rd.path / "tensorboard")
    assert [step for step, _ in written["train/loss"]] == [1, 2, 3, 4]
    assert [value for _, value in written["train/loss"]] == pytest.approx([loss for _, loss in losses], rel=1e-6)
    assert written["eval/loss"][0][0] == 4 and "train/learning_rate" in written
    assert any(tag.startswith("memory/") for tag in written)
    before = written
    assert main(["track", str(rd.path)]) == 0  # from events.jsonl alone: the same figures
    assert scalars(rd.path / "tensorboard") == before


def test_a_resumed_run_shows_each_step_once_in_tensorboard_with_the_losses_it_kept(tmp_path, small_data, monkeypatch):
    import shutil
    import time
    import types

    from tensorboardX import event_file_writer

    # every file opened in the same second, as when a short run is resumed at once: no file may overwrite another
    frozen = types.SimpleNamespace(time=lambda: 1_700_000_000.0, sleep=time.sleep)
    monkeypatch.setattr(event_file_writer, "time", frozen)
    config = quick_config(small_data, training={"max_steps": 4}, schedule={"save_every": 2})
    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    shutil.rmtree(rd.latest_checkpoint())  # as if it had stopped after step 2's checkpoint
    code, rd = run(None, rd.path, resume=True, watch_stdin=False)
    assert code == 0
    steps = [(e["step"], e["loss"]) for e in read_events(rd.events) if e["type"] == "step"]
    assert [step for step, _ in steps] == [1, 2, 3, 4, 3, 4]
    kept = steps[:2] + steps[4:]
    for _ in ("live", "replayed"):
        written = scalars(rd.path / "tensorboard")["train/loss"]
        assert [step for step, _ in written] == [1, 2, 3, 4]
        assert [value for _, value in written] == pytest.approx([loss for _, loss in kept], rel=1e-6)
        assert main(["track", str(rd.path)]) == 0


def test_no_tensorboard_files_when_switched_off(tmp_path, small_data):
    config = quick_config(small_data, training={"max_steps": 1}, schedule={"tensorboard": False})
    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0 and not (rd.path / "tensorboard").exists()


# ---------------------------------------------------------------- the opt-in trackers

FAKE_WANDB_KEY = "studio-test-" + "k" * 40  # W&B takes a key of 40 characters or more


def wandb_history(folder) -> list[dict]:
    """Every row a W&B run logged, read back from its offline .wandb file (LevelDB-log records of its protobufs)."""
    from wandb.proto import wandb_internal_pb2

    [file] = folder.glob("wandb/offline-run-*/run-*.wandb")
    data, position, chunk, rows = file.read_bytes(), 7, b"", []  # after the ":W&B" header
    while position + 7 <= len(data):
        if 32768 - position % 32768 < 7:  # a block's tail too short for a record header is padding
            position += 32768 - position % 32768
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        chunk += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a record whole, or its last piece
            record = wandb_internal_pb2.Record.FromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture
def tracker_homes(tmp_path, monkeypatch):
    """Studio's data folder in tmp_path, W&B offline with a fake key, MLflow without a server: nothing of the
    user's."""
    monkeypatch.setenv("STUDIO_RUNS_DIR", str(tmp_path / "data" / "runs"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return tmp_path / "data" / "trackers"


def mlflow_runs(trackers):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + (trackers / "mlflow" / "mlflow.db").as_posix())
    experiment = client.get_experiment_by_name("finetune-studio")
    return client, client.search_runs([experiment.experiment_id])


def assert_same_points(found: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, and the same values to float precision (pytest 9.2's approx takes no nested pairs)."""
    assert [step for step, _ in found] == [step for step, _ in expected]
    assert [value for _, value in found] == pytest.approx([value for _, value in expected])


def test_a_run_s_figures_reach_wandb_and_mlflow_as_it_trains_and_no_token_reaches_its_folder(tmp_path, small_data,
                                                                                               tracker_homes):
    config = quick_config(small_data, training={"max_steps": 4}, schedule={"trackers": ("wandb", "mlflow"),
                                                                            "sample_every": 4})
    code, rd = run(config.replace(data={"eval_fraction": 0.25}), tmp_path / "run", watch_stdin=False)
    assert code == 0
    events = read_events(rd.events)
    losses = [(e["step"], e["loss"]) for e in events if e["type"] == "step"]
    assert not [e for e in events if e["type"] == "warning"]

    rows = wandb_history(tracker_homes / "wandb")
    assert_same_points([(row["step"], row["train/loss"]) for row in rows if "train/loss" in row], losses)
    assert [row["step"] for row in rows if "eval/loss" in row] == [4]
    samples = [(row["step"], row["samples/nrows"]) for row in rows if "samples/nrows" in row]  # a table of answers
    assert samples[-1] == (4, 3)

    client, [found] = mlflow_runs(tracker_homes)
    assert found.info.run_name == rd.path.name and found.info.status == "FINISHED"
    history = client.get_metric_history(found.info.run_id, "train/loss")
    assert_same_points([(m.step, m.value) for m in history], losses)
    assert client.get_metric_history(found.info.run_id, "eval/loss")[0].step == 4
    assert found.data.params["training.max_steps"] == "4"

    log = rd.log.read_text()
    assert "mlflow ui --backend-store-uri" in log and str(tracker_homes / "wandb") in log
    for file in rd.path.rglob("*"):  # the trackers' files are elsewhere, and none quotes the login
        assert not file.is_file() or FAKE_WANDB_KEY.encode() not in file.read_bytes(), file
    assert not any(part in ("wandb", "mlruns") for file in rd.path.rglob("*") for part in file.parts)

    # `studio eval` afterwards (its own process: record_event opens the trackers anew) joins the same MLflow run, at
    # the last step
    record_event(rd, "evaluation", checkpoint="step-000004", data=[], base={"loss": 2.5}, tuned={"loss": 1.5})
    client, [continued] = mlflow_runs(tracker_homes)
    assert continued.info.run_id == found.info.run_id
    assert [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "evaluation/loss/tuned")] == [(4, 1.5)]


def test_studio_track_feeds_a_finished_run_to_trackio_in_its_own_folder(tmp_path, small_data):
    code, rd = run(quick_config(small_data, training={"max_steps": 3}), tmp_path / "run", watch_stdin=False)
    losses = [(e["step"], e["loss"]) for e in read_events(rd.events) if e["type"] == "step"]
    # Trackio fixes its folder when imported: a process of its own, its folder in tmp_path.
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": str(Path(__file__).parents[1])}
    subprocess.run([sys.executable, "-m", "studio", "track", str(rd.path), "--to", "trackio"], env=env, check=True,
                   capture_output=True, timeout=300)
    read_back = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
                 "print(json.dumps(SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])))")
    logs = json.loads(subprocess.run([sys.executable, "-c", read_back, "finetune-studio", rd.path.name], env=env,
                                     check=True, capture_output=True, text=True, timeout=300).stdout)
    assert_same_points([(row["step"], row["train/loss"]) for row in logs if "train/loss" in row], losses)
    assert not list(rd.path.rglob("*.db"))


def test_a_tracker_missing_or_unreachable_is_a_warning_and_the_run_trains(tmp_path, small_data, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://studio:secret-password@127.0.0.1:9")  # a server down
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    config = quick_config(small_data, training={"max_steps": 2}, schedule={"trackers": ("wandb", "mlflow")})
    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0 and [e["step"] for e in read_events(rd.events) if e["type"] == "step"] == [1, 2]
    warnings = [e for e in read_events(rd.events) if e["type"] == "warning"]
    assert len(warnings) == 2
    assert 'pip install "finetune-studio[wandb]"' in warnings[0]["hint"]
    assert warnings[1]["message"].startswith("MLflow did not start") and "127.0.0.1:9" in warnings[1]["message"]
    assert not [file for file in rd.path.rglob("*") if file.is_file() and b"secret-password" in file.read_bytes()]


class Unreachable(Tracker):
    """A tracker whose server went away after it started."""

    name, label, failure_hint = "wandb", "Weights & Biases", "check the network"

    def __init__(self):
        super().__init__()
        self.writes, self.closed = 0, False

    def write_scalars(self, values, step):
        self.writes += 1
        raise ConnectionError("network down")

    def close(self):
        self.closed = True


def test_a_tracker_failing_while_the_run_trains_is_dropped_after_one_warning(tmp_path):
    rd = RunDir(tmp_path / "run")
    tracker = Unreachable()
    events = TrackedEvents(EventWriter(rd.events), [tracker])
    for step in (1, 2, 3):
        events.emit("step", step=step, loss=2.0)
    events.close()
    written = read_events(rd.events)
    assert [e["type"] for e in written] == ["step", "warning", "step", "step"]
    assert "network down" in written[1]["message"] and f'studio track "{rd.path}" --to wandb' in written[1]["hint"]
    assert tracker.writes == 1 and tracker.closed
