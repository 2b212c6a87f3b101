"""Faults injected into the simulated cluster (``cluster.faults``), recovered by the code a real replica's death
runs (``ClusterBase._recover``): every request ends finished or failed with a reason, none is lost, a resumed
request generates all its tokens, retries and recomputed tokens are counted, a seed reproduces a run, a hung
replica is found dead after ``cluster.step_timeout``, a failed K/V transfer is recomputed on the decode side."""

from __future__ import annotations

import pytest

from helpers import REPO  # noqa: F401  (conftest puts tests/ on the path)
from nanovllm.cluster.config import ClusterConfig
from nanovllm.cluster.faults import FaultInjector, FaultsConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster, format_per_replica
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload

TOKEN_COST = {"name": "sim", "step_time": "token_cost"}
ENGINE = dict(num_kv_blocks=64, max_num_seqs=8, dtype="bfloat16")
LINK = {"name": "link", "bandwidth": 1.0e9, "latency": 1.0e-3}


def workload(tokenizer, n=80, rate=40.0, output=24, seed=0):
    return generate_workload(SyntheticWorkloadConfig(
        num_requests=n, request_rate=rate, seed=seed,
        input_len=LengthDist(kind="uniform", mean=96, range_ratio=0.5),
        output_len=LengthDist(kind="fixed", mean=output)), tokenizer)


def served(replicas=4, router="least_loaded", **cluster):
    return ServedCluster.simulated(ClusterConfig(replicas=replicas, **cluster), router, TOKEN_COST, None,
                                   EngineConfig(**ENGINE))


def run(replicas=4, n=80, rate=40.0, output=24, **cluster):
    cluster_ = served(replicas, **cluster)
    return cluster_.serve(workload(cluster_.engine.tokenizer, n=n, rate=rate, output=output))


def check_none_lost(result, n):
    """Every request is recorded once, and ended finished with all its tokens or failed/aborted with a reason."""
    ids = [r["request_id"] for r in result.requests]
    assert sorted(ids) == sorted(str(i) for i in range(n))
    for r in result.requests:
        if r["error"] is None:
            assert r["finish_reason"] == "length" and r["num_output_tokens"] == 24
            assert len(r["token_times"]) == 24
        else:
            assert r["finish_reason"] in (None, "abort") and r["error"]


def test_a_replicas_death_resumes_its_requests_on_the_others_with_every_token_and_counts_the_cost():
    deaths = [{"replica": 1, "time": 0.5}, {"replica": 2, "time": 1.0}]
    result = run(faults={"deaths": deaths})
    check_none_lost(result, 80)
    retried = [r for r in result.requests if r["num_retries"]]
    assert retried and all(r["error"] is None for r in result.requests)   # 2 of 4 left: every request finishes
    # after their deaths, the dead replicas finish nothing and run no step but the one reporting the death
    marker_time = {}
    for index, died in ((1, 0.5), (2, 1.0)):
        assert all(r["finish_time"] <= died + 0.2 for r in result.requests if r["replica"] == index)
        later = [s for s in result.steps if s["replica"] == index and s["start_time"] > died + 0.2]
        assert later == []
        (marker,) = [s for s in result.steps if s["replica"] == index and s["duration"] == 0.0
                     and s["num_sampled"] == 0 and s["kv_blocks_used"] == 0 and s["start_time"] >= died]
        assert marker["start_time"] < died + 0.2   # at the end of the step in progress at the death
        marker_time[index] = marker["start_time"]
    for r in retried:
        assert set(r["retried_from"]) <= {1, 2} and r["replica"] not in r["retried_from"]
        assert r["replica"] in (0, 3)    # it finished on a replica that never died
        assert r["token_times"] == sorted(r["token_times"])
        if len(r["retried_from"]) == 1:
            # it resumed from its prompt and the k tokens it had: the dead replica had computed all but the newest
            k = sum(t <= marker_time[r["retried_from"][0]] + 1e-9 for t in r["token_times"])
            assert r["retry_recomputed_tokens"] == (r["num_prompt_tokens"] + k - 1 if k else 0)
    faults = result.summary["faults"]
    assert faults["retried_requests"] == len(retried) and faults["retries"] == sum(r["num_retries"] for r in retried)
    assert faults["retry_recomputed_tokens"] == sum(r["retry_recomputed_tokens"] for r in retried)
    assert faults["failed_replica_died"] == 0 and faults["replica_restarts"] == 0 and faults["replica_deaths"] == 2
    assert "replica deaths:" in format_per_replica(result.summary)


def test_with_no_replica_left_requests_fail_with_the_reason_and_none_is_lost():
    deaths = [{"replica": 0, "time": 0.4}, {"replica": 1, "time": 0.6}]
    result = run(replicas=2, faults={"deaths": deaths})
    check_none_lost(result, 80)
    errors = [r["error"] for r in result.requests if r["error"] is not None]
    assert errors
    assert any(e.startswith("replica 1 died: fault injected (cluster.faults) (no live replica is left to retry it on)")
               for e in errors)
    assert any(e == "no live replica is left to route it to (every replica died)" for e in errors)
    assert result.summary["faults"]["failed_no_replica"] == len(errors)


def test_with_every_replica_dead_and_a_restart_due_requests_wait_for_it_as_on_ray():
    """As ``RayCluster`` does while it relaunches an actor: a dead replica's requests and new arrivals wait in the
    queue of the replica whose restart comes first and are served there once it restarts; none fails."""
    deaths = [{"replica": 0, "time": 0.4}, {"replica": 1, "time": 0.6}]
    result = run(replicas=2, max_restarts=1, faults={"deaths": deaths, "restart_delay": 1.0})
    check_none_lost(result, 80)
    assert all(r["error"] is None for r in result.requests)
    waited = [r for r in result.requests if 0.6 < r["arrival_time"] < 1.4]   # arrived with no replica alive
    assert waited and all(r["replica"] == 0 and r["token_times"][0] >= 1.4 for r in waited)   # 0 restarts first
    assert any(1 in r["retried_from"] and r["replica"] == 0 for r in result.requests)   # 1's requests waited too
    assert result.summary["faults"]["failed_no_replica"] == 0 and result.summary["faults"]["replica_restarts"] == 2


def test_an_abort_reaches_a_request_that_waits_for_a_restart():
    from nanovllm.request import RequestStatus
    from nanovllm.sampling import SamplingParams

    served_ = served(replicas=1, max_restarts=1, faults={"deaths": [{"replica": 0, "time": 0.1}],
                                                          "restart_delay": 5.0})
    cluster = served_.cluster
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first = cluster.make_request(list(range(10, 60)), params, arrival_time=0.0)
    cluster.add_request(first)
    ended = []
    while cluster.next_ready_time() is not None and cluster.next_ready_time() < 0.1:
        ended += cluster.step().finished
    late = cluster.make_request(list(range(10, 40)), params, arrival_time=0.2)
    cluster.add_request(late)   # the only replica died at 0.1: it waits for the restart at 5.1
    assert late.replica == 0 and cluster.has_unfinished()
    assert cluster.abort_request(late.request_id, "client went away")
    while cluster.has_unfinished():
        ended += cluster.step().finished
    by_id = {r.request_id: r for r in ended}
    assert by_id[late.request_id].status == RequestStatus.ABORTED and late.error == "client went away"
    assert by_id[first.request_id].status == RequestStatus.FINISHED and first.num_retries == 1
    assert first.num_output_tokens == 8 and first.finish_time >= 5.1   # resumed on the restarted replica
    served_.close()


def test_max_retries_zero_fails_a_dead_replicas_requests_with_the_reason():
    result = run(max_retries=0, faults={"deaths": [{"replica": 1, "time": 0.5}]})
    check_none_lost(result, 80)
    failed = [r for r in result.requests if r["error"] is not None]
    assert failed and all(r["error"] == "replica 1 died: fault injected (cluster.faults)" for r in failed)
    assert all(r["num_retries"] == 0 for r in result.requests)
    assert result.summary["faults"]["failed_replica_died"] == len(failed)


def test_a_request_fails_once_it_was_retried_max_retries_times():
    """Three replicas die one after another under the same requests: with max_retries=1 a request that was on
    two of them fails naming the limit."""
    deaths = [{"replica": i, "time": 0.3 + 0.05 * i} for i in range(3)]
    result = run(replicas=4, n=40, rate=200.0, max_retries=1, faults={"deaths": deaths})
    check_none_lost(result, 40)
    limited = [r for r in result.requests if r["error"] and "cluster.max_retries" in r["error"]]
    assert limited and all(r["num_retries"] == 1 and "(retried 1 times: cluster.max_retries)" in r["error"]
                           for r in limited)


def test_poisson_deaths_and_restarts_are_reproduced_by_the_seed():
    faults = {"rate": 720.0, "seed": 3, "restart_delay": 0.3}   # one death per replica every 5 s on average
    first = run(n=120, rate=30.0, max_restarts=100, faults=faults)
    again = run(n=120, rate=30.0, max_restarts=100, faults=faults)
    other = run(n=120, rate=30.0, max_restarts=100, faults={**faults, "seed": 4})
    check_none_lost(first, 120)
    assert first.requests == again.requests and first.steps == again.steps
    assert first.requests != other.requests
    summary = first.summary["faults"]
    assert summary["replica_restarts"] > 0 and summary["retries"] > 0
    assert summary["failed_replica_died"] == sum(r["error"] is not None for r in first.requests)
    assert sum(row["restarts"] for row in first.summary["per_replica"].values()) == summary["replica_restarts"]
    # a restarted replica serves again: some replica that died finished requests that arrived after its death
    deaths = {s["replica"]: s["start_time"] for s in first.steps if s["duration"] == 0.0 and s["num_sampled"] == 0}
    assert any(r["replica"] == index and r["arrival_time"] > t + 0.3 for index, t in deaths.items()
               for r in first.requests)


def test_the_injector_draws_each_replicas_deaths_from_its_own_stream():
    config = FaultsConfig(rate=3600.0, seed=7)
    one, two = FaultInjector(config, 4), FaultInjector(config, 4)
    draws = [one.pop_due(1e9) for _ in range(20)]
    assert draws == [two.pop_due(1e9) for _ in range(20)]
    assert {replica for _, _, replica in draws} == {0, 1, 2, 3}
    assert [t for t, _, _ in draws] == sorted(t for t, _, _ in draws)
    # a replica's stream does not depend on how many replicas there are
    wide = FaultInjector(config, 8)
    times_of_0 = [t for t, _, r in draws if r == 0]
    wide_0 = [t for t, _, r in (wide.pop_due(1e9) for _ in range(60)) if r == 0][:len(times_of_0)]
    assert wide_0 == times_of_0


def test_a_hung_replica_is_found_dead_after_the_step_timeout_and_its_requests_resume():
    result = run(step_timeout=0.5, faults={"hangs": [{"replica": 2, "time": 0.4}]})
    check_none_lost(result, 80)
    assert all(r["error"] is None for r in result.requests)
    moved = [r for r in result.requests if r["retried_from"] == [2]]
    assert moved
    (death,) = [s for s in result.steps if s["replica"] == 2 and s["duration"] == 0.0 and s["num_sampled"] == 0]
    assert 0.9 - 1e-9 <= death["start_time"] < 1.1   # its last step ended by ~0.4 s; found dead 0.5 s later
    assert not [s for s in result.steps if s["replica"] == 2 and 0.45 < s["start_time"] and s["duration"] > 0]
    for r in moved:   # nothing of it was computed between the hang and the detection
        assert not [t for t in r["token_times"] if 0.45 < t < death["start_time"]]


def test_hangs_need_a_step_timeout_and_bad_fault_settings_name_the_field():
    with pytest.raises(ValueError, match="cluster.faults.hangs need cluster.step_timeout"):
        ClusterConfig(replicas=2, faults={"hangs": [{"replica": 0, "time": 1.0}]})
    for spec, message in [({"rate": -1}, "cluster.faults.rate must be a number >= 0"),
                          ({"kv_transfer_failure": 1.5}, r"cluster.faults.kv_transfer_failure must be a probability"),
                          ({"deaths": [{"replica": 5, "time": 1.0}]}, r"cluster.faults.deaths: replica 5 is not in"),
                          ({"deaths": [{"replica": 0}]}, r"each entry is \{replica: i, time: seconds\}"),
                          ({"rates": 1}, r"cluster.faults: unknown key\(s\) rates")]:
        with pytest.raises(ValueError, match=message):
            ClusterConfig(replicas=2, faults=spec)
    with pytest.raises(ValueError, match="cluster.step_timeout must be seconds > 0"):
        ClusterConfig(replicas=2, step_timeout=0)


# -- prefill/decode disaggregation ------------------------------------------------------------------------------

def disaggregated(prefill=2, decode=2, **cluster):
    config = ClusterConfig(prefill_replicas=prefill, decode_replicas=decode, kv_transfer=LINK, **cluster)
    served_ = ServedCluster.simulated(config, "round_robin", TOKEN_COST, None, EngineConfig(**ENGINE))
    return served_.serve(workload(served_.engine.tokenizer, n=60, rate=30.0))


def test_a_failed_kv_transfer_is_recomputed_on_the_decode_side():
    result = disaggregated(faults={"kv_transfer_failure": 0.5, "seed": 1})
    check_none_lost(result, 60)
    failed = [r for r in result.requests if r["kv_transfer_failed"]]
    assert 10 < len(failed) < 50 and all(r["error"] is None for r in result.requests)
    assert result.summary["faults"]["kv_transfer_failures"] == len(failed)
    clean = disaggregated()
    # the decode replicas computed those prompts again: more prefill tokens on them than with every transfer good
    def decode_prefill(res):
        return sum(s["num_prefill_tokens"] for s in res.steps if s["replica"] >= 2)
    extra = decode_prefill(result) - decode_prefill(clean)
    assert extra >= sum(r["num_prompt_tokens"] for r in failed) - 64 * len(failed)   # less prefix-cache hits
    assert extra > 0


def test_a_dead_decode_replica_hands_its_requests_to_the_other_and_a_dead_prefill_replicas_too():
    deaths = [{"replica": 3, "time": 0.6}, {"replica": 0, "time": 1.0}]
    result = disaggregated(faults={"deaths": deaths})
    check_none_lost(result, 60)
    assert all(r["error"] is None for r in result.requests)
    decode_moved = [r for r in result.requests if 3 in r["retried_from"]]
    prefill_moved = [r for r in result.requests if 0 in r["retried_from"]]
    assert decode_moved and all(r["replica"] == 2 for r in decode_moved)
    assert all(r["prefill_replica"] == 1 or r["replica"] == 2 for r in prefill_moved)
    assert all(r["replica"] in (2, 3) for r in result.requests)


def test_hand_offs_wait_for_the_only_decode_replicas_restart():
    result = disaggregated(prefill=1, decode=1, max_restarts=1,
                           faults={"deaths": [{"replica": 1, "time": 0.6}], "restart_delay": 1.0})
    check_none_lost(result, 60)
    assert all(r["error"] is None and r["replica"] == 1 for r in result.requests)
    # handed off while the decode replica was down: decoded after its restart at 1.6
    waited = [r for r in result.requests if not r["retried_from"] and 0.6 < r["token_times"][0] < 1.6]
    assert waited and all(r["token_times"][1] >= 1.6 for r in waited)
    assert any(r["retried_from"] == [1] for r in result.requests)   # what it held resumed on it after the restart


# -- the command line -------------------------------------------------------------------------------------------

def test_the_command_line_injects_faults_into_a_simulated_cluster():
    from test_cluster_sim import compose_run

    from nanovllm.harness.run import check_config
    from nanovllm.harness.runners import served_engine

    cfg = compose_run("runner=sim", "runner.step_time=token_cost", "cluster.replicas=3", "workload=synthetic",
                      "workload.num_requests=40", "workload.request_rate=20", "cluster.max_restarts=1",
                      "cluster.faults.restart_delay=0.2", "+cluster.faults.deaths=[{replica: 1, time: 0.5}]")
    checked = check_config(cfg)
    assert checked.cluster.faults.deaths == [(1, 0.5)] and checked.cluster.faults.restart_delay == 0.2
    served_ = served_engine(checked.runner, checked.hardware, checked.engine, cluster=checked.cluster,
                            router=checked.router, scheduler=checked.scheduler, allocator=checked.allocator,
                            attention=checked.attention)
    result = served_.serve(generate_workload(cfg.workload, served_.engine.tokenizer))
    assert len(result.requests) == 40 and result.summary["faults"]["replica_restarts"] == 1
    with pytest.raises(ValueError, match="cluster.faults.rate must be a number >= 0"):
        check_config(compose_run("runner=sim", "cluster.replicas=2", "cluster.faults.rate=-2"))
