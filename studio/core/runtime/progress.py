"""How far a runtime setup has come: bytes in uv's cache, packages ready, and the time left.

uv prints little while it downloads when its output is not a terminal, so the setup is measured where
it lands: uv unpacks each downloaded package into ``archive-v0/<id>`` of its cache (in flight it sits in
a hidden temporary folder). A finished package folder never changes again, so it is measured once.
"""

from __future__ import annotations

import os
import re
import time
from collections import deque
from pathlib import Path

GB, MB = 1000**3, 1000**2
RESOLVED = re.compile(r"Resolved (\d+) packages?")
RATE_WINDOW_S = 20.0


def folder_bytes(path: Path) -> int:
    total = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # removed while we looked: uv renames finished downloads
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total


class CacheMeter:
    """The bytes and finished packages in a uv cache folder, cheap to ask again and again."""

    def __init__(self, cache: Path):
        self.cache = cache
        self._finished: dict[str, int] = {}

    def measure(self) -> tuple[int, int]:
        """(bytes, finished packages) now."""
        archive = self.cache / "archive-v0"
        in_flight = 0
        try:
            entries = list(os.scandir(archive))
        except OSError:
            entries = []
        for entry in entries:
            if entry.name.startswith("."):
                in_flight += folder_bytes(Path(entry.path))
            elif entry.name not in self._finished:
                self._finished[entry.name] = folder_bytes(Path(entry.path))
        for other in _hidden_folders(self.cache):
            in_flight += folder_bytes(other)
        return sum(self._finished.values()) + in_flight, len(self._finished)


def _hidden_folders(folder: Path) -> list[Path]:
    try:
        return [Path(entry.path) for entry in os.scandir(folder) if entry.name.startswith(".tmp")]
    except OSError:
        return []


class SetupProgress:
    """Progress towards ``expected_bytes`` on disk, with the rate of the last RATE_WINDOW_S seconds."""

    def __init__(self, expected_bytes: int, clock=time.monotonic):
        self.expected_bytes = expected_bytes
        self.clock = clock
        self.bytes_done = 0
        self.packages_done = 0
        self.packages_total: int | None = None
        self._samples: deque[tuple[float, int]] = deque()

    def note_line(self, line: str) -> None:
        """uv says how many packages the set has once it has resolved it."""
        match = RESOLVED.search(line)
        if match:
            self.packages_total = int(match.group(1))

    def update(self, bytes_done: int, packages_done: int) -> None:
        now = self.clock()
        self.bytes_done, self.packages_done = bytes_done, packages_done
        self._samples.append((now, bytes_done))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()

    @property
    def fraction(self) -> float:
        return min(self.bytes_done / self.expected_bytes, 0.99) if self.expected_bytes else 0.0

    def rate(self) -> float:
        """Bytes per second lately; 0 before two samples."""
        if len(self._samples) < 2:
            return 0.0
        (start, first), (end, last) = self._samples[0], self._samples[-1]
        return (last - first) / (end - start) if end > start else 0.0

    def seconds_left(self) -> float | None:
        rate = self.rate()
        if rate <= 0:
            return None
        return max(self.expected_bytes - self.bytes_done, 0) / rate

    def text(self) -> str:
        """``1.2 GB of about 6.3 GB · 12 of 59 packages · 8.4 MB/s · about 4 min left``"""
        parts = [f"{self.bytes_done / GB:.1f} GB of about {self.expected_bytes / GB:.1f} GB"]
        if self.packages_total:
            parts.append(f"{min(self.packages_done, self.packages_total)} of {self.packages_total} packages")
        elif self.packages_done:
            parts.append(f"{self.packages_done} packages ready")
        rate = self.rate()
        if rate > 0:
            parts.append(f"{rate / MB:.1f} MB/s")
        left = self.seconds_left()
        if left is not None:
            parts.append(f"about {duration_words(left)} left")
        return " · ".join(parts)


def duration_words(seconds: float) -> str:
    if seconds < 60:
        return "1 min" if seconds > 30 else "a few seconds"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes / 60:.1f} h"
