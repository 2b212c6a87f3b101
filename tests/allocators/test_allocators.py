"""Block allocators on their own: accounting, sharing and eviction (no model needed)."""

from __future__ import annotations

import pytest

from helpers import bare_scheduler, block_tokens, make_request, run_step
from nanovllm import ALLOCATORS, POLICIES, Request, SamplingParams, register_allocator


@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_allocate_and_free_return_every_block(name):
    allocator = ALLOCATORS.get(name)(num_blocks=32, block_size=4)
    requests = [make_request(f"r{i}", list(range(10 + i)), max_tokens=4) for i in range(3)]
    for r in requests:
        assert allocator.can_allocate(r, r.num_tokens)
        allocator.allocate(r, r.num_tokens)
        r.num_computed_tokens = r.num_tokens
        allocator.on_tokens_computed(r)
        assert len(r.block_table) >= allocator.blocks_for(r.num_tokens)
    held = [b for r in requests for b in r.block_table]
    assert len(held) == len(set(held)), "a block was handed to two requests"
    assert allocator.num_used_blocks() == len(held)
    for r in requests:
        allocator.free(r)
        assert r.block_table == []
    assert allocator.num_free_blocks() == 32 and allocator.usage() == 0.0


def test_paged_grows_on_demand_and_refuses_when_full():
    allocator = ALLOCATORS.get("paged")(num_blocks=3, block_size=4)
    r = make_request("a", [1, 2, 3, 4, 5], max_tokens=8)
    allocator.allocate(r, 5)
    assert len(r.block_table) == 2
    r.num_computed_tokens = 5
    assert allocator.num_new_blocks(r, 3) == 0 and allocator.num_new_blocks(r, 4) == 1
    allocator.allocate(r, 4)
    r.num_computed_tokens = 9                              # 3 blocks hold 12 slots: 4 more need a 4th block
    assert allocator.num_free_blocks() == 0 and not allocator.can_allocate(r, 4)
    with pytest.raises(MemoryError):
        allocator.allocate(r, 4)


def test_prefix_cache_shares_full_blocks_and_evicts_lru():
    allocator = ALLOCATORS.get("prefix")(num_blocks=8, block_size=4)
    shared = list(range(100, 108))                       # two full blocks
    a = make_request("a", shared + [1, 2, 3], max_tokens=8)
    assert allocator.match_prefix(a) == 0
    allocator.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    allocator.on_tokens_computed(a)
    b = make_request("b", shared + [9, 9], max_tokens=8)
    assert allocator.match_prefix(b) == 8                  # both shared blocks hit
    assert b.block_table == a.block_table[:2]
    b.num_computed_tokens = 8
    allocator.allocate(b, 2)
    assert allocator.num_used_blocks() == 4               # 3 for a, 1 new for b
    allocator.free(a)
    allocator.free(b)
    assert allocator.num_free_blocks() == 8 and allocator.num_cached_blocks() == 2
    # A request that matches nothing still gets blocks: fresh ones first, then cached ones evicted LRU.
    c = make_request("c", list(range(28)), max_tokens=8)
    allocator.allocate(c, 28)
    assert allocator.num_cached_blocks() == 1
    # Tails are evicted before heads: the shared head block survives, the second one was recycled.
    d = make_request("d", shared + [5], max_tokens=8)
    assert allocator.match_prefix(d) == 4
    allocator.free(d)
    allocator.free(c)
    # The head block survived c's evictions (tails go first), so e hits it. (e's second block could not count
    # either way: one token is always left to compute.)
    e = make_request("e", shared, max_tokens=8)
    assert allocator.match_prefix(e) == 4
    # Never the whole request: one token is always left to compute, so a prompt that is exactly the cached
    # head block matches nothing.
    f = make_request("f", shared[:4], max_tokens=8)
    assert allocator.match_prefix(f) == 0


def test_contiguous_reserves_prompt_plus_max_tokens_in_one_run():
    allocator = ALLOCATORS.get("contiguous")(num_blocks=10, block_size=4)
    a = make_request("a", list(range(6)), max_tokens=6)        # 12 tokens -> 3 blocks reserved up front
    allocator.allocate(a, 6)
    assert a.block_table == [0, 1, 2]
    b = make_request("b", list(range(10)), max_tokens=10)      # 5 blocks
    allocator.allocate(b, 10)
    assert b.block_table == [3, 4, 5, 6, 7]
    allocator.free(a)
    # 5 blocks are free (0-2 and 8-9) but no run of 4: external fragmentation.
    c = make_request("c", list(range(8)), max_tokens=8)
    assert allocator.num_free_blocks() == 5 and not allocator.can_allocate(c, 8)


# -- prefix caches through the scheduler, and the allocators' edges ----------------------------------------------------

@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_prefix_cache_never_matches_a_whole_prompt_and_takes_hit_blocks_out_of_the_free_pool(allocator):
    scheduler = bare_scheduler("fcfs", allocator, num_blocks=16)
    first = make_request("first", 8, max_tokens=1)          # exactly two full blocks
    scheduler.add(first, 0.0)
    run_step(scheduler, 0.0)
    assert first.is_finished
    allocator = scheduler.allocator
    assert allocator.num_free_blocks() == 16 and allocator.num_cached_blocks() == 2
    twin = make_request("twin", 8, max_tokens=1)
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
        owner = make_request(rid, 5, start=start)
        cache.allocate(owner, 5)
        owner.num_computed_tokens = 5
        cache.on_tokens_computed(owner)
        cache.free(owner)
    twin = make_request("twin", 5, start=1)
    twin.num_computed_tokens = cache.match_prefix(twin)
    assert twin.num_computed_tokens == 4
    cache.allocate(twin, 1)
    other = make_request("other", 8, start=21)
    assert cache.num_free_blocks() == 2                    # one never-used block and C: A is held
    cache.allocate(other, 8)
    assert not set(twin.block_table) & set(other.block_table)
    assert cache.cached_prefix_len(make_request("again", 5, start=1)) == 4     # A's content survived
    assert cache.cached_prefix_len(make_request("again-c", 5, start=11)) == 0  # C was the one evicted


def test_contiguous_reservation_fits_exactly_and_never_grows():
    cache = ALLOCATORS.get("contiguous")(4, 4)
    request = make_request("r", prompt=8, max_tokens=8)           # 16 tokens: all 4 blocks
    assert cache.can_allocate(request, 8)
    assert not cache.can_allocate(request, 8, reserve=1)
    small = make_request("small", prompt=4, max_tokens=8)          # 3 blocks
    assert not cache.can_allocate(small, 4, reserve=2) and cache.can_allocate(small, 4, reserve=1)
    cache.allocate(small, 4)
    small.num_computed_tokens = 12
    assert cache.num_free_blocks() == 1 and not cache.can_allocate(small, 4)   # past its reservation: no
    assert cache.can_allocate(small, 0)
    with pytest.raises(MemoryError):
        cache.allocate(small, 4)


def test_contiguous_allocation_marks_only_its_own_run():
    cache = ALLOCATORS.get("contiguous")(4, 4)
    a, b = make_request("a", prompt=2, max_tokens=2), make_request("b", prompt=2, max_tokens=2)   # one block each
    d = make_request("d", prompt=4, max_tokens=4)                                             # two blocks
    cache.allocate(a, 2)
    cache.allocate(b, 2)
    cache.free(a)                                                       # block 0 free, 1 taken, 2-3 free
    cache.allocate(d, 4)
    assert d.block_table == [2, 3]
    e = make_request("e", prompt=2, max_tokens=2)
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
    request = make_request("r", prompt=1)
    smallest.allocate(request, 1)
    assert smallest.usage() == 1.0
    for sizes in ((0, 4), (4, 0)):
        with pytest.raises(ValueError, match="num_blocks and block_size must be >= 1"):
            SurvivorTestPaged(*sizes)
    quarter = SurvivorTestPaged(4, 4)
    quarter.allocate(make_request("q", prompt=4), 4)
    assert quarter.usage() == 0.25


def _compute(cache, request: Request, upto: int) -> None:
    """The scheduler's report that ``request`` has computed its first ``upto`` tokens."""
    request.num_computed_tokens = upto
    cache.on_tokens_computed(request)


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_a_prefix_cache_shares_the_blocks_before_a_divergence_and_none_after_it(allocator):
    cache = ALLOCATORS.get(allocator)(16, 4)
    first = Request("first", block_tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0)
    cache.allocate(first, first.num_tokens)
    _compute(cache, first, first.num_tokens)
    cache.free(first)
    for blocks, shared in (((1, 5, 3), 4), ((1, 2, 6), 8), ((7, 2, 3), 0), ((1, 2, 3), 12)):
        probe = Request("probe", block_tokens(*blocks), SamplingParams(max_tokens=1), 0.0)
        assert cache.cached_prefix_len(probe) == shared
        assert cache.match_prefix(probe) == shared and len(probe.block_table) == shared // 4
        cache.free(probe)


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_a_prompt_prefilled_in_chunks_is_cached_block_by_block(allocator):
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=16, allocator=allocator, max_num_batched_tokens=4)
    scheduler.add(Request("chunked", block_tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0), 0.0)
    probe = Request("probe", block_tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0)
    for step, cached in enumerate((4, 8, 12)):   # each 4-token chunk completes one block
        run_step(scheduler, float(step))
        assert scheduler.allocator.cached_prefix_len(probe) == cached
    run_step(scheduler, 3.0)                       # the last prompt token; its one output token ends it
    assert not scheduler.has_unfinished() and scheduler.allocator.cached_prefix_len(probe) == 12


@pytest.mark.parametrize("publish", ["computed", "scheduled"])
def test_a_block_becomes_a_hit_when_its_step_is_planned_only_under_vllms_rule(publish):
    # Two prompts sharing two blocks arrive together. Under publish=scheduled (vLLM V1) the second, admitted in
    # the same step, finds the blocks the first is computing in it; under publish=computed it computes them too.
    scheduler = bare_scheduler(POLICIES.build("fcfs"), num_blocks=16,
                               allocator={"name": "prefix", "publish": publish})
    first = Request("first", block_tokens(1, 2), SamplingParams(max_tokens=2), 0.0)
    twin = Request("twin", block_tokens(1, 2), SamplingParams(max_tokens=2), 0.0)
    scheduler.add(first, 0.0)
    scheduler.add(twin, 0.0)
    out = scheduler.schedule(0.0)
    shared = 8 if publish == "scheduled" else 0
    assert [(r.request_id, n) for r, n in out.scheduled] == [("first", 9), ("twin", 9 - shared)]
    assert out.num_prefix_hit_tokens == shared and twin.num_cached_tokens == shared
    assert (set(twin.block_table) & set(first.block_table)) == (set(first.block_table[:2]) if shared else set())


def test_a_chunk_publishes_only_the_blocks_it_completes_and_never_a_proposal():
    cache = ALLOCATORS.build({"name": "prefix", "publish": "scheduled"}, 16, 4)
    request = Request("chunked", block_tokens(1, 2, 3), SamplingParams(max_tokens=4), 0.0)
    probe = Request("probe", block_tokens(1, 2, 3), SamplingParams(max_tokens=1), 0.0)
    cache.allocate(request, 6)
    cache.on_tokens_scheduled(request, 6)                 # a 6-token chunk completes one block, not two
    assert cache.cached_prefix_len(probe) == 4
    request.num_computed_tokens = 6
    cache.append(request, 7 + 3)                          # the rest of the prompt and three proposals past it
    cache.on_tokens_scheduled(request, 7 + 3)
    assert cache.cached_prefix_len(probe) == 12           # the prompt's three full blocks; the proposals' never
    assert len(cache.cached_block_keys()) == 3


def test_an_unknown_publish_rule_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"allocator.publish must be one of computed, scheduled.*'eventually'"):
        ALLOCATORS.build({"name": "prefix", "publish": "eventually"}, 16, 4)


def test_radix_a_request_that_lost_the_race_to_cache_a_block_keeps_its_copy_private_for_life():
    """Two requests with one prompt computed side by side: the second finds the first's block already cached and
    (module docstring) keeps its own copy private, publishing nothing further even once the first's copy has
    been evicted; its copy returns to the free list when it ends."""
    cache = ALLOCATORS.get("radix")(8, 4)
    first, second = (Request(rid, block_tokens(1, 2), SamplingParams(max_tokens=4), 0.0) for rid in ("first", "second"))
    for request in (first, second):
        cache.allocate(request, request.num_tokens)
    for request in (first, second):
        _compute(cache, request, request.num_tokens)
    cache.free(first)
    assert cache.num_cached_blocks() == 2
    filler = make_request("filler", prompt=20)          # needs every free block: the first's cached copy is evicted
    cache.allocate(filler, 20)
    assert cache.num_evictions == 2 and cache.num_cached_blocks() == 0
    second.append_token(7, 1.0)                      # the second decodes on
    cache.allocate(second, 1)
    _compute(cache, second, second.num_tokens)
    cache.free(filler)
    cache.free(second)
    assert cache.num_cached_blocks() == 0 and cache.num_free_blocks() == 8
    assert cache.cached_prefix_len(Request("probe", block_tokens(1, 2), SamplingParams(max_tokens=1), 0.0)) == 0


@pytest.mark.parametrize("allocator", ["prefix", "radix"])
def test_cached_block_keys_are_what_a_prefix_lookup_follows(allocator):
    """What a real cluster's driver mirrors: the keys of the cached blocks, chained as ``prefix_block_keys`` hashes a
    prompt, so walking them gives ``cached_prefix_len``; evicted blocks leave the set (paged caches nothing)."""
    from nanovllm.allocator import prefix_block_keys

    assert ALLOCATORS.get("paged")(num_blocks=8, block_size=4).cached_block_keys() is None
    cache = ALLOCATORS.get(allocator)(num_blocks=4, block_size=4)
    a = make_request("a", list(range(100, 111)), max_tokens=1)   # 11 tokens: two full blocks cached
    cache.allocate(a, a.num_tokens)
    _compute(cache, a, a.num_tokens)
    keys = cache.cached_block_keys()
    probe = make_request("p", list(range(100, 108)) + [7, 7, 7], max_tokens=1)
    walked = 0
    for key in prefix_block_keys(probe.token_ids, 4):
        if key not in keys:
            break
        walked += 4
    assert keys == set(prefix_block_keys(a.token_ids, 4)[:2]) and walked == cache.cached_prefix_len(probe) == 8
    cache.free(a)
    b = make_request("b", list(range(200, 216)), max_tokens=1)  # needs every block: the cached ones are evicted
    cache.allocate(b, b.num_tokens)
    assert not keys & cache.cached_block_keys()
