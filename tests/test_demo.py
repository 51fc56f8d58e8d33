"""The main job the README runs: the demo must really teach the embedded model its task."""

import pytest

from studio.core.run.directory import RunDir
from studio.core.run.events import read_events
from studio.train.demo import run_demo


@pytest.mark.slow
def test_demo_turns_a_failing_base_model_into_a_correct_one(tmp_path, capsys):
    assert run_demo(tmp_path / "demo") == 0
    accuracy = next(e for e in read_events(RunDir(tmp_path / "demo").events) if "heldout_exact_match" in e)
    assert accuracy["heldout_exact_match_before"] < 0.10
    assert accuracy["heldout_exact_match"] > 0.70
    assert (tmp_path / "demo" / "exports" / "adapter" / "adapter_model.safetensors").is_file()
    assert "held-out exact match after training" in capsys.readouterr().out
