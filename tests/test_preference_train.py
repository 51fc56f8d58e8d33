"""``studio train`` with a preference objective: a short real run learns the pairs (their reward accuracy rises,
the loss falls) or raises KTO's desirable completions, and logs TRL's metrics in its step and eval events; a stopped
run resumes exactly; data that does not fit is refused by line."""

import itertools
import json

import pytest
from safetensors.torch import load_file

from helpers import quick_config
from studio.core.errors import StudioError
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.train.control import StopController
from studio.train.preflight import inspect_data
from studio.train.worker import run

COLORS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    rows = [{"prompt": f"Name a color like {c}:", "chosen": f" {c}", "rejected": f" {COLORS[(i + 3) % 8]} and more"}
            for i, c in enumerate(COLORS * 4)]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def unpaired(tmp_path_factory):
    """KTO's rows: each prompt with a desirable completion and an undesirable one, as two rows."""
    rows = []
    for i, c in enumerate(COLORS * 2):
        rows += [{"prompt": f"Name a color like {c}:", "completion": f" {c}", "label": True},
                 {"prompt": f"Name a color like {c}:", "completion": f" {COLORS[(i + 3) % 8]} and more", "label": False}]
    folder = tmp_path_factory.mktemp("unpaired")
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:4]))  # both labels
    return folder


def _events(config, tmp_path):
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    return list(read_events(run_dir.events))


@pytest.mark.parametrize("objective, method, reference", [("dpo", "lora", "each_step"), ("dpo", "full", "precomputed"),
                                                         ("orpo", "lora", "each_step"), ("simpo", "lora", "each_step")])
def test_a_short_run_learns_the_pairs(pairs, tmp_path, objective, method, reference):
    config = quick_config(pairs, objective=objective, method=method, preference={"reference": reference},
                          data={"eval_fraction": 0.125},
                          training={"max_steps": 6, "micro_batch_size": 4, "learning_rate": 1e-3})
    events = _events(config, tmp_path)
    steps = [e for e in events if e["type"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert steps[-1]["rewards/margins"] > steps[0]["rewards/margins"]
    assert steps[-1]["rewards/accuracies"] == 1.0 and steps[0]["rewards/accuracies"] <= 0.75
    evaluation = [e for e in events if e["type"] == "eval"][-1]
    assert evaluation["tokens"] == 4 and evaluation["eval_rewards/accuracies"] == 1.0  # the held-out pairs


@pytest.mark.parametrize("method, reference", [("lora", "each_step"), ("full", "precomputed")])
def test_a_short_kto_run_raises_the_desirable_completions(unpaired, tmp_path, method, reference):
    config = quick_config(unpaired / "train.jsonl", objective="kto", method=method,
                          preference={"reference": reference}, data={"eval_files": (str(unpaired / "eval.jsonl"),)},
                          training={"max_steps": 6, "micro_batch_size": 4, "learning_rate": 1e-3})
    events = _events(config, tmp_path)
    steps = [e for e in events if e["type"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    gap = [step["logps/chosen"] - step["logps/rejected"] for step in steps if "rewards/margins" in step]
    assert gap[-1] > gap[0]  # the desirable completions' log-probability rises against the undesirable ones'
    assert steps[-1]["rewards/margins"] > 0 and steps[0]["rewards/margins"] < steps[-1]["rewards/margins"]
    assert all(step["kl"] >= 0 for step in steps)
    evaluation = [e for e in events if e["type"] == "eval"][-1]
    assert evaluation["tokens"] == 4 and evaluation["eval_rewards/margins"] > 0


@pytest.mark.parametrize("objective, method, reference", [("dpo", "lora", "each_step"), ("kto", "full", "precomputed")])
def test_a_stopped_preference_run_resumes_exactly(pairs, unpaired, tmp_path, monkeypatch, objective, method,
                                                  reference):
    """Stopped after step 2 of 4 and resumed: the same losses, metrics and trained weights as the run that was not
    stopped (LoRA's dropout draws from the restored random state; a precomputed reference is read back)."""
    data = pairs if objective == "dpo" else unpaired / "train.jsonl"
    config = quick_config(data, objective=objective, method=method, preference={"reference": reference},
                          lora={"dropout": 0.1}, training={"max_steps": 4, "micro_batch_size": 4, "learning_rate": 1e-3})
    whole, whole_dir = _steps_and_weights(config, tmp_path / "whole", resume=False)
    stops = itertools.chain([False, True], itertools.repeat(False))  # a stop request seen after step 2
    monkeypatch.setattr(StopController, "stop_requested", property(lambda self: next(stops)))
    code, run_dir = run(config, tmp_path / "stopped", watch_stdin=False)
    assert code == EXIT_OK and run_dir.latest_checkpoint().name == "step-000002"
    resumed, _ = _steps_and_weights(None, run_dir.path, resume=True)
    assert sorted(resumed[0]) == [1, 2, 3, 4]
    for step, logged in whole[0].items():
        assert resumed[0][step] == pytest.approx(logged, rel=1e-5, abs=1e-6), step
    for name, tensor in whole[1].items():
        assert resumed[1][name].equal(tensor), name


def _steps_and_weights(config, run_dir, resume):
    """A run's logged numbers by step (loss, gradient norm, learning rate, the objective's metrics), and its final
    checkpoint's trained tensors."""
    code, run_dir = run(config, run_dir, resume=resume, watch_stdin=False)
    assert code == EXIT_OK
    timing = {"type", "time", "step", "tokens_per_s", "samples_per_s", "step_seconds", "memory"}
    steps = {e["step"]: {k: v for k, v in e.items() if k not in timing}
             for e in read_events(run_dir.events) if e["type"] == "step"}
    return (steps, load_file(run_dir.latest_checkpoint() / "trainable.safetensors")), run_dir


def test_rows_that_do_not_fit_the_objective_are_refused_by_line_and_field(pairs, tmp_path):
    responses = tmp_path / "sft.jsonl"
    responses.write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    with pytest.raises(StudioError, match=r"sft.jsonl:1: the row looks like instruction, not a preference pair "
                                          r"\(field 'chosen' is missing\)"):
        inspect_data(quick_config(responses, objective="dpo"))
    half = tmp_path / "half.jsonl"
    half.write_text(pairs.read_text().splitlines()[0] + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    with pytest.raises(StudioError, match=r"half.jsonl:2: field 'rejected' is missing"):
        inspect_data(quick_config(half, objective="dpo"))
    with pytest.raises(StudioError, match="pairs.jsonl: the rows are preference pairs"):
        inspect_data(quick_config(pairs, objective="sft"))


def test_rows_that_do_not_fit_kto_are_refused_by_line_and_field(pairs, unpaired, tmp_path):
    with pytest.raises(StudioError, match=r"pairs.jsonl:1: the row looks like preference, not an unpaired preference "
                                          r"row \(field 'label' is missing\)"):
        inspect_data(quick_config(pairs, objective="kto"))
    unsure = tmp_path / "unsure.jsonl"
    unsure.write_text((unpaired / "eval.jsonl").read_text().splitlines()[0] + "\n"
                      + json.dumps({"prompt": "a", "completion": "b", "label": "maybe"}) + "\n")
    with pytest.raises(StudioError, match=r"unsure.jsonl:2: field 'label' must be true or false, got text 'maybe'"):
        inspect_data(quick_config(unsure, objective="kto"))
    with pytest.raises(StudioError, match=r"train.jsonl: the rows are unpaired preference rows"):
        inspect_data(quick_config(unpaired / "train.jsonl", objective="sft"))
