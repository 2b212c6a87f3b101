"""``calibrate_server``: the simulator calibrated to a server from what its client sees. Against a real
``python -m nanovllm.serve`` on 127.0.0.1 (slow): the profile, run by the simulator itself, reproduces the
batch-1 TTFT and ITL it was fitted from, within the fit's own largest residual. Bad input (a URL where nothing
listens, a server that answers errors, a bad plan) is one clear error naming it (fast: a standard-library HTTP
server in a thread)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from helpers import cli_env, free_port, wait_until_healthy, workload_request
from nanovllm.harness.sim.calibrate_server import (
    CalibrationPlan,
    ServerCalibrationError,
    calibrate_server,
    client_overhead,
    main,
    measure,
    with_client_overhead,
)
from nanovllm.serving.metrics import summarize

SERVER = ["engine.warmup=false", "monitor.calibrate=false", "engine.num_kv_blocks=128", "engine.max_model_len=512",
          "engine.dtype=float32"]
PLAN = dict(prompt_lens=(8, 32, 96, 192), concurrency=(1, 2, 4), output_len=6, burst_prompt_lens=(16, 64),
            burst_output_len=12, max_burst_tokens=200, repeats=2)


@pytest.fixture(scope="module")
def our_server(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("calibrate_server")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanovllm.serve", *SERVER, f"server.port={port}",
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=cli_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, url, timeout=240)
        yield f"{url}/v1"
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_the_fitted_profile_run_by_the_simulator_reproduces_the_batch1_ttft_and_itl_it_was_fitted_from(
        our_server, tmp_path):
    from nanovllm.config import EngineConfig
    from nanovllm.harness.sim import Simulation

    out = tmp_path / "server.yaml"
    profile = calibrate_server(CalibrationPlan(url=our_server, **PLAN), out, dtype="float32", progress=False)
    assert yaml.safe_load(out.read_text()) == profile
    assert client_overhead(out) == profile["client_overhead"] >= 0
    observed = {(o["kind"], o["prompt_len"], o["batch"]): o for o in profile["observations"]}
    # Every burst within max_burst_tokens: 3 sizes of 16-token prompts, 2 of 64 (4 x 76 tokens is over 200).
    assert len(observed) == 2 * len(PLAN["prompt_lens"]) + 3 + 2
    # One request at a time, each alone in the engine, as the calibration sent them (prompts sharing no block).
    workload = [workload_request(f"r{length}", list(range(1000 * (i + 1), 1000 * (i + 1) + length)), PLAN["output_len"],
                                 arrival=100.0 * i) for i, length in enumerate(PLAN["prompt_lens"])]
    sim = Simulation.build(EngineConfig(dtype="float32", num_kv_blocks=128, max_model_len=512), "calibrated",
                           profile=str(out), scheduler="vllm_v1", allocator="prefix")
    simulated = sim.serve(workload).requests
    records = with_client_overhead(simulated, profile["client_overhead"])
    # The simulator's steps are the fitted model's, so it misses each measurement by that row's residual: never
    # more than the largest one (a feature read differently by the fit and the simulator would).
    tolerance = profile["fit"]["max_abs_residual_s"] * (1 + 1e-6) + 1e-9
    for record in records:
        length = record["num_prompt_tokens"]
        ttft = record["first_token_time"] - record["arrival_time"]
        times = record["token_times"]
        itl = (times[-1] - times[0]) / (len(times) - 1)
        assert abs(ttft - observed["ttft", length, 1]["measured_s"]) <= tolerance, (length, ttft, profile["fit"])
        assert ttft == pytest.approx(observed["ttft", length, 1]["fitted_s"], rel=1e-9)
        assert abs(itl - observed["itl", length, 1]["measured_s"]) <= tolerance, (length, itl, profile["fit"])
        assert itl == pytest.approx(observed["itl", length, 1]["fitted_s"], rel=1e-9)
    # The overhead moves TTFT and E2E, never the time between tokens.
    plain = summarize(simulated, ())
    shifted = summarize(records, ())
    assert shifted["median_ttft_ms"] == pytest.approx(plain["median_ttft_ms"] + profile["client_overhead"] * 1e3)
    assert shifted["median_tpot_ms"] == pytest.approx(plain["median_tpot_ms"])


def test_a_url_where_nothing_listens_is_one_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(ServerCalibrationError, match=f"url={url}: cannot reach the server"):
        measure(CalibrationPlan(url=url, **PLAN), progress=False)
    with pytest.raises(SystemExit, match=f"error: url={url}: cannot reach the server"):
        main(["--url", url, "--out", "unused.yaml"])


class _FailingServer(BaseHTTPRequestHandler):
    """Lists one model and answers every completion with HTTP 500."""

    def do_GET(self):  # noqa: N802 (the standard library's name)
        self._reply(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(500, {"error": {"message": "the engine died", "type": "InternalServerError"}})

    def _reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        """Nothing logged: the test reads the replies, not the server's log."""


def test_a_server_that_answers_errors_is_one_error_naming_the_request_and_the_message():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FailingServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        with pytest.raises(ServerCalibrationError,
                           match=rf"url={url}: calibration request warmup \(warm-up\) failed: HTTP 500: the engine died"):
            measure(CalibrationPlan(url=url, **PLAN), progress=False)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("field, value", [("url", "127.0.0.1:8000"), ("prompt_lens", (8, 8, 16)),
                                          ("prompt_lens", (8, 0, 16)), ("concurrency", (4,)),
                                          ("output_len", 2), ("burst_output_len", 5), ("repeats", 0),
                                          ("burst_prompt_lens", ()), ("max_burst_tokens", 10),
                                          ("warmup_rounds", -1)])
def test_a_bad_plan_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CalibrationPlan(**{**PLAN, "url": "http://127.0.0.1:1/v1", field: value})
