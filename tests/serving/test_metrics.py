"""The serving summary on hand-built records, with every expected number worked out here by hand."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import request_record
from nanovllm.serving.metrics import SLO, breakdown, format_summary, run_duration, summarize, summarize_with_breakdowns
from nanovllm.serving.records import RunWriter, read_run


def _step(i: int, duration: float, used: int, total: int = 10) -> dict:
    return {"step": i, "start_time": float(i), "duration": duration, "num_prefill_tokens": 0,
            "num_decode_tokens": 0, "num_prefill_seqs": 0, "num_decode_seqs": 0, "num_running": 0,
            "num_waiting": 0, "num_preempted": 0, "kv_blocks_used": used, "kv_blocks_cached": 0,
            "kv_blocks_free": total - used, "kv_blocks_total": total, "context_tokens": 0}


# A: arrives 0.0, scheduled 0.05, tokens at 0.1, 0.3, 0.5  -> TTFT 100, TPOT (500-100)/2 = 200, E2EL 500
# B: arrives 0.2, scheduled 0.4, tokens at 0.5 .. 1.2      -> TTFT 300, TPOT (1000-300)/4 = 175, E2EL 1000
# C: rejected at 0.3
A = request_record("A", 0.0, scheduled=0.05, token_times=[0.1, 0.3, 0.5], num_prompt_tokens=100, num_cached_tokens=50,
                   priority=0, client_id="alice")
B = request_record("B", 0.2, scheduled=0.4, token_times=[0.5, 0.6, 0.7, 0.8, 1.2], num_prompt_tokens=60,
                   num_preemptions=2, priority=1, client_id="bob")
C = request_record("C", 0.3, token_times=[], num_prompt_tokens=5000, priority=1, client_id="bob",
                   error="prompt longer than max_model_len")
STEPS = [_step(0, 0.01, 2), _step(1, 0.03, 5)]


def test_counts_and_throughput():
    s = summarize([A, B, C], STEPS)
    assert (s["completed"], s["failed"], s["unfinished"]) == (2, 1, 0)
    assert s["total_input_tokens"] == 160 and s["total_output_tokens"] == 8  # failed C not counted
    assert s["duration"] == pytest.approx(1.2)  # last finish 1.2 - first arrival 0.0
    assert s["request_throughput"] == pytest.approx(2 / 1.2)
    assert s["output_throughput"] == pytest.approx(8 / 1.2)
    assert s["total_token_throughput"] == pytest.approx(168 / 1.2)


def test_latency_statistics():
    s = summarize([A, B, C], STEPS)
    assert s["mean_ttft_ms"] == pytest.approx(200) and s["median_ttft_ms"] == pytest.approx(200)
    assert s["std_ttft_ms"] == pytest.approx(100)  # population std of {100, 300}
    assert s["p90_ttft_ms"] == pytest.approx(100 + 0.90 * 200)  # linear interpolation between the two
    assert s["p99_ttft_ms"] == pytest.approx(100 + 0.99 * 200)
    assert s["mean_tpot_ms"] == pytest.approx(187.5) and s["std_tpot_ms"] == pytest.approx(12.5)
    # ITL pooled over requests: A {200, 200}, B {100, 100, 100, 400}
    assert s["mean_itl_ms"] == pytest.approx(1100 / 6)
    assert s["median_itl_ms"] == pytest.approx(150)
    assert s["p99_itl_ms"] == pytest.approx(200 + 0.95 * 200)  # rank 0.99*5 = 4.95 between 200 and 400
    assert s["mean_e2el_ms"] == pytest.approx(750) and s["p90_e2el_ms"] == pytest.approx(950)


def test_scheduling_and_steps():
    s = summarize([A, B, C], STEPS)
    assert s["mean_queue_time_ms"] == pytest.approx(125) and s["p99_queue_time_ms"] == pytest.approx(198.5)
    assert s["num_preemptions"] == 2
    assert s["prefix_cache_hit_rate"] == pytest.approx(50 / 160)
    assert s["peak_kv_usage"] == pytest.approx(0.5) and s["mean_kv_usage"] == pytest.approx(0.35)
    assert s["num_steps"] == 2 and s["mean_step_ms"] == pytest.approx(20)


@pytest.mark.parametrize("slo,good", [
    (SLO(ttft_ms=250), 1),              # B's TTFT 300 misses
    (SLO(tpot_ms=190), 1),              # A's TPOT 200 misses
    (SLO(ttft_ms=250, tpot_ms=190), 0),  # each misses one
    (SLO(e2el_ms=2000), 2),
])
def test_goodput(slo, good):
    s = summarize([A, B, C], STEPS, slo=slo)
    assert s["request_goodput"] == pytest.approx(good / 1.2)
    assert s["goodput_fraction"] == pytest.approx(good / 3)  # the failed request counts as not good


def test_no_slo_no_goodput():
    s = summarize([A, B], STEPS)
    assert s["request_goodput"] is None and s["goodput_fraction"] is None
    assert summarize([A, B], STEPS, slo=SLO())["request_goodput"] is None
    assert "goodput" not in format_summary(s)


def test_own_slo_attainment_is_against_each_requests_own_targets():
    # A: TTFT 0.1 s, E2EL 0.5 s; B: TTFT 0.3 s, E2EL 1.0 s; C failed. Targets in seconds, as Request holds them.
    a = {**A, "slo_ttft": 0.2, "slo_e2el": 1.0}      # meets both
    b = {**B, "slo_ttft": 0.2, "slo_e2el": None}     # TTFT 0.3 > 0.2: misses
    c = {**C, "slo_ttft": 5.0, "slo_e2el": 9.0}      # failed: misses whatever its targets
    assert summarize([a, b, c])["slo_attainment"] == pytest.approx(1 / 3)
    assert summarize([a, {**B, "slo_ttft": None, "slo_e2el": 1.0}])["slo_attainment"] == 1.0  # E2EL 1.0 <= 1.0
    # Requests without targets (or records from before the fields) are not counted; none at all: None.
    assert summarize([a, B])["slo_attainment"] == 1.0
    assert summarize([A, B])["slo_attainment"] is None and "attainment" not in format_summary(summarize([A, B]))
    assert "Own-SLO attainment:" in format_summary(summarize([a, b, c]))


def test_duration_override():
    s = summarize([A, B], [], duration=4.0)
    assert s["duration"] == 4.0 and s["request_throughput"] == pytest.approx(0.5)


def test_itl_pools_each_requests_own_gaps_whatever_their_lengths():
    """Gaps are taken within a request, never from one request's last token to the next one's first, with
    requests of one token between and at either end."""
    records = [request_record("E", 0.0, scheduled=0.0, token_times=[0.5]),
               request_record("F", 0.0, scheduled=0.0, token_times=[0.1, 0.3, 0.6]),
               request_record("G", 0.0, scheduled=0.0, token_times=[0.2]),
               request_record("H", 0.0, scheduled=0.0, token_times=[1.0, 1.1]),
               request_record("I", 0.0, scheduled=0.0, token_times=[2.0])]
    s = summarize(records, [])
    assert s["mean_itl_ms"] == pytest.approx((200 + 300 + 100) / 3)
    assert s["median_itl_ms"] == pytest.approx(200)   # of {200, 300, 100}: a spanning gap (-0.1 s, 0.4 s) would move it


def test_single_token_output_has_no_tpot_and_meets_tpot_slo():
    one = request_record("D", 0.0, scheduled=0.0, token_times=[0.2])
    s = summarize([one], [], slo=SLO(tpot_ms=1.0))
    assert s["mean_tpot_ms"] is None and s["mean_itl_ms"] is None
    assert s["mean_ttft_ms"] == pytest.approx(200)
    assert s["goodput_fraction"] == 1.0


def test_unfinished_request_counts_in_neither():
    cut = request_record("E", 0.1, scheduled=0.2, token_times=[])
    s = summarize([A, cut], [])
    assert (s["completed"], s["failed"], s["unfinished"]) == (1, 0, 1)


@pytest.mark.parametrize("requests", [[], [C]])
def test_empty_input_is_quiet(requests):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "mean of empty slice" would fail the test
        s = summarize(requests, [], slo=SLO(ttft_ms=100))
        text = format_summary(s)
    assert s["completed"] == 0 and s["request_throughput"] == 0.0 and s["num_steps"] == 0
    assert s["mean_ttft_ms"] is None and s["p99_e2el_ms"] is None and s["peak_kv_usage"] is None
    assert s["prefix_cache_hit_rate"] is None and s["mean_step_ms"] is None
    assert "n/a" in text


def test_vllm_key_names_present():
    s = summarize([A, B], STEPS)
    for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "duration",
                "request_throughput", "output_throughput", "total_token_throughput", "num_preemptions",
                "prefix_cache_hit_rate", "peak_kv_usage", "mean_kv_usage", "request_goodput",
                "goodput_fraction", "num_steps", "mean_step_ms", "median_queue_time_ms"):
        assert key in s
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in s


def test_breakdown_by_priority_shares_duration():
    groups = breakdown([A, B, C], "priority", slo=SLO(ttft_ms=250))
    assert list(groups) == ["0", "1"]
    low, high = groups["0"], groups["1"]
    assert low["duration"] == high["duration"] == pytest.approx(1.2)
    assert (low["completed"], high["completed"], high["failed"]) == (1, 1, 1)
    assert low["mean_ttft_ms"] == pytest.approx(100) and high["mean_ttft_ms"] == pytest.approx(300)
    assert low["request_throughput"] + high["request_throughput"] == pytest.approx(2 / 1.2)
    assert low["goodput_fraction"] == 1.0 and high["goodput_fraction"] == 0.0
    assert low["num_steps"] == 0  # steps are global: not attributed to a group


def test_breakdown_by_client_with_none_last():
    anon = request_record("F", 0.0, scheduled=0.0, token_times=[0.1, 0.2])
    groups = breakdown([A, B, anon], "client_id")
    assert list(groups) == ["alice", "bob", "None"]
    assert groups["bob"]["num_preemptions"] == 2


def test_breakdown_unknown_field():
    with pytest.raises(ValueError, match="colour"):
        breakdown([A], "colour")
    assert breakdown([], "priority") == {}


def test_format_summary_layout():
    text = format_summary(summarize([A, B, C], STEPS, slo=SLO(ttft_ms=250)))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    assert "---------------Time to First Token----------------" in lines
    assert "Successful requests:                     2" in lines
    assert "Request goodput (req/s):                 0.83" in lines
    assert "Mean TTFT (ms):                          200.00" in lines
    rows = [line for line in lines if ":" in line]
    assert all(line[40] == " " and line[41] != " " for line in rows)  # every value starts in column 41


def test_format_summary_extra_keys_and_title():
    text = format_summary({"completed": 3, "my_metric": 1.5}, title="Run 7")
    assert text.splitlines()[0].strip("=") == " Run 7 "
    assert "Other" in text and "my_metric:" in text and "1.50" in text


def test_run_files_round_trip(tmp_path):
    summary = summarize([A, B, C], STEPS, slo=SLO(ttft_ms=250))
    run_dir = tmp_path / "run" / "0"
    writer = RunWriter(run_dir)
    for record in [A, B, C]:
        writer.write_request(record)
    for step in STEPS:
        writer.write_step(step)
    writer.write_metrics(summary)
    writer.close()
    assert json.loads((run_dir / "metrics.json").read_text()) == {**summary, "breakdowns": {}}
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 3
    run = read_run(run_dir)
    requests, steps, loaded = run.requests, run.steps, run.summary
    assert requests == [A, B, C] and steps == STEPS and loaded == summary
    assert summarize(requests, steps, slo=SLO(ttft_ms=250)) == summary  # files alone reproduce the summary


def _spec_step(i: int, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> dict:
    return {**_step(i, 0.01, 2), "spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted, "spec_decode_num_accepted_tokens_per_pos": per_pos}


# Step 0: two requests verify 3 proposals each, accepting 2 and 0; step 1: one verifies 2 and accepts both;
# step 2: nothing proposed.
SPEC_STEPS = [_spec_step(0, 2, 6, 2, [1, 1, 0]), _spec_step(1, 1, 2, 2, [1, 1]), _spec_step(2, 0, 0, 0, [])]


def test_speculative_decoding_figures_sum_the_step_records_with_vllm_names():
    s = summarize([A, B], SPEC_STEPS)
    assert (s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]) \
        == (3, 8, 4)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(4 / 8)
    assert s["spec_decode_mean_accepted_length"] == pytest.approx(1 + 4 / 3)   # the target's own token included
    assert s["spec_decode_num_accepted_tokens_per_pos"] == [2, 2, 0]
    # Without proposals the counters are 0 and the ratios None (never a misleading 0); older runs have none.
    off = summarize([A, B], [_spec_step(0, 0, 0, 0, [])])
    assert off["spec_decode_num_drafts"] == 0 and off["spec_decode_acceptance_rate"] is None
    assert off["spec_decode_mean_accepted_length"] is None and off["spec_decode_num_accepted_tokens_per_pos"] == []
    assert "spec_decode_num_drafts" not in summarize([A, B], STEPS)


def test_format_summary_shows_speculative_decoding_only_when_something_was_proposed():
    text = format_summary(summarize([A, B], SPEC_STEPS))
    lines = text.splitlines()
    assert "---------------Speculative Decoding---------------" in lines
    assert "Acceptance rate:                         0.50" in lines
    assert "Mean accepted length:                    2.33" in lines
    assert "Accepted per position:                   2, 2, 0" in lines
    off = format_summary(summarize([A, B], [_spec_step(0, 0, 0, 0, [])]))
    assert "Speculative" not in off and "spec_decode" not in off


@st.composite
def _records(draw) -> list[dict]:
    """Requests done, failed, aborted and unfinished, of a few priorities, clients and replicas, each with its
    own number of token times (none, one, many)."""
    out = []
    for i in range(draw(st.integers(0, 12))):
        arrival = draw(st.floats(0.0, 5.0))
        gaps = draw(st.lists(st.floats(0.001, 1.0), max_size=6))
        times = [arrival + sum(gaps[:k + 1]) for k in range(len(gaps))]
        fate = draw(st.sampled_from(["done", "done", "failed", "aborted", "unfinished"]))
        fields = {"priority": draw(st.integers(0, 2)), "client_id": draw(st.sampled_from([None, "a", "b"])),
                  "replica": draw(st.integers(0, 3))}
        if fate == "failed":
            fields.update(error="prompt too long")
        elif fate == "aborted":
            fields.update(error="aborted by the client", finish_reason="abort")
        elif fate == "unfinished":
            fields.update(finish_time=None, finish_reason=None)
        out.append(request_record(str(i), arrival, token_times=times if fate != "failed" else [], **fields))
    return out


@settings(max_examples=150, deadline=None)
@given(records=_records(), slo=st.sampled_from([None, SLO(ttft_ms=300.0, tpot_ms=150.0)]))
def test_a_summary_with_its_breakdowns_is_each_group_summarized_alone(records: list[dict], slo: SLO | None):
    """The summary and breakdowns a harness reports at the end of a run (read in one pass over the latencies)
    are ``summarize`` of the whole run, and of each group's records alone over the whole run's duration."""
    summary, breakdowns = summarize_with_breakdowns(records, STEPS, ("priority", "client_id", "replica"), slo=slo)
    assert summary == summarize(records, STEPS, slo=slo)
    for by in ("priority", "client_id", "replica"):
        values = sorted({r[by] for r in records}, key=lambda v: (v is None, isinstance(v, str), v or 0))
        assert list(breakdowns[by]) == [str(v) for v in values]
        for value in values:
            group = [r for r in records if r[by] == value]
            assert breakdowns[by][str(value)] == summarize(group, (), duration=run_duration(records), slo=slo)
        assert breakdowns[by] == breakdown(records, by, slo=slo)
