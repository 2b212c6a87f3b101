"""Property tests for every registered allocator (a new one is tested here for free): random sequences of
admit (prefix match + allocate) / grow (prefill chunks and decodes) / free, over prompts that share prefixes,
with the invariants checked after every operation:

* a block is held twice only as a shared cached prefix: at the same position in each table, under identical
  tokens, and never written while shared;
* free + held = total (``num_free_blocks`` counts exactly the blocks no live request holds);
* a matched prefix's blocks hold exactly the request's tokens (the tokens written into them by whoever
  computed them), and the side-effect-free ``cached_prefix_len`` predicts ``match_prefix``;
* after every request is freed, every block is free.

Each allocator runs ``EXAMPLES * OPS_PER_EXAMPLE`` (>= 10,000) operations."""

from __future__ import annotations

from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import ALLOCATORS, Request, SamplingParams

EXAMPLES = 100
OPS_PER_EXAMPLE = 100


class _World:
    """The allocator under test, the live requests and what each written block holds."""

    def __init__(self, allocator, block_size: int) -> None:
        self.allocator = allocator
        self.bs = block_size
        self.live: list[Request] = []
        self.content: dict[int, tuple[int, ...]] = {}   # block -> the tokens computed into it (full blocks)
        self.count = 0

    def chunk(self, request: Request, index: int) -> tuple[int, ...]:
        return tuple(request.token_ids[index * self.bs:(index + 1) * self.bs])

    def admit(self, tokens: list[int], max_tokens: int, first_chunk: int) -> None:
        self.count += 1
        request = Request(f"r{self.count}", tokens, SamplingParams(max_tokens=max_tokens), arrival_time=0.0)
        free_before = self.allocator.num_free_blocks()
        predicted = self.allocator.cached_prefix_len(request)
        assert self.allocator.num_free_blocks() == free_before, "cached_prefix_len changed the cache"
        hit = self.allocator.match_prefix(request)
        assert hit == predicted, "cached_prefix_len disagrees with match_prefix"
        assert hit % self.bs == 0 and hit < request.num_tokens
        assert len(request.block_table) == hit // self.bs
        for i, block in enumerate(request.block_table):
            assert self.content.get(block) == self.chunk(request, i), "a matched block holds other tokens"
        request.num_computed_tokens = request.num_cached_tokens = hit
        num_new = min(first_chunk, request.num_uncomputed_tokens)
        if self.allocator.can_allocate(request, num_new):
            self.allocator.allocate(request, num_new)
            self.live.append(request)
            self.compute(request, num_new)
        else:
            self.allocator.free(request)
            assert request.block_table == []

    def grow(self, index: int, chunk: int, token: int) -> None:
        request = self.live[index % len(self.live)]
        if request.num_uncomputed_tokens == 0:
            if request.num_output_tokens >= request.max_tokens:
                return
            request.append_token(token, 0.0)
        num_new = min(chunk, request.num_uncomputed_tokens)
        if not self.allocator.can_allocate(request, num_new):
            return
        self.allocator.append(request, num_new)
        self.compute(request, num_new)

    def compute(self, request: Request, num_new: int) -> None:
        """Write the K/V of ``num_new`` tokens: the blocks written must be this request's alone."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
        assert len(request.block_table) * self.bs >= end, "allocate did not cover the tokens to compute"
        written = {request.block_table[pos // self.bs] for pos in range(start, end)}
        others = {b for r in self.live if r is not request for b in r.block_table}
        assert not written & others, "a shared block was written"
        request.num_computed_tokens = end
        for i in range(start // self.bs, end // self.bs):
            self.content[request.block_table[i]] = self.chunk(request, i)
        for block in written:   # a partly written block holds no complete, matchable content
            if block not in {request.block_table[i] for i in range(end // self.bs)}:
                self.content.pop(block, None)
        self.allocator.on_tokens_computed(request)

    def free(self, index: int) -> None:
        request = self.live.pop(index % len(self.live))
        self.allocator.free(request)
        assert request.block_table == []

    def check(self) -> None:
        allocator = self.allocator
        holders: dict[int, list[tuple[Request, int]]] = defaultdict(list)
        for request in self.live:
            table = request.block_table
            assert len(table) == len(set(table)), "a block appears twice in one table"
            for i, block in enumerate(table):
                assert 0 <= block < allocator.num_blocks
                holders[block].append((request, i))
        for block, held in holders.items():
            if len(held) < 2:
                continue
            (first, index), *rest = held
            assert all(i == index for _, i in rest), "a shared block sits at different positions"
            prefix = first.token_ids[:(index + 1) * self.bs]
            assert all(r.token_ids[:(index + 1) * self.bs] == prefix for r, _ in rest), \
                "a block is shared by requests whose prefixes differ"
            assert self.content.get(block) == self.chunk(first, index)
        assert allocator.num_free_blocks() == allocator.num_blocks - len(holders), "free + held != total"
        assert 0 <= allocator.num_cached_blocks() <= allocator.num_free_blocks()


@st.composite
def _scenario(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(6, 40))
    vocab = draw(st.integers(2, 6))    # a tiny vocabulary makes equal prefixes (and hash work) common
    bases = draw(st.lists(st.lists(st.integers(0, vocab), min_size=1, max_size=12), min_size=1, max_size=3))
    ops = draw(st.lists(st.tuples(st.sampled_from(["admit", "grow", "grow", "free"]),
                                  st.integers(0, 1000), st.integers(1, 9), st.integers(0, vocab),
                                  st.lists(st.integers(0, vocab), max_size=6)),
                        min_size=OPS_PER_EXAMPLE, max_size=OPS_PER_EXAMPLE))
    return block_size, num_blocks, bases, ops


@pytest.mark.parametrize("name", ALLOCATORS.names())
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=_scenario())
def test_allocator_invariants_hold_under_random_operations(name, scenario):
    block_size, num_blocks, bases, ops = scenario
    world = _World(ALLOCATORS.build(name, num_blocks, block_size), block_size)
    for op, pick, size, token, suffix in ops:
        if op == "admit":
            base = bases[pick % len(bases)]
            tokens = base[:max(1, pick % (len(base) + 1))] + suffix
            max_tokens = 1 + pick % 6
            # Whole request must fit the cache (the engine's validation guarantees it).
            if world.allocator.blocks_for(len(tokens) + max_tokens) <= num_blocks:
                world.admit(tokens, max_tokens, size)
        elif op == "grow" and world.live:
            world.grow(pick, size, token)
        elif op == "free" and world.live:
            world.free(pick)
        world.check()
    while world.live:
        world.free(0)
        world.check()
    assert world.allocator.num_free_blocks() == num_blocks and world.allocator.num_used_blocks() == 0
