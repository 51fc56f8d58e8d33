"""The window is on screen before anything heavier than Qt, pyqtgraph and studio.core is imported (issue 25):
the data preview and the run history are read after its first paint. How long that takes is measured by
benchmarks/gui_startup.py, not here."""

import json
import subprocess
import sys
import textwrap

# What reading data, tokenizing or training loads: none of it may delay the first frame. Nor numpy (0.1 s):
# pyqtgraph's, it comes with the first chart or the data's lengths.
HEAVY = ("torch", "transformers", "peft", "accelerate", "datasets", "pandas", "pyarrow", "tokenizers",
         "safetensors", "huggingface_hub", "jinja2", "numpy", "studio.train")


def test_the_window_is_painted_before_any_heavy_import_and_the_preview_comes_after(tmp_path):
    code = textwrap.dedent(f"""
        import json, os, sys, time
        os.environ.update(QT_QPA_PLATFORM="offscreen", STUDIO_CONFIG_DIR={str(tmp_path / "config")!r},
                          STUDIO_RUNS_DIR={str(tmp_path / "runs")!r})
        from PySide6.QtCore import QEvent, QObject
        from studio.gui.app import create_app
        from studio.gui.main_window import MainWindow

        def heavy():
            return sorted(m for m in sys.modules if m in {HEAVY!r} or m.split(".")[0] in {HEAVY!r}
                          or m.startswith("studio.train."))

        class FirstPaint(QObject):
            def eventFilter(self, watched, event):
                if event.type() == QEvent.Type.Paint and at_paint is None:
                    globals()["at_paint"] = heavy()
                return False

        at_paint = None
        app = create_app([])
        window = MainWindow()
        first_paint = FirstPaint()
        window.installEventFilter(first_paint)
        window.show()
        deadline = time.time() + 60
        while window.data_panel.preview is None and time.time() < deadline:
            app.processEvents()
            time.sleep(0.01)
        print(json.dumps({{"at_paint": at_paint, "previewed": window.data_panel.preview is not None,
                          "tokenizers_later": "tokenizers" in sys.modules}}))
        window.close()
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["at_paint"] == []
    assert seen["previewed"] and seen["tokenizers_later"]  # the demo's preview, counted in tokens, after it
