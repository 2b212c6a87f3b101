"""Eviction choice of every caching allocator (``lru``, ``lfu``, ``fifo``), each shown by its defining effect,
and token-verified cache hits. Driven through the allocator interface as the scheduler drives it."""

from __future__ import annotations

import pytest

from nanovllm import ALLOCATORS, EvictionTracker, Request, SamplingParams

CACHING = ["prefix", "radix"]
BLOCK = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), arrival_time=0.0)


def _serve(allocator, rid: str, tokens: list[int]) -> int:
    """Admit, compute the whole prompt, finish: the request's full blocks stay cached. Returns its hit tokens."""
    request = _request(rid, tokens)
    hit = allocator.match_prefix(request)
    request.num_computed_tokens = hit
    allocator.allocate(request, request.num_tokens - hit)
    request.num_computed_tokens = request.num_tokens
    allocator.on_tokens_computed(request)
    allocator.free(request)
    return hit


def _prompt(base: int, blocks: int = 2) -> list[int]:
    # `blocks` full blocks plus one token, so every full block can be matched.
    return [base + i for i in range(blocks * BLOCK)] + [base + 999]


@pytest.mark.parametrize("allocator", CACHING)
def test_lfu_keeps_a_hot_prefix_through_a_scan_that_fifo_and_lru_let_evict_it(allocator):
    def hot_survives(eviction: str) -> bool:
        cache = ALLOCATORS.build({"name": allocator, "eviction": eviction}, 9, BLOCK)
        hot = _prompt(1000)
        _serve(cache, "hot0", hot)
        for i in range(1, 4):
            assert _serve(cache, f"hot{i}", hot) == 2 * BLOCK   # reused: a hot prefix
        for i in range(6):                                         # a scan of one-off prompts
            _serve(cache, f"scan{i}", _prompt(10_000 * (i + 1)))
        return cache.cached_prefix_len(_request("probe", hot)) == 2 * BLOCK

    assert hot_survives("lfu")
    assert not hot_survives("fifo")
    assert not hot_survives("lru")


@pytest.mark.parametrize("allocator", CACHING)
def test_lru_keeps_the_recently_reused_prefix_that_fifo_evicts_for_being_old(allocator):
    def survivors(eviction: str) -> tuple[bool, bool]:
        cache = ALLOCATORS.build({"name": allocator, "eviction": eviction}, 6, BLOCK)
        old, young = _prompt(1000), _prompt(2000)
        _serve(cache, "old", old)          # cached first...
        _serve(cache, "young", young)
        _serve(cache, "old-again", old)    # ...but used most recently
        # The newcomer needs 4 blocks; 2 are free (never used, or held only a partial block), so 2 cached go.
        _serve(cache, "newcomer", _prompt(3000, blocks=3))
        return (cache.cached_prefix_len(_request("p", old)) > 0, cache.cached_prefix_len(_request("q", young)) > 0)

    assert survivors("lru") == (True, False)
    assert survivors("fifo") == (False, True)


@pytest.mark.parametrize("allocator", CACHING)
def test_cached_prefix_len_only_looks(allocator):
    cache = ALLOCATORS.build({"name": allocator, "eviction": "lfu"}, 8, BLOCK)
    _serve(cache, "a", _prompt(1000))
    probe = _request("probe", _prompt(1000))
    free_before, cached_before = cache.num_free_blocks(), cache.num_cached_blocks()
    for _ in range(5):   # under lfu, a lookup that counted as a use would change what is evicted
        assert cache.cached_prefix_len(probe) == 2 * BLOCK
    assert probe.block_table == [] and cache.num_free_blocks() == free_before
    assert cache.num_cached_blocks() == cached_before
    assert cache.eviction._use[cache.eviction.victim()].uses == 1


@pytest.mark.parametrize("allocator", CACHING)
def test_evictions_are_counted(allocator):
    cache = ALLOCATORS.build(allocator, 4, BLOCK)
    _serve(cache, "a", _prompt(1000))
    assert cache.num_evictions == 0
    _serve(cache, "b", _prompt(2000))
    # b needs 3 blocks: the never-used one, the one that held a's partial last block, and one of a's prefix.
    assert cache.num_evictions == 1


def test_an_unknown_eviction_name_is_an_error_naming_the_field_and_the_choices():
    for allocator in CACHING:
        with pytest.raises(ValueError, match=r"allocator.eviction must be one of lru, lfu, fifo, got 'mru'"):
            ALLOCATORS.build({"name": allocator, "eviction": "mru"}, 8, BLOCK)
    with pytest.raises(ValueError, match="allocator.eviction"):
        EvictionTracker("random")


def test_a_hash_hit_is_checked_against_the_blocks_tokens():
    class CollidingPrefixCache(ALLOCATORS.get("prefix")):
        """Every block of a given position hashes alike: any two prompts collide."""

        def _block_hash(self, parent, token_ids, index):
            return hash((parent, index))

    cache = CollidingPrefixCache(8, BLOCK)
    _serve(cache, "a", _prompt(1000))
    other = _request("b", _prompt(2000))
    assert cache.cached_prefix_len(other) == 0
    assert cache.match_prefix(other) == 0 and other.block_table == []
    assert _serve(cache, "a-again", _prompt(1000)) == 2 * BLOCK
