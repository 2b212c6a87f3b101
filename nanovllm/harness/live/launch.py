"""Turning ``live.*`` into what a run needs: extra loggers, and for ``web`` the dashboard's own process.

``start_live`` (before the model loads) and ``LiveSession.attach`` / ``close`` are all ``run.py`` calls. The dashboard never gets a say over the run: its port is checked
before the run starts (taken: a warning, and the run goes on without it), it runs as a child process that only
reads the run's files at a lower CPU priority (niceness 10; its log is ``live.log`` in the run directory), and
every live logger is wrapped so an
error in it switches it off with a warning instead of ending the run.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from nanovllm.harness.live.config import LiveConfig
from nanovllm.serving.loggers import RunLogger


def _warn(message: str) -> None:
    print(f"warning: live: {message}", file=sys.stderr, flush=True)


class NeverFails(RunLogger):
    """Wraps a logger so that its first error disables it (one warning) rather than failing the run."""

    def __init__(self, inner: RunLogger) -> None:
        self.inner = inner
        self.failed = False

    def _call(self, hook: str, *args: Any, **kwargs: Any) -> None:
        if self.failed:
            return
        try:
            getattr(self.inner, hook)(*args, **kwargs)
        except Exception as exc:  # the run matters more than its live view: report and go on without it
            self.failed = True
            _warn(f"{type(self.inner).__name__}.{hook} failed ({type(exc).__name__}: {exc}); live view off")

    def start(self, *args: Any, **kwargs: Any) -> None:
        self._call("start", *args, **kwargs)

    def log_step(self, step: Mapping[str, Any]) -> None:
        self._call("log_step", step)

    def log_request(self, record: Mapping[str, Any]) -> None:
        self._call("log_request", record)

    def log_summary(self, summary: dict, breakdowns: dict | None = None) -> None:
        self._call("log_summary", summary, breakdowns)

    def finish(self) -> None:
        self._call("finish")


def free_port(host: str, port: int) -> int | None:
    """``port`` if it can be bound on ``host`` now (0: a free one, chosen by the OS); None if it is taken."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as tornado binds: TIME_WAIT is no obstacle
        try:
            sock.bind((host, port))
        except OSError:
            return None
        return sock.getsockname()[1]


@dataclass
class LiveSession:
    """The live view of one run: loggers to add, and the dashboard process (web) to close at the end."""

    config: LiveConfig
    run_dir: Path
    loggers: list[RunLogger] = field(default_factory=list)
    process: subprocess.Popen | None = None
    url: str | None = None

    def attach(self, engine: Any, num_requests: int) -> list[RunLogger]:
        """The loggers that feed the live view from ``engine`` (block snapshots; the terminal view for tui)."""
        _start_loggers(self, engine, num_requests)
        return self.loggers

    def close(self, keep_open: bool = False) -> None:
        """Stop the dashboard, after serving until Ctrl-C if ``keep_open`` and someone is at the terminal."""
        process = self.process
        if process is None:
            return
        if process.poll() is not None:
            _warn(f"the dashboard exited early (status {process.returncode}); see {self.run_dir / 'live.log'}")
            return
        if keep_open and sys.stdin.isatty():  # nobody could press Ctrl-C otherwise (CI, scripts, nohup)
            print(f"live dashboard still at {self.url} (Ctrl-C to stop; reopen later with "
                  f"python -m nanovllm.viz --live {self.run_dir})", flush=True)
            try:
                process.wait()
            except KeyboardInterrupt:
                print(file=sys.stderr)
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self.process = None


def start_live(config: LiveConfig, run_dir: Path) -> LiveSession:
    """Set up ``config.mode`` for a run in ``run_dir``, before the model loads: the dashboard process (web)
    starts now, so that its own imports overlap the model's loading. ``off``: nothing at all."""
    session = LiveSession(config, Path(run_dir))
    if config.mode == "web":
        _start_dashboard(session)
    return session


def _start_loggers(session: LiveSession, engine: Any, num_requests: int) -> None:
    config = session.config
    if config.mode == "off":
        return
    # The engine side of a live view (torch, and rich for tui) only when one is on: live=off imports nothing.
    from nanovllm.cluster import Cluster
    from nanovllm.harness.live.snapshot import ClusterInfoLogger, SnapshotLogger

    if isinstance(engine, Cluster):  # each replica's batch and KV usage come from steps.jsonl
        session.loggers.append(NeverFails(ClusterInfoLogger(engine, num_requests)))
        return
    session.loggers.append(NeverFails(SnapshotLogger(engine, num_requests, config.snapshot_every)))
    if config.mode == "tui":
        from nanovllm.harness.live.tui import TuiLogger  # rich, for live=tui only

        session.loggers.append(NeverFails(TuiLogger(engine, num_requests, config.update_ms)))


def _lower_priority() -> None:
    # The dashboard yields the CPU to the engine whenever both want it: on a small machine that is the
    # difference between watching a run and slowing it down.
    os.nice(DASHBOARD_NICENESS)


DASHBOARD_NICENESS = 10


def _start_dashboard(session: LiveSession) -> None:
    config = session.config
    port = free_port(config.host, config.port)
    if port is None:
        _warn(f"port {config.port} on {config.host} is in use, so no dashboard for this run (choose another "
              f"with live.port=...); the run goes on and python -m nanovllm.viz --live {session.run_dir} "
              f"can attach later")
        return
    session.run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "nanovllm.viz", "--live", str(session.run_dir), "--host", config.host,
               "--port", str(port), "--update-ms", str(config.update_ms), "--starting"]
    with open(session.run_dir / "live.log", "w", encoding="utf-8") as log:
        session.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           preexec_fn=_lower_priority)
    atexit.register(session.close)  # a run that ends in an error must not leave its dashboard behind
    session.url = f"http://{config.host}:{port}/"
    print(f"live dashboard: {session.url}", flush=True)
