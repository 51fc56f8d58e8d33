"""TensorBoard files beside events.jsonl: written as the run trains, and again from the events on request."""

import pytest

from helpers import quick_config
from studio.cli import main
from studio.core.run.events import read_events
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


def test_no_tensorboard_files_when_switched_off(tmp_path, small_data):
    config = quick_config(small_data, training={"max_steps": 1}, schedule={"tensorboard": False})
    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0 and not (rd.path / "tensorboard").exists()
