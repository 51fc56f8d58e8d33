"""The estimate counts Llama 3.2 Vision's (mllama's) images (issue 30): a tiny random mllama (test_vision_families'
builder, its tower on 32-pixel tiles: 64 patches and a CLS a tile, padded to 72; four tiles an image, the padded
ones run too; one cross-attention layer among three). The worker's measured step on the CPU within 3 % of the
estimate of its own data, LoRA on the language model with the tower and projector frozen or trained, one and two
images a row; an image is every tile's patches, a micro-batch gives each row as many image slots as its row with the
most, and the rule's tower and projector are the model's parameters."""

import json
import re
from pathlib import Path

import pytest

from helpers import quick_config
from studio.core.memory.parts.vision import image_rule
from test_vision_families import MLLAMA_VISION, prepared, saved_family
from test_vision_memory_families import (TOLERANCE, TRAINED, assert_the_pixel_limit_changes_nothing, image_rows,
                                        measured_run)

TOWER = {**MLLAMA_VISION, "image_size": 32}
IMAGE_PATCHES = 4 * 8 * 8  # four tiles of 8x8 patches


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return saved_family("mllama", tmp_path_factory.mktemp("mllama"), vision=TOWER)


def model_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def run_config(folder: Path, data: Path, **sections):
    config = quick_config(data, model={"name_or_path": str(folder)}).replace(
        data={"train_files": (str(data),), "eval_files": (), "max_length": 64, "eval_fraction": 0.0},
        training={"micro_batch_size": 4, "max_steps": 2, "chunked_loss": False}, schedule={"eval_every": 0})
    return config.replace(**sections)


# a trained tower is traced anew (a minute on 2 cores): the two-image rows are heavy
CASES = [pytest.param(vision, per_row, id=f"{'trained' if vision else 'frozen'}-{per_row}",
                      marks=[pytest.mark.heavy] if per_row == 2 else [])
         for vision in ({}, TRAINED) for per_row in (1, 2)]


@pytest.mark.parametrize("vision, per_row", CASES)
def test_the_step_is_estimated_as_measured(folder, tmp_path, vision, per_row):
    config = run_config(folder, image_rows(tmp_path, per_row), vision=vision)
    measured, predicted = measured_run(config, tmp_path / "run")
    own = predicted["run_data"]
    assert own["image_patches"] == 4 * per_row * IMAGE_PATCHES
    assert abs(own["peak_bytes"] / measured - 1) < TOLERANCE, (own, measured)
    note = next(n for n in predicted["notes"] if n.startswith("vision-language"))
    assert ("the vision tower and the projector train" in note) == bool(vision)


def test_an_image_is_every_tile_and_a_micro_batch_fills_each_row_s_slots(folder, tmp_path):
    """An image is its four tiles whatever its size (the processor pads the tiles it does not fill), and a row of
    fewer images than another in its micro-batch, or none, gets as many slots, which the tower runs too."""
    from studio.core.memory.run_data import most_image_patches
    from studio.train.data.images import row_image_patches, tower_patch_size

    config = run_config(folder, image_rows(tmp_path, 2))
    data, _, _ = prepared(config)
    patch = tower_patch_size(model_config(folder))
    assert [row_image_patches(row, patch) for row in data.train] == [(IMAGE_PATCHES,) * 2] * len(data.train)
    rows = [(IMAGE_PATCHES,), (IMAGE_PATCHES,) * 2, ()]
    assert most_image_patches(rows, [[0, 1, 2]], every_row=True) == (IMAGE_PATCHES,) * 6
    assert most_image_patches(rows, [[2]], every_row=True) == ()


def test_the_tower_and_projector_parameters_are_the_model_s(folder):
    from transformers import AutoModelForImageTextToText

    from studio.core.model.vision import VISION_FAMILIES

    family, rule = VISION_FAMILIES["mllama"], image_rule(model_config(folder))
    named = dict(AutoModelForImageTextToText.from_pretrained(folder).named_parameters())
    for part, pattern in ((rule.parameters(True, False), family.tower),
                          (rule.parameters(False, True), family.projector)):
        assert part == sum(p.numel() for n, p in named.items() if re.compile(pattern).fullmatch(n))


def test_the_pixel_limit_is_no_saver_and_setting_it_is_noted(folder):
    from studio.core.memory.derived import cached_trace
    from studio.train.measure.trace import write_trace

    model = model_config(folder)
    config = run_config(folder, Path("rows.jsonl"))
    if cached_trace(model, config) is None:
        write_trace(config, neighbours=False)
    note = assert_the_pixel_limit_changes_nothing(model, config)
    assert "max_num_tiles" in note
