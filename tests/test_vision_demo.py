"""The vision demo (issue 30): drawn shapes whose colour the tiny vision-language model learns to name, measured on
held-out drawings by ``studio eval`` before and after."""

import json
import time
from collections import Counter
from pathlib import Path

import pytest

from studio.cli import main
from studio.core.data.dataset import inspect_files
from studio.core.presets import SHAPES_HELDOUT, SHAPES_TRAIN, vision_demo_config
from studio.core.run.directory import RunDir
from studio.core.run.events import read_events
from studio.train.evaluation.compare import evaluate_run

COLOURS = {"red", "green", "blue", "yellow"}


def test_the_demo_data_reads_every_image_and_balances_the_colours_and_shapes():
    splits = {}
    for path in (SHAPES_TRAIN, SHAPES_HELDOUT):
        report = inspect_files([path], keep=1000)
        assert report.format == "chat" and report.rows == len(report.examples)
        for example in report.examples:
            assert len(example.images) == 1 and Path(example.images[0]).is_file()
            assert [part["type"] for part in example.messages[0]["content"]] == ["image", "text"]
            assert example.messages[1]["content"] in COLOURS
        splits[path.name] = [(e.messages[1]["content"], Path(e.images[0]).stem.split("-")[1]) for e in report.examples]
    train, held_out = splits["shapes_train.jsonl"], splits["shapes_heldout.jsonl"]
    assert (len(train), len(held_out)) == (96, 36)
    for rows in (train, held_out):  # every colour as every shape, as often
        assert len(set(Counter(rows).values())) == 1 and len(Counter(rows)) == 12
    images = [json.loads(line)["images"][0] for path in (SHAPES_TRAIN, SHAPES_HELDOUT)
              for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(set(images)) == len(images)  # no drawing in both splits


@pytest.mark.heavy  # about 2 minutes on 2 idle cores, 4 when busy; the lighter test below answers images too
def test_the_vision_demo_learns_to_name_the_colours_of_held_out_drawings(tmp_path):
    started = time.monotonic()
    assert main(["demo", "--vision", "--run-dir", str(tmp_path / "run")]) == 0
    run_dir = RunDir(tmp_path / "run")
    evaluation = next(e for e in read_events(run_dir.events) if e["type"] == "evaluation")
    base, tuned = evaluation["base"]["exact_match"], evaluation["tuned"]["exact_match"]
    print(f"exact match {base:.0%} -> {tuned:.0%} in {time.monotonic() - started:.0f} s")
    assert base <= 0.25 and tuned >= 0.9  # from at most chance (4 colours) to nearly every drawing
    assert (tmp_path / "run" / "exports" / "merged" / "preprocessor_config.json").is_file()


def test_studio_eval_and_try_it_answer_the_held_out_drawings_with_their_images(tmp_path):
    from studio.train import worker
    from studio.train.evaluation.generate import side_by_side

    config = vision_demo_config().replace(training={"max_steps": 2}, schedule={"eval_every": 0})
    code, run_dir = worker.run(config, tmp_path / "run", watch_stdin=False)
    assert code == 0
    result = evaluate_run(run_dir.path, max_new_tokens=2)
    assert result["summary"]["tuned"]["rows"] == 36 and "exact_match" in result["summary"]["base"]
    assert {row["prompt"] for row in result["rows"]} == {"[image] What colour is this shape?"}
    assert {row["reference"] for row in result["rows"]} == COLOURS
    image = SHAPES_HELDOUT.parent / "images" / "red-circle-8.png"
    answers = side_by_side(run_dir.path, "What colour is this shape?", 2, image)
    assert isinstance(answers["base"], str) and answers["checkpoint"] == "step-000002"


def test_config_init_writes_the_vision_demo_run(tmp_path, capsys):
    from studio.core.config import load_config

    assert main(["config", "init", str(tmp_path / "vision.yaml"), "--vision"]) == 0
    assert load_config(tmp_path / "vision.yaml") == vision_demo_config()
    assert "the vision demo run" in capsys.readouterr().out
