"""`studio eval`: the base and the fine-tuned model side by side on held-out rows, and where the result goes."""

import json

import pytest
import torch

from conftest import first_lines
from studio.cli import main
from studio.core.errors import ProblemsError, StudioError
from studio.core.export.model_card import model_card
from studio.core.presets import DEMO_HELDOUT, DEMO_TRAIN, demo_config, train_files_changes
from studio.core.run.evaluation import answer_scores, read_evaluation
from studio.core.run.events import read_events
from studio.core.validation import validate
from studio.train.data.prepare import encode, prepare_data, render_segments
from studio.train.evaluation.benchmarks import benchmark_run
from studio.train.evaluation.compare import evaluate_run, held_out_examples
from studio.train.evaluation.samples import Sampler, why_no_samples
from studio.train.model.build import load_base_model, load_tokenizer
from studio.train.worker import run


def test_answers_are_scored_on_words_not_on_case_or_punctuation():
    assert answer_scores("A kind of fruit.", "a kind of fruit") == {"exact_match": 1.0, "contains": 1.0, "f1": 1.0}
    assert answer_scores("it is a kind of fruit , sweet", "a kind of fruit")["contains"] == 1.0
    partial = answer_scores("a kind of color", "a kind of fruit")
    assert partial["exact_match"] == partial["contains"] == 0.0 and partial["f1"] == pytest.approx(0.75)
    assert answer_scores("", "a kind of fruit")["f1"] == 0.0


def test_a_reasoning_models_answer_is_scored_after_its_reasoning():
    reasoned = "<think>\nA plum grows on a tree, so it is a kind of fruit.\n</think>\n\nA kind of fruit."
    assert answer_scores(reasoned, "a kind of fruit")["exact_match"] == 1.0
    assert answer_scores("<think>\nA plum grows on a tree, so", "a kind of fruit")["contains"] == 0.0  # cut short
    assert answer_scores("a kind of fruit", "<think>why</think>a kind of fruit")["exact_match"] == 1.0


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo task trained briefly, with 16 held-out questions it never saw."""
    held_out = first_lines(DEMO_HELDOUT, 16, tmp_path_factory.mktemp("data") / "held_out.jsonl")
    config = demo_config().replace(data={"eval_files": (str(held_out),)}, training={"max_steps": 40},
                                   schedule={"save_every": 0, "sample_every": 15})
    code, run_dir = run(config, tmp_path_factory.mktemp("demo") / "run", watch_stdin=False)
    assert code == 0
    return config, run_dir


@pytest.mark.slow
def test_the_tuned_model_beats_its_base_on_the_held_out_questions(demo_run, capsys):
    config, run_dir = demo_run
    assert main(["eval", str(run_dir.path)]) == 0
    printed = capsys.readouterr().out
    assert "exact match" in printed and "fine-tuned" in printed
    result = read_evaluation(run_dir.path)
    base, tuned = result["summary"]["base"], result["summary"]["tuned"]
    assert tuned["rows"] == base["rows"] == 16 and tuned["answered"] == 16
    assert tuned["loss"] < base["loss"] and tuned["perplexity"] < base["perplexity"]
    assert base["exact_match"] <= 0.25 and tuned["exact_match"] >= 0.75  # the demo's base has never been asked
    scores = [row["tuned"]["f1"] for row in result["rows"]]
    assert scores == sorted(scores)  # the weakest rows first, to browse
    row = result["rows"][0]
    assert row["location"].startswith("held_out.jsonl:") and row["reference"].startswith("a kind of")
    assert {"answer", "loss_sum"} <= set(row["base"]) and row["base"]["answer"] != row["tuned"]["answer"]
    # the summary goes to the run's events, and from there into an export's model card
    events = read_events(run_dir.events)
    assert [e for e in events if e["type"] == "evaluation"][-1]["tuned"] == tuned
    card = model_card(config, events, {"kind": "adapter"})
    assert "## Evaluation" in card and f"| exact match | {base['exact_match']:.1%} | {tuned['exact_match']:.1%} |" in card


@pytest.mark.slow
def test_other_files_can_be_named_and_their_bad_rows_are_named_by_line(demo_run, tmp_path):
    config, run_dir = demo_run
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"instruction": "What kind of thing is a fig?", "output": "a kind of fruit"}\n{"instruction": \n')
    before = read_evaluation(run_dir.path)
    with pytest.raises(ProblemsError, match=r"mine\.jsonl:2"):
        evaluate_run(run_dir.path, [str(bad)])
    assert read_evaluation(run_dir.path) == before  # an earlier result is kept
    good = first_lines(bad, 1, tmp_path / "good.jsonl")
    result = evaluate_run(run_dir.path, [str(good)], max_new_tokens=8)
    assert result["data"] == [str(good)] and result["rows"][0]["location"] == "good.jsonl:1"


@pytest.mark.slow
def test_while_training_the_sample_answers_change_from_the_base_s_to_the_reference(demo_run):
    _, run_dir = demo_run
    samples = [e for e in read_events(run_dir.events) if e["type"] == "samples"]
    assert [e["step"] for e in samples] == [0, 15, 30, 40]  # the base, every 15 steps, the end
    first, last = samples[0]["samples"], samples[-1]["samples"]
    assert len(first) == 3 and [s["prompt"] for s in first] == [s["prompt"] for s in last]
    assert all(s["reference"].startswith("a kind of") and s["location"].startswith("held_out.jsonl:") for s in last)
    assert sum(s["answer"] == s["reference"] for s in first) == 0  # the base was never asked
    assert sum(s["answer"] == s["reference"] for s in last) >= 2


def test_a_run_without_prompts_or_with_sharded_weights_trains_and_says_why_it_has_no_samples():
    config = demo_config().replace(data={"eval_files": ()}, schedule={"sample_every": 10})
    assert validate(config) == []  # it can finish: samples are not worth refusing a run for
    assert "no sample prompts and no held-out rows" in why_no_samples(config)[0]
    assert why_no_samples(config.replace(data={"sample_prompts": ("What kind of thing is a fig?",)})) is None
    sharded = demo_config().replace(distributed={"num_processes": 2, "sharding": "zero3"})
    assert "shards the weights" in why_no_samples(sharded)[0] and "studio eval" in why_no_samples(sharded)[1]


def test_the_user_s_own_sample_prompts_are_asked_as_the_rows_ask():
    config = demo_config().replace(data={"sample_prompts": ("What kind of thing is a fig?", "What is a teal?")},
                                   schedule={"sample_every": 10})
    tokenizer = load_tokenizer(config)
    found = Sampler(config, tokenizer).samples(load_base_model(config, torch.device("cpu")))
    assert [s["prompt"] for s in found["samples"]] == list(config.data.sample_prompts)
    assert all(s["reference"] is None and s["answer"] for s in found["samples"]) and found["seconds"] >= 0


def test_a_run_without_held_out_rows_says_where_to_get_them():
    with pytest.raises(StudioError, match="no held-out rows") as caught:
        held_out_examples(demo_config().replace(data={"eval_files": ()}))
    assert "--data" in caught.value.hint and "data.eval_fraction" in caught.value.hint


def test_the_rows_held_out_by_a_fraction_are_the_ones_training_left_out(small_data):
    config = demo_config().replace(data={"train_files": (str(small_data),), "eval_files": (), "eval_fraction": 0.25})
    rows, source = held_out_examples(config)
    assert len(rows) == 8 and "held out" in source[0]
    tokenizer = load_tokenizer(config)
    ours = [encode(render_segments(row, tokenizer, "auto"), tokenizer, config.data.max_length)["input_ids"]
            for row in rows]
    assert ours == list(prepare_data(config, tokenizer).eval["input_ids"])


def test_the_demo_s_held_out_questions_go_with_its_data(small_data):
    demo = demo_config()
    assert demo.data.eval_files == (str(DEMO_HELDOUT),) and validate(demo) == []
    own = demo.replace(data=train_files_changes(demo, (str(small_data),)))
    assert own.data.eval_files == () and own.data.train_files == (str(small_data),)
    assert own.replace(data=train_files_changes(own, (str(DEMO_TRAIN),))).data.eval_files == (str(DEMO_HELDOUT),)
    mine = own.replace(data={"eval_fraction": 0.1})
    assert train_files_changes(mine, (str(DEMO_TRAIN),)) == {"train_files": (str(DEMO_TRAIN),)}  # the user's choice


TASK_YAML = """task: demo_categories
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{instruction}}}}"
doc_to_choice: {choices}
doc_to_target: "{{{{output}}}}"
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_a_harness_task_over_local_files_compares_base_and_tuned_and_a_missing_dataset_is_named(demo_run, tmp_path,
                                                                                                 capsys):
    _, run_dir = demo_run
    held_out = first_lines(DEMO_HELDOUT, 24, tmp_path / "held.jsonl")
    choices = sorted({json.loads(line)["output"] for line in DEMO_HELDOUT.read_text().splitlines()})
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "demo_categories.yaml").write_text(TASK_YAML.format(data=held_out, choices=json.dumps(choices)))
    assert main(["eval", str(run_dir.path), "--tasks", "demo_categories", "--include-path", str(tasks)]) == 0
    assert "benchmarks: 2/2 [####################]" in capsys.readouterr().err  # the base model scored too
    result = json.loads((run_dir.path / "benchmarks.json").read_text())
    scores = result["tasks"]["demo_categories"]
    assert scores["tuned"]["acc"] > scores["base"]["acc"] and scores["tuned"]["acc"] >= 0.9
    assert result["chat_template"]  # an instruction run is asked as it trained
    events = read_events(run_dir.events)
    card = model_card(demo_run[0], events, {"kind": "adapter"})
    assert f"| demo_categories | acc | {scores['base']['acc']:.4g} | {scores['tuned']['acc']:.4g} |" in card
    with pytest.raises(StudioError, match="no task no_such_task"):
        benchmark_run(run_dir.path, ["no_such_task"])
    with pytest.raises(StudioError, match="task arc_easy: allenai/ai2_arc is not in the Hugging Face cache") as caught:
        benchmark_run(run_dir.path, ["arc_easy"], limit=2)  # the tests run with the Hub switched off
    assert "hf download allenai/ai2_arc --repo-type dataset" in caught.value.hint


def test_the_estimate_says_what_the_samples_keys_and_values_take():
    from studio.core.memory.estimate import estimate
    from studio.core.model.info import load_model_config, model_shape
    from studio.core.sizes import format_bytes

    config = demo_config()  # fp32, 3 held-out questions, max_length 64, 64 new tokens
    shape = model_shape(load_model_config(config.model.name_or_path))
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * 3 * (64 + 64) * 4
    notes = estimate(load_model_config(config.model.name_or_path), config, "cpu").notes
    assert any(f"3 prompts answered between steps, their KV cache at most {format_bytes(cache)}" in n for n in notes)
    quiet = config.replace(schedule={"sample_every": 0})
    assert not any("samples" in n for n in estimate(load_model_config(config.model.name_or_path), quiet, "cpu").notes)
