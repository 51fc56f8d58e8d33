"""The window fits a 1280x720 and a 1366x768 screen in every state (tests/gui_states.py), with no label
cut off or overlapping, no raw HTML entity or config key, and no sentence shown twice; the first window fits the
screen it opens on; controls stay where they are as the estimate's text changes. STUDIO_LAYOUT_SHOTS=folder also
saves each state as a PNG to look at."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

import os
from pathlib import Path

import pytest
from gui_states import (FRAME_HEIGHT, FRAME_WIDTH, STATES, TWO_GPU_STATES, choose_8b_model,
                        eight_b_fit_with_problems, layout_problems, repeated_texts, shown_text)
from PySide6.QtCore import QPoint, QRect, QSize
from PySide6.QtWidgets import (QAbstractButton, QAbstractSpinBox, QApplication, QComboBox, QLineEdit, QSlider,
                               QWidget)

from studio.gui import main_window
from studio.gui.main_window import MainWindow
from studio.gui.panels import estimate as estimate_panel
from studio.gui.state.hardware import Gpu
from studio.gui.widgets.common import apply_app_style
from test_gui import open_window, wait_for_preview, window  # noqa: F401 (fixtures)

SCREENS = ((1280, 720), (1366, 768))
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
    own = window.size() + QSize(FRAME_WIDTH, FRAME_HEIGHT)  # a state that sets the window's size is checked there
    for width, height in [(own.width(), own.height())] if getattr(state, "keeps_size", False) else SCREENS:
        window.resize(width - FRAME_WIDTH, height - FRAME_HEIGHT)
        for _ in range(5):
            QApplication.processEvents()
        problems += [f"{width}x{height}: {p}" for p in layout_problems(window, width, height) + repeated_texts(window)]
        if os.environ.get("STUDIO_LAYOUT_SHOTS"):
            folder = Path(os.environ["STUDIO_LAYOUT_SHOTS"])
            folder.mkdir(parents=True, exist_ok=True)
            window.grab().save(str(folder / f"{state.__name__}-{gpus}gpu-{width}x{height}.png"))
    window.controller.cancel()
    assert not problems, "\n".join(problems)


def settle() -> None:
    for _ in range(5):
        QApplication.processEvents()


@pytest.mark.parametrize("screen", SCREENS, ids=[f"{w}x{h}" for w, h in SCREENS])
def test_the_first_window_fits_the_screen_it_opens_on(screen, qtbot, app_dirs, monkeypatch):
    """No saved geometry: the window is sized to the screen's room (its panels taken off) with the frame around it."""
    width, height = screen
    room = QRect(0, 0, width, height - 40)  # a 40 px panel: what availableGeometry leaves
    monkeypatch.setattr(main_window, "available_geometry", lambda window: room)
    window = MainWindow()
    window.ask_close_choice = lambda: "stop"
    qtbot.addWidget(window)
    window.show()
    wait_for_preview(qtbot, window)  # its data is read after the first frame: "Your data" comes with it
    settle()
    framed = QRect(window.pos(), window.size() + main_window.FRAME_ALLOWANCE)
    assert room.contains(framed), (framed.getRect(), room.getRect())
    assert window.width() >= min(1280, width - 100) and window.height() >= room.height() - 100  # not small either
    assert not layout_problems(window, width, height)


def test_the_smallest_window_fits_1280x720_with_its_frame(window):
    minimum = window.minimumSizeHint().expandedTo(window.minimumSize())
    assert minimum.width() + FRAME_WIDTH <= 1280 and minimum.height() + FRAME_HEIGHT <= 720, minimum
    assert minimum.width() <= 1000, minimum  # room to spare beside other windows on a small screen


def test_start_off_points_to_the_problems_and_says_none_of_them_twice(window, qtbot, tmp_path, environment):
    """The trial's 8B model with Fit pressed: the toolbar says where the problems are, each is listed once."""
    eight_b_fit_with_problems(window, qtbot, tmp_path)
    settle()
    assert not window.start_action.isEnabled()
    reason, listed = shown_text(window.start_reason), shown_text(window.problems)
    assert reason == "⚠ Cannot start: 3 problems, listed in 1 Model, 2 Data and under the tabs"
    assert "4-bit base weights need an NVIDIA GPU" in listed and "“Base weights”" in listed
    for repeated in ("no weights", "HF_HUB_OFFLINE", "mixed.jsonl"):  # the model's and data's, in their own tabs
        assert repeated not in listed and repeated not in reason
    assert not repeated_texts(window)
    window.setup_tabs.setCurrentWidget(window.model_panel)  # the model's problems, where they are listed
    settle()
    assert "HF_HUB_OFFLINE" in shown_text(window.model_panel.banner.text) and not repeated_texts(window)


def _controls(widget: QWidget) -> dict[str, QPoint]:
    """Where each visible control inside ``widget`` is on the screen."""
    kinds = (QAbstractButton, QComboBox, QAbstractSpinBox, QLineEdit, QSlider)
    return {f"{type(c).__name__} {getattr(c, 'text', lambda: '')()!r} #{i}": c.mapToGlobal(QPoint(0, 0))
            for i, c in enumerate(widget.findChildren(QWidget)) if isinstance(c, kinds) and c.isVisible()}


# Settings that make the estimate's notes longer and shorter (offloads, tiling, CPU RAM, the row length, the
# adapter's size, the batch) and leave the setup's own reasons and problems as they are (a method's choice shows
# why other choices are off, in its tab): what moves, moves for the estimate.
STEADY_CHANGES = ({"training": {"activation_offload": True}}, {"training": {"tiled_mlp": True}},
                  {"training": {"output_layer_on_cpu": True, "embedding_on_cpu": True}},
                  {"data": {"max_length": 8192}}, {"lora": {"r": 64}}, {"training": {"micro_batch_size": 8}},
                  {"training": {"activation_offload": False, "tiled_mlp": False, "output_layer_on_cpu": False}},
                  {"data": {"max_length": 256}, "lora": {"r": 8}, "training": {"embedding_on_cpu": False}})


def _where_controls_are(window) -> dict[str, QPoint]:
    estimate = window.estimate_panel
    return {**_controls(window.setup_tabs.currentWidget()), **_controls(estimate.picker),
            "Fit to my GPU": estimate.fit_button.mapToGlobal(QPoint(0, 0)),
            "Simulate": estimate.simulate_button.mapToGlobal(QPoint(0, 0))}


@pytest.mark.parametrize("screen", SCREENS, ids=[f"{w}x{h}" for w, h in SCREENS])
@pytest.mark.parametrize("model", ["demo", "8B"])
def test_controls_stay_put_as_the_estimate_text_grows_and_shrinks(model, screen, window, qtbot, tmp_path,
                                                                   environment):
    """The trial: a click landed on the wrong box after the estimate's notes grew. Savers on and off make the
    estimate's text longer and shorter; the setup tab's controls and the estimate's own do not move."""
    window.resize(screen[0] - FRAME_WIDTH, screen[1] - FRAME_HEIGHT)
    if model == "8B":
        choose_8b_model(window, tmp_path)
        window.store.update(method="qlora")
    window.store.update(training={"gradient_checkpointing": True, "optimizer": "adamw_8bit"})
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    settle()
    estimate = window.estimate_panel
    before, lengths = _where_controls_are(window), set()
    for change in STEADY_CHANGES:
        window.store.update(**change)
        settle()
        lengths.add(len(shown_text(estimate.phase)))
        after = _where_controls_are(window)
        moved = {name: (before[name].toTuple(), after[name].toTuple()) for name in before.keys() & after.keys()
                 if before[name] != after[name]}
        assert not moved, f"after {change}: {moved}"
    assert len(lengths) > 2 and max(lengths) > min(lengths) + 60  # the notes did grow and shrink
