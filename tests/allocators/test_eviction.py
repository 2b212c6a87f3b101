"""Eviction choice of every caching allocator (``lru``, ``lfu``, ``fifo``), each shown by its defining effect,
and token-verified cache hits. Driven through the allocator interface as the scheduler drives it."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from helpers import make_request
from nanovllm import ALLOCATORS, EvictionTracker

CACHING = ["prefix", "radix"]
BLOCK = 4


def _serve(allocator, rid: str, tokens: list[int]) -> int:
    """Admit, compute the whole prompt, finish: the request's full blocks stay cached. Returns its hit tokens."""
    request = make_request(rid, tokens)
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
        return cache.cached_prefix_len(make_request("probe", hot)) == 2 * BLOCK

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
        return (cache.cached_prefix_len(make_request("p", old)) > 0, cache.cached_prefix_len(make_request("q", young)) > 0)

    assert survivors("lru") == (True, False)
    assert survivors("fifo") == (False, True)


@pytest.mark.parametrize("allocator", CACHING)
def test_cached_prefix_len_only_looks(allocator):
    cache = ALLOCATORS.build({"name": allocator, "eviction": "lfu"}, 8, BLOCK)
    _serve(cache, "a", _prompt(1000))
    probe = make_request("probe", _prompt(1000))
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
        with pytest.raises(ValueError, match=r"allocator.eviction must be one of fifo, lfu, lru, got 'mru'"):
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
    other = make_request("b", _prompt(2000))
    assert cache.cached_prefix_len(other) == 0
    assert cache.match_prefix(other) == 0 and other.block_table == []
    assert _serve(cache, "a-again", _prompt(1000)) == 2 * BLOCK


# -- the eviction tracker on its own -----------------------------------------------------------------------------------

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


@settings(max_examples=150, deadline=None)
# A block made evictable, held again (its key moves on) and released again: its first, now stale, entry must not
# make it the victim ahead of a block whose key is smaller than its current one.
@example(policy="lru", ops=[("cached", 0), ("cached", 1), ("release", 0), ("pin", 0), ("release", 1),
                            ("release", 0), ("victim", 0)])
@given(policy=st.sampled_from(["lru", "lfu", "fifo"]),
       ops=st.lists(st.tuples(st.sampled_from(["cached", "hit", "release", "release_untouched", "pin", "forget",
                                               "victim"]), st.integers(0, 4)), max_size=120))
def test_the_victim_is_the_smallest_key_among_the_evictable_blocks_after_any_events(policy, ops):
    """``EvictionTracker.victim`` keeps its candidates in a heap rather than scanning them: after any sequence of
    events its victim is the evictable block with the smallest key, as a scan of all of them finds it."""
    tracker = EvictionTracker(policy)
    held: set[int] = set()        # cached blocks a request holds (not evictable)
    evictable: set[int] = set()
    for op, block in ops:
        cached = tracker.is_cached(block)
        if op == "cached" and not cached:
            tracker.cached(block)
            held.add(block)
        elif op == "hit" and block in held:
            tracker.hit(block)
        elif op in ("release", "release_untouched") and block in held:
            tracker.release(block, touch=op == "release")
            held.discard(block)
            evictable.add(block)
        elif op == "pin" and block in evictable:
            tracker.pin(block)
            evictable.discard(block)
            held.add(block)
            tracker.hit(block)
        elif op == "forget" and block in evictable:
            tracker.forget(block)
            evictable.discard(block)
        elif op == "victim" and evictable:
            order = tracker._order
            assert tracker.victim() == min(evictable, key=lambda b: order.key(tracker._use[b]))
        assert tracker.num_evictable() == len(evictable)
    if not evictable:
        with pytest.raises(KeyError):
            tracker.victim()
