"""The estimate of a vision-language model counts its images (issue 30): the tiny Qwen2-VL's measured step on the
CPU within 3 % (the derived estimate's worst row: 2.89 %), its tower frozen (16x16 images) and trained with the projector on images at a higher resolution
(vision.max_pixels, which the worker's image processor honours); the patches and tokens of an image, computed in
pure Python from preprocessor_config.json, are the processor's."""

import json
from pathlib import Path

import pytest

from helpers import quick_config
from studio.core.memory.estimate import estimate
from studio.core.memory.parts.vision import image_rule, load_preprocessor_config
from studio.core.run.events import read_events
from studio.train import worker

RESOURCES = Path(__file__).resolve().parent.parent / "resources"
TINY_VL = RESOURCES / "models" / "studio-tiny-vl"
COLOURS = RESOURCES / "datasets" / "colours" / "colours_chat.jsonl"
MODEL_CONFIG = json.loads((TINY_VL / "config.json").read_text())


def squares(folder: Path, side: int) -> Path:
    """Eight rows, each a square image of ``side`` pixels and its colour."""
    from PIL import Image

    rows = []
    for index, colour in enumerate(["red", "blue"] * 4):
        Image.new("RGB", (side, side), colour).save(folder / f"{index}.png")
        rows.append({"images": [f"{index}.png"], "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is this square?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": colour}]}]})
    path = folder / "squares.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def measured_run(tmp_path, data_file: Path, max_length: int, **sections):
    """A two-step run's measured peak, its estimate of its own data, and that estimate's vision note."""
    config = quick_config(data_file, model={"name_or_path": str(TINY_VL)}).replace(
        data={"train_files": (str(data_file),), "eval_files": (), "max_length": max_length, "eval_fraction": 0.0},
        training={"micro_batch_size": 4, "max_steps": 2, "chunked_loss": False}, schedule={"eval_every": 0})
    code, run_dir = worker.run(config.replace(**sections), tmp_path / "run", watch_stdin=False)
    assert code == 0
    events = list(read_events(run_dir.events))
    measured = next(e for e in events if e["type"] == "memory_measured")["peak_bytes"]
    predicted = next(e for e in events if e["type"] == "estimate")
    return measured, predicted["run_data"], next(n for n in predicted["notes"] if n.startswith("vision-language"))


def test_a_frozen_tower_s_step_is_estimated_as_measured(tmp_path):
    measured, own, note = measured_run(tmp_path, COLOURS, 64)
    assert own["image_patches"] == 4 * 16  # four 16x16 images a micro-batch, 4x4 patches each
    assert abs(own["peak_bytes"] / measured - 1) < 0.03, (own, measured)
    assert "16 image tokens" in note and "frozen" in note


def test_a_trained_tower_at_a_higher_resolution_is_estimated_as_measured(tmp_path):
    data = squares(tmp_path, 64)
    measured, own, note = measured_run(tmp_path, data, 96, vision={"max_pixels": 64 * 64, "train_vision_tower": True,
                                                                   "train_projector": True})
    assert own["image_patches"] == 4 * 256  # the processor kept 64x64 pixels: 16x16 patches, 64 tokens
    assert abs(own["peak_bytes"] / measured - 1) < 0.03, (own, measured)
    assert "256 image tokens" in note  # four images' tokens
    assert "the vision tower and the projector train" in note


@pytest.mark.parametrize("side, max_pixels", [(16, 0), (64, 0), (64, 1024), (48, 4096), (100, 40 * 40)])
def test_an_image_s_patches_and_tokens_are_the_processor_s(side, max_pixels):
    from PIL import Image
    from transformers import AutoImageProcessor

    limit = {"max_pixels": max_pixels} if max_pixels else {}
    processor = AutoImageProcessor.from_pretrained(TINY_VL, backend="pil", **limit)
    for height, width in ((side, side), (side, side // 2 + 3)):
        t, h, w = processor(images=[Image.new("RGB", (width, height))])["image_grid_thw"][0].tolist()
        size = image_rule(MODEL_CONFIG).size(load_preprocessor_config(str(TINY_VL)), height, width, max_pixels)
        assert (size.patches, size.tokens) == (t * h * w, t * h * w // processor.merge_size ** 2)


def test_the_worst_case_is_an_image_at_the_pixel_limit_in_every_row():
    from studio.core.memory.parts.vision import worst_case_images

    config = quick_config(COLOURS, model={"name_or_path": str(TINY_VL)}).replace(data={"max_length": 512})
    assert worst_case_images(MODEL_CONFIG, config) == (16,) * 8  # the processor's limit: 256 pixels, 4 tokens
    larger = config.replace(vision={"max_pixels": 128 * 128})
    assert worst_case_images(MODEL_CONFIG, larger) == (1024,) * 8  # 256 tokens an image
    capped = larger.replace(data={"max_length": 100})
    assert worst_case_images(MODEL_CONFIG, capped) == (400,) * 8  # no more image tokens than the row holds


def test_fit_lowers_the_image_resolution_last_and_says_the_tokens_it_gives():
    """Where a micro-batch of one does not fit, fit lowers vision.max_pixels, to the highest limit that fits."""
    from studio.core.memory.fit import fit
    from studio.train.measure.trace import write_trace

    config = quick_config(COLOURS, model={"name_or_path": str(TINY_VL)}).replace(
        data={"max_length": 96}, training={"micro_batch_size": 4, "chunked_loss": False},
        vision={"max_pixels": 64 * 64, "train_vision_tower": True, "train_projector": True})
    write_trace(config, neighbours=False)  # the measured test's trace, when it ran first
    one = config.replace(training={"micro_batch_size": 1, "gradient_accumulation_steps": 4})
    result = fit(MODEL_CONFIG, config, int(estimate(MODEL_CONFIG, one, "cpu").peak_bytes * 0.8 / 0.9), "cpu")
    assert result.fits and result.config.vision.max_pixels == 32 * 32  # not 16 x 16: the highest that fits
    assert result.config.training.micro_batch_size == 1
    assert "vision.max_pixels 4,096 -> 1,024 (an image at most 16 tokens, 64 patches)" in result.explanation


def test_a_negative_pixel_limit_is_refused():
    from studio.core.validation import validate

    config = quick_config(COLOURS).replace(vision={"max_pixels": -1})
    assert [problem.where for problem in validate(config, check_files=False)] == ["vision.max_pixels"]
