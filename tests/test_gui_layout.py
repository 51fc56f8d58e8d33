"""The window fits a 1280x800 and a 1366x768 screen in every state (tests/gui_states.py), with no label
cut off or overlapping. STUDIO_LAYOUT_SHOTS=folder also saves each state as a PNG to look at."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

import os
from pathlib import Path

import pytest
from gui_states import FRAME_HEIGHT, FRAME_WIDTH, STATES, TWO_GPU_STATES, layout_problems
from PySide6.QtWidgets import QApplication

from studio.gui.panels import estimate as estimate_panel
from studio.gui.state.hardware import Gpu
from studio.gui.widgets.common import apply_app_style
from test_gui import app_dirs, open_window  # noqa: F401 (fixture)

SCREENS = ((1280, 800), (1366, 768))
CASES = [(state, 1) for state in STATES] + [(state, 2) for state in TWO_GPU_STATES]


@pytest.fixture(scope="module", autouse=True)
def app_style(qapp):
    """The app's own style and style sheet (its fonts, paddings and group boxes take room); restored after."""
    style, sheet, palette = qapp.style().name(), qapp.styleSheet(), qapp.palette()
    apply_app_style(qapp)
    yield
    qapp.setStyleSheet(sheet)
    qapp.setStyle(style)
    qapp.setPalette(palette)


@pytest.fixture
def environment():
    """States switch the Hub off or point its cache elsewhere: each test gets the environment back."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("state,gpus", CASES, ids=[f"{s.__name__}-{g}gpu" for s, g in CASES])
def test_every_state_fits_the_screen_without_cut_off_text(state, gpus, qtbot, app_dirs, tmp_path, monkeypatch,
                                                          environment):
    if gpus > 1:
        monkeypatch.setattr(estimate_panel, "detect_gpus",
                            lambda: [Gpu("NVIDIA GeForce RTX 4090", 24 * 2**30, i) for i in range(gpus)])
    window = open_window(qtbot)
    state(window, qtbot, tmp_path)
    problems = []
    for width, height in SCREENS:
        window.resize(width - FRAME_WIDTH, height - FRAME_HEIGHT)
        for _ in range(5):
            QApplication.processEvents()
        problems += [f"{width}x{height}: {p}" for p in layout_problems(window, width, height)]
        if os.environ.get("STUDIO_LAYOUT_SHOTS"):
            folder = Path(os.environ["STUDIO_LAYOUT_SHOTS"])
            folder.mkdir(parents=True, exist_ok=True)
            window.grab().save(str(folder / f"{state.__name__}-{gpus}gpu-{width}x{height}.png"))
    window.controller.cancel()
    assert not problems, "\n".join(problems)
