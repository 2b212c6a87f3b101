"""Each built-in policy's rules, one at a time and at their edges: the Python defaults are the Hydra configs',
bad parameters are named, and each decision (whom to reject, preempt, order first; what to charge) holds exactly
at its boundary. Most were written to kill mutants that mutation testing (``make mutate``) showed the suite let
live; none needs the model. The policies' effects on whole workloads are ``test_policy_effects.py``."""

from __future__ import annotations

import functools
import math

import pytest
from omegaconf import OmegaConf

from helpers import REPO, bare_scheduler, block_tokens, make_request, run_step
from nanovllm import POLICIES, Policy, Request, RequestStatus, SamplingParams, SchedulerView, StepBudget, register_policy


# -- the Python defaults are the Hydra configs' ------------------------------------------------------------------------

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
    requests = [make_request(f"r{i}") for i in range(8)]
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


# -- priority ----------------------------------------------------------------------------------------------------------

def test_priority_preempts_the_least_urgent_latest_running_request():
    policy = POLICIES.build("priority")
    running = [make_request("p1-early", 4, priority=1, arrival=0.0), make_request("p2-early", 4, priority=2, arrival=1.0),
               make_request("p2-late", 4, priority=2, arrival=2.0), make_request("p0", 4, priority=0, arrival=3.0)]
    urgent = make_request("urgent", 4, priority=0, arrival=4.0)
    assert policy.preempt_for(urgent, running, 5.0).request_id == "p2-late"
    assert policy.select_victim(running, 5.0).request_id == "p2-late"
    # Only for a strictly more urgent request: an equal one waits.
    assert policy.preempt_for(make_request("peer", 4, priority=2, arrival=9.0), running[1:3], 5.0) is None


# -- edf ---------------------------------------------------------------------------------------------------------------

def test_edf_rejects_exactly_when_the_remaining_steps_no_longer_fit():
    e2el = POLICIES.build({"name": "edf", "deadline": "e2el", "step_time": 0.25})
    two = make_request("two", max_tokens=2, slo_e2el=1.0, slo_ttft=10.0)
    assert e2el.reject_reason(two, 0.5) is None               # 0.5 + 2 steps * 0.25 = the deadline: still fits
    assert "cannot meet its e2el deadline (1000 ms after arrival)" in e2el.reject_reason(two, 0.51)
    one = make_request("one", max_tokens=1, slo_e2el=1.0)
    assert e2el.reject_reason(one, 0.75) is None and e2el.reject_reason(one, 0.76) is not None
    ttft = POLICIES.build({"name": "edf", "deadline": "ttft", "step_time": 0.25})
    first = make_request("first", max_tokens=8, slo_ttft=1.0, slo_e2el=100.0)
    assert ttft.reject_reason(first, 0.75) is None and ttft.reject_reason(first, 0.76) is not None
    assert POLICIES.build("edf").reject_reason(make_request("late", slo_ttft=1.0), 0.99) is None   # step_time 0: now only


def test_edf_deadlines_use_the_chosen_target_or_the_default():
    both = make_request("both", slo_ttft=1.0, slo_e2el=5.0, arrival=2.0)
    assert POLICIES.build({"name": "edf", "deadline": "e2el"}).deadline_of(both) == 7.0
    assert POLICIES.build({"name": "edf", "deadline": "ttft"}).deadline_of(both) == 3.0
    assert POLICIES.build({"name": "edf", "default_slo_ms": 500}).slo_of(make_request("none")) == 0.5


# -- fair (VTC) --------------------------------------------------------------------------------------------------------

def test_vtc_lifts_a_returning_client_to_the_least_served_active_one():
    policy = POLICIES.build("fair")
    a1, a2, b, a3 = make_request("a1", client="a"), make_request("a2", client="a"), make_request("b", client="b"), make_request("a3", client="a")
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


def test_vtc_charges_prompt_tokens_at_input_weight_and_decodes_at_output_weight():
    # Through the scheduler: a prefill of 10 prompt tokens, then decodes.
    policy = POLICIES.build({"name": "fair", "input_weight": 1.0, "output_weight": 3.0})
    scheduler = bare_scheduler(policy, num_blocks=16)
    scheduler.add(make_request("r", 10, max_tokens=3, client="c"), 0.0)
    for step in range(3):
        run_step(scheduler, float(step))
    # One prefill of 10 prompt tokens, then two decodes (the first token came from the prefill).
    assert policy.counters["c"] == 10 * 1.0 + 2 * 3.0
    # Token by token: a final prefill chunk is input, a middle chunk is input, a decode is output; a request
    # without a client is charged to the default one.
    policy = POLICIES.build("fair")                         # defaults: input 1, output 2
    request = make_request("r", prompt=5)
    request.num_computed_tokens = 5                         # a final prefill chunk of one token
    policy.on_step([(request, 1)], 0.0)
    request.num_computed_tokens = 3                         # a middle chunk of one token
    policy.on_step([(request, 1)], 0.0)
    request.num_computed_tokens = 6                         # a decode
    policy.on_step([(request, 1)], 0.0)
    assert dict(policy.counters) == {"default": 1.0 + 1.0 + 2.0}


# -- lpm ---------------------------------------------------------------------------------------------------------------

def test_lpm_ages_exactly_past_max_wait():
    policy = POLICIES.build({"name": "lpm", "max_wait": 10.0})
    policy.bind_prefix_lookup(lambda r: 8 if r.request_id == "cached" else 0)
    old, cached = make_request("old", arrival=0.0), make_request("cached", arrival=0.5)
    order = lambda now: sorted([old, cached], key=lambda r: policy.priority(r, now))   # noqa: E731
    assert order(10.0) == [cached, old]                     # waited exactly max_wait: not yet starving
    assert order(10.01) == [old, cached]
    late_old, late_cached = make_request("old", arrival=6.0), make_request("cached", arrival=6.5)
    assert sorted([late_old, late_cached], key=lambda r: policy.priority(r, 7.0)) == [late_cached, late_old]


def test_a_policy_outside_a_scheduler_sees_no_cached_prefix_and_inside_one_sees_its_allocators():
    prompt = block_tokens(1, 2)
    lpm = POLICIES.build("lpm")
    assert lpm.cached_prefix_len(Request("alone", prompt, SamplingParams(max_tokens=1), 0.0)) == 0
    scheduler = bare_scheduler(lpm, num_blocks=8, allocator="radix")
    scheduler.add(Request("first", prompt, SamplingParams(max_tokens=1), 0.0), 0.0)
    run_step(scheduler, 0.0)
    assert lpm.cached_prefix_len(Request("again", prompt, SamplingParams(max_tokens=1), 1.0)) == 8


# -- mlfq --------------------------------------------------------------------------------------------------------------

def test_mlfq_levels_follow_the_quantum_are_capped_and_reset_on_finish():
    policy = POLICIES.build({"name": "mlfq", "quantum": 4, "num_levels": 3})
    short = make_request("short", prompt=1)
    policy.on_step([(short, 3)], 0.0)
    assert policy.level(short) == 0                         # 3 tokens: log2(1 + 3/4) < 1
    policy.on_step([(short, 1)], 0.0)
    assert policy.level(short) == 1                         # 4 tokens: one quantum
    policy.on_step([(short, 1000)], 0.0)
    assert policy.level(short) == 2                         # capped at num_levels - 1
    policy.on_finish(short, 0.0)
    assert policy.level(short) == 0                         # a finished request's service is forgotten
    # The level is log2(1 + service / quantum): a finer quantum demotes sooner.
    fine, coarse = POLICIES.build({"name": "mlfq", "quantum": 4}), POLICIES.build({"name": "mlfq", "quantum": 64})
    request = make_request("r", 8)
    assert fine.level(request) == 1 and coarse.level(request) == 0      # log2(1 + 8/4) vs log2(1 + 8/64)
    fine.on_step([(request, 28)], 0.0)
    assert fine.level(request) == 3                                       # log2(1 + 28/4)


def test_mlfq_preempts_only_when_asked_and_only_for_a_strictly_higher_level():
    running = [make_request("low-early", prompt=64, arrival=0.0), make_request("low-late", prompt=64, arrival=1.0),
               make_request("top", prompt=1, arrival=2.0)]
    waiting = make_request("new", prompt=1, arrival=3.0)
    assert POLICIES.build("mlfq").preempt_for(waiting, running, 0.0) is None        # preempt is off by default
    policy = POLICIES.build({"name": "mlfq", "preempt": True})
    assert policy.preempt_for(waiting, running, 0.0) is running[1]                 # lowest level, latest arrival
    assert policy.preempt_for(waiting, running[2:], 0.0) is None                   # same level: no preemption


# -- prefill_first and random ------------------------------------------------------------------------------------------

def test_prefill_first_asks_for_prefills_before_decodes():
    view = SchedulerView(num_running=0, num_waiting=1, num_scheduled_tokens=0, token_budget_left=64,
                         max_num_seqs=4, num_free_blocks=8, num_total_blocks=8, block_size=4,
                         max_num_batched_tokens=64)
    assert POLICIES.build("prefill_first").step_budget(view, 0.0) == StepBudget(64, decodes_first=False)


def test_random_policy_forgets_finished_requests():
    policy = POLICIES.build("random")
    requests = [make_request(f"r{i}") for i in range(5)]
    for request in requests:
        policy.on_arrival(request, 0.0)
    for request in requests:
        policy.on_finish(request, 0.0)
    assert policy._rank == {}                               # bounded memory over a long run


# -- sjf ---------------------------------------------------------------------------------------------------------------

def three_tokens(request: Request) -> float:
    """A 'module:function' predictor for the sjf test."""
    return 3


def minus_one(request: Request, offset: int = 0) -> float:
    return -1 + offset


def test_sjf_predictors_from_history_prompt_length_and_a_module_path():
    history = POLICIES.build({"name": "sjf", "predictor": "client_history"})
    fresh = make_request("fresh", max_tokens=50, client="a")
    assert history.predicted_output_len(fresh) == 50        # nobody finished yet: max_tokens
    for rid, client, n in (("x", "a", 4), ("y", "a", 8), ("z", None, 30)):
        done = make_request(rid, client=client)
        done.token_ids += [7] * n
        history.on_finish(done, 0.0)
    assert history.predicted_output_len(fresh) == 6         # a's mean
    assert history.predicted_output_len(make_request("n", client=None)) == 30    # the default client's own
    assert history.predicted_output_len(make_request("c", client="c")) == 14     # everyone's mean: (4 + 8 + 30) / 3
    assert POLICIES.build({"name": "sjf", "predictor": "prompt_length"}).predicted_output_len(make_request("p", 6)) == 6
    scaled = POLICIES.build({"name": "sjf", "predictor": "prompt_length", "output_per_prompt_token": 2.0})
    assert scaled.predicted_output_len(make_request("p", 6)) == 12
    by_path = POLICIES.build({"name": "sjf", "predictor": f"{__name__}:three_tokens"})
    assert by_path.predicted_output_len(make_request("p")) == 3


@pytest.mark.parametrize("predictor, name", [
    (minus_one, "minus_one"), (functools.partial(minus_one, offset=0), "callable"),
    (f"{__name__}:minus_one", f"{__name__}:minus_one")])
def test_sjf_names_a_predictor_that_returns_a_bad_length(predictor, name):
    policy = POLICIES.build({"name": "sjf", "predictor": predictor})
    with pytest.raises(ValueError, match=f"scheduler.predictor={name!r} must return a number"):
        policy.predicted_output_len(make_request("r"))


@pytest.mark.parametrize("value, ok", [(0, True), (0.5, True), (-1, False), (True, False)])
def test_sjf_accepts_any_length_from_zero(value, ok):
    policy = POLICIES.build({"name": "sjf", "predictor": lambda r: value})
    if ok:
        assert policy.predicted_output_len(make_request("r")) == value
    else:
        with pytest.raises(ValueError):
            policy.predicted_output_len(make_request("r"))


def test_sjf_ages_exactly_past_max_wait():
    policy = POLICIES.build({"name": "sjf", "max_wait": 10.0})
    long, short = make_request("long", max_tokens=100, arrival=0.0), make_request("short", max_tokens=1, arrival=0.5)
    assert sorted([long, short], key=lambda r: policy.priority(r, 10.0)) == [short, long]
    assert sorted([long, short], key=lambda r: policy.priority(r, 10.01)) == [long, short]
    late_long, late_short = make_request("long", max_tokens=100, arrival=6.0), make_request("short", max_tokens=1, arrival=6.5)
    assert sorted([late_long, late_short], key=lambda r: policy.priority(r, 7.0)) == [late_short, late_long]


def _running(request, computed: int):
    """``request`` as the scheduler leaves it while it runs, ``computed`` of its tokens in the cache."""
    request.num_computed_tokens, request.status = computed, RequestStatus.RUNNING
    return request


def test_sjf_remaining_work_counts_uncomputed_prompt_and_generated_tokens_and_floors_each_part_at_zero():
    policy = POLICIES.build({"name": "sjf", "predictor": lambda r: 2})
    over = make_request("over", prompt=4, arrival=1.0)                # generated 5 > the 2 predicted: 0 left, not 1
    over.token_ids += [7] * 5
    fresh = make_request("fresh", prompt=3, arrival=0.0)              # 3 + 2
    assert sorted([fresh, over], key=lambda r: policy.priority(r, 0.0)) == [over, fresh]
    oracle = POLICIES.build("sjf")
    long_prompt = _running(make_request("long-prompt", prompt=100, max_tokens=10, arrival=0.0), 100)
    long_prompt.token_ids += [7] * 8                                  # 2 left to generate
    short = _running(make_request("short", prompt=4, max_tokens=10, arrival=1.0), 4)              # 10 left
    assert oracle.select_victim([long_prompt, short], 0.0) is short
    decode = _running(make_request("decode", prompt=4, max_tokens=13, arrival=0.0), 4)             # 0 + 13
    chunked = _running(make_request("chunked", prompt=8, max_tokens=10, arrival=1.0), 5)  # 3 + 10: a tie, by arrival
    assert oracle.select_victim([decode, chunked], 0.0) is chunked
    # The tokens generated so far count: 2 left of 10 ranks before 5 left of 5.
    nearly_done = make_request("nearly-done", 4, max_tokens=10, arrival=0.0)
    nearly_done.num_computed_tokens = 4
    for _ in range(8):
        nearly_done.append_token(7, 0.0)                              # 2 tokens left to generate
    fresh = make_request("fresh", 4, max_tokens=5, arrival=1.0)
    fresh.num_computed_tokens = 4                                     # 5 left
    assert oracle.priority(nearly_done, 0.0) < oracle.priority(fresh, 0.0)


# -- every policy ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlfq", "random", "fair", "sjf"])
def test_a_policy_hears_on_finish_for_a_request_it_never_scheduled(name):
    policy = POLICIES.build(name)
    aborted = make_request("aborted-while-waiting")
    policy.on_arrival(aborted, 0.0)
    policy.on_finish(aborted, 1.0)                          # aborted or rejected before any step: no KeyError
    POLICIES.build(name).on_finish(make_request("unknown"), 1.0)


def test_register_policy_registers_under_its_name(monkeypatch):
    monkeypatch.setattr(POLICIES, "_entries", dict(POLICIES._entries))   # the registration ends with the test

    @register_policy("survivor-test-lifo")
    class LastInFirstOut(Policy):
        def priority(self, request, now):
            return (-request.arrival_time,)

    assert POLICIES.get("survivor-test-lifo") is LastInFirstOut
    policy = POLICIES.build("survivor-test-lifo")
    assert policy.registered_name == "survivor-test-lifo"
    scheduler = bare_scheduler(policy, num_blocks=16)
    scheduler.max_num_seqs = 1
    for rid, arrival in (("early", 0.0), ("late", 1.0)):
        scheduler.add(make_request(rid, arrival=arrival), arrival)
    out, _ = run_step(scheduler, 1.0)
    assert [r.request_id for r, _ in out.scheduled] == ["late"]
