"""Stop requests that work on every OS.

Three channels, any of which may be missing on a platform: a control file in the
run directory (``STOP`` / ``ABORT``, what the GUI uses), a line ``stop`` or
``abort`` on stdin, and SIGTERM/SIGINT where the OS has them. The first request
asks for a clean stop (checkpoint, then exit); a second one, or an explicit
abort, interrupts the main thread at once.
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading

from studio.core.run.directory import RunDir


class StopController:
    def __init__(self, run_dir: RunDir, watch_stdin: bool = True, poll_seconds: float = 0.5):
        self.run_dir = run_dir
        self.requests = 0
        self.aborting = False
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._previous_handlers: dict[int, object] = {}
        self._install_signal_handlers()
        threading.Thread(target=self._poll_files, args=(poll_seconds,), daemon=True, name="stop-files").start()
        if watch_stdin and sys.stdin is not None and not sys.stdin.closed:
            threading.Thread(target=self._read_stdin, daemon=True, name="stop-stdin").start()

    @property
    def stop_requested(self) -> bool:
        return self.requests > 0

    def request(self, abort: bool = False) -> None:
        """Count a request; the second, or an abort, interrupts the main thread."""
        with self._lock:
            self.requests += 1
            if (abort or self.requests > 1) and not self.aborting:
                self.aborting = True
                _thread.interrupt_main()

    def close(self) -> None:
        self._closed.set()
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in ("SIGTERM", "SIGINT", "SIGBREAK"):
            signum = getattr(signal, name, None)
            if signum is not None:
                self._previous_handlers[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.stop_requested or self.aborting:
            self.aborting = True
            raise KeyboardInterrupt  # second request: abort now, from inside the handler
        self.requests += 1

    def _poll_files(self, poll_seconds: float) -> None:
        stop_seen = False
        while not self._closed.wait(poll_seconds):
            if self.run_dir.abort_file.exists():
                self.request(abort=True)
                return
            if not stop_seen and self.run_dir.stop_file.exists():
                stop_seen = True
                self.request()

    def _read_stdin(self) -> None:
        try:
            for line in sys.stdin:
                command = line.strip().lower()
                if command in ("stop", "abort"):
                    self.request(abort=command == "abort")
        except (OSError, ValueError):
            pass  # stdin closed or not readable: the other channels remain
