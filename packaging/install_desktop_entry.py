"""Put Finetune Studio in the Linux desktop menu (freedesktop.org: GNOME, KDE, Xfce...).

Run it with the Python that has finetune-studio installed (after `pip install -e .`):

    python packaging/install_desktop_entry.py              # for this user (~/.local/share)
    python packaging/install_desktop_entry.py --uninstall

The desktop download does the same with `finetune-studio --install-menu-entry` (packaging/studio_app.py).

It copies the .desktop entry with Exec pointing at this installation's `studio`
command, and the icon (SVG, plus the 256 px PNG) into the hicolor theme.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ICONS = HERE.parent / "resources" / "icons"
NAME = "finetune-studio"


def data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def targets(root: Path) -> dict[str, Path]:
    return {
        "desktop": root / "applications" / f"{NAME}.desktop",
        "svg": root / "icons" / "hicolor" / "scalable" / "apps" / f"{NAME}.svg",
        "png": root / "icons" / "hicolor" / "256x256" / "apps" / f"{NAME}.png",
    }


def studio_command() -> str:
    """The `studio` script next to this Python, or `python -m studio` when there is none."""
    script = Path(sys.executable).with_name("studio")
    found = str(script) if script.is_file() else shutil.which("studio")
    return f'"{found}"' if found else f'"{sys.executable}" -m studio'


def install(root: Path, command: str | None = None, icons: Path = ICONS) -> None:
    """Install the entry starting ``command`` (default: this installation's `studio`) and the icons."""
    paths = targets(root)
    for path in paths.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    entry = (HERE / f"{NAME}.desktop").read_text(encoding="utf-8")
    paths["desktop"].write_text(entry.replace("Exec=studio", f"Exec={command or studio_command()}"), encoding="utf-8")
    shutil.copyfile(icons / f"{NAME}.svg", paths["svg"])
    shutil.copyfile(icons / f"{NAME}.png", paths["png"])
    refresh(root)
    print(f"installed {paths['desktop']}; Finetune Studio is in the menu (log out and in if it does not show yet)")


def uninstall(root: Path) -> None:
    for path in targets(root).values():
        path.unlink(missing_ok=True)
    refresh(root)
    print("removed the menu entry and icons")


def refresh(root: Path) -> None:
    """Let the desktop notice at once; both tools are optional."""
    for command in (["update-desktop-database", str(root / "applications")],
                    ["gtk-update-icon-cache", "-q", "-t", str(root / "icons" / "hicolor")]):
        if shutil.which(command[0]):
            subprocess.run(command, check=False, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uninstall", action="store_true")
    parser.add_argument("--prefix", type=Path, help="a share/ folder other than $XDG_DATA_HOME (e.g. /usr/local/share)")
    args = parser.parse_args()
    root = args.prefix or data_home()
    if args.uninstall:
        uninstall(root)
    else:
        install(root)


if __name__ == "__main__":
    main()
