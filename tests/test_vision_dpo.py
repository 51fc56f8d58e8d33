"""DPO with image prompts (issue 30): TRL's vision preference rows read and refused as chat rows with images are, a
short DPO run on the tiny Qwen2-VL learns the pairs, and the objectives that do not train on images refuse them
before any work. Equality with TRL's DPOTrainer on such rows: tests/test_preference_exact.py."""

import json

import pytest

from studio.core.data.dataset import inspect_files
from studio.core.data.row_formats import DataError
from studio.core.errors import ProblemsError
from studio.core.run.events import read_events
from test_vision import COLOURS, QUESTION, vision_config, write_rows


def image_pair(chosen="red", rejected="blue", prompt_content=None, **fields):
    return {"images": ["red.png"], **fields,
            "prompt": [{"role": "user", "content": prompt_content or [{"type": "image"}, QUESTION]}],
            "chosen": [{"role": "assistant", "content": [{"type": "text", "text": chosen}]}],
            "rejected": [{"role": "assistant", "content": [{"type": "text", "text": rejected}]}]}


def colour_pairs(folder, rows=8):
    """The colours dataset's chat rows as pairs: its answer chosen, another colour rejected (images by absolute
    path, from the dataset's folder)."""
    chats = [json.loads(line) for line in COLOURS.read_text(encoding="utf-8").splitlines()[:rows]]
    colours = sorted({chat["messages"][1]["content"][0]["text"] for chat in chats})
    pairs = []
    for chat in chats:
        answer = chat["messages"][1]["content"][0]["text"]
        wrong = colours[(colours.index(answer) + 1) % len(colours)]
        pairs.append({"images": [str(COLOURS.parent / image) for image in chat["images"]],
                      "prompt": chat["messages"][:1], "chosen": chat["messages"][1:],
                      "rejected": [{"role": "assistant", "content": [{"type": "text", "text": wrong}]}]})
    path = folder / "pairs.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in pairs), encoding="utf-8")
    return path


def test_image_pairs_read_with_their_files_in_the_prompt(tmp_path):
    example = inspect_files([write_rows(tmp_path, [image_pair()])], keep=1).examples[0]
    assert example.kind == "preference" and example.images == (str(tmp_path / "red.png"),)
    assert [part["type"] for part in example.messages[0]["content"]] == ["image", "text"]
    assert example.chosen[0]["content"] == "red" and example.chosen_row().images == example.images


@pytest.mark.parametrize("row, expected", [
    (image_pair(images=["missing.png"]), "rows.jsonl:2: image 0 (missing.png) does not exist"),
    (image_pair(prompt_content=[QUESTION]),
     "rows.jsonl:2: field 'images' lists 1 image(s), but the messages' image parts take 0"),
    ({**image_pair(), "chosen": [{"role": "assistant", "content": [{"type": "image", "path": "red.png"}]}]},
     "rows.jsonl:2: chosen[0].content[0] is an image in the assistant's turn"),
    ({"images": ["red.png"], "prompt": "What colour?", "chosen": "red", "rejected": "blue"},
     "rows.jsonl:2: field 'images' needs a conversational pair"),
])
def test_bad_image_pairs_are_refused_naming_the_row_and_the_field(tmp_path, row, expected):
    path = write_rows(tmp_path, [image_pair(), row])
    with pytest.raises(ProblemsError) as raised:
        inspect_files([path])
    assert str(raised.value).splitlines()[1].strip().startswith(f"- {expected}"), str(raised.value)


def test_unpaired_rows_with_images_are_refused_saying_what_trains_images(tmp_path):
    row = {"images": ["red.png"], "prompt": [{"role": "user", "content": [{"type": "image"}, QUESTION]}],
           "completion": [{"role": "assistant", "content": "red"}], "label": True}
    with pytest.raises(ProblemsError, match=r"rows.jsonl:1: unpaired_preference rows with images are not trained yet "
                       r"\(images train in chat rows \(supervised fine-tuning\) and preference pairs \(dpo, simpo\)"):
        inspect_files([write_rows(tmp_path, [row])])


def test_orpo_refuses_image_pairs_before_any_work(tmp_path):
    from studio.train import worker

    config = vision_config(colour_pairs(tmp_path), objective="orpo")
    code, run_dir = worker.run(config, tmp_path / "run", watch_stdin=False)
    events = read_events(run_dir.events)
    failed = [event for event in events if event["type"] == "error"]
    assert code != 0 and "objective orpo does not train on images yet" in failed[0]["message"]
    assert "set objective to dpo or simpo" in failed[0]["hint"]
    assert not any(event["type"] in ("step", "estimate") for event in events)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    from studio.train import worker

    folder = tmp_path_factory.mktemp("vision-dpo")
    pairs = colour_pairs(folder)
    config = vision_config(pairs, objective="dpo", preference={"beta": 0.5},
                           training={"micro_batch_size": 8, "max_steps": 8, "learning_rate": 5e-3,
                                     "warmup_ratio": 0.0, "lr_scheduler": "constant"})
    code, run_dir = worker.run(config, folder / "run", watch_stdin=False)
    assert code == 0
    return run_dir, pairs


def test_a_short_dpo_run_on_image_pairs_raises_the_margin(dpo_run):
    run_dir, _ = dpo_run
    events = read_events(run_dir.events)
    steps = [event for event in events if event["type"] == "step"]
    margins = [step["rewards/margins"] for step in steps]  # each step's: all 8 pairs, before its update
    assert len(steps) == 8 and margins[-1] > margins[0] + 0.3, margins
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.1
    estimate = next(event for event in events if event["type"] == "estimate")
    assert estimate["run_data"]["image_patches"] == 2 * 8 * 16  # each pair's 4x4 patches, in both its sequences


def test_studio_eval_ranks_the_image_pairs_with_their_images(dpo_run):
    from studio.train.evaluation.compare import evaluate_run

    run_dir, pairs = dpo_run
    rows = evaluate_run(run_dir.path, [str(pairs)], max_new_tokens=4)["rows"]
    assert len(rows) == 8 and all(row["prompt"] == "[image] What colour is this square?" for row in rows)
    assert sum(row["tuned"]["margin"] for row in rows) > sum(row["base"]["margin"] for row in rows) + 8 * 0.3 / 0.5


def test_a_pipeline_refuses_image_rows_before_any_work(tmp_path):
    """Its first stage starts from the token embeddings: the images would be dropped, the image tokens learned as
    text."""
    from studio.train.preflight import inspect_data
    from test_vision import COLOURS

    config = vision_config(COLOURS).replace(distributed={"pipeline_stages": 2, "num_processes": 2})
    with pytest.raises(DataError, match=r"colours_chat.jsonl: the rows hold images: a pipeline does not carry them "
                                        r"yet") as refused:
        inspect_data(config)
    assert "set distributed.pipeline_stages to 0" in refused.value.hint
