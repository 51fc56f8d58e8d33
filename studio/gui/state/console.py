"""Reading what subprocesses print: whole lines, the worker's console file, and readable errors. No Qt.

The app starts the worker with its stdout and stderr appended to
``RUN_DIR/console.log`` (the run's own log is train.log); before the first
event arrives, its lines are all there is to show that the worker is alive.
"""

from __future__ import annotations

import re
from pathlib import Path

from studio.gui.state.job_state import ErrorReport

CONSOLE_FILE = "console.log"
CONSOLE_TAIL_CHARS = 20000


class LineSplitter:
    """Bytes in, complete lines out; a partial line waits for its end."""

    def __init__(self):
        self._pending = b""

    def feed(self, data: bytes) -> list[str]:
        data = (self._pending + data).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._pending = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]

    def flush(self) -> list[str]:
        rest, self._pending = self._pending, b""
        return [rest.decode("utf-8", errors="replace")] if rest.strip() else []


LOADING_WORDS = ("Loading", "Download", "Fetching", "loading")
_PROGRESS_BAR = re.compile(r"\|[^|]*\|")  # tqdm's |█████     | between the label and the counts


def loading_detail(line: str) -> str:
    """A console line worth showing while the model loads, made short; "" for the others."""
    line = line.strip()
    if line.startswith("[studio] run directory"):
        return "reading the data, loading the tokenizer and the model"
    is_progress_bar = "%" in line and _PROGRESS_BAR.search(line)  # e.g. a Hub download's tqdm bar
    if not is_progress_bar and not any(word in line for word in LOADING_WORDS):
        return ""
    return re.sub(r"\s+", " ", _PROGRESS_BAR.sub(" ", line)).strip()[:100]


class ConsoleTail:
    """Follows the worker's console file: the last meaningful line and the recent text."""

    def __init__(self, path: Path):
        self.path, self.offset = path, path.stat().st_size if path.is_file() else 0
        self.text, self.note = "", ""
        self._splitter = LineSplitter()

    def read(self) -> None:
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                chunk = file.read()
        except OSError:
            return
        self.offset += len(chunk)
        for line in self._splitter.feed(chunk):
            self.text = (self.text + line + "\n")[-CONSOLE_TAIL_CHARS:]
            self.note = loading_detail(line) or self.note


def console_error(text: str) -> ErrorReport | None:
    """A readable error from a subprocess's console output (worker, export, generate), if it printed one.

    The command line prints ``error: MESSAGE`` and ``  hint: HINT`` for a refused
    config; a Python traceback ends with ``ExceptionType: message``.
    """
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if line.startswith("error: "):
            message = [line[len("error: "):]]
            hint = ""
            for follow in lines[index + 1:]:
                if follow.strip().startswith("hint:"):
                    hint = follow.strip()[len("hint:"):].strip()
                    break
                message.append(follow.strip())
            return ErrorReport("\n".join(message), hint, "console")
    if any(line.startswith("Traceback") for line in lines):
        return ErrorReport(f"it stopped with {lines[-1]}", "the log has the full traceback", "console")
    return None
