"""Vision-language rows in the window (issue 30): the preview draws each image where it stands in the
conversation, as the model reads it."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

import json
import os
from pathlib import Path

from test_gui import open_window, wait_for_preview
from test_vision import COLOURS, QUESTION, TINY_VL, chat_row


def test_the_preview_draws_each_image_where_it_stands_in_the_conversation(qtbot, app_dirs):
    window = open_window(qtbot)
    window.store.update(model={"name_or_path": str(TINY_VL)}, data={"train_files": [str(COLOURS)], "max_length": 64})
    wait_for_preview(qtbot, window)
    window.setup_tabs.setCurrentWidget(window.data_panel)
    preview = window.data_panel.preview
    first = preview.examples[0]
    (image,) = first.images
    assert Path(image.path) == COLOURS.parent / "images" / "white-1.png" and max(image.width, image.height) == 96
    assert image.tokens == 4 and first.tokens == 32 + 3  # a 32x32 square: 4 tokens where its placeholder was 1
    assert preview.lengths[0] == first.tokens  # the histogram counts them
    assert "4 image tokens" in window.data_panel.examples.toPlainText()
    shown = window.data_panel.examples.toHtml()
    assert shown.count("<img") == len(window.data_panel.preview.examples)
    before, after = shown.split("<img", 1)
    assert before.endswith("&lt;|image_pad|&gt;") or "image_pad" in before[-80:]  # right after its placeholder
    assert "What colour is this square?" in after.split("<img", 1)[0]
    if folder := os.environ.get("STUDIO_LAYOUT_SHOTS"):
        window.grab().save(str(Path(folder) / "data_tab_images.png"))
        examples = window.data_panel.examples
        examples.resize(460, 420)
        examples.grab().save(str(Path(folder) / "data_preview_images.png"))


def test_a_lower_pixel_limit_shows_the_fewer_tokens_an_image_becomes(qtbot, app_dirs, tmp_path):
    from PIL import Image

    Image.new("RGB", (112, 112), "red").save(tmp_path / "big.png")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(chat_row([{"type": "image"}, QUESTION], images=["big.png"])) + "\n", encoding="utf-8")
    window = open_window(qtbot)
    window.store.update(model={"name_or_path": str(TINY_VL)}, data={"train_files": [str(rows)], "max_length": 64})
    wait_for_preview(qtbot, window)
    # the tiny model's processor: 4-pixel patches merged 2 x 2, at most 256 pixels (16 x 16 after its resize)
    assert window.data_panel.preview.examples[0].images[0].tokens == 4
    window.store.update(vision={"max_pixels": 64})  # 8 x 8: one merged patch
    wait_for_preview(qtbot, window)
    assert window.data_panel.preview.examples[0].images[0].tokens == 1
    assert "1 image token" in window.data_panel.examples.toPlainText()


def test_try_it_offers_an_image_for_a_vision_language_run_alone_and_shows_the_one_chosen(qtbot, app_dirs, tmp_path):
    from studio.core.presets import DEMO_MODEL

    window = open_window(qtbot)
    panel = window.try_panel
    runs = {}
    for name, model in (("text", DEMO_MODEL), ("vision", TINY_VL)):
        runs[name] = app_dirs / "runs" / name
        runs[name].mkdir(parents=True)
        (runs[name] / "config.yaml").write_text(json.dumps({"model": {"name_or_path": str(model)}}))
    panel.set_run(runs["vision"])
    assert not panel.image_button.isHidden()
    panel.set_image(COLOURS.parent / "images" / "white-1.png")
    assert not panel.thumbnail.isHidden() and panel.thumbnail.pixmap().width() == 48
    panel.set_run(runs["text"])  # a text model cannot read the image: neither the choice nor the image stays
    assert panel.image_button.isHidden() and panel.image is None and panel.thumbnail.isHidden()


def test_rows_with_images_the_run_cannot_train_are_refused_in_the_data_tab_before_start(qtbot, app_dirs, tmp_path):
    """What the worker would refuse at Start, said where the data is chosen: images for a text model, and image
    pairs for ORPO (its cross-entropy would learn the prompt's image tokens); DPO trains the same pairs."""
    from studio.core.presets import DEMO_MODEL
    from test_vision_dpo import colour_pairs

    window = open_window(qtbot)
    window.store.update(model={"name_or_path": str(DEMO_MODEL)}, data={"train_files": [str(COLOURS)]})
    wait_for_preview(qtbot, window)
    assert "the model is a text model" in window.data_panel.banner.text.text()
    assert not window.start_action.isEnabled()
    window.store.update(model={"name_or_path": str(TINY_VL)}, objective="orpo",
                        data={"train_files": [str(colour_pairs(tmp_path))]})
    wait_for_preview(qtbot, window)
    assert "objective orpo does not train on images" in window.data_panel.banner.text.text()
    assert not window.start_action.isEnabled()
    window.store.update(objective="dpo")
    wait_for_preview(qtbot, window)
    assert window.data_panel.problems == [] and window.data_panel.preview.image_rows == 8
