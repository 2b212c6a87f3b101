"""One test per class of realistic one-line bug that an audit found the suite let through (issue 14): each
asserts the exact behaviour the bug would change, so the bug fails it. Scheduler-level cases step requests
without a model; the chunk-boundary case runs the real engine against transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from nanovllm import ALLOCATORS, LLM, POLICIES, Request, SamplingParams
from nanovllm.engine.scheduler import Scheduler
from nanovllm.sampling import Sampler


def _request(rid: str, n_prompt: int, max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
             client: str | None = None, start: int = 1, **params) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=params.pop("ignore_eos", True), **params)
    return Request(rid, list(range(start, start + n_prompt)), sampling, arrival_time=arrival, priority=priority,
                   client_id=client)


def _step(scheduler: Scheduler, now: float, token: int = 7):
    """One scheduler step as the engine runs it: plan, then a token for each request whose chunk completes it."""
    out = scheduler.schedule(now)
    tokens = [token if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]
    scheduler.update_from_output(out, tokens, now, max_model_len=10**9)
    return out


# -- priority: the victim ------------------------------------------------------------------------------------------

def test_priority_preempts_the_least_urgent_latest_running_request():
    policy = POLICIES.build("priority")
    running = [_request("p1-early", 4, priority=1, arrival=0.0), _request("p2-early", 4, priority=2, arrival=1.0),
               _request("p2-late", 4, priority=2, arrival=2.0), _request("p0", 4, priority=0, arrival=3.0)]
    urgent = _request("urgent", 4, priority=0, arrival=4.0)
    assert policy.preempt_for(urgent, running, 5.0).request_id == "p2-late"
    assert policy.select_victim(running, 5.0).request_id == "p2-late"
    # Only for a strictly more urgent request: an equal one waits.
    assert policy.preempt_for(_request("peer", 4, priority=2, arrival=9.0), running[1:3], 5.0) is None


# -- prefix cache --------------------------------------------------------------------------------------------------

def _prefix_scheduler(num_blocks: int = 16, allocator: str = "prefix") -> Scheduler:
    return Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get(allocator)(num_blocks, 4), max_num_seqs=4,
                     max_num_batched_tokens=64)


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_prefix_cache_never_matches_a_whole_prompt_and_takes_hit_blocks_out_of_the_free_pool(allocator):
    scheduler = _prefix_scheduler(allocator=allocator)
    first = _request("first", 8, max_tokens=1)          # exactly two full blocks
    scheduler.add(first, 0.0)
    _step(scheduler, 0.0)
    assert first.is_finished
    allocator = scheduler.allocator
    assert allocator.num_free_blocks() == 16 and allocator.num_cached_blocks() == 2
    twin = _request("twin", 8, max_tokens=1)
    scheduler.add(twin, 1.0)
    out = scheduler.schedule(1.0)
    # The last prompt token is always computed (its logits give the first output token): one block is a hit.
    assert twin.num_cached_tokens == 4 and out.scheduled == [(twin, 4)]
    # The hit block is in use again: out of the evictable pool, so a fresh allocation can never take it.
    assert len(twin.block_table) == 2 and allocator.num_cached_blocks() == 1   # only the unmatched one is left
    assert allocator.num_free_blocks() == 14


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_a_matched_block_is_never_evicted_for_another_request(allocator):
    # Two one-block prefixes are cached (A first, then C); a twin of A's prompt holds A. A fresh request then
    # needs an eviction: with FIFO order A would be the victim if the match had left it evictable.
    cache = ALLOCATORS.get(allocator)(4, 4, eviction="fifo")
    for rid, start in (("a", 1), ("c", 11)):
        owner = _request(rid, 5, start=start)
        cache.allocate(owner, 5)
        owner.num_computed_tokens = 5
        cache.on_tokens_computed(owner)
        cache.free(owner)
    twin = _request("twin", 5, start=1)
    twin.num_computed_tokens = cache.match_prefix(twin)
    assert twin.num_computed_tokens == 4
    cache.allocate(twin, 1)
    other = _request("other", 8, start=21)
    assert cache.num_free_blocks() == 2                    # one never-used block and C: A is held
    cache.allocate(other, 8)
    assert not set(twin.block_table) & set(other.block_table)
    assert cache.cached_prefix_len(_request("again", 5, start=1)) == 4     # A's content survived
    assert cache.cached_prefix_len(_request("again-c", 5, start=11)) == 0  # C was the one evicted


# -- admission -----------------------------------------------------------------------------------------------------

def test_admission_keeps_the_watermark_free_while_others_run():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("paged")(16, 4), max_num_seqs=4,
                          max_num_batched_tokens=64, watermark=0.25)   # 4 blocks kept spare
    small = _request("small", 8, max_tokens=50)
    scheduler.add(small, 0.0)
    _step(scheduler, 0.0)
    big = _request("big", 44, arrival=1.0)                # 11 blocks: fits the 13 free, not 13 - 4
    scheduler.add(big, 1.0)
    out = _step(scheduler, 1.0)
    assert [r.request_id for r, _ in out.scheduled] == ["small"] and scheduler.waiting == [big]
    fits = _request("fits", 36, arrival=2.0)               # 9 blocks + 4 spare = the 13 free: admitted
    scheduler.waiting.remove(big)
    scheduler.add(fits, 2.0)
    assert [r.request_id for r, _ in _step(scheduler, 2.0).scheduled] == ["small", "fits"]


def test_no_admission_in_a_step_that_preempted_for_memory():
    # Two 8-token requests fill 4 of 6 blocks; as both grow, the late one is preempted for memory. A small
    # request arriving just then would fit in the freed blocks, but must wait for the next step.
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("paged")(6, 4), max_num_seqs=4,
                          max_num_batched_tokens=64)
    early, late = _request("early", 8, max_tokens=20, arrival=0.0), _request("late", 8, max_tokens=20, arrival=1.0)
    scheduler.add(early, 0.0)
    scheduler.add(late, 0.0)
    small = _request("small", 2, max_tokens=2, arrival=0.5, start=100)   # sorts ahead of "late" once waiting
    for step in range(1, 20):
        if early.num_tokens + 1 > 12 and small not in scheduler.waiting and not small.is_finished:
            scheduler.add(small, float(step))
        out = _step(scheduler, float(step))
        if out.preempted:
            break
    assert [r.request_id for r in out.preempted] == ["late"]
    assert small in scheduler.waiting and all(r is not small for r, _ in out.scheduled)
    assert scheduler.allocator.num_free_blocks() >= 1      # it would have fit
    assert any(r is small for r, _ in _step(scheduler, 30.0).scheduled)


# -- preemption ----------------------------------------------------------------------------------------------------

def test_a_preempted_request_forgets_its_computed_tokens_and_recomputes_them_all():
    scheduler = Scheduler(POLICIES.build("fcfs"), ALLOCATORS.get("paged")(6, 4), max_num_seqs=4,
                          max_num_batched_tokens=64)
    # 6 blocks of 4 tokens: each request fits alone (8 + 12 tokens = 5 blocks), both together do not.
    early, late = _request("early", 8, max_tokens=12, arrival=0.0), _request("late", 8, max_tokens=12, arrival=1.0)
    scheduler.add(early, 0.0)
    scheduler.add(late, 0.0)
    for step in range(20):
        out = _step(scheduler, float(step))
        if out.preempted:
            break
    assert out.preempted == [late]
    assert late.num_computed_tokens == 0 and late.block_table == [] and late.num_output_tokens > 0
    for step in range(100, 200):  # bounded: a scheduler that never readmits it fails here instead of hanging
        out = _step(scheduler, float(step))
        if any(r is late for r, _ in out.scheduled):
            break
    [num_new] = [n for r, n in out.scheduled if r is late]
    assert num_new == late.num_tokens - 1  # prompt and outputs recomputed (the newest token was just sampled)


# -- sampling ------------------------------------------------------------------------------------------------------

def test_temperature_scales_logits_before_top_p_filters_them():
    # Logits 2, 1, 0: at temperature 1 the top token alone holds 0.665 >= top_p=0.6, so only it survives; at
    # temperature 10 the distribution is nearly flat and the nucleus keeps two tokens.
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = SamplingParams(temperature=10.0, top_p=0.6)
    generator = torch.Generator().manual_seed(0)
    draws = {Sampler()(logits, [params], [generator])[0] for _ in range(200)}
    assert draws == {0, 1}


def test_stop_token_ids_stop_even_when_eos_is_ignored():
    request = _request("r", 3, max_tokens=10, ignore_eos=True, stop_token_ids=[42])
    request.eos_token_ids = frozenset({2})
    request.append_token(2, 0.0)
    assert request.check_stop(10**9) is None               # EOS ignored
    request.append_token(42, 0.0)
    assert request.check_stop(10**9) == "stop"             # a stop id still stops


# -- policies ------------------------------------------------------------------------------------------------------

def test_vtc_charges_prompt_tokens_at_input_weight_and_decodes_at_output_weight():
    policy = POLICIES.build({"name": "fair", "input_weight": 1.0, "output_weight": 3.0})
    scheduler = Scheduler(policy, ALLOCATORS.get("paged")(16, 4), max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(_request("r", 10, max_tokens=3, client="c"), 0.0)
    for step in range(3):
        _step(scheduler, float(step))
    # One prefill of 10 prompt tokens, then two decodes (the first token came from the prefill).
    assert policy.counters["c"] == 10 * 1.0 + 2 * 3.0


def test_mlfq_levels_follow_the_quantum():
    fine, coarse = POLICIES.build({"name": "mlfq", "quantum": 4}), POLICIES.build({"name": "mlfq", "quantum": 64})
    request = _request("r", 8)
    assert fine.level(request) == 1 and coarse.level(request) == 0      # log2(1 + 8/4) vs log2(1 + 8/64)
    fine.on_step([(request, 28)], 0.0)
    assert fine.level(request) == 3                                       # log2(1 + 28/4)


def test_sjf_counts_the_tokens_already_generated():
    policy = POLICIES.build("sjf")
    nearly_done = _request("nearly-done", 4, max_tokens=10, arrival=0.0)
    nearly_done.num_computed_tokens = 4
    for _ in range(8):
        nearly_done.append_token(7, 0.0)                  # 2 tokens left to generate
    fresh = _request("fresh", 4, max_tokens=5, arrival=1.0)
    fresh.num_computed_tokens = 4                          # 5 left
    assert policy.priority(nearly_done, 0.0) < policy.priority(fresh, 0.0)


# -- the chunk boundary after a recompute, on the real model -------------------------------------------------------

def test_chunked_recompute_after_preemption_matches_transformers(llm, parity_prompts, hf_greedy):
    """Preempted requests come back with prompt + output to recompute in several chunks: only the chunk that
    reaches the newest token may sample. Checked against transformers' greedy tokens, not our own baseline."""
    order = sorted(range(len(parity_prompts)), key=lambda i: len(parity_prompts[i]))[:10]
    block_size = 4
    longest = max(len(parity_prompts[i]) for i in order)
    engine = LLM(block_size=block_size, num_kv_blocks=-(-(longest + 24) // block_size) + 2, max_model_len=1024,
                 max_num_batched_tokens=16)
    requests = [engine.engine.make_request(parity_prompts[i], SamplingParams(temperature=0, max_tokens=24))
                for i in order]
    for r in requests:
        engine.engine.add_request(r)
    chunked_recomputes = 0
    while engine.engine.has_unfinished():
        out_before = {id(r): (r.num_computed_tokens, r.num_output_tokens) for r in requests}
        engine.engine.step()
        chunked_recomputes += sum(1 for r in requests if out_before[id(r)][1] > 0
                                  and out_before[id(r)][0] == 0 and 0 < r.num_computed_tokens < r.num_tokens - 1)
    assert [r.output_token_ids for r in requests] == [hf_greedy[i] for i in order]
    assert sum(r.num_preemptions for r in requests) >= 3 and chunked_recomputes >= 1
