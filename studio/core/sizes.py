"""Byte sizes as users read and write them: binary units (GiB, MiB, KiB), as GPU tools report memory."""

from __future__ import annotations

import re

from studio.core.errors import StudioError

GIB = 1024**3


def format_bytes(count: int) -> str:
    """``21.30 GiB``: binary units, as GPU tools report memory."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


_UNITS = {"": 1024**3, "b": 1, "kb": 10**3, "kib": 1024, "mb": 10**6, "mib": 1024**2, "gb": 10**9, "gib": 1024**3,
          "tb": 10**12, "tib": 1024**4, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """``24GiB``, ``24GB``, ``16000MiB`` or a bare number of GiB, as bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise StudioError(f"cannot read the memory size {text!r}", "write it like 24GiB, 24GB or 16000MiB", kind="usage")
    return int(float(match.group(1)) * _UNITS[unit])
