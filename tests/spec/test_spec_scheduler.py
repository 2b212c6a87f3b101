"""The scheduler's side of speculative decoding, on a bare scheduler (the runner's verified tokens given by hand,
as ``helpers.run_step`` gives plain ones): proposals take budget and blocks without taking them from others,
and after verification only accepted tokens count as computed, the blocks of rejected ones go back, and a stop
inside an accepted run ends the request there."""

from __future__ import annotations

import pytest
from helpers import SAMPLED_TOKEN, bare_scheduler, make_request, run_step

from nanovllm.engine.scheduler import Scheduler


def _decoding(scheduler: Scheduler, *requests) -> None:
    """Admit ``requests`` and run steps until each has its first token (only its newest is uncomputed)."""
    for request in requests:
        scheduler.add(request, 0.0)
    while any(r.num_output_tokens == 0 for r in requests):
        run_step(scheduler, 0.0)
    assert all(r.num_uncomputed_tokens == 1 for r in requests)


def test_proposals_count_against_the_token_budget_after_every_other_requests_next_token():
    scheduler = bare_scheduler(max_num_batched_tokens=5, num_blocks=64)
    a, b = make_request("a", 6, max_tokens=20), make_request("b", 6, max_tokens=20)
    _decoding(scheduler, a, b)
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4], [1, 2, 3, 4]
    out = scheduler.schedule(1.0)
    assert dict((r.request_id, n) for r, n in out.scheduled) == {"a": 4, "b": 1}   # a: 1 + 3 proposals
    assert out.num_tokens == 5
    assert (a.spec_token_ids, b.spec_token_ids) == ([1, 2, 3], [])   # what did not fit is dropped
    assert len(a.block_table) * 4 >= a.num_tokens + 3                   # KV slots for every proposal


def test_only_accepted_tokens_stay_computed_and_blocks_of_rejected_ones_are_freed():
    scheduler = bare_scheduler(num_blocks=16, block_size=4)
    request = make_request("r", 7, max_tokens=20)        # 7 prompt tokens + 1 output = 8: two full blocks
    _decoding(scheduler, request)
    free_before = scheduler.allocator.num_free_blocks()
    request.spec_token_ids = [5, 6, 7, 8, 9]
    out = scheduler.schedule(1.0)
    assert out.scheduled == [(request, 6)]
    assert len(request.block_table) == 4                  # 8 tokens + 5 proposals need 4 blocks of 4
    # The target agreed with the first proposal only, then produced 42 instead of 6.
    scheduler.update_from_output(out, [[5, 42]], 1.0, max_model_len=10**9)
    assert request.output_token_ids[-3:] == [SAMPLED_TOKEN, 5, 42]
    assert request.num_computed_tokens == request.num_tokens - 1 == 9
    assert len(request.block_table) == 3                  # 10 tokens: the fourth block held only rejections
    assert scheduler.allocator.num_free_blocks() == free_before - 1
    assert (out.num_drafts, out.num_draft_tokens, out.num_accepted_tokens) == (1, 5, 1)
    assert (request.num_drafts, request.num_draft_tokens, request.num_accepted_tokens) == (1, 5, 1)
    # The next step computes only the newest token (42) on top of the kept K/V.
    request.spec_token_ids = []
    out = scheduler.schedule(2.0)
    assert out.scheduled == [(request, 1)]


@pytest.mark.parametrize("allocator", ["paged", "prefix", "radix"])
def test_every_allocator_gives_back_the_blocks_of_rejected_proposals(allocator):
    scheduler = bare_scheduler(allocator=allocator, num_blocks=16, block_size=4)
    request = make_request("r", 7, max_tokens=30)
    _decoding(scheduler, request)
    for step in range(4):
        request.spec_token_ids = [1] * 8                    # 8 proposals: 2 or 3 blocks more than the request holds
        out = scheduler.schedule(float(step))
        assert out.scheduled == [(request, 9)]
        scheduler.update_from_output(out, [[2]], float(step), max_model_len=10**9)   # all rejected
        assert len(request.block_table) == scheduler.allocator.blocks_for(request.num_tokens)
        assert scheduler.allocator.num_free_blocks() == 16 - len(request.block_table)
    scheduler.abort("r", 9.0)
    assert scheduler.allocator.num_free_blocks() == 16


def test_a_stop_token_inside_an_accepted_run_ends_the_request_there():
    scheduler = bare_scheduler()
    request = make_request("r", 5, max_tokens=20, stop_token_ids=[99])
    _decoding(scheduler, request)
    request.spec_token_ids = [3, 99, 4]
    out = scheduler.schedule(1.0)
    finished = scheduler.update_from_output(out, [[3, 99, 4, 5]], 1.0, max_model_len=10**9)
    assert finished == [request] and request.finish_reason == "stop"
    assert request.output_token_ids == [SAMPLED_TOKEN, 3, 99]
    assert scheduler.allocator.num_free_blocks() == scheduler.allocator.num_blocks


def test_max_tokens_inside_an_accepted_run_cuts_it():
    scheduler = bare_scheduler()
    request = make_request("r", 5, max_tokens=3)
    _decoding(scheduler, request)
    request.spec_token_ids = [3, 4, 5]
    out = scheduler.schedule(1.0)
    finished = scheduler.update_from_output(out, [[3, 4, 5, 6]], 1.0, max_model_len=10**9)
    assert finished == [request] and request.finish_reason == "length"
    assert request.output_token_ids == [SAMPLED_TOKEN, 3, 4]


def test_proposals_never_cost_a_preemption():
    # 2 blocks of 4: a (5 tokens + 1 output = 6) holds 2 blocks with 2 slots free; its proposals get those only.
    scheduler = bare_scheduler(num_blocks=2, block_size=4)
    request = make_request("a", 5, max_tokens=3)
    _decoding(scheduler, request)
    request.spec_token_ids = [1, 2, 3, 4]
    out = scheduler.schedule(1.0)
    assert out.scheduled == [(request, 3)] and not out.preempted
    assert request.spec_token_ids == [1, 2]
