"""Vision-language rows in the window (issue 30): the preview draws each image where it stands in the
conversation, as the model reads it."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

import os
from pathlib import Path

from test_gui import open_window, wait_for_preview
from test_vision import COLOURS, TINY_VL


def test_the_preview_draws_each_image_where_it_stands_in_the_conversation(qtbot, app_dirs):
    window = open_window(qtbot)
    window.store.update(model={"name_or_path": str(TINY_VL)}, data={"train_files": [str(COLOURS)], "max_length": 64})
    wait_for_preview(qtbot, window)
    window.setup_tabs.setCurrentWidget(window.data_panel)
    first = window.data_panel.preview.examples[0]
    (image,) = first.images
    assert Path(image.path) == COLOURS.parent / "images" / "white-1.png" and max(image.width, image.height) == 96
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
