"""The offload-policy seam: which K/V blocks go down a tier, which come back early, and whether a tier's
evicted blocks go further down. Mechanics (reading and writing blocks, capacity, checksums) are the engine's
and the tiers'; an ``OffloadPolicy`` only decides.

When the engine asks what:

* ``on_evict(block)``: the primary pool is about to reuse a cached block (its content is still intact): True
  writes it to the top tier first.
* ``on_prefill(request)``: ``request``'s prompt was just fully computed: True writes its full prompt blocks to
  the top tier now (write-through), before anyone evicts them.
* ``demote(tier, key)``: a tier evicts an entry: True writes it to the tier below (when there is one).
* ``prefetch``: how many waiting requests, from the head of the queue, have their blocks in lower tiers
  promoted to the top tier at the start of each step, before they are admitted (admission then loads from
  the fastest tier); ``should_prefetch(request)`` may skip some.

Built-ins: ``evict`` (offload on eviction from the primary pool, vLLM's CPU offloading and SGLang HiCache's
default), ``write_through`` (every prefill's blocks go down at once), ``reuse`` (only blocks used by at least
``k`` requests go down, so one-off prompts never take tier space). Each takes ``prefetch=N`` and ``demote``.
Eviction inside each tier is the tier's ``eviction`` option (the ``lru``/``lfu``/``fifo`` registry).
"""

from __future__ import annotations

from typing import Callable

from nanovllm.allocator import EvictedBlock
from nanovllm.registry import Registry
from nanovllm.request import Request


class OffloadPolicy:
    """Decides what moves between the primary pool and the tiers (see the module docstring)."""

    registered_name: str = "custom"

    def __init__(self, prefetch: int = 0, demote: bool = True) -> None:
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ValueError(f"kv_offload.policy: prefetch must be an integer >= 0, got {prefetch!r}")
        self.prefetch = prefetch
        self.demote_evicted = demote

    def on_evict(self, block: EvictedBlock) -> bool:
        """The primary pool evicts ``block``: write it to the top tier? Default: no."""
        return False

    def on_prefill(self, request: Request) -> bool:
        """``request``'s prompt is fully computed: write its full prompt blocks to the top tier now? Default: no."""
        return False

    def demote(self, tier: str, key: int) -> bool:
        """Tier ``tier`` evicts the entry ``key``: write it to the tier below? Default: the ``demote`` option."""
        return self.demote_evicted

    def should_prefetch(self, request: Request) -> bool:
        """Promote ``request``'s blocks now (it is among the first ``prefetch`` waiting)? Default: yes."""
        return True


OFFLOAD_POLICIES: Registry[OffloadPolicy] = Registry("offload policy", base=OffloadPolicy,
                                                     builtin_packages=("nanovllm.kv_tiers.offload",))


def register_offload_policy(name: str) -> Callable[[type[OffloadPolicy]], type[OffloadPolicy]]:
    """Class decorator registering an ``OffloadPolicy`` subclass under ``name`` (``kv_offload.policy=<name>``)."""
    return OFFLOAD_POLICIES.register(name)


@register_offload_policy("evict")
class OffloadOnEvict(OffloadPolicy):
    """A cached block goes down when the primary pool evicts it (and only then: no copy while it is cached)."""

    def on_evict(self, block: EvictedBlock) -> bool:
        return True


@register_offload_policy("write_through")
class WriteThrough(OffloadPolicy):
    """Every prompt's full blocks go down as soon as its prefill completes, so an eviction costs no copy."""

    def on_prefill(self, request: Request) -> bool:
        return True


@register_offload_policy("reuse")
class ReusedPrefixes(OffloadPolicy):
    """Only blocks that at least ``k`` requests used (the one that computed it counts) go down, on eviction."""

    def __init__(self, k: int = 2, prefetch: int = 0, demote: bool = True) -> None:
        super().__init__(prefetch, demote)
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"kv_offload.policy: reuse needs k >= 1, got {k!r}")
        self.k = k

    def on_evict(self, block: EvictedBlock) -> bool:
        return block.uses >= self.k
