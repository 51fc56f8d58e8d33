"""How long `studio` takes to put its window on screen: median of several cold starts.

Each start is a fresh Python process that builds the main window exactly as
`studio` does and stops the clock once the window is exposed (shown and
painted); the clock starts just before this script launches the process, so
interpreter start-up and every import count. The target is under 1.0 s on an
idle 2-core machine.

    python benchmarks/gui_startup.py [--runs 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

PROBE = """
import time
from studio.gui.app import create_app
from studio.gui.main_window import MainWindow
app = create_app([])
window = MainWindow()
window.show()
while not (window.windowHandle() and window.windowHandle().isExposed()):
    app.processEvents()
app.processEvents()
print(time.time())
"""


def one_start(env: dict[str, str]) -> float:
    # Not psutil's create_time: it adds the boot time in whole seconds (/proc/stat), up to 1 s too early.
    launched = time.time()
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120, check=True)
    return float(result.stdout.strip().splitlines()[-1]) - launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen"),
               "STUDIO_CONFIG_DIR": os.path.join(scratch, "config"), "STUDIO_RUNS_DIR": os.path.join(scratch, "runs")}
        one_start(env)  # warm the OS file cache: users start the app more than once
        times = [one_start(env) for _ in range(args.runs)]
    print("starts (s):", " ".join(f"{t:.2f}" for t in times))
    print(f"median {statistics.median(times):.2f} s, best {min(times):.2f} s, worst {max(times):.2f} s (target < 1.0 s)")


if __name__ == "__main__":
    main()
