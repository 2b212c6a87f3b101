"""The simulated cluster: N replicas (each its own scheduler, policy instance and allocator) on one timeline.
One replica is exactly one engine; replicas may differ; every request ends and says where it ran; the
per-replica figures and the load imbalance add up; the command line's cluster options are checked before
anything is built."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from helpers import REPO
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster, format_per_replica
from nanovllm.harness.sim import Simulation
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, WorkloadRequest, generate_workload
from nanovllm.serving.loggers import JsonlLogger

TOKEN_COST = {"name": "sim", "step_time": "token_cost"}
ENGINE = dict(num_kv_blocks=48, max_num_seqs=4, dtype="bfloat16")


def workload(tokenizer, n=60, rate=30.0, seed=0):
    return generate_workload(SyntheticWorkloadConfig(
        num_requests=n, request_rate=rate, seed=seed, priority_classes=[0, 1], priority_weights=[0.5, 0.5],
        input_len=LengthDist(kind="uniform", mean=96, range_ratio=0.8),
        output_len=LengthDist(kind="uniform", mean=24, range_ratio=0.8)), tokenizer)


def cluster(replicas, router="round_robin", overrides=None, scheduler="fcfs", **engine):
    return ServedCluster.simulated(ClusterConfig(replicas=replicas, replica_overrides=overrides or {}), router,
                                   TOKEN_COST, None, EngineConfig(**{**ENGINE, **engine}), scheduler=scheduler)


@pytest.mark.parametrize("scheduler", ["fcfs", "priority"])
def test_one_replica_is_exactly_one_engine(scheduler):
    """Same records, same steps (preemptions included: the cache is small), whatever the router."""
    small = {**ENGINE, "num_kv_blocks": 24}
    single = Simulation.from_config(TOKEN_COST, None, EngineConfig(**small), scheduler=scheduler)
    alone = single.serve(workload(single.engine.tokenizer, rate=80.0))
    for router in ("round_robin", "cache_aware", "predicted_latency"):
        one = cluster(1, router, scheduler=scheduler, num_kv_blocks=24)
        result = one.serve(workload(one.engine.tokenizer, rate=80.0))
        assert alone.summary["num_preemptions"] > 0
        assert [{**r, "replica": None} for r in result.requests] == alone.requests
        assert [{k: v for k, v in s.items() if k != "replica"} for s in result.steps] == alone.steps
        assert {r["replica"] for r in result.requests} == {0}
        assert result.wall_time == pytest.approx(alone.wall_time)   # the run's length, simulated seconds


def test_replicas_step_in_time_order_and_every_request_ends_once():
    served = cluster(4, "least_loaded")
    requests = workload(served.engine.tokenizer, n=120, rate=60.0)
    result = served.serve(requests)
    assert sorted(r["request_id"] for r in result.requests) == sorted(str(i) for i in range(120))
    starts = [s["start_time"] for s in result.steps]
    assert starts == sorted(starts)   # one timeline: the discrete-event order
    for replica in range(4):          # and each replica's own steps never overlap
        mine = [s for s in result.steps if s["replica"] == replica]
        assert all(a["start_time"] + a["duration"] <= b["start_time"] + 1e-9 for a, b in zip(mine, mine[1:]))
    for r in result.requests:         # no request starts before it arrived, on whichever replica
        assert r["first_scheduled_time"] >= r["arrival_time"] - 1e-9
    # The run lasts until its last step ends (not until the last time every replica stood idle).
    assert result.wall_time == pytest.approx(max(s["start_time"] + s["duration"] for s in result.steps))


def test_a_request_routed_during_a_step_sees_the_replica_as_a_real_router_would():
    """A simulated step is computed when it starts; a request arriving while it runs must not see its outcome.
    Request a (96 tokens, 1 output token) starts replica 0's first step at 0 s, which ends at 0.112 s (16 ms +
    1 ms a token) with a finished. Request b arrives at 0.05 s: replica 0 as last reported still holds a, so
    least_loaded sends b to replica 1. Request c arrives after the step (0.5 s) and sees replica 0 empty."""
    from nanovllm import Router

    from helpers import workload_request

    seen = []

    class Recording(Router):
        def route(self, request, replicas, now):
            seen.append((request.request_id, [view.num_outstanding for view in replicas],
                         [view.num_queued_tokens for view in replicas]))
            return min(replicas, key=lambda view: (view.num_outstanding, view.index)).index

    served = ServedCluster.simulated(ClusterConfig(replicas=2), Recording(), TOKEN_COST, None, EngineConfig(**ENGINE))
    result = served.serve([workload_request("a", range(1, 97), 1, 0.0), workload_request("b", range(1, 9), 1, 0.05),
                           workload_request("c", range(1, 9), 1, 0.5)])
    assert seen[1] == ("b", [1, 0], [96, 0])   # a as it was when its step started: waiting, 96 tokens queued
    assert seen[2] == ("c", [0, 0], [0, 0])
    assert {r["request_id"]: r["replica"] for r in result.requests} == {"a": 0, "b": 1, "c": 0}


def test_routes_and_steps_happen_in_time_order_across_idle_gaps():
    """The discrete-event order holds when the cluster idles between bursts: each arrival is routed at its time,
    after every step that started before it (on any replica) and before any that starts after it, also when the
    step before the idle gap ended after the next arrivals; and the books keep the steps in start order."""
    from nanovllm import Router
    from nanovllm.serving.loggers import RunLogger

    events: list[tuple[str, float]] = []   # routes and steps in the order the cluster ran them

    class Recording(Router):
        def route(self, request, replicas, now):
            events.append(("route", now))
            return min(replicas, key=lambda view: (view.num_outstanding, view.index)).index

    class Steps(RunLogger):
        def __init__(self):
            self.starts: list[float] = []

        def log_step(self, step):
            self.starts.append(step["start_time"])

    served = ServedCluster.simulated(ClusterConfig(replicas=3), Recording(), TOKEN_COST, None, EngineConfig(**ENGINE))
    cluster, step, take_steps_ahead = served.engine, served.engine.step, served.engine.take_steps_ahead

    def stepped():
        output = step()
        events.append(("step", output.record["start_time"]))
        return output

    def taken_ahead():
        ahead = take_steps_ahead()
        if ahead is not None:
            events.extend(("step", float(start)) for start in ahead.steps.value("start_time"))
        return ahead

    cluster.step, cluster.take_steps_ahead = stepped, taken_ahead
    # Bursts: a 400-token prompt with one output token is one step, 0 to 0.416 s, after which the cluster idles;
    # short requests arrive at 0.1 and 0.3 s, the first one's steps (0.1 to ~0.2 s) before the second's route.
    requests = [WorkloadRequest(arrival_time=burst * 2.0 + offset, prompt=[7 + burst] * length, max_tokens=tokens)
                for burst in range(3) for offset, length, tokens in ((0.0, 400, 1), (0.1, 8, 4), (0.3, 8, 4))]
    logger = Steps()
    result = served.serve(requests, loggers=[logger])
    routes = [(position, t) for position, (kind, t) in enumerate(events) if kind == "route"]
    assert len(routes) == len(requests)
    steps = [(position, t) for position, (kind, t) in enumerate(events) if kind == "step"]
    assert len(steps) == result.summary["num_steps"] > len(requests)
    for position, t in routes:
        assert all(start < t for at, start in steps if at < position), "a step that starts after a route ran first"
        assert all(start >= t for at, start in steps if at > position), "a step that started before a route ran later"
    assert logger.starts == sorted(logger.starts) and len(logger.starts) == len(steps)


def test_per_replica_figures_add_up_to_the_cluster_and_are_printed():
    served = cluster(3, "round_robin")
    result = served.serve(workload(served.engine.tokenizer))
    table = result.summary["per_replica"]
    assert set(table) == {"0", "1", "2"}
    assert sum(row["requests"] for row in table.values()) == len(result.requests)
    assert sum(row["num_preemptions"] for row in table.values()) == result.summary["num_preemptions"]
    assert sum(row["num_steps"] for row in table.values()) == len(result.steps)
    assert all(0 < row["busy_fraction"] <= 1 and 0 < row["mean_kv_usage"] <= 1 for row in table.values())
    assert 1.0 <= result.summary["load_imbalance_mean"] <= result.summary["load_imbalance_max"] <= 3.0
    assert set(result.breakdowns["replica"]) == {"0", "1", "2"}
    assert result.summary["router"] == "round_robin" and result.summary["cluster_replicas"] == 3
    text = format_per_replica(result.summary)
    assert text.splitlines()[0].split()[:3] == ["replica", "requests", "done"] and "load imbalance" in text


def test_replicas_may_differ_and_each_keeps_its_own_settings():
    served = cluster(3, "least_loaded", overrides={0: {"num_kv_blocks": 16}, "2": {"max_num_seqs": 1}})
    result = served.serve(workload(served.engine.tokenizer, n=40, rate=20.0))
    settings = {s["replica"]: s for s in result.summary["replica_settings"]}
    assert [settings[i]["num_kv_blocks"] for i in range(3)] == [16, 48, 48]
    assert [settings[i]["max_num_seqs"] for i in range(3)] == [4, 4, 1]
    assert max(s["num_running"] for s in result.steps if s["replica"] == 2) == 1
    assert max(s["kv_blocks_total"] for s in result.steps if s["replica"] == 0) == 16
    # Every replica has a policy instance of its own: none is shared.
    assert len({id(engine.policy) for engine in served.cluster.engines}) == 3


def test_a_request_that_fits_only_the_bigger_replicas_is_refused_with_the_reason():
    """The router may send a request to any replica, so it must fit every one (the smallest cache here)."""
    served = cluster(2, "round_robin", overrides={0: {"num_kv_blocks": 4}})
    from nanovllm.harness.workload import WorkloadRequest

    big = WorkloadRequest(arrival_time=0.0, prompt=[7] * 100, max_tokens=8)
    result = served.serve([big, WorkloadRequest(arrival_time=0.0, prompt=[7] * 20, max_tokens=8)])
    errors = sorted((r["error"] or "") for r in result.requests)
    assert errors[0] == "" and "num_kv_blocks=4" in errors[1]


def test_requests_jsonl_and_steps_jsonl_say_where_each_request_and_step_ran(tmp_path):
    served = cluster(2, "round_robin")
    logger = JsonlLogger()
    logger.start(tmp_path, {}, group=None, name="t")
    try:
        served.serve(workload(served.engine.tokenizer, n=10), loggers=[logger])
    finally:
        logger.finish()
    requests = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert {r["replica"] for r in requests} == {0, 1} and {s["replica"] for s in steps} == {0, 1}
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["summary"]["per_replica"]) == {"0", "1"} if "summary" in metrics else \
        set(metrics["per_replica"]) == {"0", "1"}


def test_the_live_dashboard_draws_every_replicas_batch_and_kv_usage(tmp_path):
    """``live=web`` on a cluster: the live loggers write every replica's sizes to ``engine.json``; the dashboard
    (the real Bokeh document, fed from the run's files) draws one line per replica from ``steps.jsonl`` and its
    batch and KV charts show the sums of the replicas' latest states."""
    from helpers import serve_with_live_loggers
    from nanovllm.harness.live.feed import step_columns
    from nanovllm.harness.live.web import RunDashboard

    served = cluster(2, "round_robin", overrides={1: {"num_kv_blocks": 96}})
    result = serve_with_live_loggers(served, workload(served.engine.tokenizer, n=40), tmp_path)
    info = json.loads((tmp_path / "engine.json").read_text())
    assert info["num_replicas"] == 2 and info["num_kv_blocks"] == 48 + 96
    assert [r["num_kv_blocks"] for r in info["replicas"]] == [48, 96]
    view = RunDashboard(tmp_path)
    view.layout()
    assert not view.replica_row.visible
    view.update()
    assert view.replica_row.visible and sorted(view.replica_srcs) == [0, 1]
    for replica, source in view.replica_srcs.items():
        mine = [s for s in result.steps if s["replica"] == replica]
        assert source.data["running"] == [s["num_running"] for s in mine]
        assert source.data["kv_usage"] == [s["kv_blocks_used"] / s["kv_blocks_total"] for s in mine]
    assert len(view.replica_batch.renderers) == 2 and len(view.replica_kv.renderers) == 2
    columns = step_columns(result.steps, view.feed.sizes)
    last = {s["replica"]: s for s in result.steps}   # after the last step: each replica's last state, summed
    assert columns["running"][-1] == sum(s["num_running"] for s in last.values())
    assert columns["kv_free"][-1] == sum(s["kv_blocks_free"] for s in last.values())
    assert columns["max_num_seqs"][-1] == 2 * ENGINE["max_num_seqs"]
    middle = result.steps[len(result.steps) // 2]
    view._on_scrub("value_throttled", 1.0, middle["start_time"] + middle["duration"])
    shown = sum(len(source.data["t"]) for source in view.replica_srcs.values())
    assert shown == len(view.steps_src.data["t"]) < len(result.steps)


# -- the command line ----------------------------------------------------------------------------------------------

def compose_run(*overrides):
    from nanovllm.harness.conf_schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def test_the_command_line_serves_a_simulated_cluster():
    from nanovllm.harness.run import check_config
    from nanovllm.harness.runners import served_engine

    cfg = compose_run("runner=sim", "runner.step_time=token_cost", "cluster.replicas=3", "router=cache_aware",
                      "workload=synthetic", "workload.num_requests=30", "workload.request_rate=20",
                      "+cluster.replica_overrides={1: {num_kv_blocks: 64}}")
    checked = check_config(cfg)
    assert checked.cluster.replicas == 3 and checked.router["name"] == "cache_aware"
    served = served_engine(checked.runner, checked.hardware, checked.engine, cluster=checked.cluster,
                           router=checked.router, scheduler=checked.scheduler, allocator=checked.allocator,
                           attention=checked.attention)
    assert isinstance(served, ServedCluster)
    result = served.serve(generate_workload(cfg.workload, served.engine.tokenizer))
    assert len(result.requests) == 30 and {r["replica"] for r in result.requests} <= {0, 1, 2}
    assert result.summary["replica_settings"][1]["num_kv_blocks"] == 64


@pytest.mark.parametrize("overrides, message", [
    (["cluster.replicas=0"], r"cluster.replicas must be an integer >= 1, got 0"),
    (["runner=sim", "cluster.replicas=2", "+cluster.replica_overrides={5: {num_kv_blocks: 8}}"],
     r"cluster.replica_overrides: 5 is not a replica index in \[0, 2\)"),
    (["runner=sim", "cluster.replicas=2", "+cluster.replica_overrides={0: {num_kv_block: 8}}"],
     r"cluster.replica_overrides.0: unknown engine field\(s\) num_kv_block"),
    (["runner=sim", "cluster.replicas=2", "+cluster.replica_overrides={0: {num_kv_blocks: -1}}"],
     r"cluster.replica_overrides.0.num_kv_blocks"),
    (["runner=tp", "cluster.replicas=2"], r"cluster.replicas=2 needs runner=real \(replicas in Ray actors\) or "
                                          r"runner=sim"),
    (["cluster.replicas=2", "live=tui"], r"live=tui draws one engine in the terminal; with cluster.replicas=2 use "
                                         r"live=web"),
    (["runner=sim", "cluster.replicas=2", "router.name=nope"], r"unknown router 'nope'"),
    (["runner=sim", "cluster.replicas=2", "router=least_loaded", "router.metric=bytes"],
     r"router.metric must be one of requests, tokens"),
])
def test_bad_cluster_options_fail_before_anything_loads_naming_the_field(overrides, message):
    from nanovllm.harness.run import check_config

    with pytest.raises((ValueError, KeyError), match=message):
        check_config(compose_run(*overrides))


@pytest.mark.parametrize("field", ["max_retries", "max_restarts"])
def test_the_fault_settings_are_integers_at_least_zero(field):
    assert getattr(ClusterConfig(**{field: 0}), field) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=f"cluster.{field} must be an integer >= 0, got {bad!r}"):
            ClusterConfig(**{field: bad})
