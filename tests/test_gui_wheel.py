"""No value changes without intent (issue 25): the wheel over a spin box or drop-down scrolls the page, as it
does over a label; it changes the control only after a click (or Tab) gave the control focus. A user who
scrolled the Techniques tab had LoRA rank go from 8 to 3 as the wheel passed over it."""
# ruff: noqa: F811 (test_gui's fixtures, imported, are the tests' parameters)

import pytest
from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtTest import QTest
from PySide6.QtWidgets import (QAbstractSlider, QAbstractSpinBox, QApplication, QComboBox, QScrollArea, QScrollBar,
                               QWidget)

from studio.core.config import differences
from test_gui import open_window, wait_for_preview

NOTCH = 120  # one step of a mouse wheel


def value_controls(page: QWidget) -> list[QWidget]:
    """The spin boxes, drop-downs and sliders a user can see on ``page``."""
    return [widget for widget in page.findChildren(QWidget)
            if isinstance(widget, (QAbstractSpinBox, QComboBox, QAbstractSlider))
            and not isinstance(widget, QScrollBar) and widget.isVisible()]


def value_of(control: QWidget):
    return control.currentIndex() if isinstance(control, QComboBox) else control.value()


def scroll_area_of(widget: QWidget) -> QScrollArea | None:
    while widget is not None and not isinstance(widget, QScrollArea):
        widget = widget.parentWidget()
    return widget


def point_at(window, control: QWidget) -> QPointF:
    """The centre of ``control``, scrolled into view first: where the cursor is put."""
    QApplication.processEvents()
    area = scroll_area_of(control)
    if area is not None:
        area.ensureWidgetVisible(control)
        QApplication.processEvents()
    at = QPointF(control.mapTo(window, control.rect().center()))
    under = window.childAt(at.toPoint())
    assert under is control or control.isAncestorOf(under), f"{control} is not under the cursor but {under}"
    return at


def wheel(window, at: QPointF, notches: int) -> None:
    """Real wheel events, through the window as the window system delivers them (up for notches > 0)."""
    for _ in range(abs(notches)):
        QTest.wheelEvent(window.windowHandle(), at, QPoint(0, NOTCH if notches > 0 else -NOTCH))
        QApplication.processEvents()


def small_window(qtbot):
    window = open_window(qtbot)
    window.resize(1280, 720)  # a laptop screen: the setup tabs scroll
    assert QTest.qWaitForWindowExposed(window)
    wait_for_preview(qtbot, window)
    return window


def pages(window):
    """Every place with controls: the setup tabs, the estimate under them, the run tabs."""
    for tabs in (window.setup_tabs, window.run_tabs):
        for index in range(tabs.count()):
            yield tabs, tabs.widget(index)


@pytest.mark.parametrize("grpo", [False, True], ids=["demo", "grpo setup"])
def test_the_wheel_over_every_control_of_every_tab_scrolls_the_page_and_changes_nothing(qtbot, app_dirs, grpo):
    window = small_window(qtbot)
    if grpo:  # its settings and the rows of its rewards editor
        window.new_grpo_setup()
        window.changes_notice.hide()
        wait_for_preview(qtbot, window)
    config, card = window.store.config, window.estimate_panel.picker.card_name
    swept, scrolled = 0, set()
    for tabs, page in pages(window):
        tabs.setCurrentWidget(page)
        tab = tabs.tabText(tabs.indexOf(page))
        controls = value_controls(page) + (value_controls(window.under_tabs) if tabs is window.setup_tabs else [])
        values = [value_of(control) for control in controls]
        for control in controls:
            at = point_at(window, control)  # the cursor stays there while the page moves under it
            area = scroll_area_of(control)
            bar = area.verticalScrollBar() if area is not None and area.verticalScrollBar().maximum() > 0 else None
            for notches in ((-3, 3) if bar is not None and bar.value() < bar.maximum() else (3, -3)):  # then back
                before = bar.value() if bar is not None else None
                wheel(window, at, notches)
                changed = differences(config, window.store.config)
                assert not changed, f"{tab}: the wheel over {type(control).__name__} changed {changed}"
                if bar is not None:
                    assert bar.value() != before, f"{tab}: the page did not scroll"
                    scrolled.add(page)
            swept += 1
        assert [value_of(control) for control in controls] == values, tab
        assert not any(control.hasFocus() for control in controls), tab  # the wheel gave none focus
    assert swept > 30
    assert {window.data_panel, window.techniques_panel, window.scale_panel} <= scrolled
    assert window.store.config == config
    assert window.estimate_panel.picker.card_name == card


def test_after_a_click_gives_it_focus_the_wheel_changes_the_control(qtbot, app_dirs):
    window = small_window(qtbot)
    window.setup_tabs.setCurrentWidget(window.techniques_panel)
    rank = window.techniques_panel.rank.spin
    assert window.store.config.lora.r == 8
    wheel(window, point_at(window, rank), 2)
    assert window.store.config.lora.r == 8  # not yet: the page scrolled past it
    at = point_at(window, rank)
    QTest.mouseClick(window.windowHandle(), Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier, at.toPoint())
    assert rank.hasFocus()
    wheel(window, at, 2)
    assert window.store.config.lora.r == 10
    wheel(window, at, -3)
    assert window.store.config.lora.r == 7
    alpha = window.techniques_panel.alpha.spin
    QTest.keyClick(rank, Qt.Key.Key_Tab)  # Tab is intent too
    assert alpha.hasFocus()
    wheel(window, point_at(window, alpha), 1)
    assert window.store.config.lora.alpha == 17.0


def test_the_wheel_over_a_tab_bar_leaves_the_tab_that_is_open(qtbot, app_dirs):
    window = small_window(qtbot)
    for tabs in (window.setup_tabs, window.run_tabs):
        bar = tabs.tabBar()
        tabs.setCurrentIndex(1)
        last = bar.tabRect(bar.count() - 1)
        for on_the_bar in (bar.tabRect(1).center(), last.center() + QPoint(last.width(), 0)):  # a tab, beside them
            at = QPointF(bar.mapTo(window, on_the_bar))
            for notches in (-2, 3):
                wheel(window, at, notches)
                assert tabs.currentIndex() == 1, tabs.tabText(tabs.currentIndex())
