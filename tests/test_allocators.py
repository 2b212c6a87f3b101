"""Block allocators on their own: accounting, sharing and eviction (no model needed)."""

from __future__ import annotations

import pytest

from nanovllm import ALLOCATORS, Request, SamplingParams


def _request(rid: str, tokens: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)


@pytest.mark.parametrize("name", ALLOCATORS.names())
def test_allocate_and_free_return_every_block(name):
    allocator = ALLOCATORS.get(name)(num_blocks=32, block_size=4)
    requests = [_request(f"r{i}", list(range(10 + i)), max_tokens=4) for i in range(3)]
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
    r = _request("a", [1, 2, 3, 4, 5])
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
    a = _request("a", shared + [1, 2, 3])
    assert allocator.match_prefix(a) == 0
    allocator.allocate(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    allocator.on_tokens_computed(a)
    b = _request("b", shared + [9, 9])
    assert allocator.match_prefix(b) == 8                  # both shared blocks hit
    assert b.block_table == a.block_table[:2]
    b.num_computed_tokens = 8
    allocator.allocate(b, 2)
    assert allocator.num_used_blocks() == 4               # 3 for a, 1 new for b
    allocator.free(a)
    allocator.free(b)
    assert allocator.num_free_blocks() == 8 and allocator.num_cached_blocks() == 2
    # A request that matches nothing still gets blocks: fresh ones first, then cached ones evicted LRU.
    c = _request("c", list(range(28)))
    allocator.allocate(c, 28)
    assert allocator.num_cached_blocks() == 1
    # Tails are evicted before heads: the shared head block survives, the second one was recycled.
    d = _request("d", shared + [5])
    assert allocator.match_prefix(d) == 4
    allocator.free(d)
    allocator.free(c)
    # The head block survived c's evictions (tails go first), so e hits it. (e's second block could not count
    # either way: one token is always left to compute.)
    e = _request("e", shared)
    assert allocator.match_prefix(e) == 4
    # Never the whole request: one token is always left to compute, so a prompt that is exactly the cached
    # head block matches nothing.
    f = _request("f", shared[:4])
    assert allocator.match_prefix(f) == 0


def test_contiguous_reserves_prompt_plus_max_tokens_in_one_run():
    allocator = ALLOCATORS.get("contiguous")(num_blocks=10, block_size=4)
    a = _request("a", list(range(6)), max_tokens=6)        # 12 tokens -> 3 blocks reserved up front
    allocator.allocate(a, 6)
    assert a.block_table == [0, 1, 2]
    b = _request("b", list(range(10)), max_tokens=10)      # 5 blocks
    allocator.allocate(b, 10)
    assert b.block_table == [3, 4, 5, 6, 7]
    allocator.free(a)
    # 5 blocks are free (0-2 and 8-9) but no run of 4: external fragmentation.
    c = _request("c", list(range(8)), max_tokens=8)
    assert allocator.num_free_blocks() == 5 and not allocator.can_allocate(c, 8)
