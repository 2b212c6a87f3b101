"""Scheduler mechanics with the real allocators and policies, stepping requests without a model: budgets,
admission order, preemption and recompute, what every policy call is told, and that every block comes back. The
second half pins each decision at its edge (many were written to kill mutants of ``make mutate``)."""

from __future__ import annotations

import pytest

from helpers import bare_scheduler, drive, make_request, run_step, sampled
from nanovllm import (ALLOCATORS, POLICIES, Policy, Request, RequestStatus, SamplingParams, SchedulerView,
                      StepBudget)
from nanovllm.engine.scheduler import PolicyError, Scheduler, SchedulerOutput
from nanovllm.sampling import INVALID_TOKEN, NON_FINITE_REASON


@pytest.mark.parametrize("policy", POLICIES.names())
@pytest.mark.parametrize("allocator", ALLOCATORS.names())
def test_every_request_finishes_and_every_block_returns(policy, allocator):
    scheduler = bare_scheduler(policy, allocator, num_blocks=24, max_num_seqs=3, max_num_batched_tokens=16)
    requests = [make_request(f"r{i}", 5 + 3 * i, max_tokens=6, priority=i % 2, arrival=i * 0.1, client=f"c{i % 3}")
                for i in range(8)]
    for r in requests:
        scheduler.add(r, 0.0)
    drive(scheduler)
    assert all(r.num_output_tokens == 6 for r in requests)
    assert scheduler.allocator.num_free_blocks() == 24


def test_chunked_prefill_splits_a_long_prompt_over_steps():
    scheduler = bare_scheduler(max_num_batched_tokens=8, num_blocks=64)
    r = make_request("long", 30)
    scheduler.add(r, 0.0)
    chunks = []
    while r.num_computed_tokens < 30:
        out = scheduler.schedule(0.0)
        chunks.append(out.scheduled[0][1])
        scheduler.update_from_output(out, [None] * len(out.scheduled), 0.0, max_model_len=10**9)
    assert chunks == [8, 8, 8, 6]


def test_memory_pressure_preempts_the_latest_arrival_which_forgets_its_work_and_recomputes_it_all():
    # 6 blocks of 4 tokens: each request fits alone (8 + 12 tokens = 5 blocks), both together do not.
    scheduler = bare_scheduler(num_blocks=6)
    early, late = make_request("early", 8, max_tokens=12, arrival=0.0), make_request("late", 8, max_tokens=12,
                                                                                     arrival=1.0)
    scheduler.add(early, 0.0)
    scheduler.add(late, 0.0)
    for step in range(20):
        out, _ = run_step(scheduler, float(step))
        if out.preempted:
            break
    assert out.preempted == [late] and late.status is RequestStatus.PREEMPTED and late.num_preemptions == 1
    assert all(r is not late for r, _ in out.scheduled)    # the request that gave way is not run this step
    assert late in scheduler.waiting and late not in scheduler.running
    assert late.num_computed_tokens == 0 and late.block_table == [] and late.num_output_tokens > 0
    assert early.num_recomputed_tokens == 0
    for step in range(100, 200):  # bounded: a scheduler that never readmits it fails here instead of hanging
        out, _ = run_step(scheduler, float(step))
        if any(r is late for r, _ in out.scheduled):
            break
    [num_new] = [n for r, n in out.scheduled if r is late]
    assert num_new == late.num_tokens - 1  # prompt and outputs recomputed (the newest token was just sampled)
    drive(scheduler)
    assert early.num_preemptions == 0 and scheduler.allocator.num_free_blocks() == 6


def test_priority_policy_admits_by_priority_then_arrival():
    scheduler = bare_scheduler("priority", max_num_seqs=1)
    reqs = [make_request("low-early", 4, priority=1, arrival=0.0), make_request("high-late", 4, priority=0, arrival=2.0),
            make_request("high-early", 4, priority=0, arrival=1.0)]
    for r in reqs:
        scheduler.add(r, 0.0)
    _, first = drive(scheduler)
    assert sorted(first, key=first.get) == ["high-early", "high-late", "low-early"]


def test_priority_preempts_a_running_low_priority_request_for_a_waiting_urgent_one():
    scheduler = bare_scheduler("priority", max_num_seqs=1)
    low = make_request("low", 4, max_tokens=50, priority=5)
    scheduler.add(low, 0.0)
    scheduler.schedule(0.0)
    low.num_computed_tokens = 4
    low.append_token(7, 0.0)
    urgent = make_request("urgent", 4, priority=0, arrival=1.0)
    scheduler.add(urgent, 1.0)
    out = scheduler.schedule(1.0)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [r.request_id for r, _ in out.scheduled] == ["urgent"]
    # With preemption for priority switched off, the urgent one waits its turn.
    calm = Scheduler(POLICIES.get("priority")(preempt_for_priority=False), ALLOCATORS.get("paged")(64, 4), 1, 64)
    low2, urgent2 = make_request("low", 4, max_tokens=50, priority=5), make_request("urgent", 4, priority=0, arrival=1.0)
    calm.add(low2, 0.0)
    calm.schedule(0.0)
    low2.num_computed_tokens = 4
    calm.add(urgent2, 1.0)
    assert [r.request_id for r, _ in calm.schedule(1.0).scheduled] == ["low"]


def test_fair_share_serves_a_light_client_before_a_heavy_one():
    scheduler = bare_scheduler("fair", max_num_seqs=1, max_num_batched_tokens=64)
    for i in range(4):
        scheduler.add(make_request(f"heavy{i}", 16, max_tokens=8, arrival=i * 0.01, client="heavy"), 0.0)
    light = make_request("light", 4, max_tokens=2, arrival=1.0, client="light")
    scheduler.add(light, 0.0)
    _, first = drive(scheduler)
    # FCFS would serve the light client last; VTC serves it right after the first heavy request.
    assert first["light"] < first["heavy1"]


def test_a_policy_that_raises_is_reported_with_its_name_and_method():
    class Broken(Policy):
        registered_name = "broken"

        def priority(self, request, now):
            raise RuntimeError("boom")

    scheduler = Scheduler(Broken(), ALLOCATORS.get("paged")(8, 4), 2, 16)
    scheduler.add(make_request("a", 4), 0.0)
    with pytest.raises(PolicyError, match=r"policy 'broken' raised in priority\(\): RuntimeError: boom"):
        scheduler.schedule(0.0)


def test_a_veto_on_an_empty_batch_cannot_stall_the_engine():
    class NeverExpand(Policy):
        def should_expand_batch(self, request, view, now):
            return False

    scheduler = Scheduler(NeverExpand(), ALLOCATORS.get("paged")(16, 4), 4, 16)
    for i in range(3):
        scheduler.add(make_request(f"r{i}", 4, max_tokens=2), 0.0)
    steps, _ = drive(scheduler)
    assert steps >= 3 * 2  # one request at a time


def test_mlfq_demotes_long_jobs_so_short_ones_finish_first():
    scheduler = bare_scheduler("mlfq", max_num_seqs=1, max_num_batched_tokens=64)
    scheduler.policy.quantum = 4
    long_job = make_request("long", 4, max_tokens=40, arrival=0.0)
    scheduler.add(long_job, 0.0)
    # The long job runs alone for a while and is demoted as its service grows...
    for step in range(12):
        out = scheduler.schedule(float(step))
        scheduler.update_from_output(out, sampled(out), float(step), max_model_len=10**9)
    assert scheduler.policy.level(long_job) >= 2
    # ...so newly arrived short jobs (level 0) go ahead of it whenever a seat frees up.
    shorts = [make_request(f"short{i}", 4, max_tokens=2, arrival=1.0 + i) for i in range(3)]
    for r in shorts:
        scheduler.add(r, 12.0)
    scheduler.policy.preempt = True
    drive(scheduler)
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
    requests = [make_request(f"r{i}", 4, max_tokens=2) for i in range(4)]
    for r in requests:
        scheduler.add(r, 0.0)
    drive(scheduler)
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
    scheduler.add(make_request("a", 3, max_tokens=8), 0.0)
    out = scheduler.schedule(0.0)
    scheduler.update_from_output(out, sampled(out), 0.0, max_model_len=10**9)   # "a" now decodes
    scheduler.add(make_request("b", 20, max_tokens=2, arrival=1.0), 1.0)
    out = scheduler.schedule(1.0)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 5)]


def test_a_step_budget_that_is_not_a_step_budget_is_reported():
    class Bad(Policy):
        registered_name = "bad_budget"

        def step_budget(self, view, now):
            return 0

    scheduler = Scheduler(Bad(), ALLOCATORS.get("paged")(8, 4), 2, 16)
    scheduler.add(make_request("a", 4), 0.0)
    with pytest.raises(PolicyError, match=r"policy 'bad_budget': step_budget must return a StepBudget"):
        scheduler.schedule(0.0)


# -- every decision at its edge (policy calls, budgets, admission, preemption, recompute) ------------------------------

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


@pytest.mark.parametrize("decodes_first", [True, False])
def test_every_policy_call_gets_the_steps_time(decodes_first):
    policy = RecordingPolicy(decodes_first)
    scheduler = bare_scheduler(policy, num_blocks=6)
    for rid, arrival in (("early", 0.0), ("late", 1.0)):
        scheduler.add(make_request(rid, prompt=8, max_tokens=12, arrival=arrival), 0.0)
    hopeless = make_request("hopeless", arrival=-2.0)
    preempted = 0
    for step in range(1, 60):
        if step == 2:   # earlier than both and too big for the free blocks: preempt_for makes room for it
            scheduler.add(make_request("urgent", prompt=12, max_tokens=4, arrival=-1.0), float(step))
            scheduler.add(hopeless, float(step))
        out, _ = run_step(scheduler, float(step))
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


def test_recomputed_tokens_are_those_below_the_high_water_mark_summed_over_chunks_and_requests():
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=16)
    r1, r2, fresh = make_request("r1", prompt=12), make_request("r2", prompt=8), make_request("fresh", prompt=4)
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
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=8)
    done, garbage, after = make_request("done", max_tokens=1), make_request("garbage", max_tokens=1), make_request("after", max_tokens=1)
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
    scheduler = bare_scheduler(policy, num_blocks=8)
    refused, waiting, running = make_request("refused"), make_request("waiting", arrival=1.0), make_request("running")
    scheduler.add(running, 0.0)
    run_step(scheduler, 0.0)
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
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=8, allocator="prefix", watermark=0.0)
    first = make_request("first", prompt=8, max_tokens=1)
    scheduler.add(first, 0.0)
    run_step(scheduler, 0.0)                               # caches two blocks
    hog = Request("hog", list(range(100, 120)), SamplingParams(max_tokens=50, ignore_eos=True), 1.0)
    scheduler.add(hog, 1.0)
    run_step(scheduler, 1.0)
    run_step(scheduler, 2.0)                               # 6 of the 8 blocks are the hog's now
    twin = Request("twin", list(range(1, 9)) + list(range(50, 58)), SamplingParams(max_tokens=4), 3.0)
    scheduler.add(twin, 3.0)
    out, _ = run_step(scheduler, 3.0)
    assert all(r is not twin for r, _ in out.scheduled) and twin in scheduler.waiting
    assert (twin.num_computed_tokens, twin.num_cached_tokens, twin.block_table) == (0, 0, [])
    assert scheduler.allocator.num_cached_blocks() == 2     # the matched blocks are evictable again


@pytest.mark.parametrize("watermark, extra_blocks, preempts", [(0.0, 0, False), (0.0, 1, True), (0.25, 0, True)])
def test_priority_preempts_for_a_waiting_request_exactly_when_it_does_not_fit(watermark, extra_blocks, preempts):
    scheduler = bare_scheduler(POLICIES.build("priority"), num_blocks=16, watermark=watermark)
    low = Request("low", list(range(1, 17)), SamplingParams(max_tokens=50, ignore_eos=True), 0.0, priority=5)
    scheduler.add(low, 0.0)
    run_step(scheduler, 0.0)                               # low holds 4 blocks: 12 free when step 1 starts
    # 12 blocks fit exactly with no watermark; 13 do not, nor do 12 plus a 4-block watermark.
    urgent = Request("urgent", list(range(200, 200 + 4 * (12 + extra_blocks))), SamplingParams(max_tokens=2), 1.0,
                     priority=0)
    scheduler.add(urgent, 1.0)
    out, _ = run_step(scheduler, 1.0)
    assert (out.preempted == [low]) is preempts


def test_a_decode_that_gives_way_to_itself_lets_the_prefill_after_it_run():
    # The batch is decodes first: D (least urgent) decodes ahead of P's prefill chunks. When D's next block is
    # missing, the policy's victim among [D, P] is D itself; P's chunk must still run in that step.
    policy = POLICIES.build({"name": "priority", "preempt_for_priority": False})
    scheduler = bare_scheduler(policy, num_blocks=6, max_num_batched_tokens=4, watermark=0.0)
    d = Request("D", [1, 2, 3], SamplingParams(max_tokens=60, ignore_eos=True), 0.0, priority=9)
    p = Request("P", list(range(100, 122)), SamplingParams(max_tokens=60, ignore_eos=True), 1.0, priority=0)
    scheduler.add(d, 0.0)
    run_step(scheduler, 0.0)
    scheduler.add(p, 1.0)
    for step in range(1, 30):
        out, _ = run_step(scheduler, float(step))
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
    scheduler = bare_scheduler(policy, num_blocks=16)
    requests = [make_request(f"r{i}", prompt=1, max_tokens=10, arrival=float(i)) for i in range(3)]
    for request in requests:
        scheduler.add(request, 0.0)
    run_step(scheduler, 0.0)                               # all three admitted
    policy.tokens = budget
    out, _ = run_step(scheduler, 1.0)
    assert out.scheduled == [(r, 1) for r in requests[:budget]]   # one token each, none with 0 tokens


@pytest.mark.parametrize("budget, admitted", [(3, False), (4, True)])
def test_admission_uses_the_budget_the_decodes_leave_and_never_admits_zero_tokens(budget, admitted):
    policy = AdjustableBudget()
    scheduler = bare_scheduler(policy, num_blocks=16)
    running = [make_request(f"r{i}", prompt=1, max_tokens=10, arrival=float(i)) for i in range(3)]
    for request in running:
        scheduler.add(request, 0.0)
    run_step(scheduler, 0.0)
    newcomer = make_request("new", prompt=1, arrival=5.0)
    scheduler.add(newcomer, 5.0)
    policy.tokens = budget
    out, _ = run_step(scheduler, 5.0)
    assert all(n > 0 for _, n in out.scheduled)
    assert ((newcomer, 1) in out.scheduled) is admitted and (newcomer.status is RequestStatus.RUNNING) is admitted


@pytest.mark.parametrize("max_tokens", [0, 2.5])
def test_a_step_budget_below_one_token_or_not_an_int_is_a_policy_error(max_tokens):
    policy = AdjustableBudget()
    policy.tokens = max_tokens
    scheduler = bare_scheduler(policy, num_blocks=16)
    scheduler.add(make_request("r"), 0.0)
    with pytest.raises(PolicyError, match="step_budget must return a StepBudget with max_tokens >= 1"):
        scheduler.schedule(0.0)


def test_without_chunking_a_prompt_that_fills_the_budget_exactly_is_admitted_and_one_that_does_not_fit_waits():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("prefix")(16, 4), max_num_seqs=4,
                          max_num_batched_tokens=8, enable_chunked_prefill=False)
    first = make_request("first", prompt=8, max_tokens=20)
    scheduler.add(first, 0.0)
    out, _ = run_step(scheduler, 0.0)
    assert out.scheduled == [(first, 8)]                    # exactly the budget
    cached_before = scheduler.allocator.num_cached_blocks()
    twin = Request("twin", list(range(1, 9)) + list(range(60, 68)), SamplingParams(max_tokens=2), 1.0)
    scheduler.add(twin, 1.0)                                # 8 cached + 8 new > the 7 the decode leaves
    out, _ = run_step(scheduler, 1.0)
    assert out.scheduled == [(first, 1)] and twin in scheduler.waiting
    assert (twin.num_computed_tokens, twin.num_cached_tokens, twin.block_table) == (0, 0, [])
    assert scheduler.allocator.num_cached_blocks() == cached_before


def test_an_empty_batch_admits_its_head_request_ignoring_the_watermark():
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=16, watermark=0.25)
    whole_cache = make_request("whole", prompt=63, max_tokens=1)  # all 16 blocks: none left for the watermark
    scheduler.add(whole_cache, 0.0)
    out, _ = run_step(scheduler, 0.0)
    assert out.scheduled == [(whole_cache, 63)]


def test_prefix_hits_are_summed_over_the_requests_admitted_in_a_step():
    scheduler = _prefix_scheduler_for_hits()
    twins = [Request(f"twin{i}", list(range(1, 9)) + [50 + i], SamplingParams(max_tokens=2), 1.0) for i in range(2)]
    for twin in twins:
        scheduler.add(twin, 1.0)
    out, _ = run_step(scheduler, 1.0)
    assert [r for r, _ in out.scheduled] == twins and out.num_prefix_hit_tokens == 16


def _prefix_scheduler_for_hits() -> Scheduler:
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=16, allocator="prefix")
    scheduler.add(make_request("first", prompt=8, max_tokens=1), 0.0)
    run_step(scheduler, 0.0)                               # caches the 8-token prompt's two blocks
    return scheduler


def test_prefill_first_runs_a_prefill_chunk_while_a_decode_waits():
    scheduler = bare_scheduler(POLICIES.build("prefill_first"), num_blocks=16, max_num_batched_tokens=4)
    decode = make_request("decode", prompt=2, max_tokens=20, arrival=0.0)
    scheduler.add(decode, 0.0)
    run_step(scheduler, 0.0)
    prefill = make_request("prefill", prompt=12, arrival=1.0)
    scheduler.add(prefill, 1.0)
    run_step(scheduler, 1.0)                               # admitted: its first chunk
    out, _ = run_step(scheduler, 2.0)
    assert out.scheduled == [(prefill, 4)]                  # the decode ahead of it in the batch waits


def test_the_policy_sees_the_schedulers_state_in_its_view():
    policy = RecordingPolicy()
    scheduler = bare_scheduler(policy, num_blocks=16)
    scheduler.add(make_request("r0"), 0.0)
    run_step(scheduler, 0.0)
    for rid in ("a", "b"):
        scheduler.add(make_request(rid, arrival=1.0), 1.0)
    policy.asked.clear()
    policy.budget_views.clear()
    run_step(scheduler, 1.0)
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
    scheduler = bare_scheduler(policy, num_blocks=6, max_num_batched_tokens=8, watermark=0.0)
    for rid, arrival in (("A", 0.0), ("B", 1.0)):
        scheduler.add(Request(rid, list(range(1 + 100 * int(arrival), 17 + 100 * int(arrival))),
                              SamplingParams(max_tokens=4, ignore_eos=True), arrival), 0.0)
    for step in range(40):
        run_step(scheduler, float(step))
        if not scheduler.has_unfinished():
            break
    victims = [now for name, now in policy.times if name == "select_victim"]
    assert victims and all(isinstance(now, float) for now in victims) and sorted(policy.finished) == ["A", "B"]


def test_a_request_preempted_twice_counts_two_preemptions():
    scheduler = bare_scheduler(POLICIES.build("priority"), num_blocks=16, watermark=0.0)
    low = Request("low", list(range(1, 17)), SamplingParams(max_tokens=50, ignore_eos=True), 0.0, priority=5)
    scheduler.add(low, 0.0)
    run_step(scheduler, 0.0)
    for i in range(2):
        urgent = Request(f"urgent{i}", list(range(200, 252)), SamplingParams(max_tokens=1), 1.0 + i, priority=0)
        scheduler.add(urgent, 1.0 + i)
        out, finished = run_step(scheduler, 10.0 * (i + 1))     # preempts low, runs and finishes urgent
        assert out.preempted == [low] and finished == [urgent]
        run_step(scheduler, 10.0 * (i + 1) + 1)                 # low comes back
    assert low.num_preemptions == 2


def test_admission_keeps_the_watermark_free_while_others_run():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("paged")(16, 4), max_num_seqs=4,
                          max_num_batched_tokens=64, watermark=0.25)   # 4 blocks kept spare
    small = make_request("small", 8, max_tokens=50)
    scheduler.add(small, 0.0)
    run_step(scheduler, 0.0)
    big = make_request("big", 44, arrival=1.0)                # 11 blocks: fits the 13 free, not 13 - 4
    scheduler.add(big, 1.0)
    out, _ = run_step(scheduler, 1.0)
    assert [r.request_id for r, _ in out.scheduled] == ["small"] and scheduler.waiting == [big]
    fits = make_request("fits", 36, arrival=2.0)               # 9 blocks + 4 spare = the 13 free: admitted
    scheduler.waiting.remove(big)
    scheduler.add(fits, 2.0)
    assert [r.request_id for r, _ in run_step(scheduler, 2.0)[0].scheduled] == ["small", "fits"]


def test_no_admission_in_a_step_that_preempted_for_memory():
    # Two 8-token requests fill 4 of 6 blocks; as both grow, the late one is preempted for memory. A small
    # request arriving just then would fit in the freed blocks, but must wait for the next step.
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("paged")(6, 4), max_num_seqs=4,
                          max_num_batched_tokens=64)
    early, late = make_request("early", 8, max_tokens=20, arrival=0.0), make_request("late", 8, max_tokens=20, arrival=1.0)
    scheduler.add(early, 0.0)
    scheduler.add(late, 0.0)
    small = make_request("small", 2, max_tokens=2, arrival=0.5, start=100)   # sorts ahead of "late" once waiting
    for step in range(1, 20):
        if early.num_tokens + 1 > 12 and small not in scheduler.waiting and not small.is_finished:
            scheduler.add(small, float(step))
        out, _ = run_step(scheduler, float(step))
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["late"]
    assert small in scheduler.waiting and all(r is not small for r, _ in out.scheduled)
    assert scheduler.allocator.num_free_blocks() >= 1      # it would have fit
    assert any(r is small for r, _ in run_step(scheduler, 30.0)[0].scheduled)


# -- prefill/decode disaggregation: the hand-off and the load --------------------------------------------------

def test_a_request_to_hand_off_leaves_at_its_first_token_with_its_blocks_until_released():
    from helpers import bare_scheduler, block_tokens, make_request, run_step
    from nanovllm.request import RequestStatus

    scheduler = bare_scheduler(allocator="prefix", num_blocks=16)
    request = make_request("r", block_tokens(1, 2), max_tokens=8)
    request.hand_off_after_prefill = True
    scheduler.add(request, 0.0)
    _, finished = run_step(scheduler, 0.0)
    assert finished == [] and not scheduler.running and not scheduler.has_unfinished()
    assert request.status is RequestStatus.HANDED_OFF and request.num_output_tokens == 1
    (handed,) = scheduler.take_handed_off()
    assert handed is request and len(request.block_table) == 3   # held until the engine read the K/V
    free = scheduler.allocator.num_free_blocks()
    scheduler.release(request)
    assert scheduler.allocator.num_free_blocks() == free + 3 and scheduler.take_handed_off() == []
    assert scheduler.allocator.cached_prefix_len(make_request("s", block_tokens(1, 2))) == 8   # the prompt stays


def test_a_handed_off_request_is_admitted_with_every_block_and_computes_only_its_newest_token():
    from helpers import bare_scheduler, block_tokens, make_request, run_step
    from nanovllm.request import KVHandoff

    scheduler = bare_scheduler(allocator="prefix", num_blocks=16)
    warm = make_request("warm", block_tokens(1, 7), max_tokens=1)   # caches block 1 on this (decode) side
    scheduler.add(warm, 0.0)
    run_step(scheduler, 0.0)
    request = make_request("r", block_tokens(1, 2), max_tokens=8)
    request.token_ids.append(42)                                    # the first token, sampled on the prefill side
    request.num_cached_tokens = 4                                   # what the prefill side's cache served
    request.handoff = KVHandoff(prefill_replica=0, num_tokens=9, num_bytes=0, arrival_time=1.0)
    scheduler.add(request, 1.0)
    out, _ = run_step(scheduler, 1.0)
    assert out.scheduled == [(request, 1)] and out.kv_loads == [(request, 1)]   # block 0 was a hit here
    assert len(request.block_table) == 3 and request.handoff.loaded and request.handoff.decode_start_time == 1.0
    assert request.num_computed_tokens == 10 and request.num_cached_tokens == 4 and request.num_output_tokens == 2
    assert out.num_prefix_hit_tokens == 4 and request.num_recomputed_tokens == 0
