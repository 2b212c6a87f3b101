"""Bounded step records (``records.steps``): a run that keeps every N-th step, or one aggregate per interval,
serves exactly the same requests as one that keeps all, its kept records are what the option says, its
aggregates add up to the steps they stand for, and its summary's step figures (and a cluster's per-replica
ones, and MFU/MBU) are those of every step."""

from __future__ import annotations

import json

import pytest
from hydra import compose, initialize_config_dir

from helpers import REPO

from nanovllm.cluster.config import ClusterConfig
from nanovllm.config import EngineConfig
from nanovllm.harness.cluster import ServedCluster
from nanovllm.harness.conf_schema import register_configs
from nanovllm.harness.run import check_config
from nanovllm.harness.sim import Simulation
from nanovllm.harness.workload import LengthDist, SyntheticWorkloadConfig, generate_workload
from nanovllm.serving.loggers import JsonlLogger
from nanovllm.serving.monitor import Monitor
from nanovllm.serving import step_records
from nanovllm.serving.step_records import StepRecords

TOKEN_COST = {"name": "sim", "step_time": "token_cost"}
ENGINE = dict(num_kv_blocks=40, max_num_seqs=4, dtype="bfloat16")
STEP_KEYS = ("num_steps", "peak_kv_usage", "num_evictions")
MEAN_KEYS = ("mean_kv_usage", "mean_step_ms", "mean_kv_slots_unused", "mean_kv_blocks_cached")


def workload(tokenizer, n=40, rate=40.0):
    return generate_workload(SyntheticWorkloadConfig(
        num_requests=n, request_rate=rate, seed=3, input_len=LengthDist(kind="uniform", mean=80, range_ratio=0.8),
        output_len=LengthDist(kind="uniform", mean=30, range_ratio=0.8)), tokenizer)


def served(replicas: int):
    if replicas == 1:
        return Simulation.from_config(TOKEN_COST, None, EngineConfig(**ENGINE))
    return ServedCluster.simulated(ClusterConfig(replicas=replicas), "round_robin", TOKEN_COST, None,
                                   EngineConfig(**ENGINE))


def run(replicas: int, spec: str, **kwargs):
    engine = served(replicas)
    monitor = Monitor(engine.cost, peak_flops=1e12, peak_bandwidth=1e11)
    return engine.serve(workload(engine.engine.tokenizer), step_records=StepRecords.parse(spec), monitor=monitor,
                        **kwargs)


@pytest.mark.parametrize("spelling, parsed", [("all", StepRecords()), ("every:5", StepRecords("every", every=5)),
                                              ("interval:0.25", StepRecords("interval", interval=0.25))])
def test_parse(spelling, parsed):
    assert StepRecords.parse(spelling) == parsed and str(parsed) == spelling


@pytest.mark.parametrize("bad", ["some", "every:0", "every:x", "interval:0", "interval:-1", "interval:nan", "all:3"])
def test_parse_refuses_with_the_option_named(bad):
    with pytest.raises(ValueError, match="records.steps"):
        StepRecords.parse(bad)


def _same_summary(bounded: dict, full: dict) -> None:
    for key in STEP_KEYS + ("completed", "mean_ttft_ms", "p99_e2el_ms"):
        assert bounded[key] == full[key], key
    for key in MEAN_KEYS + ("mfu", "mbu"):
        assert bounded[key] == pytest.approx(full[key], rel=1e-12), key


@pytest.mark.parametrize("replicas", [1, 3])
def test_every_n_keeps_every_nth_step_unchanged(replicas):
    full, sampled = run(replicas, "all"), run(replicas, "every:7")
    assert sampled.requests == full.requests
    assert sampled.steps == full.steps[::7]
    assert full.summary["num_steps"] > 50
    _same_summary(sampled.summary, full.summary)
    if replicas > 1:
        for index, row in full.summary["per_replica"].items():
            mine = sampled.summary["per_replica"][index]
            assert mine["num_steps"] == row["num_steps"] and mine["peak_kv_usage"] == row["peak_kv_usage"]
            for key in ("mean_kv_usage", "busy_fraction", "mean_outstanding"):
                assert mine[key] == pytest.approx(row[key], rel=1e-12), key


@pytest.mark.parametrize("replicas", [1, 3])
def test_interval_aggregates_add_up(replicas):
    interval = 0.5
    full, agg = run(replicas, "all"), run(replicas, f"interval:{interval}")
    assert agg.requests == full.requests
    _same_summary(agg.summary, full.summary)
    assert len(agg.steps) < len(full.steps) / 5
    assert sum(a["num_steps"] for a in agg.steps) == len(full.steps)
    # Each aggregate stands for the steps of its replica whose start falls in its window, in order.
    remaining = list(full.steps)
    for a in sorted(agg.steps, key=lambda a: (a.get("replica", 0), a["step"])):
        mine = [s for s in remaining if s.get("replica") == a.get("replica")][:a["num_steps"]]
        for s in mine:
            remaining.remove(s)
        assert mine[0]["step"] == a["step"] and mine[0]["start_time"] == a["start_time"]
        assert {int(s["start_time"] // interval) for s in mine} == {int(a["start_time"] // interval)}
        for key in ("num_prefill_tokens", "num_decode_tokens", "num_sampled", "num_preempted", "attn_pairs"):
            assert a[key] == sum(s[key] for s in mine), key
        for key in ("num_running", "num_waiting", "kv_blocks_used", "kv_slots_unused"):
            assert a[key] == max(s[key] for s in mine), key
        assert a["kv_blocks_free"] == min(s["kv_blocks_free"] for s in mine)
        assert a["duration"] == pytest.approx(sum(s["duration"] for s in mine), rel=1e-12)
        assert a["flops"] == pytest.approx(sum(s["flops"] for s in mine), rel=1e-12)
        assert a["mfu"] == pytest.approx(a["flops"] / a["duration"] / 1e12, rel=1e-9)
    assert remaining == []
    starts = [a["start_time"] for a in agg.steps]
    if replicas == 1:
        assert starts == sorted(starts)


def test_the_files_hold_the_kept_records(tmp_path):
    logger = JsonlLogger()
    logger.start(tmp_path, {})
    result = run(1, "every:10", loggers=[logger])
    logger.finish()
    written = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert written == json.loads(json.dumps(result.steps)) and len(written) < result.summary["num_steps"] / 5
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["num_steps"] == result.summary["num_steps"] > len(written)



def _checked(*overrides: str):
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return check_config(compose(config_name="config", overrides=["runner=sim", "runner.step_time=token_cost",
                                                                     *overrides]))


def test_the_command_line_option():
    assert _checked().step_records == StepRecords()
    assert _checked("records.steps=interval:2").step_records == StepRecords("interval", interval=2.0)
    with pytest.raises(ValueError, match="records.steps"):
        _checked("records.steps=every:0")


def test_a_long_run_that_keeps_every_step_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(step_records, "WARN_STEPS", 3)
    keeper = step_records.StepKeeper(StepRecords())
    with caplog.at_level("WARNING", logger=step_records.__name__):
        kept = [keeper.offer({"step": i}) for i in range(6)]
    assert kept == [[{"step": i}] for i in range(6)]
    assert [r.getMessage() for r in caplog.records] == [
        "3 step records kept so far (records.steps=all); records.steps=interval:SECONDS or every:N bounds "
        "steps.jsonl, with the summary's step figures still over every step"]
