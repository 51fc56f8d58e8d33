"""GRPO's rewards: each built-in on completions a model writes, their weighted sum, and the user's reward file (run
only when trusted; an exception in it names the file, the line and the row, and ends nothing else)."""

import pytest

from studio.core.config import GrpoConfig, RewardConfig
from studio.core.data.row_formats import DataError, to_messages
from studio.core.errors import ProblemsError
from studio.core.rewards import RewardFile, Rewards, contains, equals_reference, length_within, matches_format

GSM8K_ROW = {"prompt": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                       "May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"}
MATH_ROW = {"prompt": "Simplify $\\sqrt{16}+\\frac{1}{2}$.", "solution": "It is $4+\\frac12=\\boxed{\\frac{9}{2}}$."}


@pytest.mark.parametrize("completion, row, expected", [
    ("She sold 48 + 24 = 72 clips in total. The answer is 72.", GSM8K_ROW, 1.0),
    ("48 / 2 = 24, so 48 + 24 = 96.", GSM8K_ROW, 0.0),
    ("The answer is 1,234.0", {"prompt": "q", "answer": "1234"}, 1.0),
    ("Total: $1,234", {"prompt": "q", "answer": 1234}, 1.0),
    ("so x = -0.5.", {"prompt": "q", "reference": "-.5"}, 1.0),
    ("<think>4 + 1/2</think> The result is \\boxed{\\frac{9}{2}} (that is 4.5)", MATH_ROW, 1.0),
    ("\\boxed{\\frac{7}{2}}", MATH_ROW, 0.0),
    ("The capital is \\boxed{ Paris }.", {"prompt": "q", "answer": "paris"}, 1.0),
])
def test_equals_reference_extracts_the_answer_of_each_side(completion, row, expected):
    assert equals_reference(completion, row, RewardConfig("equals_reference")) == expected


def test_equals_reference_gives_no_reward_without_a_reference():
    assert equals_reference("72", {"prompt": "q"}, RewardConfig("equals_reference")) is None


def test_format_length_and_contains():
    think = RewardConfig("matches_format", pattern=r"<think>.*?</think>\s*<answer>.*?</answer>")
    assert matches_format("<think>\n48/2 = 24\n</think>\n<answer>72</answer>\n", {}, think) == 1.0
    assert matches_format("<answer>72</answer>", {}, think) == 0.0
    assert matches_format("Sure! <think>x</think><answer>72</answer>", {}, think) == 0.0  # a full match
    words = RewardConfig("length_within", min_length=3, max_length=6, unit="words")
    assert [length_within(text, {}, words) for text in ("72", "The answer is 72.", "a b c d e f g")] == [0, 1, 0]
    characters = RewardConfig("length_within", max_length=10)
    assert length_within("short", {}, characters) == 1.0 and length_within("x" * 11, {}, characters) == 0.0
    assert contains("The answer is 72.", {}, RewardConfig("contains", text="answer is")) == 1.0
    assert contains("THE ANSWER IS 72", {}, RewardConfig("contains", text="answer is")) == 0.0
    assert contains("THE ANSWER IS 72", {}, RewardConfig("contains", text="answer is", case_sensitive=False)) == 1.0


def test_the_weighted_sum_keeps_each_function_score():
    grpo = GrpoConfig(rewards=(RewardConfig("equals_reference", weight=2.0),
                               RewardConfig("contains", weight=0.5, text="####"),
                               RewardConfig("contains", weight=0.25, text="72")))
    rewards = Rewards(grpo)
    scores = rewards.score("so 48 + 24 = 72\n#### 72", GSM8K_ROW, 0)
    assert rewards.names == ("equals_reference", "contains_1", "contains_2")
    assert scores.by_function == {"equals_reference": 1.0, "contains_1": 1.0, "contains_2": 1.0}
    assert scores.total == pytest.approx(2.75)
    unjudged = rewards.score("no idea", {"prompt": "q"}, 1)  # no reference: equals_reference gives nothing
    assert unjudged.by_function["equals_reference"] is None and unjudged.total == 0.0



def test_every_reward_is_the_best_each_judging_built_in_gives_a_penalty_best_at_zero():
    grpo = GrpoConfig(rewards=(RewardConfig("equals_reference"), RewardConfig("contains", weight=-1.0, text="sorry")))
    rewards = Rewards(grpo)
    assert rewards.got_everything(rewards.score("#### 72", GSM8K_ROW, 0))
    assert not rewards.got_everything(rewards.score("sorry, 72", GSM8K_ROW, 0))  # the penalty gave it -1
    assert not rewards.got_everything(rewards.score("#### 71", GSM8K_ROW, 0))
    assert rewards.got_everything(rewards.score("no idea", {"prompt": "q"}, 1))  # no reference: the penalty alone
    judged_by_none = Rewards(GrpoConfig(rewards=(RewardConfig("equals_reference"),)))
    assert not judged_by_none.got_everything(judged_by_none.score("no idea", {"prompt": "q"}, 1))

USER_FILE = '''import re


def reward(completion, prompt, row):
    """1 per step of reasoning the completion numbers, at most 3."""
    if row.get("answer") == "boom":
        raise ValueError("this row has no steps")
    return min(3, len(re.findall(r"^Step \\d", completion, re.M)))
'''


def test_a_trusted_reward_file_scores_each_completion(tmp_path):
    (tmp_path / "steps.py").write_text(USER_FILE)
    grpo = GrpoConfig(rewards=(), reward_file=str(tmp_path / "steps.py"), trust_reward_code=True, reward_file_weight=0.5)
    rewards = Rewards.for_run(grpo)
    scores = rewards.score("Step 1: 48/2 = 24\nStep 2: 48 + 24 = 72", GSM8K_ROW, 0)
    assert scores.by_function == {"reward_file": 2.0} and scores.total == 1.0 and scores.failure is None


def test_an_exception_in_the_reward_file_names_file_line_and_row_and_ends_nothing_else(tmp_path):
    path = tmp_path / "steps.py"
    path.write_text(USER_FILE)
    grpo = GrpoConfig(rewards=(RewardConfig("contains", text="Step"),), reward_file=str(path), trust_reward_code=True)
    rewards = Rewards.for_run(grpo)
    rows = [GSM8K_ROW, {"prompt": "q", "answer": "boom"}, GSM8K_ROW]
    scores = [rewards.score("Step 1: 72", row, index) for index, row in enumerate(rows)]
    assert [s.total for s in scores] == [2.0, 1.0, 2.0]  # the failing row keeps its built-in's score
    failure = scores[1].failure
    assert scores[1].by_function["reward_file"] is None and failure.row == 1 and failure.line == 7
    assert str(failure) == (f"{path}, line 7: ValueError: this row has no steps on row 1; that completion gets no "
                            "reward from the file")
    assert scores[0].failure is None and scores[2].failure is None


def test_a_reward_file_runs_only_when_trusted_and_a_broken_one_is_named(tmp_path):
    (tmp_path / "steps.py").write_text(USER_FILE)
    with pytest.raises(ProblemsError) as caught:
        RewardFile.load(GrpoConfig(reward_file=str(tmp_path / "steps.py")))
    assert caught.value.problems[0].where == "grpo.trust_reward_code"
    (tmp_path / "broken.py").write_text("import re\n\nx = 1 / 0\n")
    with pytest.raises(ProblemsError) as caught:
        RewardFile.load(GrpoConfig(reward_file=str(tmp_path / "broken.py"), trust_reward_code=True))
    assert caught.value.problems[0].where == f"{tmp_path / 'broken.py'}:3"
    (tmp_path / "empty.py").write_text("def score(completion):\n    return 1\n")
    with pytest.raises(ProblemsError, match="defines no function reward"):
        RewardFile.load(GrpoConfig(reward_file=str(tmp_path / "empty.py"), trust_reward_code=True))


def test_prompt_only_rows_with_their_reference_and_their_problems_by_field():
    assert to_messages(GSM8K_ROW, "prompt_only", "math.jsonl:1").reference == GSM8K_ROW["answer"]
    turns = to_messages({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
                         "solution": 4}, "prompt_only", "math.jsonl:2")
    assert turns.messages[-1] == {"role": "user", "content": "2+2?"} and turns.reference == "4"
    for row, message in [({"answer": "1"}, "math.jsonl:3: field 'prompt' is missing"),
                         ({"prompt": "q", "reference": [1]}, "field 'reference' must be text or a number"),
                         ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                          "field 'prompt' ends with an assistant turn")]:
        with pytest.raises(DataError, match=message):
            to_messages(row, "prompt_only", "math.jsonl:3")
