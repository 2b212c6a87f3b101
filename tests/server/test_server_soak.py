"""A server that runs for days holds bounded memory: the real HTTP server on 127.0.0.1 over the simulated engine
(``runner=sim``'s, no model weights) answers many requests while it holds at most ``server.records_window``
request and step records; its run's files get every record, and ``metrics.json`` (from running aggregates, not
records) equals ``metrics.summarize`` over the whole ``requests.jsonl``. The aggregates themselves are checked
against ``summarize`` below and above their reservoir's capacity."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import numpy as np
import pytest

from nanovllm.config import EngineConfig
from nanovllm.harness.sim import Simulation
from nanovllm.server.app import ServerState
from nanovllm.server.config import ServerConfig
from nanovllm.server.http import start_in_thread
from nanovllm.server.prometheus import ServerMetrics
from nanovllm.serving.aggregates import GroupedAggregates, RequestAggregates
from nanovllm.serving.loggers import JsonlLogger
from nanovllm.serving.metrics import SLO, _latencies_s, breakdown, is_completed, summarize
from nanovllm.serving.records import read_jsonl

MODEL = "sim-soak"
WINDOW = 40
NUM_REQUESTS = 600
STEP_FIGURES = ("num_steps", "peak_kv_usage", "mean_kv_usage", "mean_step_ms", "num_evictions",
                "mean_kv_slots_unused", "mean_kv_blocks_cached")


def _sim_server(run_dir, window: int):
    """The simulated engine behind the real server (uvicorn in a thread, a free loopback port)."""
    engine = Simulation.build(EngineConfig(num_kv_blocks=256, max_num_seqs=16, max_model_len=256, dtype="bfloat16",
                                           warmup=False),
                              {"name": "token_cost", "step_overhead": 0.001, "time_per_token": 0.0001}).engine
    files = JsonlLogger()
    files.start(run_dir, {"server": "soak-test"})
    state = ServerState(engine, ServerConfig(port=0, records_window=window), MODEL,
                        ServerMetrics(MODEL, "fcfs", "paged"), loggers=[files])
    return state, start_in_thread(state)


def test_the_server_holds_a_bounded_window_of_records_while_its_files_and_summary_cover_every_request(tmp_path):
    state, running = _sim_server(tmp_path, WINDOW)
    held: list[tuple[int, int]] = []
    rng = random.Random(0)
    try:
        loop = state.running_loop()

        async def one(client: httpx.AsyncClient, i: int) -> int:
            body = {"model": MODEL, "prompt": [rng.randrange(1, 1000) for _ in range(rng.randint(1, 24))],
                    "max_tokens": rng.randint(1, 12), "ignore_eos": True, "temperature": 0,
                    "priority": i % 3}
            response = await client.post("/v1/completions", json=body, headers={"x-request-id": f"soak-{i}"})
            held.append(loop.num_records_held)
            return response.json()["usage"]["completion_tokens"]

        async def drive() -> list[int]:
            limit = asyncio.Semaphore(16)
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                async def bounded(i: int) -> int:
                    async with limit:
                        return await one(client, i)
                return await asyncio.gather(*(bounded(i) for i in range(NUM_REQUESTS)))

        tokens = asyncio.run(drive())
    finally:
        running.stop()
    summary = state.engine_loop.write_summary()
    for run_logger in state.loggers:
        run_logger.finish()

    # bounded: never more than the window held, and exactly the window once that many had ended
    assert max(r for r, _ in held) <= WINDOW and max(s for _, s in held) <= WINDOW
    assert state.engine_loop.num_records_held == (WINDOW, WINDOW)
    assert [r["request_id"] for r in state.engine_loop.records] == \
        [r["request_id"] for r in read_jsonl(tmp_path / "requests.jsonl")][-WINDOW:]
    # the files hold every record
    records = read_jsonl(tmp_path / "requests.jsonl")
    steps = read_jsonl(tmp_path / "steps.jsonl")
    assert len(records) == NUM_REQUESTS and {r["request_id"] for r in records} == {f"soak-{i}" for i in
                                                                                     range(NUM_REQUESTS)}
    assert sum(r["num_output_tokens"] for r in records) == sum(tokens)
    assert len(steps) == summary["num_steps"] > WINDOW
    # the summary from aggregates equals summarize over every record (exact: fewer values than the reservoir)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    full = summarize(records, steps)
    for key, value in full.items():
        if key in STEP_FIGURES and isinstance(value, float):
            assert metrics[key] == pytest.approx(value, rel=1e-9), key   # running sums: float rounding only
        else:
            assert metrics[key] == value, key
    assert metrics["completed"] == NUM_REQUESTS
    assert metrics["breakdowns"]["priority"] == json.loads(json.dumps(breakdown(records, "priority")))


def _records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        arrival = i * 0.01
        first = arrival + rng.expovariate(20)
        times = [first]
        for _ in range(rng.randint(0, 5)):
            times.append(times[-1] + rng.expovariate(50))
        status = rng.random()
        out.append({"request_id": str(i), "client_id": None, "priority": rng.randrange(3),
                    "arrival_time": arrival, "first_scheduled_time": arrival + 0.001, "first_token_time": first,
                    "finish_time": times[-1], "token_times": times, "num_prompt_tokens": rng.randint(1, 50),
                    "num_cached_tokens": rng.randint(0, 1), "num_output_tokens": len(times),
                    "num_preemptions": rng.randint(0, 1), "num_recomputed_tokens": 0,
                    "finish_reason": "abort" if status < 0.05 else "length",
                    "error": "client disconnected" if status < 0.05 else ("engine fault" if status < 0.08 else None),
                    "slo_ttft": 0.05 if i % 2 else None, "slo_e2el": None})
    return out


def test_aggregates_equal_summarize_while_they_fit_and_estimate_it_past_their_capacity():
    records, slo = _records(2_000, seed=1), SLO(ttft_ms=60, tpot_ms=30)
    exact = RequestAggregates(slo)
    for record in records:
        exact.add(record)
    assert exact.summary() == summarize(records, (), slo=slo)
    groups = GroupedAggregates("priority", slo)
    for record in records:
        groups.add(record)
    assert groups.breakdown(exact.duration) == breakdown(records, "priority", slo=slo)

    small = RequestAggregates(slo, capacity=500)   # fewer slots than values: counts exact, quantiles sampled
    for record in records:
        small.add(record)
    estimate, truth = small.summary(), summarize(records, (), slo=slo)
    assert len(small.latencies["itl"].sample) == 500 < small.latencies["itl"].count
    population = {name: np.asarray(values) * 1000.0 for name, values in _latencies_s(
        [r for r in records if is_completed(r)]).items()}
    for key, value in truth.items():
        stat, _, name = key.removesuffix("_ms").partition("_")
        if key.endswith("_ms") and stat in ("mean", "std") and value is not None:
            assert estimate[key] == pytest.approx(value, rel=1e-6), key   # running sums, exact up to rounding
        elif key.endswith("_ms") and value is not None and name in population:
            # a sampled quantile: its rank in the whole population is near the one asked for (rank error
            # ~ 1/sqrt(500) = 4.5% at one sigma, so 10 points is a wide margin for this seed)
            q = 0.5 if stat == "median" else float(stat[1:]) / 100
            rank = float(np.mean(population[name] <= estimate[key]))
            assert abs(rank - q) <= 0.1, (key, rank)
        elif key.endswith("_ms"):
            assert estimate[key] == value, key
        else:
            assert estimate[key] == (pytest.approx(value) if isinstance(value, float) else value), key


def test_a_record_window_must_hold_one_record():
    with pytest.raises(ValueError, match="server.records_window must be an integer >= 1"):
        ServerConfig(records_window=0)
