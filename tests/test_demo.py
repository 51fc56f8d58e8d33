"""The main job the README runs: the demo must really teach the embedded model its task."""

import pytest

from studio.core.run.directory import RunDir
from studio.core.run.events import read_events
from studio.train.demo import run_demo


@pytest.mark.slow
def test_demo_turns_a_failing_base_model_into_a_correct_one(tmp_path, capsys):
    assert run_demo(tmp_path / "demo") == 0
    evaluation = next(e for e in read_events(RunDir(tmp_path / "demo").events) if e["type"] == "evaluation")
    assert evaluation["base"]["exact_match"] < 0.10
    assert evaluation["tuned"]["exact_match"] > 0.70
    adapter = tmp_path / "demo" / "exports" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    assert "| exact match | " in (adapter / "README.md").read_text()  # the card shows base vs tuned
    printed = capsys.readouterr().out
    assert "fine-tuned" in printed and "exact match" in printed
