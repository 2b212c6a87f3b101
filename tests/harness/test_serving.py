"""The online serving loop: arrivals in wall-clock time, an idle engine that sleeps, rejected requests recorded
as failed, and loggers fed step by step."""

from __future__ import annotations

import time

import pytest
import torch

from nanovllm.harness.serving import RunResult, format_breakdown, serve
from nanovllm.harness.workload import WorkloadRequest
from nanovllm.serving.loggers import RunLogger
from nanovllm.serving.metrics import SLO
from nanovllm.serving.monitor import ModelCost, Monitor

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def engine():
    # One torch thread: on a small shared machine two OpenMP threads competing with other processes spin
    # and slow every step tenfold.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from nanovllm import LLM

    yield LLM(num_kv_blocks=64, max_model_len=MAX_MODEL_LEN).engine
    torch.set_num_threads(threads)


def _prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def _request(arrival: float, n: int = 8, max_tokens: int = 3, **kw) -> WorkloadRequest:
    return WorkloadRequest(arrival_time=arrival, prompt=_prompt(n, 100 + int(arrival * 10)), max_tokens=max_tokens,
                           ignore_eos=True, **kw)


def _by_id(result: RunResult) -> dict[str, dict]:
    return {r["request_id"]: r for r in result.requests}


def test_requests_enter_at_their_arrival_time_and_the_idle_engine_sleeps(engine) -> None:
    workload = [_request(0.0), _request(0.4, priority=1), _request(1.5)]
    cpu_start = time.process_time()
    result = serve(engine, workload, progress=False)
    cpu = time.process_time() - cpu_start

    records = _by_id(result)
    assert sorted(records) == ["0", "1", "2"]  # ids default to the index in the workload
    for i, w in enumerate(workload):
        r = records[str(i)]
        assert r["arrival_time"] == pytest.approx(w.arrival_time, abs=1e-9)
        assert r["first_scheduled_time"] >= r["arrival_time"]
        assert r["first_token_time"] >= r["first_scheduled_time"]
        assert r["finish_reason"] == "length" and r["error"] is None and r["num_output_tokens"] == 3
        assert result.output_token_ids[str(i)] and len(result.output_token_ids[str(i)]) == 3
    # The run lasts at least until the last arrival, and not much longer than its work.
    assert 1.5 <= result.wall_time < 1.5 + 20
    # Idle gaps are slept through: outside its steps the process used almost no CPU, though the engine was
    # idle for a good part of the run (a spinning loop would burn a whole core through the gaps).
    busy = sum(s["duration"] for s in result.steps)
    assert result.wall_time - busy > 0.5
    assert cpu - busy < 0.25
    # Step records are relative to the run's start and numbered from 0.
    assert [s["step"] for s in result.steps] == list(range(len(result.steps)))
    assert result.steps[0]["start_time"] >= 0
    assert all(s["start_time"] <= result.wall_time for s in result.steps)


def test_rejected_request_is_failed_with_its_reason_and_others_finish(engine) -> None:
    too_long = WorkloadRequest(arrival_time=0.0, prompt=_prompt(MAX_MODEL_LEN + 10), max_tokens=4,
                               request_id="long", ignore_eos=True)
    empty = WorkloadRequest(arrival_time=0.05, prompt=[], max_tokens=4, request_id="empty")
    ok = [_request(0.0, request_id="a"), _request(0.1, request_id="b")]
    result = serve(engine, [ok[0], too_long, empty, ok[1]], progress=False)

    records = _by_id(result)
    assert len(result.requests) == 4  # every request ends finished or failed
    for rid in ("long", "empty"):
        r = records[rid]
        assert r["finish_reason"] is None and r["first_token_time"] is None and r["num_output_tokens"] == 0
        assert r["finish_time"] is not None
    assert "max_model_len" in records["long"]["error"] and records["long"]["num_prompt_tokens"] == MAX_MODEL_LEN + 10
    assert "empty" in records["empty"]["error"]
    for rid in ("a", "b"):
        assert records[rid]["error"] is None and records[rid]["finish_reason"] == "length"
    assert result.summary["completed"] == 2 and result.summary["failed"] == 2
    assert set(result.output_token_ids) == {"a", "b"}


class RecordingLogger(RunLogger):
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def log_step(self, step: dict) -> None:
        self.calls.append(("step", step))

    def log_request(self, record: dict) -> None:
        self.calls.append(("request", record))

    def log_summary(self, summary: dict, breakdowns=None) -> None:
        self.calls.append(("summary", (summary, breakdowns)))


def test_loggers_monitor_slo_and_breakdowns(engine) -> None:
    cost = ModelCost.from_model(engine.runner.model)
    monitor = Monitor(cost, peak_flops=1e12, peak_bandwidth=1e10)
    logger = RecordingLogger()
    workload = [_request(0.0, priority=0, client_id="x"), _request(0.0, priority=1, client_id="y"),
                _request(0.1, priority=1, client_id="x", n=MAX_MODEL_LEN)]  # the last is rejected
    result = serve(engine, workload, progress=False, loggers=[logger], monitor=monitor,
                   slo=SLO(ttft_ms=60_000.0))

    kinds = [kind for kind, _ in logger.calls]
    assert kinds[-1] == "summary" and kinds.count("summary") == 1
    assert [s for kind, s in logger.calls if kind == "step"] == result.steps
    assert [r for kind, r in logger.calls if kind == "request"] == result.requests
    # Steps are logged as they happen: requests that finish later are logged after earlier steps.
    assert kinds[0] == "step"

    assert all(s["mfu"] is not None and s["flops"] > 0 for s in result.steps)
    assert result.summary["mfu"] is not None and result.summary["mbu"] is not None
    assert result.summary["goodput_fraction"] == pytest.approx(2 / 3)  # the rejected one misses
    summary, breakdowns = logger.calls[-1][1]
    assert summary == result.summary and breakdowns == result.breakdowns
    assert set(result.by_priority) == {"0", "1"} and set(result.by_client) == {"x", "y"}
    assert result.by_priority["1"]["failed"] == 1 and result.by_priority["1"]["completed"] == 1

    table = format_breakdown(result.by_priority, "priority")
    lines = table.splitlines()
    assert lines[0].split()[0] == "priority" and len(lines) == 4
    assert lines[2].split()[:4] == ["0", "1", "1", "0"] and lines[3].split()[:4] == ["1", "2", "1", "1"]


def test_temperature_sampling_runs(engine) -> None:
    result = serve(engine, [_request(0.0), _request(0.0)], progress=False, temperature=0.8)
    assert result.summary["completed"] == 2
    assert all(len(tokens) == 3 for tokens in result.output_token_ids.values())
