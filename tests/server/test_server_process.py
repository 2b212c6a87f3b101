"""``python -m nanovllm.serve`` as a user starts it: a real subprocess on a free loopback port, configured
through Hydra like ``python -m nanovllm.run``. One server shared by the module (API key, health, the run's
files; stopped with SIGINT at the end: status 130, ``metrics.json`` written), plus the SIGTERM test: requests
in flight end with a finish reason, every one of them is recorded, and the process exits 143. Bad options fail
before the model loads, with one line."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from helpers import REPO, cli_env, free_port, wait_for, wait_until_healthy
from test_server import sse_events

API_KEY = "test-key"
SMALL = ["engine.warmup=false", "monitor.calibrate=false", "engine.num_kv_blocks=128", "engine.max_model_len=512",
         "engine.dtype=float32"]


def _start(tmp_path: Path, *overrides: str) -> tuple[subprocess.Popen, str, Path]:
    run_dir = tmp_path / "run"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", *SMALL, f"server.port={port}",
                             f"hydra.run.dir={run_dir}", *overrides], cwd=tmp_path, env=cli_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, timeout=240)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, url, run_dir


def _stop(proc: subprocess.Popen, sig: int) -> tuple[str, str]:
    proc.send_signal(sig)
    try:
        return proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def _lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n"), f"{path.name} has a torn last line"
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("serve")
    proc, url, run_dir = _start(tmp_path, f"server.api_key={API_KEY}", "scheduler=priority", "allocator=prefix")
    yield url, run_dir, proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_the_api_key_guards_v1_and_the_server_runs_the_configured_plugins(server):
    url, _, _ = server
    body = {"prompt": "Hello", "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models", timeout=60).status_code == 401
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # open, as a load balancer needs it
    auth = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{url}/v1/completions", json={**body, "priority": 1}, headers=auth, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{url}/v1/models", headers=auth, timeout=60).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    assert 'policy="priority"' in metrics and 'allocator="prefix"' in metrics


def test_a_server_run_is_a_run_its_files_written_as_it_serves_and_at_sigint(server):
    url, run_dir, proc = server
    auth = {"Authorization": f"Bearer {API_KEY}", "x-request-id": "files-1"}
    response, events = None, []
    with httpx.Client(timeout=60) as client:
        response = client.post(f"{url}/v1/chat/completions", headers=auth, json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
        events = sse_events(response.text)
        summary = client.post(f"{url}/run/summary", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert summary["server"] is True and summary["completed"] >= 1
    assert json.loads((run_dir / "metrics.json").read_text())["completed"] == summary["completed"]
    assert "files-1" in {r["request_id"] for r in _lines(run_dir / "requests.jsonl")}
    assert (run_dir / ".hydra" / "config.yaml").is_file() and _lines(run_dir / "steps.jsonl")

    stdout, stderr = _stop(proc, signal.SIGINT)
    assert proc.returncode == 130, stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["interrupted"] is True and metrics["completed"] >= summary["completed"]
    assert "machine" in metrics and "nano-vllm: serving 'SmolLM2-135M-Instruct'" in stdout
    assert "Traceback" not in stderr


def test_sigterm_ends_every_request_in_flight_records_them_and_exits_143(tmp_path):
    proc, url, run_dir = _start(tmp_path, "engine.max_num_seqs=2")
    streams: dict[str, str] = {}

    def stream(request_id: str) -> None:
        # Long outputs: with two running at a time, one request waits while the others decode.
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, headers={"x-request-id": request_id},
                          json={"prompt": "Count to a thousand:", "max_tokens": 400, "ignore_eos": True,
                                "stream": True, "stream_options": {"include_usage": True}}) as response:
            streams[request_id] = "".join(f"{line}\n\n" for line in response.iter_lines() if line)

    threads = [threading.Thread(target=stream, args=(f"term-{i}",)) for i in range(3)]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(_lines(run_dir / "steps.jsonl")) >= 5 if (run_dir / "steps.jsonl").is_file() else False,
             "the server is stepping")
    stdout, stderr = _stop(proc, signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    # Every stream ended properly: its last token chunk says why, then the usage, then [DONE].
    assert set(streams) == {"term-0", "term-1", "term-2"}
    for raw in streams.values():
        events = sse_events(raw)
        assert events[-1]["choices"] == [] and events[-2]["choices"][0]["finish_reason"] == "abort"
    records = _lines(run_dir / "requests.jsonl")
    assert sorted(r["request_id"] for r in records) == ["term-0", "term-1", "term-2"]
    assert all(r["finish_reason"] == "abort" and r["error"] == "interrupted" for r in records)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["interrupted"] is True and metrics["aborted"] == 3
    # New connections are refused once it has stopped.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=5)


@pytest.mark.parametrize("overrides, expected", [
    (["server.port=70000"], "server.port must be an integer in [0, 65535]"),
    (["runner=sim"], "python -m nanovllm.serve serves the real model"),
    (["scheduler.name=fcsf"], "unknown policy 'fcsf'"),
])
def test_bad_server_options_fail_before_the_model_loads_with_one_line(tmp_path, overrides, expected):
    proc = subprocess.run([sys.executable, "-m", "nanovllm.serve", *SMALL, *overrides,
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1 and expected in proc.stderr, proc.stderr[-3000:]
    error_lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "steps.jsonl").exists()
