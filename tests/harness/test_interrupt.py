"""SIGINT / SIGTERM during ``python -m nanovllm.run``, with a real subprocess: the run stops within a step,
writes every finished request, records each unfinished one as aborted (reason ``interrupted``), keeps
``steps.jsonl`` whole, writes ``metrics.json`` with ``"interrupted": true`` and exits 130 / 143. A multirun
writes its summary over the jobs that ran and marks the interrupted one.

Before serving starts, a signal ends the run at once: status 130 / 143, one ``error: interrupted by SIGINT
while <phase>; nothing was served`` line, no traceback, whatever the phase (the imports, Hydra's composition,
the model load, the wait for another process's kernel build, the engine's warm-up).
``tests/startup_hold/sitecustomize.py`` parks the subprocess in a phase, so the signal lands there for sure; the
waits poll with a timeout, never sleep.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from helpers import TINY, cli_env, held_env

# Slow arrivals and long outputs: the run is mid-flight (requests running, others not yet arrived) when signalled.
BUSY = [
    "workload=synthetic", "workload.num_requests=40", "workload.request_rate=4",
    "workload.input_len.kind=fixed", "workload.input_len.mean=8",
    "workload.output_len.kind=fixed", "workload.output_len.mean=48", "workload.ignore_eos=true",
    "engine.num_kv_blocks=64", "engine.max_model_len=512", "monitor.calibrate=false", "progress=false",
]


def _start(tmp_path: Path, *overrides: str, multirun: bool = False) -> subprocess.Popen:
    mode = ["-m"] if multirun else []
    return subprocess.Popen([sys.executable, "-m", "nanovllm.run", *mode, *BUSY, *overrides], cwd=tmp_path,
                            env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text(encoding="utf-8").count("\n") >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before it was signalled:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"{path} never reached {n} lines")


def _lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"{path.name} has a torn last line"
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_signalled_run_writes_what_it_has_and_exits_with_the_signal_status(tmp_path, sig, status):
    run_dir = tmp_path / "run"
    proc = _start(tmp_path, f"hydra.run.dir={run_dir}")
    _wait_for_lines(run_dir / "steps.jsonl", 5, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == status, stderr[-3000:]
    assert f"error: interrupted by {signal.Signals(sig).name}" in stderr and "Traceback" not in stderr

    requests = _lines(run_dir / "requests.jsonl")
    steps = _lines(run_dir / "steps.jsonl")
    metrics = json.loads((run_dir / "metrics.json").read_text(encoding="utf-8"))
    aborted = [r for r in requests if r["finish_reason"] == "abort"]
    assert aborted, "nothing was in flight when the signal came"
    assert all(r["error"] == "interrupted" and r["finish_time"] is not None for r in aborted)
    assert all(r["finish_reason"] == "length" and r["num_output_tokens"] == 48
               for r in requests if r not in aborted)
    assert len({r["request_id"] for r in requests}) == len(requests)
    assert metrics["interrupted"] is True and metrics["aborted"] == len(aborted)
    assert metrics["completed"] == len(requests) - len(aborted)
    assert metrics["not_arrived"] == 40 - len(requests) > 0
    assert [s["step"] for s in steps] == list(range(len(steps))) and metrics["num_steps"] == len(steps)


def test_an_interrupted_multirun_summarizes_the_jobs_that_ran(tmp_path):
    sweep_dir = tmp_path / "sweep"
    proc = _start(tmp_path, "scheduler=fcfs,priority", f"hydra.sweep.dir={sweep_dir}", multirun=True)
    _wait_for_lines(sweep_dir / "0" / "steps.jsonl", 5, proc)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    summary = (sweep_dir / "summary.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines()[2:]}
    assert "interrupted by SIGINT" in rows["0"] and "not run: the sweep was interrupted" in rows["1"]
    assert json.loads((sweep_dir / "0" / "metrics.json").read_text())["interrupted"] is True


# -- a signal during start-up --------------------------------------------------------------------------------------

# Generous bounds for "it did not hang", not performance assertions: the machine may be shared and slow.
STARTUP_TIMEOUT = 240.0
ENDS_WITHIN = 30.0


class _Run:
    """``python -m nanovllm.run`` in a subprocess whose stdout and stderr are read as they come."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "nanovllm.run", *args], cwd=tmp_path,
                                     env=env or cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.stdout), (self.proc.stderr, self.stderr))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    def wait_for(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not done():
            if self.proc.poll() is not None:
                self.finish()
                raise AssertionError(f"the run ended (status {self.proc.returncode}) before {what}:\n"
                                     f"{''.join(self.stderr)[-3000:]}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"{what} did not happen within {STARTUP_TIMEOUT:.0f} s")
            time.sleep(0.05)

    def signal_and_finish(self, sig: int) -> float:
        """Send ``sig``; return how long the process took to end (it is killed past ENDS_WITHIN)."""
        sent = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=ENDS_WITHIN)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.finish()
            raise AssertionError(f"still running {ENDS_WITHIN:.0f} s after {signal.Signals(sig).name}:\n"
                                 f"{''.join(self.stderr)[-3000:]}") from None
        took = time.monotonic() - sent
        self.finish()
        return took

    def finish(self) -> None:
        self.proc.wait()
        for reader in self._readers:
            reader.join(timeout=10)

    def error_line(self, ignore: tuple[str, ...] = ()) -> str:
        """The one non-empty stderr line (besides those starting with ``ignore``), asserted to be one
        ``error:`` line with no traceback anywhere."""
        text = "".join(self.stderr)
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        lines = [line for line in text.splitlines() if line.strip() and not line.startswith(ignore)]
        assert len(lines) == 1 and lines[0].startswith("error: "), text[-3000:]
        return lines[0]


STARTUP = [*TINY, "progress=false"]


@pytest.mark.parametrize("hold, phase, sig", [
    ("torch", "importing torch", signal.SIGINT),
    ("hydra._internal.logging_config", "composing the config", signal.SIGTERM),  # imported by hydra.main
    ("nanovllm.engine.model_runner:load_model", "loading the model", signal.SIGINT),
    ("nanovllm.engine.warmup:_requests", "warming up the engine", signal.SIGINT),  # inside warm_up's loop
], ids=["imports", "hydra-composition", "model-load", "warm-up"])
def test_a_signal_during_start_up_ends_the_run_at_once_with_one_line(tmp_path, hold, phase, sig):
    run_dir = tmp_path / "run"
    run = _Run(tmp_path, *STARTUP, f"hydra.run.dir={run_dir}", env=held_env(tmp_path, hold))
    run.wait_for((tmp_path / "held").is_file, f"the start-up reached {hold}")
    took = run.signal_and_finish(sig)
    assert run.proc.returncode == 128 + sig, "".join(run.stderr)[-3000:]
    name = signal.Signals(sig).name
    line = run.error_line()
    assert line.startswith(f"error: interrupted by {name} while {phase}"), line
    assert line.endswith("; nothing was served"), line
    assert took < ENDS_WITHIN
    if hold.startswith("nanovllm."):  # Hydra got that far: its run directory stays, with nothing served
        assert (run_dir / ".hydra" / "config.yaml").is_file()
        assert not (run_dir / "metrics.json").exists()


def test_a_signal_while_the_real_model_loads_ends_the_run_at_once(tmp_path):
    # No hook: the signal comes as soon as Hydra has written the job's config, so during the real start-up
    # (importing the engine, reading the tokenizer, loading the weights): which of them is not asserted.
    run_dir = tmp_path / "run"
    run = _Run(tmp_path, *STARTUP, f"hydra.run.dir={run_dir}")
    run.wait_for((run_dir / ".hydra" / "config.yaml").is_file, "Hydra wrote the job's config")
    run.signal_and_finish(signal.SIGINT)
    assert run.proc.returncode == 130, "".join(run.stderr)[-3000:]
    line = run.error_line()
    assert line.startswith("error: interrupted by SIGINT while ") and line.endswith("; nothing was served"), line
    assert not (run_dir / "metrics.json").exists()


def test_a_signal_while_waiting_for_another_process_kernel_build(tmp_path):
    # This process holds the build lock of a fresh kernel cache, as a process building the kernels would; the
    # run finds no built kernels there and waits (the converted model is shared, so nothing big is redone).
    import filelock

    from nanovllm import kernels, machine
    from nanovllm.models.loader import resolve_model
    from nanovllm.paths import cache_root

    model_dir = resolve_model()  # converted once into the shared cache, if it is not already
    cache = tmp_path / "cache"
    (cache / "extensions").mkdir(parents=True)
    if model_dir.parent == cache_root():
        (cache / model_dir.name).symlink_to(model_dir, target_is_directory=True)
    build_dir = cache / "extensions" / kernels.build_name(kernels.kernel_build(machine.selected_isa()))
    build_dir.mkdir()
    waiting = "nano-vllm: waiting for another process's kernel build"
    run_dir = tmp_path / "run"
    with filelock.FileLock(str(build_dir / "build.lock")):
        # bfloat16 (the default run's dtype) loads the kernels while it loads the model (its fast path).
        run = _Run(tmp_path, *STARTUP, "engine.dtype=bfloat16", f"hydra.run.dir={run_dir}",
                   env=cli_env(tmp_path, NANOVLLM_CACHE=str(cache)))
        run.wait_for(lambda: any(line.startswith(waiting) for line in run.stderr), "the run waited for the build")
        run.signal_and_finish(signal.SIGINT)
    assert run.proc.returncode == 130, "".join(run.stderr)[-3000:]
    assert run.error_line(ignore=(waiting,)) == (
        "error: interrupted by SIGINT while waiting for another process's kernel build; nothing was served")
    assert not list(build_dir.glob("*.so"))


def test_a_multirun_interrupted_while_a_job_starts_summarizes_the_jobs(tmp_path):
    # As when a job is interrupted while serving: the job says so, the later ones do not start, the summary
    # is written over them and the sweep exits with the signal's status.
    sweep_dir = tmp_path / "sweep"
    run = _Run(tmp_path, "-m", *STARTUP, "scheduler=fcfs,priority", f"hydra.sweep.dir={sweep_dir}",
               env=held_env(tmp_path, "nanovllm.engine.model_runner:load_model"))
    run.wait_for((tmp_path / "held").is_file, "job 0 started loading the model")
    run.signal_and_finish(signal.SIGINT)
    stderr = "".join(run.stderr)
    assert run.proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    summary = (sweep_dir / "summary.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines()[2:]}
    assert "interrupted by SIGINT while loading the model; nothing was served" in rows["0"], summary
    assert "not run: the sweep was interrupted by SIGINT" in rows["1"], summary
