"""A server that runs for days: per-request deadlines (``timeout`` in the request, ``server.request_timeout`` by
default) abort the request, free its blocks and answer OpenAI's error object (408); a stopping server drains its
requests in flight for ``server.drain_timeout`` seconds and aborts the rest; ``/health`` is not ready while
draining or when no replica of a cluster is alive. Real servers on 127.0.0.1 (uvicorn in a thread), bounded
requests."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers import wait_for
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.server.app import ServerState
from nanovllm.server.config import ServerConfig
from nanovllm.server.http import start_in_thread
from nanovllm.server.prometheus import ServerMetrics
from test_server import MODEL, no_blocks_in_use, post_stream, serve_in_thread, stop_served

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": True, "temperature": 0}


def test_a_request_past_its_timeout_is_aborted_with_a_408_error_object_and_its_blocks_freed(tmp_path):
    served = serve_in_thread(tmp_path, ServerConfig(port=0, request_timeout=0.4), max_model_len=1024)
    try:
        started = time.monotonic()
        response = httpx.post(f"{served.url}/v1/completions", json={**LONG, "timeout": 0.3}, timeout=120)
        assert time.monotonic() - started < 30
        assert response.status_code == 408
        error = response.json()["error"]
        assert error["type"] == "timeout_error" and error["param"] == "timeout" and error["code"] == "timeout"
        assert error["message"] == "the request timed out: not done within its timeout of 0.3 s"
        # the server's default applies to a request without its own; streaming gets the error event, then [DONE]
        streamed, events = post_stream(served.url, "/v1/completions", {**LONG, "stream": True})
        assert streamed.status_code == 200
        assert events[-1]["error"]["code"] == "timeout"   # (sse_events checked that [DONE] follows it)
        assert "timeout of 0.4 s" in events[-1]["error"]["message"] and len(events) > 1
        # a request's own timeout overrides the default: a short one well within it finishes
        ok = httpx.post(f"{served.url}/v1/completions", json={**LONG, "max_tokens": 4, "timeout": 60}, timeout=120)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: no_blocks_in_use(served), "the blocks freed", timeout=10)
        timed_out = [r for r in served.records if r["error"] and r["error"].startswith("timed out")]
        assert len(timed_out) == 2 and all(r["finish_reason"] == "abort" for r in timed_out)
        assert all(0 < r["num_output_tokens"] < 900 for r in timed_out)
    finally:
        stop_served(served)


def test_a_bad_timeout_is_a_400_naming_the_field(tmp_path):
    served = serve_in_thread(tmp_path, max_model_len=1024)
    try:
        response = httpx.post(f"{served.url}/v1/completions", json={**LONG, "timeout": 0}, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == "timeout"
    finally:
        stop_served(served)
    with pytest.raises(ValueError, match="server.request_timeout must be seconds > 0 or null"):
        ServerConfig(request_timeout=0)
    with pytest.raises(ValueError, match="server.drain_timeout must be seconds >= 0"):
        ServerConfig(drain_timeout=-1)


def test_a_stopping_server_drains_its_requests_in_flight_then_aborts_what_is_left(tmp_path):
    served = serve_in_thread(tmp_path, ServerConfig(port=0, drain_timeout=60), max_model_len=1024)
    results = {}

    def stream(name, max_tokens):
        results[name] = post_stream(served.url, "/v1/completions",
                                    {**LONG, "max_tokens": max_tokens, "stream": True})

    client = threading.Thread(target=stream, args=("short", 48))
    client.start()
    wait_for(lambda: served.state.engine.queue_lengths()[0] > 0, "the stream running", timeout=30)
    loop = served.state.engine_loop
    stopper = threading.Thread(target=served.running.stop)
    stopper.start()
    wait_for(lambda: loop.stopping, "the server draining", timeout=10)
    client.join(120)
    stopper.join(120)
    _, events = results["short"]
    finals = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finals[-1] == "length"   # it ran to its end while the server drained
    (record,) = served.records
    assert record["error"] is None and record["num_output_tokens"] == 48
    served.state.engine_loop.write_summary()

    # with a short drain, a long request is aborted "interrupted" once it is over
    short = serve_in_thread(tmp_path / "short", ServerConfig(port=0, drain_timeout=0.3), max_model_len=1024)
    results.clear()
    client = threading.Thread(target=lambda: results.setdefault(
        "long", post_stream(short.url, "/v1/completions", {**LONG, "stream": True})))
    client.start()
    wait_for(lambda: short.state.engine.queue_lengths()[0] > 0, "the stream running", timeout=30)
    started = time.monotonic()
    short.running.stop()
    client.join(60)
    assert time.monotonic() - started < 20
    (record,) = short.records
    assert record["error"] == "interrupted" and 0 < record["num_output_tokens"] < 900


def test_health_is_not_ready_when_no_replica_of_a_cluster_is_alive(tmp_path):
    """A simulated cluster behind the server, both replicas dead from the start (``cluster.faults``): the first
    request fails with the reason and ``/health`` answers 503 saying why."""
    cluster = ServedCluster.simulated(
        ClusterConfig(replicas=2, faults={"deaths": [{"replica": 0, "time": 0.0}, {"replica": 1, "time": 0.0}]}),
        "round_robin", {"name": "sim", "step_time": "token_cost"}, None,
        EngineConfig(num_kv_blocks=64, max_num_seqs=4, dtype="bfloat16"))
    state = ServerState(cluster.engine, ServerConfig(port=0), MODEL, ServerMetrics(MODEL, "fcfs", "paged"))
    running = start_in_thread(state)
    try:
        url = running.url
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        response = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 4}, timeout=60)
        assert response.status_code == 500
        assert "no live replica is left to route it to" in response.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["message"] == "not serving: no replica is alive"
    finally:
        running.stop()
