"""`studio eval` on a grpo run: the base model and the tuned one answer the run's held-out prompts greedily, scored
by the run's own rewards, each function and the weighted total side by side (what the run's eval events measured,
alike); a run without held-out prompts is told which field to set; the reward file runs only as the config trusts
it."""

import json

import pytest
import yaml

from conftest import first_lines
from studio.cli import main
from studio.core.config import RewardConfig
from studio.core.export.model_card import model_card
from studio.core.presets import DEMO_FORMAT, GRPO_HELDOUT, grpo_demo_config
from studio.core.run.commands import EXIT_OK, EXIT_USAGE
from studio.core.run.evaluation import read_evaluation
from studio.core.run.events import read_events
from studio.train.worker import run

STEPS = 6
FORMAT = RewardConfig(name="matches_format", pattern=DEMO_FORMAT)
SHORT = RewardConfig(name="length_within", max_length=4, unit="words", weight=0.5)  # "kind of fruit ." or shorter


def _trained(tmp_path, **grpo):
    """The grpo demo trained for a few steps, its held-out reward measured before the first step and after the last."""
    held_out = first_lines(GRPO_HELDOUT, 16, tmp_path / "held_out.jsonl")
    config = grpo_demo_config().replace(data={"eval_files": (str(held_out),)}, training={"max_steps": STEPS},
                                        schedule={"eval_every": STEPS}, grpo=grpo)
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    return config, run_dir


def test_studio_eval_scores_the_base_and_tuned_model_by_each_of_the_runs_rewards(tmp_path, capsys):
    config, run_dir = _trained(tmp_path, rewards=(FORMAT, SHORT))
    assert main(["eval", str(run_dir.path)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "16 held-out prompts, one greedy completion each (at most 12 tokens)" in printed
    for measure in ("reward (weighted total)", "reward matches_format", "reward length_within",
                    "prompts given every reward"):
        assert measure in printed
    result = read_evaluation(run_dir.path)
    base, tuned = result["summary"]["base"], result["summary"]["tuned"]
    # the run measured its held-out prompts alike: the base before its first step, the tuned after its last
    evals = [e for e in read_events(run_dir.events) if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, STEPS]
    for figures, measured in ((base, evals[0]), (tuned, evals[-1])):
        assert figures["eval_reward"] == pytest.approx(measured["eval_reward"])
        name = "eval_rewards/matches_format/mean"
        assert figures[name] == pytest.approx(measured[name])
    assert tuned["eval_rewards/matches_format/mean"] > base["eval_rewards/matches_format/mean"]  # it learns the format
    assert tuned["eval_reward"] == pytest.approx(tuned["eval_rewards/matches_format/mean"]
                                                 + 0.5 * tuned["eval_rewards/length_within/mean"])
    assert tuned["rows"] == 16 and tuned["decoding"] == "greedy"
    for row in result["rows"]:
        for model in ("base", "tuned"):
            scores = row[model]
            assert set(scores["rewards"]) == {"matches_format", "length_within"}
            assert scores["full_reward"] == (scores["rewards"] == {"matches_format": 1.0, "length_within": 1.0})
    assert row["location"].startswith("held_out.jsonl:") and row["prompt"].endswith(" is a") and row["reference"]
    rewards = [row["tuned"]["reward"] for row in result["rows"]]
    assert rewards == sorted(rewards)  # the weakest prompts first
    card = model_card(config, read_events(run_dir.events), {"kind": "adapter"})
    assert f"| reward matches_format | {base['eval_rewards/matches_format/mean']:.4g} |" in card


def test_a_grpo_run_without_held_out_prompts_is_told_which_field_to_set(tmp_path, capsys):
    config = grpo_demo_config().replace(data={"eval_files": ()}, training={"max_steps": 1})
    code, run_dir = run(config, tmp_path / "run", watch_stdin=False)
    assert code == EXIT_OK
    assert main(["eval", str(run_dir.path)]) == EXIT_USAGE
    said = capsys.readouterr().err
    assert "error: the run has no held-out prompts to evaluate on" in said
    assert "data.eval_files" in said and "data.eval_fraction" in said and "Traceback" not in said
    assert read_evaluation(run_dir.path) is None


def test_the_reward_file_scores_the_evaluation_only_while_the_config_trusts_it(tmp_path, capsys):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def reward(completion, prompt, row):\n    return len(completion.split()) / 10\n")
    _, run_dir = _trained(tmp_path, reward_file=str(reward_file), trust_reward_code=True)
    assert main(["eval", str(run_dir.path)]) == EXIT_OK
    printed = capsys.readouterr().out
    tuned = read_evaluation(run_dir.path)["summary"]["tuned"]
    assert tuned["reward_functions"] == ["matches_format", "reward_file"] and "reward reward_file" in printed
    assert tuned["full_reward"] is None and "every reward" not in printed  # a file's best reward is unknown
    saved = yaml.safe_load((run_dir.config).read_text())
    run_dir.config.write_text(yaml.safe_dump({**saved, "grpo": {**saved["grpo"], "trust_reward_code": False}}))
    assert main(["eval", str(run_dir.path)]) == EXIT_USAGE
    assert "grpo.trust_reward_code" in capsys.readouterr().err
    assert json.loads((run_dir.path / "evaluation.json").read_text())["summary"]["tuned"] == tuned  # kept
