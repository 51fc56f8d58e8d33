"""Run a slow pure-Python function (reading a dataset, tokenizing) off the GUI thread.

Only the newest request of a ``BackgroundTask`` delivers its result: choosing
another file while the previous one is still being read must not show the
older result last. Requests made while the window is built wait for its first
frame (``FirstFrameGate``).
"""

from __future__ import annotations

import gc
from typing import Any, Callable

from PySide6.QtCore import QEvent, QObject, QRunnable, QThreadPool, QTimer, Signal
from PySide6.QtWidgets import QWidget


class _Relay(QObject):
    finished = Signal(int, object, object)  # request number, result, exception


class _Job(QRunnable):
    def __init__(self, number: int, function: Callable[[], Any], relay: _Relay):
        super().__init__()
        self.number, self.function, self.relay = number, function, relay

    def run(self) -> None:
        try:
            result, error = self.function(), None
        except Exception as exc:  # delivered to the GUI thread, shown there
            result, error = None, exc
        try:
            self.relay.finished.emit(self.number, result, error)
        except RuntimeError:  # the panel that asked was closed meanwhile: nobody to tell
            pass


class BackgroundTask(QObject):
    """``submit(function)``; ``result(value)`` or ``failed(exception)`` arrive on the GUI thread."""

    result = Signal(object)
    failed = Signal(object)

    def __init__(self, parent: QObject | None = None):
        super().__init__(parent)
        self._relay = _Relay(self)
        self._relay.finished.connect(self._deliver)
        self._latest = 0
        self.busy = False

    def submit(self, function: Callable[[], Any]) -> None:
        self._latest += 1
        self.busy = True
        job = _Job(self._latest, function, self._relay)
        if FirstFrameGate.building is not None:
            FirstFrameGate.building.held[self] = job  # only the newest: an older result would be dropped
        else:
            QThreadPool.globalInstance().start(job)

    def cancel(self) -> None:
        """Drop the result of the request in flight: what it was asked for is gone."""
        self._latest += 1
        self.busy = False

    def _deliver(self, number: int, value: Any, error: Exception | None) -> None:
        if number != self._latest:
            return
        self.busy = False
        if error is not None:
            self.failed.emit(error)
        else:
            self.result.emit(value)


def after_first_paint(widget: QWidget, callback: Callable[[], None]) -> None:
    """``callback()`` once ``widget`` has painted for the first time (a timer of 0 after ``show()`` runs
    before the first paint: posted events come before the window system's)."""

    class _FirstPaint(QObject):
        def eventFilter(self, watched, event) -> bool:
            if event.type() == QEvent.Type.Paint:
                widget.removeEventFilter(self)
                self.deleteLater()
                QTimer.singleShot(0, callback)  # after this paint reached the screen
            return False

    widget.installEventFilter(_FirstPaint(widget))


class FirstFrameGate:
    """``with FirstFrameGate(window):`` background work asked for while the window is built (the data
    preview, the run history scan) starts after the window's first paint, not during it: on two cores the
    reading threads would take the GIL from the building and painting."""

    building: FirstFrameGate | None = None

    def __init__(self, window: QWidget):
        self.held: dict[BackgroundTask, _Job] = {}
        self.window = window

    def __enter__(self) -> None:
        FirstFrameGate.building = self

    def __exit__(self, *exc) -> None:
        FirstFrameGate.building = None
        after_first_paint(self.window, self.release)

    def release(self) -> None:
        held, self.held = self.held, {}
        for task, job in held.items():
            if job.number == task._latest:  # not replaced by a request made since
                QThreadPool.globalInstance().start(job)


def wait_for_background_work(msecs: int = 10000) -> None:
    """Let running jobs finish (at exit, and between tests)."""
    QThreadPool.globalInstance().waitForDone(msecs)


class GuiThreadGarbageCollector(QObject):
    """Python's cyclic garbage collection only on the GUI thread, while the window lives.

    Any allocation can start a collection, also in a background job; one that frees Qt
    objects there deadlocks PySide with the GUI thread (seen: the window hung while a
    history scan parsed YAML in the thread pool). Automatic collection is off until
    ``stop``; a timer on the GUI thread collects with the interpreter's own thresholds.
    """

    active = 0  # collectors alive: automatic collection comes back when the last one stops

    def __init__(self, parent: QObject, interval_ms: int = 500):
        super().__init__(parent)
        self._threshold = gc.get_threshold()
        GuiThreadGarbageCollector.active += 1
        gc.disable()
        self._timer = QTimer(self)
        self._timer.timeout.connect(self.collect)
        self._timer.start(interval_ms)

    def collect(self) -> None:
        counts = gc.get_count()
        for generation in (2, 1, 0):  # the oldest generation that is due (it includes the younger ones)
            if counts[generation] > self._threshold[generation]:
                gc.collect(generation)
                return

    def stop(self) -> None:
        if self._timer.isActive():
            self._timer.stop()
            GuiThreadGarbageCollector.active -= 1
            if GuiThreadGarbageCollector.active == 0:
                gc.enable()
