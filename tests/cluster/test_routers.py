"""The routing seam: every registered router honours the contract (found automatically, as the policies are),
and each built-in shows its defining effect on a simulated cluster, counted in routed requests, prefix-cache
hit tokens or queue lengths. The simulated clusters run on the ``token_cost`` step-time model: its seconds are
no machine's, so the counts here are the same on every machine."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nanovllm import ROUTERS, ReplicaView, Request, Router, RouterError, SamplingParams, register_router
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.workload import (
    LengthDist,
    MultiTurnWorkloadConfig,
    SyntheticWorkloadConfig,
    WorkloadRequest,
    generate_workload,
)

TOKEN_COST = {"name": "sim", "step_time": "token_cost"}   # 16 ms a step + 1 ms a token: no machine's seconds


def served_cluster(replicas: int, router, *, allocator="prefix", overrides=None, **engine) -> ServedCluster:
    settings = dict(num_kv_blocks=256, max_num_seqs=8, dtype="bfloat16")
    settings.update(engine)
    return ServedCluster.simulated(ClusterConfig(replicas=replicas, replica_overrides=overrides or {}), router,
                                   TOKEN_COST, None, EngineConfig(**settings), allocator=allocator)


def synthetic(n=96, rate=40.0, groups=0, prefix_len=0, seed=0, out=16, inp=64):
    return SyntheticWorkloadConfig(
        num_requests=n, request_rate=rate, num_prefix_groups=groups, prefix_len=prefix_len, seed=seed,
        input_len=LengthDist(kind="uniform", mean=inp, range_ratio=0.5),
        output_len=LengthDist(kind="uniform", mean=out, range_ratio=0.5))


def serve(cluster: ServedCluster, workload_config):
    return cluster.serve(generate_workload(workload_config, cluster.engine.tokenizer))


def routed(result) -> Counter:
    return Counter(r["replica"] for r in result.requests)


def hit_tokens(result) -> int:
    return sum(r["num_cached_tokens"] for r in result.requests)


# -- the contract, for every registered router --------------------------------------------------------------------

def random_views(rng: random.Random, n: int, dead: set[int] = frozenset()) -> list[ReplicaView]:
    views = []
    for index in range(n):
        total = rng.choice([64, 256])
        running = rng.randint(0, 8)
        views.append(ReplicaView(
            index=index, alive=index not in dead, num_running=running, num_waiting=rng.randint(0, 20),
            num_free_blocks=rng.randint(0, total), num_total_blocks=total, block_size=16,
            num_queued_tokens=rng.randint(running, 4000), num_decoding=rng.randint(0, running), max_num_seqs=8,
            max_num_batched_tokens=2048, recent_ttft=rng.choice([None, 0.2]), recent_itl=None,
            num_routed=rng.randint(0, 100), prefix_lookup=lambda request, k=rng.randint(0, 4): 16 * k))
    return views


def a_request(rng: random.Random, i: int) -> Request:
    return Request(request_id=str(i), prompt_token_ids=[rng.randrange(1000) for _ in range(rng.randint(1, 200))],
                   sampling_params=SamplingParams(max_tokens=8), arrival_time=float(i),
                   session_id=rng.choice([None, f"s{rng.randrange(5)}"]))


def built(name: str) -> Router:
    router = ROUTERS.build(name)
    router.bind_step_time(lambda features: 0.016 + 0.001 * (features["num_prefill_tokens"]
                                                            + features["num_decode_tokens"]))
    return router


@pytest.mark.parametrize("name", ROUTERS.names())
def test_every_router_returns_a_live_replica_and_never_a_dead_one(name):
    rng = random.Random(name)
    router = built(name)
    for i in range(300):
        n = rng.randint(1, 9)
        dead = set(rng.sample(range(n), rng.randint(0, n - 1)))
        views = [view.bind(request) for view, request in
                 zip(random_views(rng, n, dead), [a_request(rng, i)] * n)]
        request = views[0]._request
        choice = router.route(request, views, float(i))
        assert isinstance(choice, int) and 0 <= choice < n and choice not in dead, (name, choice, dead)
        router.on_arrival(request, choice, float(i))
        router.on_finish(request, choice, float(i) + 0.5)


@pytest.mark.parametrize("name", ROUTERS.names())
def test_every_router_is_deterministic_for_a_seed(name):
    def decisions():
        rng = random.Random(7)
        router = built(name)
        out = []
        for i in range(100):
            request = a_request(rng, i)
            out.append(router.route(request, [v.bind(request) for v in random_views(rng, 5)], float(i)))
        return out

    assert decisions() == decisions()


@pytest.mark.parametrize("name", ROUTERS.names())
def test_every_router_serves_a_whole_simulated_workload_and_every_request_ends(name):
    result = serve(served_cluster(3, name), synthetic(n=30, groups=2, prefix_len=32))
    assert len(result.requests) == 30 and all(r["error"] is None for r in result.requests)
    assert set(routed(result)) <= {0, 1, 2}
    assert sum(s["requests"] for s in result.summary["per_replica"].values()) == 30


def test_a_router_that_picks_a_dead_replica_or_no_index_or_raises_is_a_router_error():
    @register_router("test_bad_index")
    class BadIndex(Router):
        def route(self, request, replicas, now):
            return len(replicas)

    @register_router("test_raises")
    class Raises(Router):
        def route(self, request, replicas, now):
            raise KeyError("boom")

    with pytest.raises(RouterError, match=r"router 'test_bad_index': route\(\) must return a replica index in "
                                          r"\[0, 2\), got 2"):
        serve(served_cluster(2, "test_bad_index"), synthetic(n=2))
    with pytest.raises(RouterError, match=r"router 'test_raises' raised in route\(\): KeyError: 'boom'"):
        serve(served_cluster(2, "test_raises"), synthetic(n=2))


def test_a_router_that_does_not_implement_route_cannot_be_built():
    class Lazy(Router):
        """Only the callbacks, no route."""

    with pytest.raises(TypeError, match="abstract method.*route"):
        Lazy()


def test_unknown_router_and_bad_options_name_the_field():
    with pytest.raises(KeyError, match=r"unknown router 'round_robbin'.*Did you mean 'round_robin'"):
        ROUTERS.get("round_robbin")
    with pytest.raises(ValueError, match=r"router.metric must be one of requests, tokens, got 'bytes'"):
        ROUTERS.build({"name": "least_loaded", "metric": "bytes"})
    with pytest.raises(ValueError, match=r"router.key must be one of session, prefix"):
        ROUTERS.build({"name": "consistent_hash", "key": "user"})
    with pytest.raises(ValueError, match=r"router.cache_threshold must be in \[0, 1\]"):
        ROUTERS.build({"name": "cache_aware", "cache_threshold": 2})


# -- each built-in's defining effect --------------------------------------------------------------------------------

def test_round_robin_spreads_requests_evenly_whatever_their_size():
    counts = routed(serve(served_cluster(4, "round_robin"), synthetic(n=99)))
    assert sorted(counts.values()) == [24, 25, 25, 25]


def test_random_spreads_requests_by_chance_and_a_seed_reproduces_it():
    counts = routed(serve(served_cluster(4, {"name": "random", "seed": 1}), synthetic(n=200)))
    again = routed(serve(served_cluster(4, {"name": "random", "seed": 1}), synthetic(n=200)))
    other = routed(serve(served_cluster(4, {"name": "random", "seed": 2}), synthetic(n=200)))
    assert counts == again and counts != other
    assert set(counts) == {0, 1, 2, 3} and all(25 <= n <= 75 for n in counts.values())  # 50 expected each


def imbalance(router, n=160, rate=60.0, replicas=4, **kw):
    """Mean max/mean outstanding requests at arrivals, on a workload whose request sizes vary a lot."""
    config = SyntheticWorkloadConfig(num_requests=n, request_rate=rate, burstiness=0.5, seed=3,
                                     input_len=LengthDist(kind="lognormal", mean=96, sigma=1.0, max=1024),
                                     output_len=LengthDist(kind="lognormal", mean=24, sigma=1.0, max=512))
    return serve(served_cluster(replicas, router, **kw), config).summary["load_imbalance_mean"]


def test_least_loaded_and_power_of_two_balance_load_better_than_blind_routers():
    blind = {name: imbalance(name) for name in ("round_robin", "random")}
    least = imbalance("least_loaded")
    two = imbalance("power_of_two")
    assert least < two < blind["random"], (least, two, blind)
    assert least < blind["round_robin"]


def test_least_loaded_by_tokens_sends_work_away_from_a_replica_with_a_long_prompt_queued():
    rng = random.Random(0)
    router = ROUTERS.build({"name": "least_loaded", "metric": "tokens"})
    views = random_views(rng, 3)
    for view, tokens in zip(views, (5000, 100, 900)):
        view.num_queued_tokens = tokens
        view.num_running, view.num_waiting = 0, 0
    assert router.route(a_request(rng, 0), views, 0.0) == 1
    by_requests = ROUTERS.build("least_loaded")
    views[0].num_waiting, views[1].num_waiting, views[2].num_waiting = 0, 3, 2
    assert by_requests.route(a_request(rng, 0), views, 0.0) == 0


def multi_turn(sessions=16, seed=0):
    return MultiTurnWorkloadConfig(num_sessions=sessions, request_rate=20.0, seed=seed,
                                   turns=LengthDist(kind="fixed", mean=4, max=16),
                                   user_len=LengthDist(kind="uniform", mean=24, range_ratio=0.5),
                                   reply_len=LengthDist(kind="uniform", mean=8, range_ratio=0.5),
                                   think_time_s=0.5, reply_time_per_token_s=0.005)


def test_consistent_hash_keeps_every_turn_of_a_session_on_one_replica():
    result = serve(served_cluster(4, "consistent_hash"), multi_turn())
    replicas_of = {}
    for r in result.requests:
        replicas_of.setdefault(r["session_id"], set()).add(r["replica"])
    assert all(len(replicas) == 1 for replicas in replicas_of.values()), replicas_of
    assert len({next(iter(r)) for r in replicas_of.values()}) > 1   # and sessions do spread over replicas
    spread = serve(served_cluster(4, "round_robin"), multi_turn())
    assert any(len({r["replica"] for r in spread.requests if r["session_id"] == s}) > 1 for s in replicas_of)
    assert hit_tokens(result) > hit_tokens(spread)


def test_consistent_hash_moves_only_a_dead_replicas_keys():
    rng = random.Random(1)
    router = ROUTERS.build({"name": "consistent_hash", "key": "prefix"})
    requests = [a_request(rng, i) for i in range(200)]
    views = random_views(rng, 5)
    before = [router.route(r, views, 0.0) for r in requests]
    views[2].alive = False
    after = [router.route(r, views, 0.0) for r in requests]
    assert 2 in before and 2 not in after
    assert all(a == b for a, b in zip(after, before) if b != 2)


# 24 shared prefixes of 6 blocks each; a replica caches 64 blocks: about 10 prefixes. Sent where its prefix is,
# each replica needs only its own ~6; spread blindly, every replica churns through all 24.
SHARED = dict(n=240, rate=30.0, groups=24, prefix_len=96, inp=32)


def test_cache_aware_finds_shared_prefixes_that_round_robin_scatters():
    aware = serve(served_cluster(4, "cache_aware", num_kv_blocks=64), synthetic(**SHARED))
    blind = serve(served_cluster(4, "round_robin", num_kv_blocks=64), synthetic(**SHARED))
    assert hit_tokens(aware) > 1.5 * hit_tokens(blind), (hit_tokens(aware), hit_tokens(blind))


def test_cache_aware_balance_guard_stops_one_hot_prefix_from_piling_onto_one_replica():
    # One prefix for everyone: once one replica caches it, affinity alone sends every request there.
    workload = synthetic(n=120, rate=40.0, groups=1, prefix_len=96, inp=32)
    greedy = routed(serve(served_cluster(4, {"name": "cache_aware", "balance_abs_threshold": 10_000}), workload))
    guarded = routed(serve(served_cluster(4, {"name": "cache_aware", "balance_abs_threshold": 8,
                                              "balance_rel_threshold": 1.0}), workload))
    assert max(greedy.values()) > 100
    assert max(guarded.values()) < 60 and len(guarded) == 4


def test_kv_cost_weighs_cache_hits_against_decode_load():
    hits = hit_tokens(serve(served_cluster(4, {"name": "kv_cost", "overlap_weight": 4.0}, num_kv_blocks=64),
                            synthetic(**SHARED)))
    blind = hit_tokens(serve(served_cluster(4, "round_robin", num_kv_blocks=64), synthetic(**SHARED)))
    assert hits > 1.5 * blind, (hits, blind)
    # With the overlap weight at zero only the blocks in use count: the load spreads over every replica.
    spread = routed(serve(served_cluster(4, {"name": "kv_cost", "overlap_weight": 0.0}, num_kv_blocks=64),
                          synthetic(**SHARED)))
    assert len(spread) == 4 and max(spread.values()) < 90


def test_predicted_latency_sends_less_work_to_a_slower_replica():
    # Replica 0 computes at most 16 tokens a step, the others 2048: a 256-token prompt takes it 16 steps.
    workload = synthetic(n=120, rate=8.0, inp=256, out=8)
    slow = {0: {"max_num_batched_tokens": 16}}
    predicted = serve(served_cluster(3, "predicted_latency", overrides=slow), workload)
    blind = serve(served_cluster(3, "round_robin", overrides=slow), workload)
    assert routed(predicted)[0] < 0.6 * routed(blind)[0], (routed(predicted), routed(blind))


def test_predicted_latency_picks_the_least_predicted_ttft_under_the_model_it_is_given():
    rng = random.Random(3)
    request = Request(request_id="r", prompt_token_ids=[1] * 512, sampling_params=SamplingParams(max_tokens=4),
                      arrival_time=0.0)
    views = random_views(rng, 2)
    for view, budget, queued in zip(views, (64, 2048), (0, 3000)):   # 0: small steps, idle; 1: big steps, busy
        view.max_num_batched_tokens, view.num_queued_tokens = budget, queued
        view.num_decoding = view.num_running = view.num_waiting = 0
        view._prefix_lookup = lambda r: 0
    per_step = ROUTERS.build("predicted_latency")      # step overhead dominates: fewer, bigger steps win
    per_step.bind_step_time(lambda f: 0.100 + 0.00001 * f["num_prefill_tokens"])
    per_token = ROUTERS.build("predicted_latency")     # tokens dominate: the idle replica wins
    per_token.bind_step_time(lambda f: 0.001 + 0.001 * f["num_prefill_tokens"])
    for router, expected in ((per_step, 1), (per_token, 0)):
        bound = [v.bind(request) for v in views]
        predictions = [router.predict_ttft(request, v) for v in bound]
        assert router.route(request, bound, 0.0) == expected == predictions.index(min(predictions))


def test_predicted_latency_without_a_step_time_model_says_what_is_missing():
    rng = random.Random(0)
    request = a_request(rng, 0)
    with pytest.raises(RouterError, match="needs a step-time model"):
        ROUTERS.build("predicted_latency").route(request, [v.bind(request) for v in random_views(rng, 2)], 0.0)


def test_a_router_keeps_state_through_its_callbacks():
    seen = []

    @register_router("test_recording")
    class Recording(Router):
        def route(self, request, replicas, now):
            return int(request.request_id) % len(replicas)

        def on_arrival(self, request, replica, now):
            seen.append(("arrival", request.request_id, replica))

        def on_finish(self, request, replica, now):
            seen.append(("finish", request.request_id, replica))

    workload = [WorkloadRequest(arrival_time=0.1 * i, prompt=[5 + i] * 20, max_tokens=4) for i in range(6)]
    cluster = served_cluster(3, "test_recording")
    result = cluster.serve(workload)
    assert [e for e in seen if e[0] == "arrival"] == [("arrival", str(i), i % 3) for i in range(6)]
    assert sorted(e[1:] for e in seen if e[0] == "finish") == sorted((str(i), i % 3) for i in range(6))
    assert {r["request_id"]: r["replica"] for r in result.requests} == {str(i): i % 3 for i in range(6)}
