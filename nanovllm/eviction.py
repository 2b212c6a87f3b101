"""Which cached block a caching allocator drops when it needs room: ``lru``, ``lfu`` or ``fifo``.

An ``EvictionTracker`` keeps, per cached block, when its content was cached, when it was last used and how many
requests used it, and the set of blocks that may be evicted now (no request holds them; for a tree cache, only
leaves). Allocators tell it what happens; ``victim()`` names the block to drop:

* ``lru``: least recently used (released or matched longest ago) -- vLLM's and SGLang's default.
* ``lfu``: fewest uses (the request that cached it counts as one, each prefix hit adds one), ties by recency.
* ``fifo``: cached longest ago, however often or recently it was used since.

Choose it per allocator: ``allocator=prefix allocator.eviction=lfu`` or ``LLM(allocator={"name": "prefix",
"eviction": "lfu"})``. The order is a seam like the others: an ``EvictionPolicy`` subclass registered with
``@register_eviction("name")`` (a plugin file) gives the key the victim is the smallest of.
"""

from __future__ import annotations

import abc
import heapq
import itertools
from dataclasses import dataclass
from typing import Callable

from nanovllm.registry import Registry


@dataclass(slots=True)
class BlockUse:
    """What the tracker knows of one cached block, in ticks of its own clock (one per event)."""

    cached_at: int
    last_used: int
    uses: int = 1


class EvictionPolicy(abc.ABC):
    """The order a caching allocator evicts in: ``key`` of each evictable block, the smallest goes first. Asked by
    ``EvictionTracker.victim``, i.e. whenever the allocator needs a fresh block and none was never used."""

    registered_name: str = "custom"

    @abc.abstractmethod
    def key(self, use: BlockUse) -> tuple[int, ...]:
        """Sort key of a block with this use record (smaller: evicted sooner)."""


EVICTION_POLICIES: Registry[EvictionPolicy] = Registry("eviction policy", base=EvictionPolicy,
                                                       builtin_packages=("nanovllm.eviction",))


def register_eviction(name: str) -> Callable[[type[EvictionPolicy]], type[EvictionPolicy]]:
    """Class decorator registering an ``EvictionPolicy`` subclass under ``name`` (``allocator.eviction=<name>``)."""
    return EVICTION_POLICIES.register(name)


@register_eviction("lru")
class LeastRecentlyUsed(EvictionPolicy):
    """Released or matched longest ago."""

    def key(self, use: BlockUse) -> tuple[int, ...]:
        return (use.last_used,)


@register_eviction("lfu")
class LeastFrequentlyUsed(EvictionPolicy):
    """Fewest uses, ties by recency."""

    def key(self, use: BlockUse) -> tuple[int, ...]:
        return (use.uses, use.last_used)


@register_eviction("fifo")
class FirstInFirstOut(EvictionPolicy):
    """Cached longest ago."""

    def key(self, use: BlockUse) -> tuple[int, ...]:
        return (use.cached_at,)


class EvictionTracker:
    """Bookkeeping behind one caching allocator's eviction choice (see the module docstring)."""

    def __init__(self, policy: str = "lru") -> None:
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"allocator.eviction must be one of {', '.join(EVICTION_POLICIES.names())}, "
                             f"got {policy!r}")
        self.policy = policy
        self._order = EVICTION_POLICIES.build(policy)
        self._clock = itertools.count()
        self._use: dict[int, BlockUse] = {}
        self._candidates: set[int] = set()
        # The candidates by key, smallest first, found without scanning them all (a GPU-sized cache holds tens of
        # thousands): each candidate has an entry with its current key; entries made stale by a later change of
        # its key, or by it being pinned or forgotten, are dropped when they come up (``victim``).
        self._heap: list[tuple[tuple[int, ...], int]] = []

    def cached(self, block: int) -> None:
        """``block`` now holds reusable content (its creator is its first use)."""
        tick = next(self._clock)
        self._use[block] = BlockUse(cached_at=tick, last_used=tick)
        self._queue(block)

    def hit(self, block: int) -> None:
        """A request matched ``block`` as part of its prefix."""
        use = self._use[block]
        use.uses += 1
        use.last_used = next(self._clock)
        self._queue(block)

    def release(self, block: int, touch: bool = True) -> None:
        """``block`` may be evicted now (no request holds it); with ``touch`` its last use ends now (a tree
        cache passes False for a node that became a leaf because its children were evicted)."""
        if touch:
            self._use[block].last_used = next(self._clock)
        self._candidates.add(block)
        self._queue(block)

    def _queue(self, block: int) -> None:
        """An entry for candidate ``block`` at its current key (its older entries are stale now)."""
        if block in self._candidates:
            heapq.heappush(self._heap, (self._order.key(self._use[block]), block))
            if len(self._heap) > 2 * len(self._candidates) + 64:   # mostly stale: rebuild from the candidates
                self._heap = [(self._order.key(self._use[b]), b) for b in self._candidates]
                heapq.heapify(self._heap)

    def pin(self, block: int) -> None:
        """``block`` may not be evicted now (a request holds it, or a tree node grew a child under it)."""
        self._candidates.discard(block)

    def forget(self, block: int) -> None:
        """``block``'s content is gone (evicted)."""
        self._candidates.discard(block)
        del self._use[block]

    def uses(self, block: int) -> int:
        """How many requests used ``block`` (its creator counts as one)."""
        return self._use[block].uses

    def is_cached(self, block: int) -> bool:
        return block in self._use

    def victim(self) -> int:
        """The evictable block to drop first under this policy (``KeyError`` when none is evictable)."""
        if not self._candidates:
            raise KeyError("no evictable cached block")
        heap = self._heap
        while True:
            key, block = heap[0]
            if block in self._candidates and self._order.key(self._use[block]) == key:
                return block   # (left in the heap: the allocator forgets or pins it next, which stales it)
            heapq.heappop(heap)

    def num_evictable(self) -> int:
        return len(self._candidates)
