"""Tests written to kill mutants that mutation testing (``make mutate``, mutmut) showed the fast suite let live.
Each asserts a behaviour of the scheduler, policies, allocators, sampler or stop logic that a one-token change
to the code would alter; none needs the model."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from nanovllm import (ALLOCATORS, POLICIES, EvictionTracker, Policy, Request, RequestStatus, SamplingParams,
                      SchedulerView, StepBudget, register_allocator, register_policy)
from nanovllm.engine.scheduler import PolicyError, Scheduler, SchedulerOutput
from nanovllm import sampling as sampling_module
from nanovllm.sampling import INVALID_TOKEN, NON_FINITE_REASON, Sampler, greedy_tokens, top_logprobs

REPO = Path(__file__).resolve().parent.parent


def _request(n_prompt: int, max_tokens: int, **params) -> Request:
    return Request("r", list(range(1, 1 + n_prompt)), SamplingParams(max_tokens=max_tokens, **params), 0.0)


def test_a_request_stops_at_exactly_max_tokens_or_max_model_len():
    request = _request(3, max_tokens=3, ignore_eos=True)
    for _ in range(2):
        request.append_token(7, 0.0)
        assert request.check_stop(10**9) is None
    request.append_token(7, 0.0)
    assert request.check_stop(10**9) == "length"          # the third token is the last
    long = _request(3, max_tokens=100)
    long.append_token(7, 0.0)
    assert long.check_stop(5) is None and long.check_stop(4) == "length"   # 4 tokens reach a 4-token limit


def test_eos_stops_unless_ignored_and_logprobs_are_kept_per_token():
    request = _request(3, max_tokens=10)
    request.eos_token_ids = frozenset({2})
    request.append_token(5, 0.0)                            # no logprobs asked: none kept
    assert request.logprobs is None
    request.append_token(2, 1.0, {2: "lp-a"})
    assert request.check_stop(10**9) == "stop"
    request.append_token(6, 2.0, {6: "lp-b"})
    assert request.logprobs == [{2: "lp-a"}, {6: "lp-b"}]


# -- policies: the Python defaults are the Hydra configs' ----------------------------------------------------------

@pytest.mark.parametrize("name", ["fair", "mlfq", "lpm", "sarathi", "sjf", "edf"])
def test_policy_python_defaults_equal_the_hydra_config(name):
    """`LLM(scheduler=name)` and `python -m nanovllm.run scheduler=name` run the same policy. (edf's
    require_slo differs on purpose: the run config catches a workload without SLOs; see policies/edf.py.)"""
    config = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "scheduler" / f"{name}.yaml"))
    config.pop("name")
    if name == "edf":
        assert config.pop("require_slo") is True and POLICIES.build("edf").require_slo is False
    built = POLICIES.build(name)
    assert {key: getattr(built, "predictor_name" if key == "predictor" else key) for key in config} == config


def test_random_policy_default_seed_is_zero():
    requests = [_req(f"r{i}") for i in range(8)]
    default, zero = POLICIES.build("random"), POLICIES.build({"name": "random", "seed": 0})
    assert [default.priority(r, 0.0) for r in requests] == [zero.priority(r, 0.0) for r in requests]


@pytest.mark.parametrize("spec, accepted", [
    ({"name": "mlfq", "quantum": 1, "num_levels": 1}, True), ({"name": "mlfq", "quantum": 0}, False),
    ({"name": "mlfq", "num_levels": 0}, False),
    ({"name": "sarathi", "token_budget": 1}, True), ({"name": "sarathi", "token_budget": 0}, False),
    ({"name": "sarathi", "token_budget": True}, False), ({"name": "sarathi", "token_budget": 2.0}, False),
    ({"name": "lpm", "max_wait": 0.5}, True), ({"name": "lpm", "max_wait": 0}, False),
    ({"name": "lpm", "max_wait": -1}, False), ({"name": "lpm", "max_wait": math.nan}, False),
    ({"name": "lpm", "max_wait": "soon"}, False),
    ({"name": "sjf", "max_wait": 0.5}, True), ({"name": "sjf", "max_wait": 0}, False),
    ({"name": "sjf", "max_wait": "soon"}, False),
    ({"name": "edf", "step_time": 0}, True), ({"name": "edf", "step_time": -0.1}, False),
    ({"name": "edf", "default_slo_ms": 0.5}, True), ({"name": "edf", "default_slo_ms": 100}, True),
    ({"name": "edf", "default_slo_ms": 0}, False),
])
def test_policy_parameters_at_their_bounds(spec, accepted):
    if accepted:
        POLICIES.build(dict(spec))
    else:
        with pytest.raises(ValueError):
            POLICIES.build(dict(spec))


@pytest.mark.parametrize("spec, field", [
    ({"name": "fair", "input_weight": -1}, "input_weight"), ({"name": "fair", "output_weight": -0.5}, "output_weight"),
    ({"name": "fair", "input_weight": math.inf}, "input_weight"), ({"name": "fair", "output_weight": "x"}, "output_weight"),
    ({"name": "mlfq", "quantum": 0}, "quantum"), ({"name": "mlfq", "quantum": 2.0}, "quantum"),
    ({"name": "mlfq", "num_levels": True}, "num_levels"), ({"name": "mlfq", "num_levels": 0}, "num_levels"),
    ({"name": "sjf", "output_per_prompt_token": -1}, "output_per_prompt_token"),
    ({"name": "sjf", "output_per_prompt_token": math.nan}, "output_per_prompt_token"),
    ({"name": "sjf", "output_per_prompt_token": "many"}, "output_per_prompt_token"),
])
def test_a_bad_policy_parameter_is_a_value_error_naming_it(spec, field):
    with pytest.raises(ValueError, match=rf"^scheduler\.{field} must be"):
        POLICIES.build(dict(spec))


@pytest.mark.parametrize("spec", [
    {"name": "fair", "input_weight": 0, "output_weight": 0.5}, {"name": "fair", "input_weight": 0.5, "output_weight": 0},
    {"name": "sjf", "output_per_prompt_token": 0}, {"name": "sjf", "output_per_prompt_token": 0.5},
])
def test_zero_and_fractional_weights_are_accepted_as_given(spec):
    policy = POLICIES.build(dict(spec))
    assert all(getattr(policy, key) == value for key, value in spec.items() if key != "name")


# -- policies: behaviour ---------------------------------------------------------------------------------------

def _req(rid: str, n_prompt: int = 4, max_tokens: int = 4, arrival: float = 0.0, client: str | None = None,
         **fields) -> Request:
    request = Request(rid, list(range(1, 1 + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      arrival_time=arrival, client_id=client)
    for key, value in fields.items():
        setattr(request, key, value)
    return request


def test_edf_rejects_exactly_when_the_remaining_steps_no_longer_fit():
    e2el = POLICIES.build({"name": "edf", "deadline": "e2el", "step_time": 0.25})
    two = _req("two", max_tokens=2, slo_e2el=1.0, slo_ttft=10.0)
    assert e2el.reject_reason(two, 0.5) is None               # 0.5 + 2 steps * 0.25 = the deadline: still fits
    assert "cannot meet its e2el deadline (1000 ms after arrival)" in e2el.reject_reason(two, 0.51)
    one = _req("one", max_tokens=1, slo_e2el=1.0)
    assert e2el.reject_reason(one, 0.75) is None and e2el.reject_reason(one, 0.76) is not None
    ttft = POLICIES.build({"name": "edf", "deadline": "ttft", "step_time": 0.25})
    first = _req("first", max_tokens=8, slo_ttft=1.0, slo_e2el=100.0)
    assert ttft.reject_reason(first, 0.75) is None and ttft.reject_reason(first, 0.76) is not None
    assert POLICIES.build("edf").reject_reason(_req("late", slo_ttft=1.0), 0.99) is None   # step_time 0: now only


def test_edf_deadlines_use_the_chosen_target_or_the_default():
    both = _req("both", slo_ttft=1.0, slo_e2el=5.0, arrival=2.0)
    assert POLICIES.build({"name": "edf", "deadline": "e2el"}).deadline_of(both) == 7.0
    assert POLICIES.build({"name": "edf", "deadline": "ttft"}).deadline_of(both) == 3.0
    assert POLICIES.build({"name": "edf", "default_slo_ms": 500}).slo_of(_req("none")) == 0.5


def test_vtc_lifts_a_returning_client_to_the_least_served_active_one():
    policy = POLICIES.build("fair")
    a1, a2, b, a3 = _req("a1", client="a"), _req("a2", client="a"), _req("b", client="b"), _req("a3", client="a")
    policy.on_arrival(a1, 0.0)
    a1.num_computed_tokens = 4
    policy.on_step([(a1, 4)], 0.0)                          # a: 4 prompt tokens at input weight 1
    policy.on_arrival(a2, 0.0)
    policy.on_finish(a1, 0.0)                               # a still has a2 running
    policy.on_arrival(b, 0.0)
    assert policy.counters["b"] == 4.0                      # lifted to a's counter: idleness is no credit
    b.num_computed_tokens = 4
    policy.on_step([(b, 4)], 0.0)
    policy.on_finish(a2, 0.0)                               # a is idle now
    policy.on_arrival(a3, 0.0)
    assert policy.counters["a"] == 8.0                      # lifted to b's 8 when it comes back


def test_vtc_charges_the_last_prompt_token_as_input_and_a_clientless_request_to_default():
    policy = POLICIES.build("fair")                         # defaults: input 1, output 2
    request = _req("r", n_prompt=5)
    request.num_computed_tokens = 5                         # a final prefill chunk of one token
    policy.on_step([(request, 1)], 0.0)
    request.num_computed_tokens = 3                         # a middle chunk of one token
    policy.on_step([(request, 1)], 0.0)
    request.num_computed_tokens = 6                         # a decode
    policy.on_step([(request, 1)], 0.0)
    assert dict(policy.counters) == {"default": 1.0 + 1.0 + 2.0}


def test_lpm_ages_exactly_past_max_wait():
    policy = POLICIES.build({"name": "lpm", "max_wait": 10.0})
    policy.bind_prefix_lookup(lambda r: 8 if r.request_id == "cached" else 0)
    old, cached = _req("old", arrival=0.0), _req("cached", arrival=0.5)
    order = lambda now: sorted([old, cached], key=lambda r: policy.priority(r, now))   # noqa: E731
    assert order(10.0) == [cached, old]                     # waited exactly max_wait: not yet starving
    assert order(10.01) == [old, cached]
    late_old, late_cached = _req("old", arrival=6.0), _req("cached", arrival=6.5)
    assert sorted([late_old, late_cached], key=lambda r: policy.priority(r, 7.0)) == [late_cached, late_old]


def test_mlfq_levels_are_capped_and_demoted_at_the_quantum_and_reset_on_finish():
    policy = POLICIES.build({"name": "mlfq", "quantum": 4, "num_levels": 3})
    short = _req("short", n_prompt=1)
    policy.on_step([(short, 3)], 0.0)
    assert policy.level(short) == 0                         # 3 tokens: log2(1 + 3/4) < 1
    policy.on_step([(short, 1)], 0.0)
    assert policy.level(short) == 1                         # 4 tokens: one quantum
    policy.on_step([(short, 1000)], 0.0)
    assert policy.level(short) == 2                         # capped at num_levels - 1
    policy.on_finish(short, 0.0)
    assert policy.level(short) == 0                         # a finished request's service is forgotten


def test_mlfq_preempts_only_when_asked_and_only_for_a_strictly_higher_level():
    running = [_req("low-early", n_prompt=64, arrival=0.0), _req("low-late", n_prompt=64, arrival=1.0),
               _req("top", n_prompt=1, arrival=2.0)]
    waiting = _req("new", n_prompt=1, arrival=3.0)
    assert POLICIES.build("mlfq").preempt_for(waiting, running, 0.0) is None        # preempt is off by default
    policy = POLICIES.build({"name": "mlfq", "preempt": True})
    assert policy.preempt_for(waiting, running, 0.0) is running[1]                 # lowest level, latest arrival
    assert policy.preempt_for(waiting, running[2:], 0.0) is None                   # same level: no preemption


def test_prefill_first_asks_for_prefills_before_decodes():
    view = SchedulerView(num_running=0, num_waiting=1, num_scheduled_tokens=0, token_budget_left=64,
                         max_num_seqs=4, num_free_blocks=8, num_total_blocks=8, block_size=4,
                         max_num_batched_tokens=64)
    assert POLICIES.build("prefill_first").step_budget(view, 0.0) == StepBudget(64, decodes_first=False)


def test_random_policy_forgets_finished_requests():
    policy = POLICIES.build("random")
    requests = [_req(f"r{i}") for i in range(5)]
    for request in requests:
        policy.on_arrival(request, 0.0)
    for request in requests:
        policy.on_finish(request, 0.0)
    assert policy._rank == {}                               # bounded memory over a long run


def three_tokens(request: Request) -> float:
    """A 'module:function' predictor for the sjf test."""
    return 3


def minus_one(request: Request, offset: int = 0) -> float:
    return -1 + offset


def test_sjf_predictors_from_history_prompt_length_and_a_module_path():
    history = POLICIES.build({"name": "sjf", "predictor": "client_history"})
    fresh = _req("fresh", max_tokens=50, client="a")
    assert history.predicted_output_len(fresh) == 50        # nobody finished yet: max_tokens
    for rid, client, n in (("x", "a", 4), ("y", "a", 8), ("z", None, 30)):
        done = _req(rid, client=client)
        done.token_ids += [7] * n
        history.on_finish(done, 0.0)
    assert history.predicted_output_len(fresh) == 6         # a's mean
    assert history.predicted_output_len(_req("n", client=None)) == 30    # the default client's own
    assert history.predicted_output_len(_req("c", client="c")) == 14     # everyone's mean: (4 + 8 + 30) / 3
    assert POLICIES.build({"name": "sjf", "predictor": "prompt_length"}).predicted_output_len(_req("p", 6)) == 6
    scaled = POLICIES.build({"name": "sjf", "predictor": "prompt_length", "output_per_prompt_token": 2.0})
    assert scaled.predicted_output_len(_req("p", 6)) == 12
    by_path = POLICIES.build({"name": "sjf", "predictor": f"{__name__}:three_tokens"})
    assert by_path.predicted_output_len(_req("p")) == 3


@pytest.mark.parametrize("predictor, name", [
    (minus_one, "minus_one"), (functools.partial(minus_one, offset=0), "callable"),
    (f"{__name__}:minus_one", f"{__name__}:minus_one")])
def test_sjf_names_a_predictor_that_returns_a_bad_length(predictor, name):
    policy = POLICIES.build({"name": "sjf", "predictor": predictor})
    with pytest.raises(ValueError, match=f"scheduler.predictor={name!r} must return a number"):
        policy.predicted_output_len(_req("r"))


@pytest.mark.parametrize("value, ok", [(0, True), (0.5, True), (-1, False), (True, False)])
def test_sjf_accepts_any_length_from_zero(value, ok):
    policy = POLICIES.build({"name": "sjf", "predictor": lambda r: value})
    if ok:
        assert policy.predicted_output_len(_req("r")) == value
    else:
        with pytest.raises(ValueError):
            policy.predicted_output_len(_req("r"))


def test_sjf_ages_exactly_past_max_wait():
    policy = POLICIES.build({"name": "sjf", "max_wait": 10.0})
    long, short = _req("long", max_tokens=100, arrival=0.0), _req("short", max_tokens=1, arrival=0.5)
    assert sorted([long, short], key=lambda r: policy.priority(r, 10.0)) == [short, long]
    assert sorted([long, short], key=lambda r: policy.priority(r, 10.01)) == [long, short]
    late_long, late_short = _req("long", max_tokens=100, arrival=6.0), _req("short", max_tokens=1, arrival=6.5)
    assert sorted([late_long, late_short], key=lambda r: policy.priority(r, 7.0)) == [late_short, late_long]


# -- the scheduler -------------------------------------------------------------------------------------------------

class RecordingPolicy(Policy):
    """FCFS that notes the time every scheduler call passes it (a user policy that ages requests needs it)."""

    def __init__(self, decodes_first: bool = True) -> None:
        self.decodes_first = decodes_first
        self.times: list[tuple[str, object]] = []
        self.finished: list[str] = []
        self.asked: list[tuple[object, object]] = []     # should_expand_batch's request and view
        self.budget_views: list[object] = []

    def priority(self, request, now):
        self.times.append(("priority", now))
        return (request.arrival_time,)

    def select_victim(self, candidates, now):
        self.times.append(("select_victim", now))
        return super().select_victim(candidates, now)

    def should_expand_batch(self, request, view, now):
        self.times.append(("should_expand_batch", now))
        self.asked.append((request, view))
        return True

    def step_budget(self, view, now):
        self.times.append(("step_budget", now))
        self.budget_views.append(view)
        return StepBudget(view.max_num_batched_tokens, decodes_first=self.decodes_first)

    def on_arrival(self, request, now):
        self.times.append(("on_arrival", now))

    def reject_reason(self, request, now):
        self.times.append(("reject_reason", now))
        return "it is hopeless" if request.request_id == "hopeless" else None

    def preempt_for(self, waiting, running, now):
        self.times.append(("preempt_for", now))
        latest = max(running, key=lambda r: r.arrival_time)
        return latest if latest.arrival_time > waiting.arrival_time else None   # preemptive FCFS

    def on_step(self, scheduled, now):
        self.times.append(("on_step", now))

    def on_finish(self, request, now):
        self.times.append(("on_finish", now))
        self.finished.append(request.request_id)


def _scheduler(policy: Policy, num_blocks: int, allocator: str = "paged", watermark: float = 0.01,
               max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(policy, ALLOCATORS.get(allocator)(num_blocks, 4), max_num_seqs=4,
                     max_num_batched_tokens=max_num_batched_tokens, watermark=watermark)


def _run_step(scheduler: Scheduler, now: float, token: int = 7):
    out = scheduler.schedule(now)
    tokens = [token if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]
    return out, scheduler.update_from_output(out, tokens, now, max_model_len=10**9)


@pytest.mark.parametrize("decodes_first", [True, False])
def test_every_policy_call_gets_the_steps_time(decodes_first):
    policy = RecordingPolicy(decodes_first)
    scheduler = _scheduler(policy, 6)
    for rid, arrival in (("early", 0.0), ("late", 1.0)):
        scheduler.add(_req(rid, n_prompt=8, max_tokens=12, arrival=arrival), 0.0)
    hopeless = _req("hopeless", arrival=-2.0)
    preempted = 0
    for step in range(1, 60):
        if step == 2:   # earlier than both and too big for the free blocks: preempt_for makes room for it
            scheduler.add(_req("urgent", n_prompt=12, max_tokens=4, arrival=-1.0), float(step))
            scheduler.add(hopeless, float(step))
        out, _ = _run_step(scheduler, float(step))
        preempted += len(out.preempted)
        if not scheduler.has_unfinished():
            break
    assert preempted >= 2 and sorted(policy.finished) == ["early", "hopeless", "late", "urgent"]
    assert (hopeless.status, hopeless.finish_time) == (RequestStatus.FAILED, 2.0)
    assert hopeless.error == f"rejected by policy {policy.registered_name!r}: it is hopeless"
    assert {name for name, _ in policy.times} >= {"priority", "select_victim", "step_budget", "on_finish",
                                                   "should_expand_batch", "on_step", "preempt_for", "on_arrival",
                                                   "reject_reason"}
    assert all(isinstance(now, float) for _, now in policy.times)
    assert all(isinstance(r, Request) and isinstance(v.token_budget_left, int) for r, v in policy.asked)
    assert all(v.token_budget_left == 64 for v in policy.budget_views)


def test_preemption_marks_counts_and_accounts_the_recomputed_tokens():
    scheduler = _scheduler(POLICIES.build("fcfs"), 6)
    early, late = _req("early", n_prompt=8, max_tokens=12, arrival=0.0), _req("late", n_prompt=8, max_tokens=12,
                                                                                arrival=1.0)
    scheduler.add(early, 0.0)
    scheduler.add(late, 0.0)
    for step in range(20):
        out, _ = _run_step(scheduler, float(step))
        if out.preempted:
            break
    assert out.preempted == [late] and late.status is RequestStatus.PREEMPTED and late.num_preemptions == 1
    assert all(r is not late for r, _ in out.scheduled)    # the request that gave way is not run this step
    assert late in scheduler.waiting and late not in scheduler.running
    assert early.num_recomputed_tokens == 0


def test_recomputed_tokens_are_those_below_the_high_water_mark_summed_over_chunks_and_requests():
    scheduler = _scheduler(POLICIES.build("fcfs"), 16)
    r1, r2, fresh = _req("r1", n_prompt=12), _req("r2", n_prompt=8), _req("fresh", n_prompt=4)
    r1.max_computed_tokens, r2.max_computed_tokens = 10, 6     # computed before a preemption threw them away
    scheduler.running += [r1, r2, fresh]
    out = SchedulerOutput(scheduled=[(r1, 4), (r2, 8), (fresh, 4)])
    scheduler.update_from_output(out, [None, 9, 9], 0.0, max_model_len=10**9)
    assert (r1.num_recomputed_tokens, r2.num_recomputed_tokens, fresh.num_recomputed_tokens) == (4, 6, 0)
    assert out.num_recomputed_tokens == 10
    assert (r1.output_token_ids, r2.output_token_ids, fresh.output_token_ids) == ([], [9], [9])   # r1: a chunk
    out = SchedulerOutput(scheduled=[(r1, 8)])
    scheduler.update_from_output(out, [9], 1.0, max_model_len=10**9)
    assert r1.num_recomputed_tokens == 10 and out.num_recomputed_tokens == 6 and r1.max_computed_tokens == 12


def test_finish_reason_and_error_of_a_finished_and_of_a_failed_request():
    scheduler = _scheduler(POLICIES.build("fcfs"), 8)
    done, garbage, after = _req("done", max_tokens=1), _req("garbage", max_tokens=1), _req("after", max_tokens=1)
    for request in (done, garbage, after):
        scheduler.add(request, 0.0)
    out = scheduler.schedule(0.0)
    finished = scheduler.update_from_output(out, [7, INVALID_TOKEN, 8], 2.0, max_model_len=10**9,
                                            next_logprobs=[{7: "lp"}, None, None])
    assert finished == [done, garbage, after] and done.logprobs == [{7: "lp"}] and garbage.finish_time == 2.0
    assert after.output_token_ids == [8]                    # rows after a failed one go on
    assert (done.status, done.finish_reason, done.error, done.finish_time) == (RequestStatus.FINISHED, "length",
                                                                             None, 2.0)
    assert (garbage.status, garbage.finish_reason, garbage.error) == (RequestStatus.FAILED, None, NON_FINITE_REASON)


def test_reject_and_abort_end_requests_and_report_them_at_the_next_update():
    policy = RecordingPolicy()
    scheduler = _scheduler(policy, 8)
    refused, waiting, running = _req("refused"), _req("waiting", arrival=1.0), _req("running")
    scheduler.add(running, 0.0)
    _run_step(scheduler, 0.0)
    scheduler.reject(refused, "too long", 3.0)
    scheduler.add(waiting, 1.0)
    assert scheduler.abort("nobody", 4.0) is None
    assert scheduler.abort("running", 4.0) is running
    assert scheduler.abort("waiting", 5.0, reason="client went away") is waiting
    assert scheduler.running == [] and scheduler.waiting == [] and running.block_table == []
    assert scheduler.allocator.num_free_blocks() == 8
    assert (refused.status, refused.error, refused.finish_time) == (RequestStatus.FAILED, "too long", 3.0)
    assert (running.status, running.finish_reason, running.error, running.finish_time) == (
        RequestStatus.ABORTED, "abort", "aborted", 4.0)
    assert (waiting.finish_reason, waiting.error, waiting.finish_time) == ("abort", "client went away", 5.0)
    assert policy.finished == ["running", "waiting"] and ("on_finish", 5.0) in policy.times
    assert scheduler.update_from_output(SchedulerOutput(), [], 6.0, max_model_len=10**9) == [refused, running,
                                                                                              waiting]
    assert not scheduler.has_unfinished()


def test_a_failed_admission_gives_back_its_prefix_match():
    scheduler = _scheduler(POLICIES.build("fcfs"), 8, allocator="prefix", watermark=0.0)
    first = _req("first", n_prompt=8, max_tokens=1)
    scheduler.add(first, 0.0)
    _run_step(scheduler, 0.0)                               # caches two blocks
    hog = Request("hog", list(range(100, 120)), SamplingParams(max_tokens=50, ignore_eos=True), 1.0)
    scheduler.add(hog, 1.0)
    _run_step(scheduler, 1.0)
    _run_step(scheduler, 2.0)                               # 6 of the 8 blocks are the hog's now
    twin = Request("twin", list(range(1, 9)) + list(range(50, 58)), SamplingParams(max_tokens=4), 3.0)
    scheduler.add(twin, 3.0)
    out, _ = _run_step(scheduler, 3.0)
    assert all(r is not twin for r, _ in out.scheduled) and twin in scheduler.waiting
    assert (twin.num_computed_tokens, twin.num_cached_tokens, twin.block_table) == (0, 0, [])
    assert scheduler.allocator.num_cached_blocks() == 2     # the matched blocks are evictable again


@pytest.mark.parametrize("watermark, extra_blocks, preempts", [(0.0, 0, False), (0.0, 1, True), (0.25, 0, True)])
def test_priority_preempts_for_a_waiting_request_exactly_when_it_does_not_fit(watermark, extra_blocks, preempts):
    scheduler = _scheduler(POLICIES.build("priority"), 16, watermark=watermark)
    low = Request("low", list(range(1, 17)), SamplingParams(max_tokens=50, ignore_eos=True), 0.0, priority=5)
    scheduler.add(low, 0.0)
    _run_step(scheduler, 0.0)                               # low holds 4 blocks: 12 free when step 1 starts
    # 12 blocks fit exactly with no watermark; 13 do not, nor do 12 plus a 4-block watermark.
    urgent = Request("urgent", list(range(200, 200 + 4 * (12 + extra_blocks))), SamplingParams(max_tokens=2), 1.0,
                     priority=0)
    scheduler.add(urgent, 1.0)
    out, _ = _run_step(scheduler, 1.0)
    assert (out.preempted == [low]) is preempts


# -- sampling ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, good, bad", [
    ("temperature", [0, 0.0, 2.5], [-0.01, math.inf, math.nan, True, "1"]),
    ("top_k", [-1, 1, 50], [0, -2, 2.0, True]),
    ("top_p", [1, 1.0, 0.01], [0, 0.0, 1.01, math.nan, True]),
    ("max_tokens", [1, 64], [0, -1, 1.0, True]),
    ("ignore_eos", [True, False], [1, "yes", None]),
    ("stop_token_ids", [None, [], [0], (3, 4)], [[-1], ["a"], "5", 5, [True, 1.5]]),
    ("seed", [None, 0, 2**64 - 1], [-1, 2**64, 1.5, True]),
    ("logprobs", [None, 0, 5], [-1, True, 1.5]),
])
def test_sampling_params_accept_exactly_their_documented_range(field, good, bad):
    for value in good:
        SamplingParams(**{field: value})
    for value in bad:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})


def test_greedy_below_the_temperature_threshold_or_with_top_k_one():
    assert SamplingParams(temperature=0.99e-5).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=1e-5).greedy and not SamplingParams(temperature=1.0, top_k=2).greedy


def test_sampler_marks_non_finite_rows_and_samples_the_others_by_their_own_filters():
    logits = torch.tensor([[0.0, float("nan"), 1.0], [0.0, float("inf"), 1.0], [5.0, float("-inf"), 4.0],
                           [1.0, 1.0, 1.0], [1.0, 0.9, 0.0]])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0),
              SamplingParams(top_k=-1), SamplingParams(top_k=2)]
    seen: list[set[int]] = [set() for _ in params]
    generators = [torch.Generator().manual_seed(i) for i in range(len(params))]
    for _ in range(300):
        for row, token in enumerate(Sampler()(logits, params, generators)):
            seen[row].add(token)
    assert seen[0] == seen[1] == {INVALID_TOKEN}
    assert seen[2] == {0}                                   # -inf is a legitimate "never this token"
    assert seen[3] == {0, 1, 2}                             # top_k=-1 keeps the whole row in a mixed batch
    assert seen[4] == {0, 1}                                # top_k=2 in the same batch


def test_sampler_top_k_beyond_the_vocabulary_keeps_everything_and_top_p_is_per_row():
    logits = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    params = [SamplingParams(top_k=10, top_p=1.0), SamplingParams(top_p=0.5)]
    seen: list[set[int]] = [set(), set()]
    generators = [torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)]
    for _ in range(400):
        for row, token in enumerate(Sampler()(logits, params, generators)):
            seen[row].add(token)
    assert seen == [{0, 1, 2}, {0}]


def test_each_row_draws_from_its_own_generator():
    logits = torch.zeros(2, 1000)
    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    first = Sampler()(logits, params, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)])
    again = Sampler()(logits, params, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(99)])
    assert first[0] == again[0] and first[1] != again[1]


def test_top_logprobs_rank_the_top_k_and_always_include_the_sampled_token():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]])
    result = top_logprobs(logits, [3, 0, 1], [2, 0, None])
    expected = torch.log_softmax(logits, dim=-1)
    assert set(result[0]) == {0, 1, 3}
    assert [result[0][t].rank for t in (0, 1, 3)] == [1, 2, 4]
    assert result[0][3].logprob == pytest.approx(float(expected[0, 3]))
    assert result[0][0].logprob == pytest.approx(float(expected[0, 0]))
    assert set(result[1]) == {0} and result[1][0].rank == 4 and result[2] is None
    assert top_logprobs(logits, [0, 0, 0], [None, None, None]) == [None, None, None]


@pytest.mark.parametrize("name", ["mlfq", "random", "fair", "sjf"])
def test_a_policy_hears_on_finish_for_a_request_it_never_scheduled(name):
    policy = POLICIES.build(name)
    aborted = _req("aborted-while-waiting")
    policy.on_arrival(aborted, 0.0)
    policy.on_finish(aborted, 1.0)                          # aborted or rejected before any step: no KeyError
    POLICIES.build(name).on_finish(_req("unknown"), 1.0)


def test_a_decode_that_gives_way_to_itself_lets_the_prefill_after_it_run():
    # The batch is decodes first: D (least urgent) decodes ahead of P's prefill chunks. When D's next block is
    # missing, the policy's victim among [D, P] is D itself; P's chunk must still run in that step.
    policy = POLICIES.build({"name": "priority", "preempt_for_priority": False})
    scheduler = _scheduler(policy, 6, max_num_batched_tokens=4, watermark=0.0)
    d = Request("D", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), 0.0, priority=9)
    p = Request("P", list(range(100, 122)), SamplingParams(max_tokens=60, ignore_eos=True), 1.0, priority=0)
    scheduler.add(d, 0.0)
    _run_step(scheduler, 0.0)
    scheduler.add(p, 1.0)
    for step in range(1, 30):
        out, _ = _run_step(scheduler, float(step))
        if out.preempted:
            break
    assert out.preempted == [d] and [r for r, _ in out.scheduled] == [p]


class AdjustableBudget(Policy):
    """FCFS with a per-step token budget the test sets."""

    tokens = 3

    def step_budget(self, view, now):
        return StepBudget(self.tokens)


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_every_running_decode_runs_while_the_token_budget_lasts(budget):
    policy = AdjustableBudget()
    scheduler = _scheduler(policy, 16)
    requests = [_req(f"r{i}", n_prompt=1, max_tokens=10, arrival=float(i)) for i in range(3)]
    for request in requests:
        scheduler.add(request, 0.0)
    _run_step(scheduler, 0.0)                               # all three admitted
    policy.tokens = budget
    out, _ = _run_step(scheduler, 1.0)
    assert out.scheduled == [(r, 1) for r in requests[:budget]]   # one token each, none with 0 tokens


@pytest.mark.parametrize("budget, admitted", [(3, False), (4, True)])
def test_admission_uses_the_budget_the_decodes_leave_and_never_admits_zero_tokens(budget, admitted):
    policy = AdjustableBudget()
    scheduler = _scheduler(policy, 16)
    running = [_req(f"r{i}", n_prompt=1, max_tokens=10, arrival=float(i)) for i in range(3)]
    for request in running:
        scheduler.add(request, 0.0)
    _run_step(scheduler, 0.0)
    newcomer = _req("new", n_prompt=1, arrival=5.0)
    scheduler.add(newcomer, 5.0)
    policy.tokens = budget
    out, _ = _run_step(scheduler, 5.0)
    assert all(n > 0 for _, n in out.scheduled)
    assert ((newcomer, 1) in out.scheduled) is admitted and (newcomer.status is RequestStatus.RUNNING) is admitted


@pytest.mark.parametrize("max_tokens", [0, 2.5])
def test_a_step_budget_below_one_token_or_not_an_int_is_a_policy_error(max_tokens):
    policy = AdjustableBudget()
    policy.tokens = max_tokens
    scheduler = _scheduler(policy, 16)
    scheduler.add(_req("r"), 0.0)
    with pytest.raises(PolicyError, match="step_budget must return a StepBudget with max_tokens >= 1"):
        scheduler.schedule(0.0)


def test_without_chunking_a_prompt_that_fills_the_budget_exactly_is_admitted_and_one_that_does_not_fit_waits():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("prefix")(16, 4), max_num_seqs=4,
                          max_num_batched_tokens=8, enable_chunked_prefill=False)
    first = _req("first", n_prompt=8, max_tokens=20)
    scheduler.add(first, 0.0)
    out, _ = _run_step(scheduler, 0.0)
    assert out.scheduled == [(first, 8)]                    # exactly the budget
    cached_before = scheduler.allocator.num_cached_blocks()
    twin = Request("twin", list(range(1, 9)) + list(range(60, 68)), SamplingParams(max_tokens=2), 1.0)
    scheduler.add(twin, 1.0)                                # 8 cached + 8 new > the 7 the decode leaves
    out, _ = _run_step(scheduler, 1.0)
    assert out.scheduled == [(first, 1)] and twin in scheduler.waiting
    assert (twin.num_computed_tokens, twin.num_cached_tokens, twin.block_table) == (0, 0, [])
    assert scheduler.allocator.num_cached_blocks() == cached_before


def test_an_empty_batch_admits_its_head_request_ignoring_the_watermark():
    scheduler = _scheduler(POLICIES.build("fcfs"), 16, watermark=0.25)
    whole_cache = _req("whole", n_prompt=63, max_tokens=1)  # all 16 blocks: none left for the watermark
    scheduler.add(whole_cache, 0.0)
    out, _ = _run_step(scheduler, 0.0)
    assert out.scheduled == [(whole_cache, 63)]


def test_prefix_hits_are_summed_over_the_requests_admitted_in_a_step():
    scheduler = _prefix_scheduler_for_hits()
    twins = [Request(f"twin{i}", list(range(1, 9)) + [50 + i], SamplingParams(max_tokens=2), 1.0) for i in range(2)]
    for twin in twins:
        scheduler.add(twin, 1.0)
    out, _ = _run_step(scheduler, 1.0)
    assert [r for r, _ in out.scheduled] == twins and out.num_prefix_hit_tokens == 16


def _prefix_scheduler_for_hits() -> Scheduler:
    scheduler = _scheduler(POLICIES.build("fcfs"), 16, allocator="prefix")
    scheduler.add(_req("first", n_prompt=8, max_tokens=1), 0.0)
    _run_step(scheduler, 0.0)                               # caches the 8-token prompt's two blocks
    return scheduler


def test_prefill_first_runs_a_prefill_chunk_while_a_decode_waits():
    scheduler = _scheduler(POLICIES.build("prefill_first"), 16, max_num_batched_tokens=4)
    decode = _req("decode", n_prompt=2, max_tokens=20, arrival=0.0)
    scheduler.add(decode, 0.0)
    _run_step(scheduler, 0.0)
    prefill = _req("prefill", n_prompt=12, arrival=1.0)
    scheduler.add(prefill, 1.0)
    _run_step(scheduler, 1.0)                               # admitted: its first chunk
    out, _ = _run_step(scheduler, 2.0)
    assert out.scheduled == [(prefill, 4)]                  # the decode ahead of it in the batch waits


def test_the_policy_sees_the_schedulers_state_in_its_view():
    policy = RecordingPolicy()
    scheduler = _scheduler(policy, 16)
    scheduler.add(_req("r0"), 0.0)
    _run_step(scheduler, 0.0)
    for rid in ("a", "b"):
        scheduler.add(_req(rid, arrival=1.0), 1.0)
    policy.asked.clear()
    policy.budget_views.clear()
    _run_step(scheduler, 1.0)
    view = dict(num_total_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    assert policy.budget_views == [SchedulerView(num_running=1, num_waiting=2, num_scheduled_tokens=0,
                                                 token_budget_left=64, num_free_blocks=15, **view)]
    assert [v for _, v in policy.asked] == [
        SchedulerView(num_running=1, num_waiting=2, num_scheduled_tokens=1, token_budget_left=63,
                      num_free_blocks=14, **view),
        SchedulerView(num_running=2, num_waiting=1, num_scheduled_tokens=5, token_budget_left=59,
                      num_free_blocks=13, **view)]


def test_select_victim_in_a_prefill_only_step_gets_the_time():
    # Prefill-first with two 16-token prompts on 6 blocks: B's next chunk finds no block in a prefill-only step.
    policy = RecordingPolicy(decodes_first=False)
    scheduler = _scheduler(policy, 6, max_num_batched_tokens=8, watermark=0.0)
    for rid, arrival in (("A", 0.0), ("B", 1.0)):
        scheduler.add(Request(rid, list(range(1 + 100 * int(arrival), 17 + 100 * int(arrival))),
                              SamplingParams(max_tokens=4, ignore_eos=True), arrival), 0.0)
    for step in range(40):
        _run_step(scheduler, float(step))
        if not scheduler.has_unfinished():
            break
    victims = [now for name, now in policy.times if name == "select_victim"]
    assert victims and all(isinstance(now, float) for now in victims) and sorted(policy.finished) == ["A", "B"]


def test_a_request_preempted_twice_counts_two_preemptions():
    scheduler = _scheduler(POLICIES.build("priority"), 16, watermark=0.0)
    low = Request("low", list(range(1, 17)), SamplingParams(max_tokens=50, ignore_eos=True), 0.0, priority=5)
    scheduler.add(low, 0.0)
    _run_step(scheduler, 0.0)
    for i in range(2):
        urgent = Request(f"urgent{i}", list(range(200, 252)), SamplingParams(max_tokens=1), 1.0 + i, priority=0)
        scheduler.add(urgent, 1.0 + i)
        out, finished = _run_step(scheduler, 10.0 * (i + 1))     # preempts low, runs and finishes urgent
        assert out.preempted == [low] and finished == [urgent]
        _run_step(scheduler, 10.0 * (i + 1) + 1)                 # low comes back
    assert low.num_preemptions == 2


def test_sjf_remaining_work_counts_uncomputed_prompt_and_floors_each_part_at_zero():
    policy = POLICIES.build({"name": "sjf", "predictor": lambda r: 2})
    over = _req("over", n_prompt=4, arrival=1.0)                # generated 5 > the 2 predicted: 0 left, not 1
    over.token_ids += [7] * 5
    fresh = _req("fresh", n_prompt=3, arrival=0.0)              # 3 + 2
    assert sorted([fresh, over], key=lambda r: policy.priority(r, 0.0)) == [over, fresh]
    oracle = POLICIES.build("sjf")
    long_prompt = _req("long-prompt", n_prompt=100, max_tokens=10, arrival=0.0, num_computed_tokens=100,
                       status=RequestStatus.RUNNING)
    long_prompt.token_ids += [7] * 8                            # 2 left to generate
    short = _req("short", n_prompt=4, max_tokens=10, arrival=1.0, num_computed_tokens=4,
                 status=RequestStatus.RUNNING)                  # 10 left
    assert oracle.select_victim([long_prompt, short], 0.0) is short
    decode = _req("decode", n_prompt=4, max_tokens=13, arrival=0.0, num_computed_tokens=4,
                  status=RequestStatus.RUNNING)                 # 0 + 13
    chunked = _req("chunked", n_prompt=8, max_tokens=10, arrival=1.0, num_computed_tokens=5,
                   status=RequestStatus.RUNNING)                # 3 + 10: a tie, broken by arrival
    assert oracle.select_victim([decode, chunked], 0.0) is chunked


def test_top_logprobs_with_k_one_reports_the_argmax_first():
    logits = torch.tensor([[0.0, 3.0, 1.0]])
    [entry] = top_logprobs(logits, [2], [1])
    assert set(entry) == {1, 2} and (entry[1].rank, entry[2].rank) == (1, 2)


def test_top_p_drops_a_token_once_the_mass_before_it_reaches_top_p_exactly():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25]]))    # exact in float32: masses before 0, 0.5, 0.75
    generator = torch.Generator().manual_seed(0)
    assert {Sampler()(logits, [SamplingParams(top_p=0.5)], [generator])[0] for _ in range(300)} == {0}


# -- allocators ----------------------------------------------------------------------------------------------------

def test_contiguous_reservation_fits_exactly_and_never_grows():
    cache = ALLOCATORS.get("contiguous")(4, 4)
    request = _req("r", n_prompt=8, max_tokens=8)           # 16 tokens: all 4 blocks
    assert cache.can_allocate(request, 8)
    assert not cache.can_allocate(request, 8, reserve=1)
    small = _req("small", n_prompt=4, max_tokens=8)          # 3 blocks
    assert not cache.can_allocate(small, 4, reserve=2) and cache.can_allocate(small, 4, reserve=1)
    cache.allocate(small, 4)
    small.num_computed_tokens = 12
    assert cache.num_free_blocks() == 1 and not cache.can_allocate(small, 4)   # past its reservation: no
    assert cache.can_allocate(small, 0)
    with pytest.raises(MemoryError):
        cache.allocate(small, 4)


def test_contiguous_allocation_marks_only_its_own_run():
    cache = ALLOCATORS.get("contiguous")(4, 4)
    a, b = _req("a", n_prompt=2, max_tokens=2), _req("b", n_prompt=2, max_tokens=2)   # one block each
    d = _req("d", n_prompt=4, max_tokens=4)                                             # two blocks
    cache.allocate(a, 2)
    cache.allocate(b, 2)
    cache.free(a)                                                       # block 0 free, 1 taken, 2-3 free
    cache.allocate(d, 4)
    assert d.block_table == [2, 3]
    e = _req("e", n_prompt=2, max_tokens=2)
    assert cache.can_allocate(e, 2)
    cache.allocate(e, 2)
    assert e.block_table == [0]


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_evictions_are_counted_and_a_freed_request_leaves_no_bookkeeping(allocator):
    cache = ALLOCATORS.get(allocator)(2, 4)
    for rid, start in (("a", 1), ("b", 11), ("c", 21)):
        owner = Request(rid, list(range(start, start + 5)), SamplingParams(max_tokens=4), 0.0)
        cache.allocate(owner, 5)
        owner.num_computed_tokens = 5
        cache.on_tokens_computed(owner)
        cache.free(owner)
    assert cache.num_evictions == 2                         # b's and c's full blocks each evicted one
    bookkeeping = cache._published if allocator == "prefix" else cache._cursor
    assert bookkeeping == {}                                # bounded over a long run


def test_register_allocator_registers_under_its_name_and_the_base_checks_its_sizes(monkeypatch):
    monkeypatch.setattr(ALLOCATORS, "_entries", dict(ALLOCATORS._entries))   # the registration ends with the test

    @register_allocator("survivor-test-paged")
    class SurvivorTestPaged(ALLOCATORS.get("paged")):
        """The paged allocator under another name."""

    assert ALLOCATORS.get("survivor-test-paged") is SurvivorTestPaged
    smallest = SurvivorTestPaged(1, 1)
    request = _req("r", n_prompt=1)
    smallest.allocate(request, 1)
    assert smallest.usage() == 1.0
    for sizes in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1"):
            SurvivorTestPaged(*sizes)
    quarter = SurvivorTestPaged(4, 4)
    quarter.allocate(_req("q", n_prompt=4), 4)
    assert quarter.usage() == 0.25


# -- the radix cache, eviction choice and the policy base class (second pass: allocators/radix.py,
#    nanovllm/eviction.py, nanovllm/policy.py) ------------------------------------------------------------------

def _compute(cache, request: Request, upto: int) -> None:
    """The scheduler's report that ``request`` has computed its first ``upto`` tokens."""
    request.num_computed_tokens = upto
    cache.on_tokens_computed(request)


def _tokens(*blocks: int) -> list[int]:
    """One 4-token block per argument (block ``b`` holds b*10 .. b*10+3), then a last token of its own."""
    return [b * 10 + i for b in blocks for i in range(4)] + [999]


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_a_prefix_cache_shares_the_blocks_before_a_divergence_and_none_after_it(allocator):
    cache = ALLOCATORS.get(allocator)(16, 4)
    first = Request("first", _tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0)
    cache.allocate(first, first.num_tokens)
    _compute(cache, first, first.num_tokens)
    cache.free(first)
    for blocks, shared in (((1, 5, 3), 4), ((1, 2, 6), 8), ((7, 2, 3), 0), ((1, 2, 3), 12)):
        probe = Request("probe", _tokens(*blocks), SamplingParams(max_tokens=1), 0.0)
        assert cache.cached_prefix_len(probe) == shared
        assert cache.match_prefix(probe) == shared and len(probe.block_table) == shared // 4
        cache.free(probe)


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_a_prompt_prefilled_in_chunks_is_cached_block_by_block(allocator):
    scheduler = _scheduler(POLICIES.build("fcfs"), 16, allocator=allocator, max_num_batched_tokens=4)
    scheduler.add(Request("chunked", _tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0), 0.0)
    probe = Request("probe", _tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0)
    for step, cached in enumerate((4, 8, 12)):   # each 4-token chunk completes one block
        _run_step(scheduler, float(step))
        assert scheduler.allocator.cached_prefix_len(probe) == cached
    _run_step(scheduler, 3.0)                       # the last prompt token; its one output token ends it
    assert not scheduler.has_unfinished() and scheduler.allocator.cached_prefix_len(probe) == 12


def test_radix_a_request_that_lost_the_race_to_cache_a_block_keeps_its_copy_private_for_life():
    """Two requests with one prompt computed side by side: the second finds the first's block already cached and
    (module docstring) keeps its own copy private, publishing nothing further even once the first's copy has
    been evicted; its copy returns to the free list when it ends."""
    cache = ALLOCATORS.get("radix")(8, 4)
    first, second = (Request(rid, _tokens(1, 2), SamplingParams(max_tokens=4), 0.0) for rid in ("first", "second"))
    for request in (first, second):
        cache.allocate(request, request.num_tokens)
    for request in (first, second):
        _compute(cache, request, request.num_tokens)
    cache.free(first)
    assert cache.num_cached_blocks() == 2
    filler = _req("filler", n_prompt=20)          # needs every free block: the first's cached copy is evicted
    cache.allocate(filler, 20)
    assert cache.num_evictions == 2 and cache.num_cached_blocks() == 0
    second.append_token(7, 1.0)                      # the second decodes on
    cache.allocate(second, 1)
    _compute(cache, second, second.num_tokens)
    cache.free(filler)
    cache.free(second)
    assert cache.num_cached_blocks() == 0 and cache.num_free_blocks() == 8
    assert cache.cached_prefix_len(Request("probe", _tokens(1, 2), SamplingParams(max_tokens=1), 0.0)) == 0


@pytest.mark.parametrize("allocator", ["paged", "contiguous", "prefix", "radix"])
def test_aborting_a_request_that_never_got_blocks_frees_nothing_and_reports_it(allocator):
    scheduler = _scheduler(POLICIES.build("fcfs"), 8, allocator=allocator)
    scheduler.add(_req("running", n_prompt=8, max_tokens=8), 0.0)
    _run_step(scheduler, 0.0)
    used, free = scheduler.allocator.num_used_blocks(), scheduler.allocator.num_free_blocks()
    scheduler.add(_req("never-admitted"), 0.5)
    assert scheduler.abort("never-admitted", 0.5).status is RequestStatus.ABORTED
    assert (scheduler.allocator.num_used_blocks(), scheduler.allocator.num_free_blocks()) == (used, free)
    _, finished = _run_step(scheduler, 1.0)
    assert [r.request_id for r in finished] == ["never-admitted"] and scheduler.running[0].request_id == "running"


def _eviction_history(tracker: EvictionTracker) -> EvictionTracker:
    """Blocks cached in the order 1, 0, 2; block 0 reused twice and block 1 once; released in the order 0, 1, 2.
    Oldest content: 1. Least recently used: 0. Least used: 2."""
    for block in (1, 0, 2):
        tracker.cached(block)
    for block in (0, 0, 1):
        tracker.hit(block)
    for block in (0, 1, 2):
        tracker.release(block)
    return tracker


def test_each_eviction_policy_picks_its_own_victim_and_the_default_is_lru():
    victims = {policy: _eviction_history(EvictionTracker(policy)).victim() for policy in ("lru", "lfu", "fifo")}
    assert victims == {"lru": 0, "lfu": 2, "fifo": 1}
    assert _eviction_history(EvictionTracker()).victim() == victims["lru"]


def test_eviction_tracker_knows_which_blocks_hold_cached_content():
    tracker = EvictionTracker()
    tracker.cached(3)
    assert tracker.is_cached(3) and not tracker.is_cached(4)
    tracker.release(3)
    assert tracker.is_cached(3) and tracker.num_evictable() == 1   # evictable, still cached
    tracker.forget(3)
    assert not tracker.is_cached(3) and tracker.num_evictable() == 0


def test_a_policy_outside_a_scheduler_sees_no_cached_prefix_and_inside_one_sees_its_allocators():
    prompt = _tokens(1, 2)
    lpm = POLICIES.build("lpm")
    assert lpm.cached_prefix_len(Request("alone", prompt, SamplingParams(max_tokens=1), 0.0)) == 0
    scheduler = _scheduler(lpm, 8, allocator="radix")
    scheduler.add(Request("first", prompt, SamplingParams(max_tokens=1), 0.0), 0.0)
    _run_step(scheduler, 0.0)
    assert lpm.cached_prefix_len(Request("again", prompt, SamplingParams(max_tokens=1), 1.0)) == 8


def test_register_policy_registers_under_its_name(monkeypatch):
    monkeypatch.setattr(POLICIES, "_entries", dict(POLICIES._entries))   # the registration ends with the test

    @register_policy("survivor-test-lifo")
    class LastInFirstOut(Policy):
        def priority(self, request, now):
            return (-request.arrival_time,)

    assert POLICIES.get("survivor-test-lifo") is LastInFirstOut
    policy = POLICIES.build("survivor-test-lifo")
    assert policy.registered_name == "survivor-test-lifo"
    scheduler = _scheduler(policy, 16)
    scheduler.max_num_seqs = 1
    for rid, arrival in (("early", 0.0), ("late", 1.0)):
        scheduler.add(_req(rid, arrival=arrival), arrival)
    out, _ = _run_step(scheduler, 1.0)
    assert [r.request_id for r, _ in out.scheduled] == ["late"]


# -- greedy sampling without the C++ kernel (third pass: nanovllm/sampling.py's greedy_tokens) ---------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_in_torch_ops_match_the_cpu_kernel_where_it_cannot_be_built(dtype, monkeypatch):
    """Off CPU, or where the C++ kernels cannot be built (no compiler), greedy_tokens runs in torch ops: the same
    argmax as the kernel (first index on ties; -inf is a legitimate logit), the same NaN / +inf row flags, and
    the sampler turns each flagged row into INVALID_TOKEN while the others keep their argmax."""
    vocab = 37
    torch.manual_seed(0)
    logits = (torch.randn(6, vocab) * 4).to(dtype)
    logits[1, 5] = float("nan")
    logits[2, vocab - 1] = float("inf")
    logits[3, :] = float("-inf")
    logits[3, 11] = 0.0                              # one finite logit among -inf
    logits[4, :] = 1.0                               # all tied: the first index
    logits[5, vocab - 1] = 1e4
    kernel_tokens, kernel_bad = greedy_tokens(logits)    # the C++ kernel on this CPU (built on first use)
    monkeypatch.setattr(sampling_module, "_cpu_kernels", lambda: None)
    tokens, bad = greedy_tokens(logits)
    assert bad.tolist() == kernel_bad.tolist() == [False, True, True, False, False, False]
    assert tokens[~bad].tolist() == kernel_tokens[~bad].tolist()
    assert tokens[0] == int(logits[0].float().argmax()) and tokens[3:].tolist() == [11, 0, vocab - 1]
    greedy = [SamplingParams(temperature=0.0) for _ in range(6)]
    sampled = Sampler()(logits, greedy, [torch.Generator() for _ in range(6)])
    assert sampled == [tokens[0].item(), INVALID_TOKEN, INVALID_TOKEN, 11, 0, vocab - 1]
