"""The desktop download's program: PyInstaller builds it (packaging/finetune-studio.spec).

    finetune-studio                  the window; on first start it offers to set up the training runtime
    finetune-studio --smoke          open the window, print what it found, quit (the build's own test)
    finetune-studio --install-menu-entry   (Linux) add it to the desktop menu; --uninstall-menu-entry removes it
    finetune-studio -m MODULE ARGS   MODULE in the training runtime's Python

The window starts its worker, export and generate as ``sys.executable -m ...`` (studio.core.run.commands);
in the bundle sys.executable is this program, so those commands land here and run in the runtime.
A runtime that is not ready refuses, saying what to do, the way every studio command fails.
"""

from __future__ import annotations

import os
import subprocess
import sys


def run_in_runtime(args: list[str]) -> int:
    from studio.core.run.commands import run_handler
    from studio.core.runtime.environment import plan_for_this_machine, runtime_environment, runtime_invocation

    def forward(_args) -> int:
        argv = runtime_invocation(args, plan_for_this_machine())
        env = runtime_environment(dict(os.environ))
        if sys.platform == "win32":  # no exec: wait for it, without a console window of its own
            return subprocess.run(argv, env=env, creationflags=subprocess.CREATE_NO_WINDOW).returncode
        os.execve(argv[0], argv, env)  # the same pid: the app finds its worker by it

    return run_handler(forward, None)


def smoke() -> int:
    """What a build check needs to know: the window opens, and the runtime machinery is all there."""
    from PySide6.QtCore import QTimer

    from studio import __version__
    from studio.core.data.dataset import iter_records
    from studio.core.presets import DEMO_DATASETS
    from studio.core.runtime.environment import find_uv, plan_for_this_machine, runtime_state
    from studio.gui.app import create_app
    from studio.gui.main_window import MainWindow

    app = create_app(sys.argv[:1])
    window = MainWindow(attach_live_runs=False)
    window.show()
    plan = plan_for_this_machine()
    parquet_rows = sum(1 for _ in iter_records(DEMO_DATASETS / "categories_prompt_completion.parquet"))  # pyarrow

    def report() -> None:
        print(f"Finetune Studio {__version__}: window shown ({window.width()}x{window.height()}), "
              f"uv: {find_uv()}, parquet rows read: {parquet_rows}, runtime: {runtime_state(plan).message}", flush=True)
        window.close()
        app.quit()

    QTimer.singleShot(500, report)
    return app.exec()


def menu_entry(remove: bool) -> int:
    from install_desktop_entry import data_home, install, uninstall  # packaging/, bundled beside this file

    from studio.core.presets import RESOURCES

    if remove:
        uninstall(data_home())
    else:
        install(data_home(), f'"{sys.executable}"', RESOURCES / "icons")
    return 0


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "-m":
        return run_in_runtime(sys.argv[1:])
    if sys.argv[1:] in (["--install-menu-entry"], ["--uninstall-menu-entry"]):
        return menu_entry(remove=sys.argv[1] == "--uninstall-menu-entry")
    if "--smoke" in sys.argv[1:]:
        return smoke()
    from studio.gui.app import main as open_window

    return open_window(sys.argv[:1])


if __name__ == "__main__":
    sys.exit(main())
