"""Ctrl-C and SIGTERM as a request to stop, not a crash.

While ``StopSignals`` is installed, SIGINT and SIGTERM only set an event; the serving loop checks it between
steps, aborts what is unfinished (recorded with reason ``interrupted``), writes the run's files and returns, and
the caller exits with the shell's status for that signal (130 for SIGINT, 143 for SIGTERM). A step is never cut
in half, so no record is torn. A second signal while stopping raises ``KeyboardInterrupt`` at once, for a user
who really wants out. The handlers are process-wide: one instance serves every job of a multirun, so jobs after
the interrupted one see ``requested`` and do not start.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """The stop request of this process: ``event`` is set by the first SIGINT/SIGTERM, ``signum`` says which."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.event.is_set()

    @property
    def exit_status(self) -> int:
        """The conventional shell status for death by this signal: 128 + its number."""
        return 128 + (self.signum or signal.SIGINT)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum or signal.SIGINT).name

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without cleanup")
        self.signum = signum
        self.event.set()

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopSignals"]:
        """Handle SIGINT/SIGTERM while the block runs (main thread only); the previous handlers come back after."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


STOP = StopSignals()  # the process's one stop request (``python -m nanovllm.run`` installs it)
