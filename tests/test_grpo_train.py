"""``studio train`` with objective grpo: the model samples groups of completions with its training weights, the
rewards score them and the reward rises, held out too; TRL's metrics and the completions are in the events; a stopped
run resumes exactly, also mid-way through a generation batch trained on twice; the user's reward file failing on a
row costs that row alone, with a warning naming the file, the line and the row; prompts without room for a
completion are left out by name."""

import itertools
import json
import re

import pytest

from test_preference_train import _steps_and_weights
from studio.core.config import RewardConfig
from studio.core.errors import StudioError
from studio.core.presets import DEMO_FORMAT, grpo_demo_config
from studio.core.run.commands import EXIT_OK
from studio.core.run.events import read_events
from studio.core.validation import validate
from studio.train.control import StopController
from studio.train.worker import run


def _events(config, run_dir):
    code, rd = run(config, run_dir, watch_stdin=False)
    assert code == EXIT_OK
    return list(read_events(rd.events))


def test_the_reward_rises_and_the_held_out_prompts_learn_the_format(tmp_path):
    events = _events(grpo_demo_config(), tmp_path / "run")  # 30 steps
    steps = [e for e in events if e["type"] == "step"]
    rewards = [step["reward"] for step in steps]
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.3  # the reward rises
    assert steps[0]["rewards/matches_format/mean"] == steps[0]["reward"]  # one function: the total is its score
    assert all(0 < step["completions/mean_length"] <= 12 and "clip_ratio/region_mean" in step for step in steps)
    assert "kl" not in steps[0]  # beta 0: no reference
    evals = [e for e in events if e["type"] == "eval"]
    before, after = evals[0], evals[-1]
    assert [e["step"] for e in evals] == [0, 10, 20, 30]
    assert before["step"] == 0 and before["eval_reward"] < 0.2 and after["eval_reward"] > 0.8
    completions = [e for e in events if e["type"] == "completions"]
    assert len(completions) == 30
    group = completions[-1]["groups"][0]
    assert group["location"].startswith("grpo_train.jsonl:") and group["prompt"].endswith(" is a")
    assert len(group["completions"]) == 8
    for completion in group["completions"]:  # each completion's reward is its format, as the rewards score it
        assert completion["reward"] == float(bool(re.fullmatch(DEMO_FORMAT, completion["text"].strip())))


@pytest.mark.heavy  # minutes of GRPO; test_faults covers exact resume
def test_a_stopped_grpo_run_resumes_exactly_mid_generation_batch(tmp_path, monkeypatch):
    """Two iterations per generation batch with a KL term, stopped after step 3 (the second generation batch half
    trained on): the resumed run trains on the kept completions, samples the next ones alike, and ends with the same
    losses, metrics and weights."""
    config = grpo_demo_config().replace(
        training={"max_steps": 6}, lora={"dropout": 0.1}, schedule={"eval_every": 0},
        grpo={"num_iterations": 2, "beta": 0.1, "loss_type": "grpo"})
    whole, _ = _steps_and_weights(config, tmp_path / "whole", resume=False)
    assert whole[0][2]["clip_ratio/region_mean"] >= 0 and "kl" in whole[0][2]
    stops = itertools.chain([False, False, True], itertools.repeat(False))
    monkeypatch.setattr(StopController, "stop_requested", property(lambda self: next(stops)))
    code, run_dir = run(config, tmp_path / "stopped", watch_stdin=False)
    assert code == EXIT_OK and (run_dir.latest_checkpoint() / "rank-state-0.pt").is_file()
    resumed, _ = _steps_and_weights(None, run_dir.path, resume=True)
    for step, logged in whole[0].items():
        timed = {"generation_s"}
        assert {k: v for k, v in resumed[0][step].items() if k not in timed} == pytest.approx(
            {k: v for k, v in logged.items() if k not in timed}, rel=1e-5, abs=1e-6), step
    for name, tensor in whole[1].items():
        assert resumed[1][name].equal(tensor), name


def test_a_reward_file_that_fails_on_a_row_costs_that_row_alone(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def reward(completion, prompt, row):\n"
                           "    if row['answer'] == 'fruit':\n"
                           "        raise ValueError('no fruit here')\n"
                           "    return float('kind of' in completion)\n")
    config = grpo_demo_config().replace(
        training={"max_steps": 6}, schedule={"eval_every": 0},
        grpo={"rewards": (RewardConfig(name="length_within", max_length=40),), "reward_file": str(reward_file),
              "trust_reward_code": True})
    events = _events(config, tmp_path / "run")
    assert [e["type"] for e in events][-1] == "finished"
    warnings = [e["message"] for e in events if e["type"] == "warning" and "my_reward.py" in e["message"]]
    assert len(warnings) == 1  # said once for its line; train.log has every one
    assert "my_reward.py, line 3: ValueError: no fruit here on grpo_train.jsonl:" in warnings[0]
    steps = [e for e in events if e["type"] == "step"]
    assert all(step["rewards/length_within/mean"] == 1.0 for step in steps)  # the built-in scored every row
    assert all(0 <= step["rewards/reward_file/mean"] <= 1 for step in steps)


def test_an_untrusted_reward_file_is_refused_before_any_work(tmp_path):
    reward_file = tmp_path / "my_reward.py"
    reward_file.write_text("def reward(completion, prompt, row):\n    return 1.0\n")
    config = grpo_demo_config().replace(grpo={"reward_file": str(reward_file)})
    with pytest.raises(StudioError, match="grpo.trust_reward_code"):
        run(config, tmp_path / "run", watch_stdin=False)
    assert not (tmp_path / "run" / "events.jsonl").exists()


def test_a_step_of_part_groups_and_a_prompt_without_room_are_refused_by_name(tmp_path):
    part = grpo_demo_config().replace(training={"micro_batch_size": 4, "gradient_accumulation_steps": 1})
    [problem] = [p for p in validate(part, check_files=False) if p.where == "training.gradient_accumulation_steps"]
    assert "4 completions a step, not a whole number of grpo.group_size 8 groups" in problem.message
    assert "gradient_accumulation_steps 2" in problem.hint
    no_room = grpo_demo_config().replace(data={"max_length": 12})
    assert any(p.where == "grpo.max_completion_length" for p in validate(no_room, check_files=False))

    prompts = tmp_path / "prompts.jsonl"
    rows = [json.dumps({"prompt": "a plum is a " * 20, "answer": "fruit"})]
    rows += [json.dumps({"prompt": "a pear is a", "answer": "fruit"})] * 16
    prompts.write_text("\n".join(rows) + "\n")
    config = grpo_demo_config().replace(data={"train_files": (str(prompts),), "eval_files": ()},
                                        training={"max_steps": 1})
    events = _events(config, tmp_path / "run")
    [warning] = [e for e in events if e["type"] == "warning" and "left out" in e["message"]]
    assert warning["message"].startswith("1 of 17 training rows are left out: their prompt is longer than the 52 "
                                         "tokens data.max_length 64 leaves beside grpo.max_completion_length 12")
    assert "prompts.jsonl:1:" in warning["message"]


def test_vllm_sampling_is_refused_in_words_where_it_cannot_run(tmp_path, monkeypatch):
    """vLLM is optional and CUDA only: absent, or without an NVIDIA GPU, the run stops before the model loads; it
    loads a plain LoRA adapter in one process, which validation says."""
    import importlib.util

    from studio.core.validation import machine_problems
    from studio.train.objectives import vllm_sampling

    config = grpo_demo_config().replace(grpo={"generation_backend": "vllm"})
    assert not validate(config)
    assert [p.where for p in machine_problems(config, nvidia_gpu=False)] == ["grpo.generation_backend"]
    refused = {"dora": config.replace(lora={"use_dora": True}),
               "two processes": config.replace(distributed={"num_processes": 2}),
               "all of the GPU": config.replace(grpo={"vllm_memory_fraction": 1.0})}
    assert all(validate(refused_config) for refused_config in refused.values())

    code, rd = run(config, tmp_path / "run", watch_stdin=False)
    error = next(e for e in read_events(rd.events) if e["type"] == "error")
    absent = importlib.util.find_spec("vllm") is None
    assert code != EXIT_OK and ("vllm is not installed" if absent else "NVIDIA GPU only") in error["message"]
    assert "grpo.generation_backend to hf" in error["hint"]
    assert not any(e["type"] == "run_started" for e in read_events(rd.events))  # the model never loaded
    monkeypatch.setattr(vllm_sampling.importlib.util, "find_spec", lambda name: object())  # installed, no GPU
    with pytest.raises(StudioError, match="NVIDIA GPU only"):
        vllm_sampling.check_vllm_available(cuda=False)


def test_a_reward_no_completion_earns_is_said_to_teach_nothing(tmp_path):
    config = grpo_demo_config().replace(
        training={"max_steps": 10}, schedule={"eval_every": 0},
        grpo={"rewards": (RewardConfig(name="contains", text="a word the model never writes"),)})
    events = _events(config, tmp_path / "run")
    warnings = [e for e in events if e["type"] == "warning" and "learns nothing" in e["message"]]
    assert len(warnings) == 1 and warnings[0]["message"].startswith("steps 1 to 10: every completion of a group got "
                                                                    "the same reward (0 on average)")
    assert "easier to earn" in warnings[0]["hint"]
    assert all(step["frac_reward_zero_std"] == 1.0 for step in events if step["type"] == "step")
