"""The estimate counts the images of Idefics3 and SmolVLM (issue 30): test_vision_families' tiny Idefics3 with a
larger tower (32-pixel tiles of 64 patches, two blocks) and images scaled to a 64-pixel longest edge, a square
split in four tiles beside the global one. The worker's measured step on the CPU is within 3 % of the estimate of
its own data (as test_vision_memory_families holds Gemma 3 and LLaVA), LoRA on the language model with the tower and
the connector frozen or trained, one and two images a row; an image's tiles, patches and tokens are the processor's
at its size and under vision.max_pixels, which the worker's processor honours as the longest edge the rule reads."""

import json
from pathlib import Path

import pytest

from helpers import quick_config
from studio.core.memory.estimate import estimate
from studio.core.memory.parts.vision import image_rule, load_preprocessor_config
from test_vision_families import VISION, prepared, saved_family
from test_vision_memory_families import TOLERANCE, TRAINED, image_rows, measured_run

TOWER = {**VISION, "image_size": 32, "num_hidden_layers": 2}
LONGEST_EDGE = 64
ROW_LENGTH = 128  # a row's tokens for each image it holds: 80 image tokens, the tile markers, the text
SMOLVLM = {"config_class": "SmolVLMConfig", "model_class": "SmolVLMForConditionalGeneration"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return saved_family("idefics3", tmp_path_factory.mktemp("idefics3"), vision=TOWER, longest_edge=LONGEST_EDGE)


def run_config(folder: Path, data: Path, per_row: int, **sections):
    config = quick_config(data, model={"name_or_path": str(folder)}).replace(
        data={"train_files": (str(data),), "eval_files": (), "max_length": ROW_LENGTH * per_row,
              "eval_fraction": 0.0},
        training={"micro_batch_size": 4, "max_steps": 2, "chunked_loss": False}, schedule={"eval_every": 0})
    return config.replace(**sections)


def model_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def assert_estimated_as_measured(config, run_dir: Path, per_row: int) -> dict:
    """The run's measured peak within TOLERANCE of the estimate of its own data; its estimate event."""
    measured, predicted = measured_run(config, run_dir)
    own = predicted["run_data"]
    assert own["image_patches"] == 4 * per_row * 5 * 64  # four rows, five tiles an image, 8x8 patches a tile
    assert abs(own["peak_bytes"] / measured - 1) < TOLERANCE, (own, measured)
    return predicted


# a trained tower is traced anew (its text step's trace: seconds): one of them in the default run
CASES = [pytest.param(vision, per_row, id=f"{'trained' if vision else 'frozen'}-{per_row}",
                      marks=[pytest.mark.heavy] if vision and per_row == 2 else [])
         for vision in ({}, TRAINED) for per_row in (1, 2)]


@pytest.mark.parametrize("vision, per_row", CASES)
def test_the_step_is_estimated_as_measured(folder, tmp_path, vision, per_row):
    config = run_config(folder, image_rows(tmp_path, per_row), per_row, vision=vision)
    predicted = assert_estimated_as_measured(config, tmp_path / "run", per_row)
    note = next(n for n in predicted["notes"] if n.startswith("vision-language"))
    assert ("the vision tower and the projector train" in note) == bool(vision)
    assert ("training both would add" in note) == (not vision)


@pytest.mark.heavy
def test_a_smolvlm_step_is_estimated_as_measured(tmp_path):
    pytest.importorskip("num2words", reason="SmolVLM's processor needs num2words (not a studio dependency)")
    folder = saved_family("idefics3", tmp_path / "smolvlm", vision=TOWER, longest_edge=LONGEST_EDGE, **SMOLVLM)
    assert model_config(folder)["model_type"] == "smolvlm"
    assert_estimated_as_measured(run_config(folder, image_rows(tmp_path, 1), 1), tmp_path / "run", 1)


SIZES = [(40, 40), (16, 72), (72, 16), (33, 65), (300, 1000), (1000, 301), (5, 5000), (7, 9)]


@pytest.mark.parametrize("preprocessor, max_pixels", [
    ({}, 0), ({}, 800 * 800), ({"size": {"longest_edge": 100}, "max_image_size": {"longest_edge": 32}}, 0),
    ({"size": {"longest_edge": 128}, "max_image_size": {"longest_edge": 32}}, 70 * 70),
    ({"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}, "do_image_splitting": False}, 0)])
def test_an_image_s_tiles_are_the_image_processor_s(preprocessor, max_pixels):
    """The processor's defaults (1456-pixel longest edge, 364-pixel tiles) and others, under the pixel limits."""
    from PIL import Image
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    rule = image_rule({"model_type": "idefics3", "vision_config": {}})
    processor = Idefics3ImageProcessorPil(**{**preprocessor, **rule.processor_limit(preprocessor, max_pixels)}
                                          if max_pixels else preprocessor)
    for height, width in SIZES:
        pixels = processor(images=[[Image.new("RGB", (width, height))]], return_tensors="np")["pixel_values"]
        assert rule.tiles(preprocessor, height, width, max_pixels) == pixels.shape[1], (height, width)


def test_a_row_s_patches_and_tokens_are_the_processor_s_padded_tiles_aside(folder, tmp_path):
    """Rows of images of a few sizes, one holding two whose tiles differ (the fewer padded to the more): the rule's
    patches and tokens are the processor's, its real tiles read from the row; under vision.max_pixels too."""
    from PIL import Image

    from studio.train.data.images import row_image_patches, tower_patch_size

    sizes = [[(40, 40)], [(16, 72)], [(72, 16), (20, 20)], [(50, 30)]]
    rows = []
    for index, images in enumerate(sizes):
        names = [f"{index}-{number}.png" for number in range(len(images))]
        for name, (width, height) in zip(names, images):
            Image.new("RGB", (width, height), "red").save(tmp_path / name)
        rows.append({"images": names, "messages": [
            {"role": "user", "content": [*[{"type": "image"}] * len(images), {"type": "text", "text": "Colour?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    rule, preprocessor = image_rule(model_config(folder)), load_preprocessor_config(str(folder))
    for max_pixels in (0, 40 * 40):
        config = run_config(folder, path, 2, vision={"max_pixels": max_pixels})
        data, tokenizer, _ = prepared(config)
        image_token = tokenizer.convert_tokens_to_ids("<image>")
        for row, images in zip(data.train, sizes):
            expected = [rule.size(preprocessor, height, width, max_pixels) for width, height in images]
            patches = row_image_patches(row, tower_patch_size(model_config(folder)))
            assert patches == tuple(size.patches for size in expected)
            assert row["input_ids"].count(image_token) == sum(size.tokens for size in expected)
    whole, capped = rule.size(preprocessor, 40, 40), rule.size(preprocessor, 40, 40, 40 * 40)
    assert (whole.patches, whole.tokens, capped.patches, capped.tokens) == (5 * 64, 5 * 16, 64, 16)  # one tile


def test_the_worst_case_and_fit_lower_the_longest_edge(folder):
    """The worst case is a square at the longest edge in every row; fit lowers vision.max_pixels (the longest edge,
    in whole tiles) where a micro-batch of one does not fit, saying the tokens an image then becomes."""
    from studio.core.memory.derived import cached_trace
    from studio.core.memory.fit import fit
    from studio.core.memory.parts.vision import worst_case_images
    from studio.train.measure.trace import write_trace

    model = model_config(folder)
    config = run_config(folder, Path("rows.jsonl"), 1).replace(data={"max_length": 320})
    larger = config.replace(vision={"max_pixels": 128 * 128})  # 4x4 tiles and the global one
    assert worst_case_images(model, config) == (5 * 64,) * 4 and worst_case_images(model, larger) == (17 * 64,) * 4
    assert worst_case_images(model, larger.replace(data={"max_length": 100})) == (400,) * 4  # no more than a row
    if cached_trace(model, config) is None:  # derived from its traced step (the measured test's, when it ran first)
        write_trace(config, neighbours=False)
    one = larger.replace(training={"micro_batch_size": 1})
    room = estimate(model, one.replace(vision={"max_pixels": 64 * 64}), "cpu").peak_bytes / 0.9  # 2x2 tiles fit
    result = fit(model, larger, int(room) + 1, "cpu")
    assert result.fits and result.config.training.micro_batch_size == 1
    assert result.config.vision.max_pixels == 64 * 64  # the highest limit that fits
    assert "vision.max_pixels 16,384 -> 4,096 (an image at most 80 tokens, 320 patches)" in result.explanation
