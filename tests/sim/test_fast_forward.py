"""Decode stretches (``runner.fast_forward``, ``nanovllm/engine/decode_stretch.py``): a simulated run that takes
runs of pure-decode steps at once gives the same request records, step records and summary as one that steps
every step, on one engine, a cluster and a prefill/decode-disaggregated cluster, with random workloads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from helpers import REPO
from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.sim import Simulation
from nanovllm.harness.sim.hardware import Hardware
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, WorkloadRequest, generate_workload
from nanovllm.serving.monitor import Monitor, MonitorConfig
from nanovllm.serving.step_records import StepRecords

H100 = yaml.safe_load(Path(REPO, "conf/hardware/h100_sxm.yaml").read_text())
TOKEN_COST = {"name": "sim", "step_time": "token_cost"}
ANALYTICAL = {"name": "sim", "step_time": "analytical"}


def _workload(tokenizer, seed: int, n: int, rate: float, prompt: int, output: int):
    return generate_workload(SyntheticWorkloadConfig(
        num_requests=n, request_rate=rate, seed=seed, priority_classes=[0, 1], priority_weights=[0.5, 0.5],
        input_len=LengthDist(kind="uniform", mean=prompt, range_ratio=0.9),
        output_len=LengthDist(kind="uniform", mean=output, range_ratio=0.9)), tokenizer)


def _engine(fast_forward: bool, step_time: dict, scheduler: str, allocator: str, **engine):
    config = EngineConfig(dtype="bfloat16", **engine)
    hardware = Hardware.from_config(H100) if step_time["step_time"] == "analytical" else None
    return Simulation.build(config, step_time["step_time"], scheduler=scheduler, allocator=allocator,
                            hardware=hardware, fast_forward=fast_forward)


def _cluster(fast_forward: bool, step_time: dict, scheduler: str, allocator: str, cluster: ClusterConfig,
             router: str, **engine):
    runner = {**step_time, "fast_forward": fast_forward}
    return ServedCluster.simulated(cluster, router, runner, H100 if step_time["step_time"] == "analytical" else None,
                                   EngineConfig(dtype="bfloat16", **engine), scheduler=scheduler,
                                   allocator=allocator)


def _served_both(build, workload, step_records=StepRecords()):
    """(stepping, fast-forward) results of the same run, and the steps the fast one took ahead. Each step is
    annotated by a monitor (FLOPs, bytes, and MFU/MBU where the step-time model's hardware gives peaks)."""
    results, ahead = [], 0
    for fast in (False, True):
        served = build(fast)
        peaks = served.monitor_config(MonitorConfig(calibrate=False))
        monitor = Monitor(served.cost, peaks.peak_flops, peaks.peak_bandwidth)
        results.append(served.serve(workload, step_records=step_records, monitor=monitor))
        engines = [replica.engine for replica in served.engine.replicas] if hasattr(served.engine, "replicas") \
            else [served.engine]
        if fast:
            ahead = sum(engine.num_steps_ahead for engine in engines)
        else:
            assert sum(engine.num_steps_ahead for engine in engines) == 0
    return results[0], results[1], ahead


def _assert_identical(slow, fast):
    assert fast.requests == slow.requests
    assert fast.steps == slow.steps
    assert fast.summary == slow.summary
    assert fast.output_token_ids == slow.output_token_ids
    assert fast.wall_time == slow.wall_time


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(4, 30), rate=st.sampled_from([0.5, 5.0, 50.0]),
       prompt=st.integers(8, 200), output=st.integers(2, 120), blocks=st.integers(24, 200),
       seqs=st.integers(1, 8), scheduler=st.sampled_from(["fcfs", "priority", "sjf"]),
       allocator=st.sampled_from(["paged", "prefix"]), step_time=st.sampled_from([TOKEN_COST, ANALYTICAL]),
       records=st.sampled_from(["all", "every:3", "interval:0.05"]))
def test_one_engine_fast_forward_gives_the_records_of_stepping(tokenizer, seed, n, rate, prompt, output, blocks,
                                                                seqs, scheduler, allocator, step_time, records):
    workload = _workload(tokenizer, seed, n, rate, prompt, output)
    slow, fast, _ = _served_both(lambda ff: _engine(ff, step_time, scheduler, allocator, num_kv_blocks=blocks,
                                                    max_num_seqs=seqs), workload, StepRecords.parse(records))
    _assert_identical(slow, fast)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(6, 40), rate=st.sampled_from([1.0, 10.0, 100.0]),
       replicas=st.integers(2, 4),
       router=st.sampled_from(["round_robin", "least_loaded", "cache_aware", "kv_cost"]),
       blocks=st.integers(32, 160), allocator=st.sampled_from(["paged", "prefix"]),
       step_time=st.sampled_from([TOKEN_COST, ANALYTICAL]), records=st.sampled_from(["all", "every:5", "interval:0.02"]))
def test_a_cluster_fast_forward_gives_the_records_of_stepping(tokenizer, seed, n, rate, replicas, router, blocks,
                                                              allocator, step_time, records):
    workload = _workload(tokenizer, seed, n, rate, 96, 60)
    slow, fast, _ = _served_both(lambda ff: _cluster(ff, step_time, "fcfs", allocator,
                                                     ClusterConfig(replicas=replicas), router,
                                                     num_kv_blocks=blocks, max_num_seqs=4), workload,
                                 StepRecords.parse(records))
    _assert_identical(slow, fast)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), n=st.integers(6, 30), rate=st.sampled_from([2.0, 20.0, 200.0]),
       prefill=st.integers(1, 2), decode=st.integers(1, 3), step_time=st.sampled_from([TOKEN_COST, ANALYTICAL]))
# A prefill replica looked at for a stretch while a step of its own was in progress: it must not report a new
# view then (a request routed to it since its step started would drop out of its load).
@example(seed=896, n=6, rate=20.0, prefill=2, decode=1, step_time=TOKEN_COST)
def test_a_disaggregated_cluster_fast_forward_gives_the_records_of_stepping(tokenizer, seed, n, rate, prefill,
                                                                            decode, step_time):
    workload = _workload(tokenizer, seed, n, rate, 128, 60)
    config = ClusterConfig(prefill_replicas=prefill, decode_replicas=decode,
                           kv_transfer={"name": "link", "bandwidth": 2.0e7, "latency": 1.0e-3})
    slow, fast, _ = _served_both(lambda ff: _cluster(ff, step_time, "fcfs", "prefix", config, "round_robin",
                                                     num_kv_blocks=96, max_num_seqs=8), workload)
    _assert_identical(slow, fast)


@pytest.mark.parametrize("records", ["every:7", "interval:0.05"])
def test_bounded_step_records_are_identical_too_and_most_steps_are_taken_ahead(tokenizer, records):
    """A decode-heavy run on a cluster: the bounded records (and the summary over every step) are those of
    stepping, and most steps were computed in stretches."""
    workload = _workload(tokenizer, 3, 40, 4.0, 64, 200)
    slow, fast, ahead = _served_both(lambda ff: _cluster(ff, ANALYTICAL, "fcfs", "prefix", ClusterConfig(replicas=3),
                                                         "round_robin", num_kv_blocks=400, max_num_seqs=8),
                                     workload, StepRecords.parse(records))
    _assert_identical(slow, fast)
    assert ahead > 0.8 * slow.summary["num_steps"]


@pytest.mark.parametrize("settle_every", [1, 7, 64])
def test_a_cluster_whose_steps_settle_a_few_at_a_time_keeps_them_in_stepping_order(tokenizer, monkeypatch,
                                                                                   settle_every):
    """A simulated cluster hands out each replica's stretch whole, ahead of the others' steps; the books hold
    them and keep those settled (``EngineClient.steps_settled_before``) in the order stepping runs them, however
    few they hold at a time (the rest held on), with every step and aggregate those of stepping with books kept
    a step at a time, as each comes."""
    from nanovllm.cluster import Cluster

    settles = Cluster.steps_settled_before
    # Stepping's steps come in order: its cluster says nothing of settling, and its books keep each at once.
    monkeypatch.setattr(Cluster, "steps_settled_before",
                        lambda cluster: None if not cluster.replicas[0].engine.runner.fast_forward else settles(cluster))
    monkeypatch.setattr("nanovllm.serving.loop.SETTLE_EVERY", settle_every)
    # Two refused requests among them (a prompt beyond the model's context): each ends in a step that takes no
    # time and has no MFU, kept on its own between runs kept in bulk.
    workload = sorted(_workload(tokenizer, 5, 30, 20.0, 48, 90) + [
        WorkloadRequest(arrival_time=t, prompt=[11] * 20_000, max_tokens=4) for t in (0.3, 0.7)],
        key=lambda request: request.arrival_time)
    for records in ("all", "interval:0.02"):
        slow, fast, ahead = _served_both(
            lambda ff: _cluster(ff, ANALYTICAL, "fcfs", "prefix", ClusterConfig(replicas=4), "round_robin",
                                num_kv_blocks=300, max_num_seqs=8), workload, StepRecords.parse(records))
        _assert_identical(slow, fast)
        assert ahead > 0.5 * slow.summary["num_steps"] and fast.summary["failed"] == 2


def test_replicas_configured_apart_settle_their_steps_in_order_too(tokenizer, monkeypatch):
    """One replica with a host KV tier (its step records carry the tiers' counts; it steps every step) beside
    two without (decode stretches): the books settle their different records one by one, in stepping's order,
    as stepping's books keep them step by step."""
    from nanovllm.cluster import Cluster

    settles = Cluster.steps_settled_before
    monkeypatch.setattr(Cluster, "steps_settled_before",
                        lambda cluster: None if not cluster.replicas[0].engine.runner.fast_forward else settles(cluster))
    monkeypatch.setattr("nanovllm.serving.loop.SETTLE_EVERY", 16)
    workload = _workload(tokenizer, 9, 24, 20.0, 48, 90)
    tiered = ClusterConfig(replicas=3, replica_overrides={1: {"kv_offload": {"name": "host", "capacity": 1 << 24}}})
    slow, fast, ahead = _served_both(lambda ff: _cluster(ff, ANALYTICAL, "fcfs", "prefix", tiered, "round_robin",
                                                         num_kv_blocks=300, max_num_seqs=8), workload)
    _assert_identical(slow, fast)
    assert ahead > 0 and {"kv_tiers" in step for step in fast.steps} == {True, False}


def test_a_policy_with_per_step_state_is_never_fast_forwarded(tokenizer):
    """mlfq counts each request's service in on_step: no stretch is taken, and the run is stepping's."""
    workload = _workload(tokenizer, 1, 12, 5.0, 64, 80)
    slow, fast, ahead = _served_both(lambda ff: _engine(ff, TOKEN_COST, "mlfq", "paged", num_kv_blocks=200,
                                                        max_num_seqs=4), workload)
    _assert_identical(slow, fast)
    assert ahead == 0


def test_replay_step_times_are_never_fast_forwarded():
    from nanovllm.harness.sim.step_time import ReplayStepTime, StepTimeModel

    assert StepTimeModel.pure and not ReplayStepTime.pure


def _ordinary_steps(served) -> int:
    """Steps the run took one at a time (not as parts of decode stretches)."""
    engines = [replica.engine for replica in served.engine.replicas] if hasattr(served.engine, "replicas") \
        else [served.engine]
    return sum(engine.num_steps - engine.num_steps_ahead for engine in engines)


@pytest.mark.parametrize("allocator", ["paged", "prefix"])
def test_stretches_run_through_the_steps_where_requests_finish(tokenizer, allocator):
    """By default a stretch takes the steps in which requests finish (they end inside it, with their last token,
    their blocks freed and the policy told) and decodes on with the rest: the records are stepping's, and
    fewer steps are run one at a time than by stretches that stop before each finish."""
    workload = _workload(tokenizer, 4, 24, 2.0, 40, 120)
    runs = {}
    for through in (True, False):
        served = _engine(True, ANALYTICAL, "priority", allocator, num_kv_blocks=400, max_num_seqs=8)
        served.engine.stretch_through_finishes = through
        runs[through] = (served.serve(workload), _ordinary_steps(served))
    stepped = _engine(False, ANALYTICAL, "priority", allocator, num_kv_blocks=400, max_num_seqs=8).serve(workload)
    for result, _ in runs.values():
        _assert_identical(stepped, result)
    finished_in_stretches = runs[False][1] - runs[True][1]
    assert finished_in_stretches > len(workload) // 2, runs


def test_a_router_that_hears_each_finish_hears_them_as_stepping_tells_them(tokenizer):
    """A router with its own ``on_finish`` hears every finish in stepping's order and at its time: stretches
    then stop before finishing steps, and the run (records and what the router heard) is stepping's."""
    from nanovllm.router import Router

    class Listening(Router):
        def __init__(self):
            self.heard: list[tuple[str, int, float]] = []
            self.next = 0

        def route(self, request, replicas, now):
            self.next += 1
            return self.next % len(replicas)

        def on_finish(self, request, replica, now):
            self.heard.append((request.request_id, replica, now))

    workload = _workload(tokenizer, 8, 30, 20.0, 48, 90)
    results, routers, ahead = [], [], 0
    for fast in (False, True):
        router = Listening()
        served = _cluster(fast, ANALYTICAL, "fcfs", "prefix", ClusterConfig(replicas=3), router,
                          num_kv_blocks=300, max_num_seqs=8)
        results.append(served.serve(workload))
        routers.append(router.heard)
        if fast:
            ahead = sum(replica.engine.num_steps_ahead for replica in served.engine.replicas)
    _assert_identical(*results)
    assert routers[0] == routers[1] and len(routers[0]) == len(workload)
    assert ahead > 0
