"""SIGINT / SIGTERM during ``python -m nanovllm.run``, with a real subprocess: the run stops within a step,
writes every finished request, records each unfinished one as aborted (reason ``interrupted``), keeps
``steps.jsonl`` whole, writes ``metrics.json`` with ``"interrupted": true`` and exits 130 / 143. A multirun
writes its summary over the jobs that ran and marks the interrupted one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_run import _env

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
                            env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
