"""``studio`` with no subcommand (or ``python -m studio``): open the main window."""

from __future__ import annotations

import sys

from PySide6.QtWidgets import QApplication

from studio.core.runtime.environment import is_bundle
from studio.gui.errors import install_excepthook
from studio.gui.main_window import MainWindow
from studio.gui.runtime.dialog import check_runtime_at_start
from studio.gui.tasks import after_first_paint
from studio.gui.widgets.common import apply_app_style


def create_app(argv: list[str] | None = None) -> QApplication:
    app = QApplication.instance() or QApplication(argv if argv is not None else sys.argv)
    app.setApplicationName("Finetune Studio")
    app.setOrganizationName("finetune-studio")
    app.setDesktopFileName("finetune-studio")  # matches packaging/finetune-studio.desktop (taskbar icon)
    apply_app_style(app)
    return app


def main(argv: list[str] | None = None) -> int:
    app = create_app(argv)
    install_excepthook()
    window = MainWindow()
    window.show()
    after_first_paint(window, lambda: after_first_frame(window))
    return app.exec()


def after_first_frame(window: MainWindow) -> None:
    """What asks NVML and the runtime (slow on some machines) waits until the window is on screen."""
    window.offer_self_test()
    if is_bundle():  # the download trains in its own runtime: set it up, or check it
        check_runtime_at_start(window)


if __name__ == "__main__":
    sys.exit(main())
