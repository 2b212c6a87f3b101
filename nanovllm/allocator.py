"""The memory seam. A ``BlockAllocator`` owns the KV blocks: their ids, reference counts and free lists, and
(optionally) which blocks hold which prompt prefixes. It writes a request's ``block_table``; the model runner
reads it; nothing else touches the allocator's internals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

from nanovllm.registry import Registry
from nanovllm.request import Request


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block a caching allocator is about to reuse: its id (its K/V still intact), its
    ``prefix_block_key``, its tokens and how many requests used it (the one that computed it counts)."""

    block: int
    key: int
    tokens: tuple[int, ...]
    uses: int


class BlockAllocator(ABC):
    """Hands out ``num_blocks`` blocks of ``block_size`` token slots each."""

    registered_name: str = "custom"
    # Whether ``append`` of one decode token does anything only when the request needs a new block, and
    # ``on_tokens_computed`` only when a block has just filled: then a simulated engine may take a run of
    # decode steps at once, calling them at those steps alone (``nanovllm.engine.decode_stretch``).
    decode_stretches: ClassVar[bool] = False
    # Set by the engine when KV tiers are on: told of every cached block before its content is dropped.
    evict_listener: Callable[[EvictedBlock], None] | None = None

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_evictions = 0   # cached blocks whose content was dropped to make room (caching allocators)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks ``request`` lacks to hold its computed tokens plus ``num_new_tokens`` more."""
        needed = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(request.block_table))

    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (evictable cached blocks included)."""

    def can_allocate(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Could ``allocate(request, num_new_tokens)`` succeed while leaving ``reserve`` blocks free?"""
        return self.num_new_blocks(request, num_new_tokens) + reserve <= self.num_free_blocks()

    @abstractmethod
    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Admission: extend ``request.block_table`` to cover ``num_new_tokens`` more tokens (after any prefix
        match). Raises ``MemoryError`` if blocks are short (the scheduler checks ``can_allocate`` first)."""

    def append(self, request: Request, num_new_tokens: int) -> None:
        """Grow a running request by ``num_new_tokens`` (its next decode token or prefill chunk). Separate from
        ``allocate`` (admission) for allocators that treat growth differently; by default the same."""
        self.allocate(request, num_new_tokens)

    @abstractmethod
    def free(self, request: Request) -> None:
        """Release all of ``request``'s blocks and clear its block table."""

    def free_tail(self, request: Request, num_tokens: int) -> None:
        """Speculative decoding: ``request`` needs blocks for its first ``num_tokens`` tokens only; the blocks
        after those were taken for proposals the target rejected and hold nothing it keeps. Called after a
        verification step; an allocator that returns them here lets other requests use them at once. Default:
        keep them (the request's next tokens fill them)."""

    def _tail(self, request: Request, num_tokens: int) -> list[int]:
        """Cut ``request.block_table`` to the blocks holding its first ``num_tokens`` tokens; return the rest."""
        keep = self.blocks_for(num_tokens)
        tail = request.block_table[keep:]
        del request.block_table[keep:]
        return tail

    def match_prefix(self, request: Request) -> int:
        """Attach cached blocks holding a prefix of ``request``'s tokens; return how many tokens they cover
        (a multiple of ``block_size``, always fewer than the request's tokens). Default: no prefix cache."""
        return 0

    def cached_prefix_len(self, request: Request) -> int:
        """How many of ``request``'s tokens ``match_prefix`` would cover now, without attaching anything and
        without changing the cache's state (recency, hit counts): a pure lookup for policies (lpm). Default:
        no prefix cache."""
        return 0

    def on_tokens_scheduled(self, request: Request, num_new_tokens: int) -> None:
        """The scheduler gave ``request`` ``num_new_tokens`` more tokens in the step it is planning (their blocks
        are allocated; the step's forward writes their K/V before any attention reads the cache). A prefix cache
        that publishes blocks when they are scheduled (vLLM's rule) may publish the full blocks these tokens
        complete now, so a request admitted later in the same step or in the next one finds them. Default:
        nothing (blocks are published by ``on_tokens_computed``)."""

    def on_tokens_computed(self, request: Request) -> None:
        """``request.num_computed_tokens`` advanced; a prefix cache may now publish its full blocks."""

    def num_cached_blocks(self) -> int:
        """Free blocks still holding reusable content (a prefix cache's evictable blocks)."""
        return 0

    def cached_block_keys(self) -> set[int] | None:
        """The ``prefix_block_key`` of every full block a prefix lookup can match now (``cached_prefix_len``
        would follow them), or None for an allocator that does not say: what a real cluster's driver mirrors
        to answer ``ReplicaView.prefix_match_tokens`` without asking the replica's process. Default: None."""
        return None

    def _notify_evicted(self, block: int, key: int, tokens: tuple[int, ...], uses: int) -> None:
        """A caching allocator calls this as it evicts ``block`` (before anything overwrites it), so the KV
        tiers may keep a copy."""
        if self.evict_listener is not None:
            self.evict_listener(EvictedBlock(block, key, tokens, uses))

    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks()

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.num_used_blocks() / self.num_blocks


def prefix_block_key(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The key of a full block holding ``tokens`` after the blocks whose last key is ``parent`` (None: the first
    block). The same in every process: ints and tuples of ints hash alike everywhere (None's hash does not)."""
    return hash((0 if parent is None else parent, tokens))


def prefix_block_keys(token_ids: list[int], block_size: int) -> list[int]:
    """The keys of the full blocks of ``token_ids`` a prefix cache may match (never the block holding the last
    token: a step must compute at least one token), in order."""
    keys: list[int] = []
    parent: int | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = prefix_block_key(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        keys.append(parent)
    return keys


ALLOCATORS: Registry[BlockAllocator] = Registry(
    "allocator", base=BlockAllocator, builtin_packages=("allocators",), engine_args=("num_blocks", "block_size")
)


def register_allocator(name: str) -> Callable[[type[BlockAllocator]], type[BlockAllocator]]:
    """Class decorator registering a ``BlockAllocator`` subclass under ``name`` (``allocator.name=<name>``)."""
    return ALLOCATORS.register(name)
