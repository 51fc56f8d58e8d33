"""Render resources/icons/finetune-studio.svg to the PNG the window and the desktop menu use.

    python packaging/render_icon.py [--size 256]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import Qt  # noqa: E402
from PySide6.QtGui import QGuiApplication, QImage, QPainter  # noqa: E402
from PySide6.QtSvg import QSvgRenderer  # noqa: E402

ICONS = Path(__file__).resolve().parents[1] / "resources" / "icons"
SVG = ICONS / "finetune-studio.svg"


def render(size: int, target: Path) -> None:
    renderer = QSvgRenderer(str(SVG))
    if not renderer.isValid():
        raise SystemExit(f"{SVG} is not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    if not image.save(str(target)):
        raise SystemExit(f"cannot write {target}")
    print(f"wrote {target} ({size}x{size})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    QGuiApplication.instance() or QGuiApplication([])
    render(args.size, ICONS / "finetune-studio.png")


if __name__ == "__main__":
    main()
