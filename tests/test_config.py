"""The run config: YAML round trip, every problem reported with its field and line, the reference doc."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import yaml

from studio.core.choices import CHOICE_WORDS, choice_label
from studio.core.config import RewardConfig, RunConfig, choice_values, load_config, parse_config, reference_markdown, save_config
from studio.core.errors import ProblemsError
from studio.core.memory.savers import savers_reference
from studio.core.presets import demo_config
from studio.core.validation import validate

ROOT = Path(__file__).resolve().parents[1]


def test_yaml_round_trip_keeps_every_field(tmp_path):
    config = demo_config().replace(lora={"target_modules": ("q_proj", "v_proj")}, training={"learning_rate": 3e-5})
    save_config(config, tmp_path / "run.yaml")
    assert load_config(tmp_path / "run.yaml") == config


def test_relative_data_paths_are_read_from_the_config_folder(tmp_path):
    (tmp_path / "data.jsonl").write_text('{"text": "hi"}\n')
    (tmp_path / "run.yaml").write_text("model: {name_or_path: some/model}\ndata: {train_files: [data.jsonl]}\n")
    config = load_config(tmp_path / "run.yaml")
    assert config.data.train_files == (str(tmp_path / "data.jsonl"),)
    assert config.model.name_or_path == "some/model"  # a Hub id stays a Hub id


def test_every_problem_is_reported_at_once_with_field_and_line():
    text = "model:\n  name_or_path: m\n  dtype: bf16\ntraining:\n  micro_batch: 3\n  optimizer: adam\n  epochs: many\n"
    with pytest.raises(ProblemsError) as caught:
        parse_config(text, "my.yaml")
    message = str(caught.value)
    assert len(caught.value.problems) == 4
    assert "model.dtype (my.yaml:3)" in message and "did you mean 'bfloat16'" in message
    assert "training.micro_batch (my.yaml:5): unknown field" in message and "training.micro_batch_size" in message
    assert "training.optimizer (my.yaml:6)" in message and "'adamw'" in message
    assert "training.epochs (my.yaml:7): expected a number" in message


def test_broken_yaml_names_the_line():
    with pytest.raises(ProblemsError) as caught:
        parse_config("model:\n  name_or_path: [unclosed\n", "bad.yaml")
    assert "bad.yaml:" in str(caught.value) and "not valid YAML" in str(caught.value)


def test_a_newer_schema_is_refused_with_a_hint():
    with pytest.raises(ProblemsError, match="newer Finetune Studio"):
        parse_config("schema_version: 99\n")


def test_scientific_learning_rate_without_a_dot_is_a_number():
    assert parse_config("training: {learning_rate: 2e-4}").training.learning_rate == 2e-4


def test_validation_collects_value_and_combination_problems(tmp_path):
    config = RunConfig().replace(
        method="full", quantization={"load_in": "4bit"},
        data={"train_files": (str(tmp_path / "missing.jsonl"), "notes.docx"), "max_length": 2},
        training={"micro_batch_size": 0, "learning_rate": -1.0},
    )
    where = {p.where for p in validate(config)}
    assert {"model.name_or_path", "data.train_files[0]", "data.train_files[1]", "data.max_length",
            "quantization.load_in", "training.micro_batch_size", "training.learning_rate"} <= where


def test_preference_settings_are_checked_for_their_objective():
    def problems(**sections):
        return {p.where: p.message for p in validate(demo_config().replace(**sections), check_files=False)}

    kto = problems(objective="kto", data={"format": "preference"},
                   preference={"desirable_weight": 0.0, "sft_weight": 0.5, "label_smoothing": 0.1})
    assert kto["data.format"] == "objective kto learns from unpaired_preference rows"
    assert {"preference.desirable_weight", "preference.sft_weight", "preference.label_smoothing"} <= kto.keys()
    assert "preference.undesirable_weight" not in kto
    dpo = problems(objective="dpo", preference={"undesirable_weight": 2.0})
    assert dpo == {"preference.undesirable_weight": "objective dpo does not weigh rows by their label"}
    assert problems(objective="sft", data={"format": "unpaired_preference"})["data.format"] == \
        "unpaired_preference rows are for the preference objectives"
    assert problems(objective="kto") == {}
    assert demo_config().replace(objective="kto").row_format == "unpaired_preference"


def test_qlora_defaults_to_a_4bit_base():
    assert RunConfig(method="qlora").effective_load_in == "4bit"
    assert RunConfig(method="lora").effective_load_in == "none"


def test_demo_config_is_valid():
    assert validate(demo_config()) == []


def test_reference_doc_is_generated_from_the_schema():
    assert (ROOT / "docs" / "config.md").read_text() == reference_markdown() + savers_reference(), \
        "regenerate: studio config reference > docs/config.md"


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=4),
                    max_leaves=12))
def test_loader_never_crashes_on_arbitrary_yaml(data):
    """Any YAML document either loads or raises ProblemsError: never a raw exception."""
    try:
        config = parse_config(yaml.safe_dump(data))
    except ProblemsError:
        return
    assert isinstance(config, RunConfig)



def test_every_choice_field_has_words_for_exactly_its_values():
    """The words users read for a choice (studio.core.choices) cover the schema's values, no more, no less."""
    for path, words in CHOICE_WORDS.items():
        assert list(words) == list(choice_values(path)), path
    assert choice_label("distributed.sharding", "zero3") == "ZeRO-3"


def test_trackers_are_a_list_of_choices_each_named_when_wrong():
    assert parse_config("schedule: {trackers: [wandb, mlflow]}").schedule.trackers == ("wandb", "mlflow")
    assert parse_config("schedule: {trackers: trackio}").schedule.trackers == ("trackio",)
    with pytest.raises(ProblemsError) as caught:
        parse_config("schedule:\n  trackers: [wandb, mlfow]\n", "my.yaml")
    assert "schedule.trackers[1]" in str(caught.value) and "did you mean 'mlflow'" in str(caught.value)
    assert choice_values("schedule.trackers") == ("trackio", "wandb", "mlflow")


def test_validation_names_a_tracker_listed_twice_and_a_project_no_tracker_takes():
    config = demo_config().replace(schedule={"trackers": ("wandb", "wandb"), "tracker_project": "team/project"})
    problems = {p.where: p.message for p in validate(config)}
    assert "wandb is listed twice" in problems["schedule.trackers"]
    assert "team/project" in problems["schedule.tracker_project"]
    assert validate(demo_config().replace(schedule={"tracker_project": ""})) == []  # no tracker: no project needed


def test_grpo_settings_and_rewards_are_checked_each_by_its_field():
    def problems(**grpo):  # the demo's data.max_length 64 leaves room for a prompt beside 32 tokens of completion
        config = demo_config().replace(objective="grpo", grpo={"max_completion_length": 32, **grpo})
        return {p.where: p.message for p in validate(config, check_files=False)}

    assert problems() == {}
    assert demo_config().replace(objective="grpo").row_format == "prompt_only"
    found = problems(group_size=1, top_p=0.0, epsilon=-0.1, reward_file="mine.py",
                     rewards=(RewardConfig("matches_format", pattern="(", text="x"),
                              RewardConfig("length_within", min_length=50, max_length=10), RewardConfig("contains")))
    assert {"grpo.group_size", "grpo.top_p", "grpo.epsilon", "grpo.rewards[0].pattern", "grpo.rewards[0].text",
            "grpo.rewards[1].max_length", "grpo.rewards[2].text"} <= found.keys()
    assert found["grpo.rewards[0].text"] == "matches_format does not read text"
    assert "runs only when you trust it" in found["grpo.trust_reward_code"]
    assert problems(rewards=()) == {"grpo.rewards": "no reward scores the completions"}
    sft = {p.where: p.message for p in validate(demo_config().replace(data={"format": "prompt_only"}),
                                                check_files=False)}
    assert sft == {"data.format": "prompt_only rows are for grpo, which writes their completions"}


def test_grpo_rewards_are_a_readable_list_in_yaml_each_named_when_wrong(tmp_path):
    config = demo_config().replace(objective="grpo", grpo={"rewards": (
        RewardConfig("equals_reference"), RewardConfig("matches_format", weight=0.5, pattern="<think>.*</think>.*"))})
    save_config(config, tmp_path / "run.yaml")
    text = (tmp_path / "run.yaml").read_text()
    assert "- name: matches_format\n    weight: 0.5\n    pattern: <think>.*</think>.*\n  reward_file:" in text
    assert load_config(tmp_path / "run.yaml") == config
    with pytest.raises(ProblemsError) as caught:
        parse_config("grpo:\n  rewards:\n  - {name: contain, weight: x}\n  - 3\n")
    assert {p.where for p in caught.value.problems} == {"grpo.rewards[0].name", "grpo.rewards[0].weight",
                                                        "grpo.rewards[1]"}
    assert choice_values("grpo.rewards.name")[0] == "equals_reference"
