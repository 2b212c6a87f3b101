"""vLLM's OpenAI server as the experiments that measure it start and stop it (``sim_predicts_vllm.py``,
``spec_vs_rate.py``): wait until it answers, and stop it with everything it started.

The server must be started in a process group of its own (``subprocess.Popen(..., start_new_session=True)``):
vLLM's API process starts an EngineCore process, and stopping only the API process can leave that one running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import psutil


def wait_up(url: str, proc: subprocess.Popen, timeout: float = 300.0, log_path: Path | None = None) -> None:
    """Return once ``url`` (the API's base, ending in ``/v1``) lists its models; ``RuntimeError`` naming the
    cause (with the end of the server's log at ``log_path``, when given) if the server exits or is not up within
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = f":\n{log_path.read_text()[-3000:]}" if log_path is not None else ""
            raise RuntimeError(f"vLLM's server exited with {proc.returncode} before serving{log}")
        try:
            urllib.request.urlopen(url + "/models", timeout=2)
            return
        except OSError:
            time.sleep(1)
    where = f" (its log: {log_path})" if log_path is not None else ""
    raise RuntimeError(f"vLLM's server was not up after {timeout:.0f} s{where}")


def stop_vllm(proc: subprocess.Popen) -> list[int]:
    """Stop the server's process group, then kill (by id) any of its descendants still alive (vLLM's
    EngineCore); returns the ids that had to be killed."""
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):   # the group is gone already
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    _, alive = psutil.wait_procs(family, timeout=15)
    for child in alive:
        child.kill()
    return [child.pid for child in alive]
