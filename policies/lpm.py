"""Longest prefix match first (SGLang's ``lpm`` schedule policy; Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", NeurIPS 2024, section 3: cache-aware scheduling).

Waiting requests with more of their prompt already in the prefix cache go first: they cost less to prefill,
and running them while their prefix is resident keeps it from being evicted by others. The cached length comes
from ``Policy.cached_prefix_len`` (a pure lookup). Plain lpm starves requests that share nothing with the cache
(SGLang users report 20-60 s TTFT tails, sglang#31954), so a request that has waited longer than ``max_wait``
goes ahead of every non-starving one, oldest first: no request waits past the bound while seats free up."""

from __future__ import annotations

import math

from nanovllm import Policy, Request, RequestStatus, register_policy


@register_policy("lpm")
class LongestPrefixMatch(Policy):
    def __init__(self, max_wait: float = 10.0) -> None:
        if not (isinstance(max_wait, (int, float)) and max_wait > 0) or math.isnan(max_wait):
            raise ValueError(f"scheduler.max_wait must be > 0 seconds (inf: no aging bound), got {max_wait!r}")
        self.max_wait = max_wait

    def priority(self, request: Request, now: float):
        if request.status is RequestStatus.RUNNING:
            # The running batch keeps arrival order (and the latest arrival is preempted first).
            return (1, 0, request.arrival_time)
        if now - request.arrival_time > self.max_wait:
            return (0, 0, request.arrival_time)
        return (1, -self.cached_prefix_len(request), request.arrival_time)
