"""Build the desktop download (the window alone, no torch) with PyInstaller, then start it offscreen.

    pip install -e ".[packaging]"        # PyInstaller, uv, Pillow (icon conversion on Windows and macOS)
    python packaging/build_bundle.py     # -> dist/finetune-studio/ (dist/Finetune Studio.app on macOS)

It runs packaging/finetune-studio.spec, starts the result with ``--smoke`` (offscreen: QT_QPA_PLATFORM
is set, and the user's settings and runtime folders are temporary ones), and prints the build time, the
size of the folder and of a compressed archive, as docs/packaging.md records them. ``--archive`` also
writes that archive next to the folder (.tar.gz on Linux and macOS, .zip on Windows) for a release.
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


def smoke() -> str:
    """Start the built app offscreen with throwaway settings; its report line, or SystemExit."""
    with tempfile.TemporaryDirectory(prefix="studio-smoke-") as home:
        env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "STUDIO_RUNTIME_DIR": str(Path(home) / "runtime"),
               "XDG_CONFIG_HOME": str(Path(home) / "config"), "XDG_DATA_HOME": str(Path(home) / "data"),
               "STUDIO_RUNS_DIR": str(Path(home) / "runs")}
        env.pop("PYTHONPATH", None)  # the bundle must stand alone
        started = time.monotonic()
        done = subprocess.run([str(program()), "--smoke"], env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or "window shown" not in done.stdout:
        raise SystemExit(f"the built app did not start (exit {done.returncode}):\n{done.stdout}\n{done.stderr[-4000:]}")
    return f"{done.stdout.strip()} (started and quit in {time.monotonic() - started:.1f} s)"


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file() and not path.is_symlink())


def archive(folder: Path) -> Path:
    kind = "zip" if sys.platform == "win32" else "gztar"
    return Path(shutil.make_archive(str(DIST / f"{NAME}-{sys.platform}"), kind, folder.parent, folder.name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-build", action="store_true", help="only start the app built before")
    parser.add_argument("--archive", action="store_true", help="also write the compressed archive for a release")
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
    print(smoke())


if __name__ == "__main__":
    main()
