"""Cache-aware routing with a load-balance guard, after SGLang's router (sgl-router's cache_aware policy):

* while the cluster is balanced, the request goes to the live replica whose prefix cache holds the longest
  prefix of its prompt, if that covers more than ``cache_threshold`` of the prompt; otherwise to the replica
  with the most free KV blocks (the most room to cache it);
* when it is not balanced -- the most and least loaded live replicas (outstanding requests) differ by more than
  ``balance_abs_threshold`` requests *and* by a factor over ``balance_rel_threshold`` -- it goes to the least
  loaded replica, whatever the caches hold, so a hot prefix cannot pile every request onto one replica.

SGLang keeps an approximate radix tree of what it routed per worker; here the router reads each replica's real
prefix cache through ``ReplicaView.prefix_match_tokens`` (no reference taken, no recency changed).

With KV tiers (``kv_offload``, docs/kv_tiers.md) and ``tier_aware`` (the default), the match that counts is the
replica's own (``prefix_match_local_tokens``: its pool, then its host and disk tiers), and among replicas the
one whose primary pool holds most of it wins: what a ``shared`` store holds every replica can load, so it is no
reason to send the request anywhere in particular, and the request then goes by load (most free blocks)."""

from __future__ import annotations

from typing import Sequence

from nanovllm import ReplicaView, Request, Router, live_replicas, register_router


@register_router("cache_aware")
class CacheAware(Router):
    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5, tier_aware: bool = True) -> None:
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"router.cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if not isinstance(balance_abs_threshold, int) or balance_abs_threshold < 0:
            raise ValueError(f"router.balance_abs_threshold must be an integer >= 0, got {balance_abs_threshold!r}")
        if not balance_rel_threshold >= 1:
            raise ValueError(f"router.balance_rel_threshold must be >= 1, got {balance_rel_threshold!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.tier_aware = tier_aware

    def imbalanced(self, alive: Sequence[ReplicaView]) -> bool:
        loads = [view.num_outstanding for view in alive]
        return (max(loads) - min(loads) > self.balance_abs_threshold
                and max(loads) > self.balance_rel_threshold * min(loads))

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        alive = live_replicas(replicas)
        if self.imbalanced(alive):
            return min(alive, key=lambda view: (view.num_outstanding, view.index)).index
        if self.tier_aware:
            best = max(alive, key=lambda view: (view.prefix_match_by_tier["primary"], view.prefix_match_local_tokens,
                                                -view.num_outstanding, -view.index))
            matched = best.prefix_match_local_tokens
        else:
            best = max(alive, key=lambda view: (view.prefix_match_tokens, -view.num_outstanding, -view.index))
            matched = best.prefix_match_tokens
        if matched > self.cache_threshold * request.num_prompt_tokens:
            return best.index
        return max(alive, key=lambda view: (view.num_free_blocks, -view.num_outstanding, -view.index)).index
