"""Ctrl-C and SIGTERM during ``python -m nanovllm.run``: at once while the run starts, a clean stop once it serves.

The entry point installs ``StopSignals`` before it imports anything heavy. Until the serving loop starts (the
imports, Hydra composing the config, the config checks, the model load, a kernel build or the wait for another
process's build, the engine's warm-up, the monitor's calibration) a signal raises :class:`StartupInterrupt` (a
``KeyboardInterrupt``) at once, and :func:`one_line_interrupts` around the entry point turns it into one
``error: interrupted by SIGINT while loading the model; nothing was served`` line and the shell's status for
the signal (130 for SIGINT, 143 for SIGTERM); what was written (Hydra's run directory with ``.hydra/``) stays.

Once serving has started (:meth:`StopSignals.serving`), SIGINT and SIGTERM only set an event; the serving loop
checks it between steps, aborts what is unfinished (recorded with reason ``interrupted``), writes the run's
files and returns, and the caller exits with the same status. A step is never cut in half, so no record is
torn. A second signal while stopping raises ``KeyboardInterrupt`` at once, for a user who really wants out
(one line too). The handlers are process-wide: one instance serves every job of a multirun, so jobs after the
interrupted one see ``requested`` and do not start.

This module imports nothing heavy: ``nanovllm/run.py`` installs it before torch, transformers and Hydra load.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import traceback
from types import FrameType
from typing import Iterator

from nanovllm.harness.errors import exit_with_error, full_tracebacks  # light: no Hydra, no torch

HANDLED = (signal.SIGINT, signal.SIGTERM)


class StartupInterrupt(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived before the run started serving: nothing was served."""


class StopSignals:
    """The stop request of this process: ``event`` is set by the first SIGINT/SIGTERM, ``signum`` says which.
    ``phase`` says what the process is doing, for the message of an interrupt that comes before serving."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.phase = "starting"
        self.graceful = False  # True from serving() on: a signal only sets the event

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

    def starting(self, phase: str) -> None:
        """The run is starting (``phase``: what it does now, e.g. ``loading the model``): a signal interrupts
        at once. Each job of a multirun starts here again."""
        self.phase = phase
        self.graceful = False

    def serving(self, phase: str = "serving") -> None:
        """A loop that watches ``event`` runs from now on (the serving loop; a multirun's launcher, between and
        around its jobs): a signal asks it to stop after the current step or job."""
        self.phase = phase
        self.graceful = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: stopping without cleanup")
        self.signum = signum
        self.event.set()
        if not self.graceful:
            raise StartupInterrupt(signal.Signals(signum).name)

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


# Where in the start-up an interrupt landed, read off its traceback (innermost match wins), so the engine and
# the kernels need not report their progress to the harness: (file, function or None for any, phase).
_PHASES_BY_FRAME: tuple[tuple[str, str | None, str], ...] = (
    ("nanovllm/kernels.py", "__enter__", "waiting for another process's kernel build"),
    ("nanovllm/kernels.py", "_build", "building the C++ kernels"),
    ("torch/utils/cpp_extension.py", None, "building the C++ kernels"),
    ("nanovllm/kernels.py", None, "loading the C++ kernels"),
    ("nanovllm/models/loader.py", "resolve_model", "preparing the model files (GGUF conversion, checksums)"),
    ("nanovllm/models/loader.py", None, "loading the model"),
    ("nanovllm/engine/model_runner.py", "__init__", "loading the model"),
    ("nanovllm/engine/tp/runner.py", "__init__", "loading the model"),
)


def startup_phase(exc: BaseException) -> str:
    """What the run was doing when ``exc`` (an interrupt) was raised: ``STOP.phase``, made precise from the
    traceback where it was inside the model load, a kernel build or wait, or the engine's warm-up."""
    frames = [(frame.f_code.co_filename.replace(os.sep, "/"), frame.f_code.co_name)
              for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for filename, function in reversed(frames):
        if "/nanovllm/engine/" in filename and "warm" in function.lower():
            return "warming up the engine"
        for suffix, name, phase in _PHASES_BY_FRAME:
            if filename.endswith(suffix) and (name is None or name == function):
                return phase
    return STOP.phase


def interrupt_message(exc: KeyboardInterrupt) -> str:
    """What to say of an interrupt that ended the run before the serving loop could stop it cleanly: where the
    start-up was (nothing was served), or, for a second signal while serving, that it stopped at once."""
    if not isinstance(exc, StartupInterrupt) and isinstance(exc.__context__, StartupInterrupt):
        exc = exc.__context__  # a second signal cut the first one's cleanup short: say where the first came
    if isinstance(exc, StartupInterrupt) or not STOP.graceful:
        return f"interrupted by {STOP.name} while {startup_phase(exc)}; nothing was served"
    what = exc.args[0] if exc.args else f"{STOP.name} while {STOP.phase}"
    return f"{what}; the run's files hold what was written before it"


@contextlib.contextmanager
def one_line_interrupts() -> Iterator[None]:
    """Around the entry point: an interrupt that escapes (one during start-up, or a second signal) ends the
    process with ``error: <interrupt_message>`` on stderr and status 130 / 143, no traceback
    (``HYDRA_FULL_ERROR=1``: the traceback, as for every other error)."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if full_tracebacks():
            raise
        exit_with_error(interrupt_message(exc), STOP.exit_status)
