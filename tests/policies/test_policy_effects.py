"""Each policy's defining effect, shown on a generated workload served by the real engine on the simulated
runner (``runner=sim``, ``helpers.simulate``): the real scheduler, policy and allocator, the serving loop, its
records and summary, with time counted in engine steps or tokens (the ``token_cost`` step-time model), never
wall time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import bare_scheduler, by_id, make_request, simulate, workload_request
from nanovllm import POLICIES
from nanovllm.engine.scheduler import PolicyError
from nanovllm.serving.metrics import tpot_s, ttft_s


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(1000, 30000, n)]


# -- lpm ----------------------------------------------------------------------------------------------------------

def _shared_prefix_workload(n=48, groups=4, prefix_len=64, suffix_len=8, gap=0.25, seed=0):
    """Several long system prompts, requests of each interleaved in arrival order (group i % groups)."""
    rng = np.random.default_rng(seed)
    prefixes = [_tokens(rng, prefix_len) for _ in range(groups)]
    return [workload_request(f"r{i}", prefixes[i % groups] + _tokens(rng, suffix_len), 4, arrival=i * gap)
            for i in range(n)]


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_lpm_gets_more_cache_hits_and_lower_ttft_than_fcfs_on_shared_prefixes(allocator):
    # 24 blocks of 8 tokens hold the two running requests (10 blocks each) and a few cached blocks: not all four
    # 64-token system prompts. FCFS's interleaved order evicts each prompt before its next use; lpm groups them.
    runs = {policy: simulate(policy, _shared_prefix_workload(), allocator=allocator, num_blocks=24,
                             max_num_seqs=2, max_num_batched_tokens=32)
            for policy in ("fcfs", "lpm")}
    lpm, fcfs = runs["lpm"].summary, runs["fcfs"].summary
    assert lpm["prefix_cache_hit_rate"] > fcfs["prefix_cache_hit_rate"] + 0.1
    assert lpm["mean_ttft_ms"] < fcfs["mean_ttft_ms"]


def test_lpm_aging_bound_stops_starvation_of_requests_without_a_cache_hit():
    # A steady stream sharing one system prompt, at the rate two seats can serve, keeps lpm busy with cache
    # hits; a few requests share nothing with it. Plain lpm leaves them waiting until the stream ends.
    def waits(max_wait):
        rng = np.random.default_rng(1)
        system = _tokens(rng, 32)
        stream = [workload_request(f"hot{i}", system + _tokens(rng, 4), 2, arrival=float(i)) for i in range(150)]
        loners = [workload_request(f"cold{i}", _tokens(rng, 36), 2, arrival=5.0 + 10 * i) for i in range(4)]
        run = simulate({"name": "lpm", "max_wait": max_wait}, stream + loners, allocator="prefix", num_blocks=64,
                       max_num_seqs=2, max_num_batched_tokens=64)
        return {r["request_id"]: r["first_scheduled_time"] - r["arrival_time"] for r in run.requests}

    bound = 8.0
    seat_frees_within = 3.0   # requests of 2 output tokens leave their seat within 3 steps of starting
    starved, aged = waits(math.inf), waits(bound)
    assert min(starved[f"cold{i}"] for i in range(4)) > 10 * bound, starved
    assert max(aged.values()) <= bound + seat_frees_within, max(aged.values())


# -- sarathi vs prefill_first -------------------------------------------------------------------------------------

def _decodes_with_long_prompts_arriving(seed=0):
    """Eight long-running decodes, and a 1024-token prompt arriving every 40 token-time units."""
    rng = np.random.default_rng(seed)
    decoders = [workload_request(f"d{i}", _tokens(rng, 16), 200, arrival=0.0) for i in range(8)]
    prompts = [workload_request(f"p{i}", _tokens(rng, 1024), 4, arrival=200.0 + 1500.0 * i) for i in range(6)]
    return decoders + prompts


def test_sarathi_has_lower_tail_tpot_and_itl_than_prefill_first():
    kw = dict(num_blocks=4096, block_size=16, max_num_seqs=16, max_num_batched_tokens=2048, clock="tokens")
    sarathi = simulate({"name": "sarathi", "token_budget": 128}, _decodes_with_long_prompts_arriving(), **kw)
    prefill_first = simulate("prefill_first", _decodes_with_long_prompts_arriving(), **kw)

    def worst_tpot(run):
        return max(tpot for tpot in map(tpot_s, run.requests) if tpot is not None)

    assert sarathi.summary["p99_itl_ms"] < prefill_first.summary["p99_itl_ms"] / 2
    assert worst_tpot(sarathi) < worst_tpot(prefill_first)
    # The stall-free budget holds in every step: never more than 128 tokens.
    assert max(s["num_prefill_tokens"] + s["num_decode_seqs"] for s in sarathi.steps) <= 128
    # Prefill-first really stalls: some step runs a whole 1024-token prompt, and nothing else.
    assert any(s["num_prefill_tokens"] == 1024 and s["num_prefill_seqs"] == 1 and s["num_decode_seqs"] == 0
               for s in prefill_first.steps)


# -- sjf ----------------------------------------------------------------------------------------------------------

def _mixed_lengths(seed=0, n=24):
    rng = np.random.default_rng(seed)
    return [workload_request(f"r{i}", _tokens(rng, 8), int(rng.choice([2, 4, 64])), arrival=0.0) for i in range(n)]


def test_sjf_has_lower_mean_e2e_than_fcfs():
    kw = dict(max_num_seqs=2)
    fcfs = simulate("fcfs", _mixed_lengths(), **kw)
    sjf = simulate("sjf", _mixed_lengths(), **kw)
    assert sjf.summary["mean_e2el_ms"] < 0.75 * fcfs.summary["mean_e2el_ms"]


@pytest.mark.parametrize("predictor", ["prompt_length", "client_history"])
def test_sjf_predictors_beat_fcfs_when_their_signal_is_informative(predictor):
    # Output length follows the prompt length and the client: both predictors can tell long jobs from short.
    rng = np.random.default_rng(3)

    def workload():
        requests = []
        for i in range(40):
            long_job = i % 3 == 0
            requests.append(workload_request(f"r{i}", _tokens(rng, 48 if long_job else 6), 48 if long_job else 3,
                                         arrival=float(i // 8) * 40, client_id="batch" if long_job else "chat"))
        return requests

    kw = dict(max_num_seqs=2)
    fcfs = simulate("fcfs", workload(), **kw)
    sjf = simulate({"name": "sjf", "predictor": predictor}, workload(), **kw)
    assert sjf.summary["mean_e2el_ms"] < fcfs.summary["mean_e2el_ms"]


def test_sjf_aging_bounds_the_wait_of_a_long_job():
    rng = np.random.default_rng(2)

    def workload():
        long_job = workload_request("long", _tokens(rng, 8), 32, arrival=0.5)
        shorts = [workload_request(f"s{i}", _tokens(rng, 8), 2, arrival=float(i)) for i in range(200)]
        return [long_job] + shorts

    pure = by_id(simulate("sjf", workload(), max_num_seqs=1).requests)["long"]
    bound = 10.0
    aged = by_id(simulate({"name": "sjf", "max_wait": bound}, workload(), max_num_seqs=1).requests)["long"]
    assert pure["first_scheduled_time"] - pure["arrival_time"] > 10 * bound
    # One seat, short jobs of 2 output tokens: once starving, the long job waits at most for the seat to free.
    assert aged["first_scheduled_time"] - aged["arrival_time"] <= bound + 3


def test_sjf_user_callable_predictor_is_used():
    calls = []

    def by_id(request):
        calls.append(request.request_id)
        return 100 - int(request.request_id[1:])   # later ids predicted shorter: reverse arrival order

    requests = [workload_request(f"r{i}", [1, 2, 3], 2, arrival=0.0) for i in range(5)]
    run = simulate({"name": "sjf", "predictor": by_id}, requests, max_num_seqs=1)
    order = sorted(run.requests, key=lambda r: r["first_scheduled_time"])
    assert [r["request_id"] for r in order] == ["r4", "r3", "r2", "r1", "r0"] and calls


def test_sjf_bad_predictors_are_named():
    with pytest.raises(ValueError, match=r"scheduler.predictor must be one of oracle, prompt_length, "
                                         r"client_history.*got 'psychic'"):
        POLICIES.build({"name": "sjf", "predictor": "psychic"})

    def broken(request):
        raise RuntimeError("model offline")

    bare = bare_scheduler({"name": "sjf", "predictor": broken}, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    bare.add(make_request("a", [1, 2], 2), 0.0)
    bare.add(make_request("b", [1, 2], 2), 0.0)
    with pytest.raises(PolicyError, match=r"scheduler.predictor='broken' raised on request '[ab]': "
                                          r"RuntimeError: model offline"):
        bare.schedule(0.0)


# -- edf ----------------------------------------------------------------------------------------------------------

def _overloaded_with_mixed_slos(seed=0, n=60):
    """Arrivals faster than one seat can serve; a third of the requests are interactive (tight TTFT target)."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(n):
        tight = i % 3 == 0
        requests.append(workload_request(f"r{i}", _tokens(rng, 8), 4, arrival=i * 2.0,
                                     slo_ttft=6.0 if tight else 400.0))
    return requests


def _goodput(run) -> int:
    return sum(r["error"] is None and ttft_s(r) <= r["slo_ttft"] for r in run.requests)


def test_edf_gets_more_requests_within_their_slo_than_fcfs_past_saturation():
    kw = dict(max_num_seqs=1)   # a request takes 5 steps, one arrives every 2: past saturation
    fcfs = simulate("fcfs", _overloaded_with_mixed_slos(), **kw)
    edf = simulate("edf", _overloaded_with_mixed_slos(), **kw)
    assert _goodput(edf) > _goodput(fcfs) + 10


def test_edf_admission_control_rejects_hopeless_requests_with_a_reason():
    requests = [workload_request(f"r{i}", [1, 2, 3], 8, arrival=0.0, slo_ttft=3.0) for i in range(6)]
    run = simulate("edf", requests, max_num_seqs=1)
    rejected = [r for r in run.requests if r["error"] is not None]
    assert rejected and all("rejected by policy 'edf': cannot meet its ttft deadline" in r["error"] for r in rejected)
    assert all(r["finish_reason"] is None for r in rejected)   # failed, not aborted
    assert all(ttft_s(r) <= 3.0 for r in run.requests if r["error"] is None)
    # Without admission control every request is served, most of them late.
    late = simulate({"name": "edf", "admission_control": False},
                    [workload_request(f"r{i}", [1, 2, 3], 8, arrival=0.0, slo_ttft=3.0) for i in range(6)], max_num_seqs=1)
    assert all(r["error"] is None for r in late.requests)


def test_edf_names_the_missing_slo_field():
    bare = bare_scheduler({"name": "edf", "require_slo": True}, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16)
    with pytest.raises(PolicyError, match=r"needs every request's ttft_slo_ms: request 'x' has none; set "
                                          r"workload.ttft_slo_ms"):
        bare.add(make_request("x", [1, 2], 2), 0.0)
    with pytest.raises(ValueError, match=r"scheduler.deadline must be one of ttft, e2el, got 'soon'"):
        POLICIES.build({"name": "edf", "deadline": "soon"})


# -- fair (VTC) ---------------------------------------------------------------------------------------------------

def _service_gap(policy: str) -> tuple[float, float]:
    """Two backlogged clients, one sending 4x the requests; the largest gap in weighted service (VTC's measure:
    prompt tokens x1, output tokens x2) while both have work, and the VTC paper's bound for this setup."""
    rng = np.random.default_rng(0)
    requests = []
    for i in range(100):
        client = "light" if i % 5 == 0 else "heavy"
        requests.append(workload_request(f"r{i}", _tokens(rng, 16), 8, arrival=i * 0.1, client_id=client))
    max_num_seqs, budget = 4, 64
    recording = _recording(policy)
    run = simulate(recording, requests, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    served = {"light": 0.0, "heavy": 0.0}
    computed: dict[str, int] = {}
    light_done = max(r["finish_time"] for r in run.requests if r["client_id"] == "light")
    gap = 0.0
    for t, (request_id, client, prompt_len, n) in recording.events:
        before = computed.get(request_id, 0)
        prompt_part = max(0, min(before + n, prompt_len) - before)
        served[client] += prompt_part + 2 * (n - prompt_part)
        computed[request_id] = before + n
        if t < light_done - 20:   # while the light client still has a backlog
            gap = max(gap, abs(served["heavy"] - served["light"]))
    # Sheng et al. (OSDI 2024), Theorem 4.4: for backlogged clients the service difference stays within
    # 2 * (w_p * L_input + w_q * M), M the tokens the batch can hold (here: seats x (prompt + output)).
    bound = 2 * (1 * 16 + 2 * max_num_seqs * (16 + 8))
    return gap, bound


def _recording(name: str):
    """The registered policy ``name``, also noting every step's work as it hears it (``on_step``, at the step's
    end): (time, (request id, client, prompt length, tokens computed))."""

    class Recording(POLICIES.get(name)):
        def __init__(self) -> None:
            super().__init__()
            self.events: list[tuple[float, tuple[str, str, int, int]]] = []

        def on_step(self, scheduled, now):
            self.events += [(now, (r.request_id, r.client_id, r.num_prompt_tokens, n)) for r, n in scheduled]
            super().on_step(scheduled, now)

    return Recording()


def test_vtc_keeps_service_of_a_4x_heavier_client_within_the_bound_where_fcfs_does_not():
    fair_gap, bound = _service_gap("fair")
    fcfs_gap, _ = _service_gap("fcfs")
    assert fair_gap <= bound, (fair_gap, bound)
    assert fcfs_gap > 2 * bound, (fcfs_gap, bound)


# -- random -------------------------------------------------------------------------------------------------------

def test_random_order_is_reproducible_from_its_seed_and_differs_across_seeds():
    def order(seed):
        requests = [workload_request(f"r{i}", [1, 2, 3], 2, arrival=0.0) for i in range(12)]
        run = simulate({"name": "random", "seed": seed}, requests, max_num_seqs=1)
        return [r["request_id"] for r in sorted(run.requests, key=lambda r: r["first_scheduled_time"])]

    assert order(1) == order(1)
    assert order(1) != order(2)
    assert order(1) != [f"r{i}" for i in range(12)]
