"""Unexpected exceptions in the app become a readable dialog (with the traceback one click away),
instead of a silent failure or a traceback on a terminal the user never sees."""

from __future__ import annotations

import sys
import traceback
from types import TracebackType

from PySide6.QtWidgets import QApplication, QMessageBox

from studio.core.errors import StudioError

_showing = False


def show_exception(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
    global _showing
    details = "".join(traceback.format_exception(kind, value, tb))
    print(details, file=sys.stderr)
    if _showing or QApplication.instance() is None:
        return  # an error inside the dialog itself, or before the app exists: the terminal has it
    _showing = True
    try:
        box = QMessageBox(QMessageBox.Icon.Critical, "Finetune Studio — unexpected error", _summary(value))
        box.setInformativeText("Training runs in its own process and is not affected. If this keeps happening, "
                               "please report it with the details below.")
        box.setDetailedText(details)
        box.exec()
    finally:
        _showing = False


def _summary(value: BaseException) -> str:
    if isinstance(value, StudioError):
        return str(value)
    return f"Something went wrong in the app: {type(value).__name__}: {value}"


def install_excepthook() -> None:
    sys.excepthook = show_exception
