"""Scheduler mechanics with the real allocators and policies, stepping requests without a model: budgets,
admission order, preemption, and that every block comes back."""

from __future__ import annotations

import pytest

from nanovllm import ALLOCATORS, POLICIES, Policy, Request, SamplingParams
from nanovllm.engine.scheduler import PolicyError, Scheduler


def _request(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, client=None) -> Request:
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   arrival_time=arrival, priority=priority, client_id=client)


def _drive(scheduler: Scheduler, max_steps: int = 10_000):
    """Step until done, advancing tokens as the engine would; return (steps, first-token step per request)."""
    first_token_step = {}
    for step in range(max_steps):
        if not scheduler.has_unfinished():
            return step, first_token_step
        out = scheduler.schedule(now=float(step))
        assert out.scheduled, "the scheduler stalled with unfinished requests"
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        tokens = _sampled(out)
        for (request, _), token in zip(out.scheduled, tokens):
            if token is not None:
                first_token_step.setdefault(request.request_id, step)
        scheduler.update_from_output(out, tokens, float(step), max_model_len=10**9)
    raise AssertionError("did not finish")


def _sampled(out, token: int = 7) -> list[int | None]:
    """What the model runner would return: a token for each request whose chunk reaches its newest token."""
    return [token if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]


def _scheduler(policy="fcfs", allocator="paged", num_blocks=64, block_size=4, max_num_seqs=4, budget=64):
    return Scheduler(POLICIES.build(policy), ALLOCATORS.get(allocator)(num_blocks, block_size),
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


@pytest.mark.parametrize("policy", POLICIES.names())
@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_every_request_finishes_and_every_block_returns(policy, allocator):
    scheduler = _scheduler(policy, allocator, num_blocks=24, max_num_seqs=3, budget=16)
    requests = [_request(f"r{i}", 5 + 3 * i, max_tokens=6, priority=i % 2, arrival=i * 0.1, client=f"c{i % 3}")
                for i in range(8)]
    for r in requests:
        scheduler.add(r, 0.0)
    _drive(scheduler)
    assert all(r.num_output_tokens == 6 for r in requests)
    assert scheduler.allocator.num_free_blocks() == 24


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    scheduler = _scheduler(budget=8, num_blocks=64)
    r = _request("long", 30)
    scheduler.add(r, 0.0)
    chunks = []
    while r.num_computed_tokens < 30:
        out = scheduler.schedule(0.0)
        chunks.append(out.scheduled[0][1])
        scheduler.update_from_output(out, [None] * len(out.scheduled), 0.0, max_model_len=10**9)
    assert chunks == [8, 8, 8, 6]


def test_memory_pressure_preempts_the_latest_arrival_and_recomputes_it():
    # 6 blocks of 4: two 8-token prompts fill 4 blocks; growth to 12+ tokens needs 6; a third cannot fit.
    scheduler = _scheduler(num_blocks=6, max_num_seqs=4, budget=64)
    early, late = _request("early", 8, max_tokens=8, arrival=0.0), _request("late", 8, max_tokens=8, arrival=1.0)
    scheduler.add(early, 0.0)
    scheduler.add(late, 0.0)
    _drive(scheduler)
    assert late.num_preemptions >= 1 and early.num_preemptions == 0
    assert scheduler.allocator.num_free_blocks() == 6


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = _scheduler("priority", max_num_seqs=1)
    reqs = [_request("low-early", 4, priority=1, arrival=0.0), _request("high-late", 4, priority=0, arrival=2.0),
            _request("high-early", 4, priority=0, arrival=1.0)]
    for r in reqs:
        scheduler.add(r, 0.0)
    _, first = _drive(scheduler)
    assert sorted(first, key=first.get) == ["high-early", "high-late", "low-early"]


def test_priority_preempts_a_running_low_priority_request_for_a_waiting_urgent_one():
    scheduler = _scheduler("priority", max_num_seqs=1)
    low = _request("low", 4, max_tokens=50, priority=5)
    scheduler.add(low, 0.0)
    scheduler.schedule(0.0)
    low.num_computed_tokens = 4
    low.append_token(7, 0.0)
    urgent = _request("urgent", 4, priority=0, arrival=1.0)
    scheduler.add(urgent, 1.0)
    out = scheduler.schedule(1.0)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [r.request_id for r, _ in out.scheduled] == ["urgent"]
    # With preemption for priority switched off, the urgent one waits its turn.
    calm = Scheduler(POLICIES.get("priority")(preempt_for_priority=False), ALLOCATORS.get("paged")(64, 4), 1, 64)
    low2, urgent2 = _request("low", 4, max_tokens=50, priority=5), _request("urgent", 4, priority=0, arrival=1.0)
    calm.add(low2, 0.0)
    calm.schedule(0.0)
    low2.num_computed_tokens = 4
    calm.add(urgent2, 1.0)
    assert [r.request_id for r, _ in calm.schedule(1.0).scheduled] == ["low"]


def test_fair_share_serves_a_light_client_before_a_heavy_one():
    scheduler = _scheduler("fair", max_num_seqs=1, budget=64)
    for i in range(4):
        scheduler.add(_request(f"heavy{i}", 16, max_tokens=8, arrival=i * 0.01, client="heavy"), 0.0)
    light = _request("light", 4, max_tokens=2, arrival=1.0, client="light")
    scheduler.add(light, 0.0)
    _, first = _drive(scheduler)
    # FCFS would serve the light client last; VTC serves it right after the first heavy request.
    assert first["light"] < first["heavy1"]


def test_a_policy_that_raises_is_reported_with_its_name_and_method():
    class Broken(Policy):
        registered_name = "broken"

        def priority(self, request, now):
            raise RuntimeError("boom")

    scheduler = Scheduler(Broken(), ALLOCATORS.get("paged")(8, 4), 2, 16)
    scheduler.add(_request("a", 4), 0.0)
    with pytest.raises(PolicyError, match=r"policy 'broken' raised in priority\(\): RuntimeError: boom"):
        scheduler.schedule(0.0)


def test_a_veto_on_an_empty_batch_cannot_stall_the_engine():
    class NeverExpand(Policy):
        def should_expand_batch(self, request, view, now):
            return False

    scheduler = Scheduler(NeverExpand(), ALLOCATORS.get("paged")(16, 4), 4, 16)
    for i in range(3):
        scheduler.add(_request(f"r{i}", 4, max_tokens=2), 0.0)
    steps, _ = _drive(scheduler)
    assert steps >= 3 * 2  # one request at a time


def test_mlfq_demotes_long_jobs_so_short_ones_finish_first():
    scheduler = _scheduler("mlfq", max_num_seqs=1, budget=64)
    scheduler.policy.quantum = 4
    long_job = _request("long", 4, max_tokens=40, arrival=0.0)
    scheduler.add(long_job, 0.0)
    # The long job runs alone for a while and is demoted as its service grows...
    for step in range(12):
        out = scheduler.schedule(float(step))
        scheduler.update_from_output(out, _sampled(out), float(step), max_model_len=10**9)
    assert scheduler.policy.level(long_job) >= 2
    # ...so newly arrived short jobs (level 0) go ahead of it whenever a seat frees up.
    shorts = [_request(f"short{i}", 4, max_tokens=2, arrival=1.0 + i) for i in range(3)]
    for r in shorts:
        scheduler.add(r, 12.0)
    scheduler.policy.preempt = True
    _drive(scheduler)
    finished_order = sorted(shorts + [long_job], key=lambda r: r.finish_time)
    assert finished_order[-1] is long_job


def test_a_policy_rejection_ends_the_request_failed_with_its_reason_and_tells_the_policy():
    finished = []

    class RejectOdd(Policy):
        registered_name = "reject_odd"

        def reject_reason(self, request, now):
            return "odd ids are not served" if int(request.request_id[1:]) % 2 else None

        def on_finish(self, request, now):
            finished.append(request.request_id)

    scheduler = Scheduler(RejectOdd(), ALLOCATORS.get("paged")(32, 4), 4, 64)
    requests = [_request(f"r{i}", 4, max_tokens=2) for i in range(4)]
    for r in requests:
        scheduler.add(r, 0.0)
    _drive(scheduler)
    assert [r.status.value for r in requests] == ["finished", "failed", "finished", "failed"]
    assert requests[1].error == "rejected by policy 'reject_odd': odd ids are not served"
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert scheduler.allocator.num_free_blocks() == 32


def test_step_budget_caps_every_step_and_decodes_go_first():
    from nanovllm import StepBudget

    class Small(Policy):
        def step_budget(self, view, now):
            return StepBudget(6)

    scheduler = Scheduler(Small(), ALLOCATORS.get("paged")(64, 4), 4, 64)
    scheduler.add(_request("a", 3, max_tokens=8), 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update_from_output(out, _sampled(out), 0.0, max_model_len=10**9)   # "a" now decodes
    scheduler.add(_request("b", 20, max_tokens=2, arrival=1.0), 1.0)
    out = scheduler.schedule(1.0)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 5)]


def test_a_step_budget_that_is_not_a_step_budget_is_reported():
    class Bad(Policy):
        registered_name = "bad_budget"

        def step_budget(self, view, now):
            return 0

    scheduler = Scheduler(Bad(), ALLOCATORS.get("paged")(8, 4), 2, 16)
    scheduler.add(_request("a", 4), 0.0)
    with pytest.raises(PolicyError, match=r"policy 'bad_budget': step_budget must return a StepBudget"):
        scheduler.schedule(0.0)
