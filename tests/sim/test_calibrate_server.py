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
    BATCH_LEAD_S,
    MIXED_DECODE_PROMPT,
    MIXED_INJECT_S,
    CalibrationPlan,
    Observation,
    ServerCalibrationError,
    calibrate_server,
    client_overhead,
    decode_features,
    fit,
    main,
    measure,
    prefill_features,
    refit,
    with_client_overhead,
)
from nanovllm.harness.sim.step_time import KNEE_FEATURE, CalibratedStepTime
from nanovllm.serving.metrics import summarize

SERVER = ["engine.warmup=false", "monitor.calibrate=false", "engine.num_kv_blocks=128", "engine.max_model_len=512",
          "engine.dtype=float32"]
PLAN = dict(prompt_lens=(8, 32, 96, 192), concurrency=(1, 2, 4), output_len=6, burst_prompt_lens=(16, 64),
            burst_output_len=12, max_burst_tokens=200, prefill_batches=((16, 3), (48, 2)), mixed_steps=((3, 24, 2),),
            repeats=1, warmup_rounds=0)   # the fit reproduces what it measured, however noisy: one round


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
    assert len(observed) == (2 * len(PLAN["prompt_lens"]) + 3 + 2 + len(PLAN["prefill_batches"])
                             + len(PLAN["mixed_steps"]))
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
    # A batched prefill as the calibration sent it: the simulator runs the batch in the step after the leading
    # request's prefill, beside its first decode, and that step is the fitted one.
    for length, count in PLAN["prefill_batches"]:
        lead = workload_request("lead", list(range(1000, 1000 + max(PLAN["prompt_lens"]))), 2)
        batch = [workload_request(f"b{i}", list(range(5000 + 100 * i, 5000 + 100 * i + length)), 2,
                                  arrival=BATCH_LEAD_S) for i in range(count)]
        sim = Simulation.build(EngineConfig(dtype="float32", num_kv_blocks=128, max_model_len=512), "calibrated",
                               profile=str(out), scheduler="vllm_v1", allocator="prefix")
        ended = {r["request_id"]: r for r in sim.serve([lead, *batch]).requests}
        step = ended["b0"]["first_token_time"] - ended["lead"]["first_token_time"]
        assert all(ended[f"b{i}"]["first_token_time"] == ended["lead"]["token_times"][1] for i in range(count))
        assert step == pytest.approx(observed["batched_prefill", length, count]["fitted_s"], rel=1e-9)
        assert abs(step - observed["batched_prefill", length, count]["measured_s"]) <= tolerance
    # A mixed step as the calibration sent it: the newcomers' prefill joins the decoders' step. The simulator's
    # decoders reach it at a context a few tokens off the measured one (their pace is the fit's), which the
    # context term prices at microseconds: 1 ms of slack covers it.
    for decodes, length, count in PLAN["mixed_steps"]:
        decoders = [workload_request(f"d{i}", list(range(2000 + 100 * i, 2000 + 100 * i + MIXED_DECODE_PROMPT)), 200)
                    for i in range(decodes)]
        newcomers = [workload_request(f"n{i}", list(range(9000 + 100 * i, 9000 + 100 * i + length)), 2,
                                      arrival=MIXED_INJECT_S) for i in range(count)]
        sim = Simulation.build(EngineConfig(dtype="float32", num_kv_blocks=128, max_model_len=512), "calibrated",
                               profile=str(out), scheduler="vllm_v1", allocator="prefix")
        ended = {r["request_id"]: r for r in sim.serve([*decoders, *newcomers]).requests}
        joined = ended["n0"]["first_token_time"]
        times = ended["d0"]["token_times"]
        k = times.index(joined)   # the newcomers' first tokens come out of a decode step
        assert abs((times[k] - times[k - 1]) - observed["mixed", length, count]["measured_s"]) <= tolerance + 1e-3
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
                                          ("warmup_rounds", -1), ("prefill_batches", ((16, 0),)),
                                          ("prefill_batches", ((16,),)), ("mixed_steps", ((2, 16),)),
                                          ("mixed_steps", ((0, 16, 2),))])
def test_a_bad_plan_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        CalibrationPlan(**{**PLAN, "url": "http://127.0.0.1:1/v1", field: value})


def _bent_server_observations(knee: int, per_row: float) -> list[Observation]:
    """What a client would measure of a server whose step costs 40 ms + 0.02 ms a prefill token + 1 us a
    context token, plus ``per_row`` a row past ``knee`` rows (flat below it), with a 3 ms client overhead."""
    def step_seconds(features: dict) -> float:
        rows = features["num_prefill_tokens"] + features["num_decode_seqs"]
        return (0.040 + 2e-5 * features["num_prefill_tokens"] + 1e-6 * features["context_tokens"]
                + per_row * max(0, rows - knee))
    observations = []
    for length in (16, 64, 256, 512, 1024):
        observations.append(Observation("ttft", length, 1, step_seconds(prefill_features(length)) + 0.003,
                                        prefill_features(length), client=1))
        observations.append(Observation("itl", length, 1, step_seconds(decode_features(1, length + 16)),
                                        decode_features(1, length + 16)))
    for length in (32, 512):
        for batch in (1, 2, 4, 8, 16, 32, 64, 128):
            features = decode_features(batch, length + 24)
            observations.append(Observation("itl", length, batch, step_seconds(features), features, burst=True))
    return observations


def test_the_fit_finds_where_a_servers_step_cost_bends_and_the_simulator_prices_steps_on_both_sides(tmp_path):
    observations = _bent_server_observations(knee=8, per_row=0.001)
    fitted = fit(observations)
    assert fitted["knee_rows"] == 8
    assert fitted["coefficients"][KNEE_FEATURE] == pytest.approx(0.001, rel=1e-3)
    assert fitted["client_overhead"] == pytest.approx(0.003, rel=1e-3)
    assert fitted["fit"]["max_abs_rel_error"] < 1e-3
    # A straight line through the same observations misses the bend on both sides.
    assert fit(observations, knee_rows=None)["fit"]["max_abs_rel_error"] > 0.05
    profile = {"step_time": "calibrated", "intercept": fitted["intercept"], "coefficients": fitted["coefficients"],
               "knee_rows": fitted["knee_rows"]}
    path = tmp_path / "bent.yaml"
    path.write_text(yaml.safe_dump(profile))
    model = CalibratedStepTime(profile=str(path))
    for o in observations:
        if o.kind == "itl":   # one step each: the simulator's price is the measured step
            assert model.predict(o.features, 0.0) == pytest.approx(o.measured_s, rel=1e-3)


def test_a_server_whose_steps_do_not_bend_gets_no_knee():
    observations = _bent_server_observations(knee=0, per_row=0.0005)   # a straight line from the first row
    fitted = fit(observations)
    assert fitted["knee_rows"] is None
    assert KNEE_FEATURE not in fitted["coefficients"]
    assert fitted["fit"]["max_abs_rel_error"] < 1e-3


def test_a_profile_fitted_again_from_what_it_records_is_the_fit_of_the_measurements_themselves():
    observations = _bent_server_observations(knee=16, per_row=0.002)
    profile = {"calibration": {"prompt_lens": [16, 64, 256, 512, 1024], "output_len": 32, "burst_output_len": 48},
               **fit(observations, knee_rows=None)}
    again = refit(profile)
    direct = fit(observations)
    assert again["knee_rows"] == direct["knee_rows"] == 16
    assert again["coefficients"] == pytest.approx(direct["coefficients"], rel=1e-9)
    assert again["calibration"] == profile["calibration"]
    assert refit(profile, knee_rows=None)["coefficients"] == pytest.approx(profile["coefficients"], rel=1e-9)
