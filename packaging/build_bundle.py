"""Build the desktop download (the window alone, no torch) with PyInstaller, then start it offscreen.

    pip install -e ".[packaging]"        # PyInstaller, uv, Pillow (icon conversion on Windows and macOS)
    python packaging/build_bundle.py     # -> dist/finetune-studio/ (dist/Finetune Studio.app on macOS)

It runs packaging/finetune-studio.spec, starts the result with ``--smoke`` (offscreen, with temporary
settings, runs and runtime folders), checks that a training command refuses with the fix when there is
no runtime, and prints the build time and the folder's size, as docs/packaging.md records them.
``--archive`` also writes the compressed archive for a release (.tar.gz; .zip on Windows);
``--demo-runtime DIR`` trains the demo through the built app and the ready runtime in DIR.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIST = ROOT / "dist"
NAME = "finetune-studio"


def build() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN",
                    "--distpath", str(DIST), "--workpath", str(ROOT / "build" / "pyinstaller"),
                    str(ROOT / "packaging" / f"{NAME}.spec")], check=True, cwd=ROOT)
    return time.monotonic() - started


def program() -> Path:
    return DIST / NAME / (f"{NAME}.exe" if sys.platform == "win32" else NAME)


def run_app(args: list[str], home: Path, runtime: Path | None = None, timeout: int = 300):
    """The built app with throwaway settings and runs, offscreen, standing alone (no PYTHONPATH)."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "STUDIO_RUNTIME_DIR": str(runtime or home / "runtime"),
           "XDG_CONFIG_HOME": str(home / "config"), "XDG_DATA_HOME": str(home / "data"),
           "STUDIO_RUNS_DIR": str(home / "runs")}
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(program()), *args], env=env, capture_output=True, text=True, timeout=timeout)


def smoke(home: Path) -> str:
    """The window opens and quits; a training command without a runtime refuses with the fix. Else SystemExit."""
    started = time.monotonic()
    done = run_app(["--smoke"], home)
    if done.returncode != 0 or "window shown" not in done.stdout:
        raise SystemExit(f"the built app did not start (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}")
    seconds = time.monotonic() - started
    refused = run_app(["-m", "studio.train.runtime_check"], home)
    if refused.returncode == 0 or "Training runtime" not in refused.stderr:
        raise SystemExit(f"without a runtime, `-m` should refuse with the fix; it said:\n{refused.stderr[-2000:]}")
    report = f"{done.stdout.strip()} (started and quit in {seconds:.1f} s); without a runtime `-m` refuses: " \
             f"{refused.stderr.splitlines()[0]}"
    return report + (f"; {menu_entry(home)}" if sys.platform == "linux" else "")


def menu_entry(home: Path) -> str:
    """``--install-menu-entry`` writes a desktop entry that starts this very program, and its icons."""
    done = run_app(["--install-menu-entry"], home)
    entry = home / "data" / "applications" / f"{NAME}.desktop"
    if done.returncode != 0 or not entry.is_file() or f'Exec="{program()}"' not in entry.read_text():
        raise SystemExit(f"--install-menu-entry did not write {entry}:\n{done.stdout}\n{done.stderr[-2000:]}")
    return f"menu entry: {entry.name} with Exec={program().name}"


def demo_through(runtime: Path, home: Path) -> str:
    """``finetune-studio -m studio demo`` through a ready runtime: the bundle's way of training."""
    started = time.monotonic()
    done = run_app(["-m", "studio", "demo", "--run-dir", str(home / "demo")], home, runtime, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the demo through {runtime} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    match = next(line for line in done.stdout.splitlines() if line.startswith("exact match"))
    return f"demo through the runtime: held-out {' '.join(match.split())} (base, fine-tuned) " \
           f"({time.monotonic() - started:.0f} s)"


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def archive(folder: Path) -> Path:
    kind = "zip" if sys.platform == "win32" else "gztar"
    return Path(shutil.make_archive(str(DIST / f"{NAME}-{sys.platform}"), kind, folder.parent, folder.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-build", action="store_true", help="only start the app built before")
    parser.add_argument("--archive", action="store_true", help="also write the compressed archive for a release")
    parser.add_argument("--demo-runtime", type=Path, metavar="DIR",
                        help="also train the demo through the built app with this ready runtime folder")
    args = parser.parse_args()
    seconds = 0.0 if args.skip_build else build()
    if not args.skip_build:
        print(f"built in {seconds:.0f} s")
    if sys.platform == "linux":
        shutil.copyfile(ROOT / "packaging" / f"{NAME}.desktop", DIST / NAME / f"{NAME}.desktop")
    print(f"size: {folder_size(DIST / NAME) / 1e6:.0f} MB in {DIST / NAME}")
    if args.archive:
        made = archive(DIST / NAME)
        print(f"archive: {made.stat().st_size / 1e6:.0f} MB in {made}")
    with tempfile.TemporaryDirectory(prefix="studio-smoke-") as home:
        print(smoke(Path(home)))
        if args.demo_runtime:
            print(demo_through(args.demo_runtime, Path(home)))


if __name__ == "__main__":
    main()
