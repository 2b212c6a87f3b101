"""Longest prefix match first (SGLang's ``lpm`` schedule policy; Zheng et al., "SGLang: Efficient Execution of
Structured Language Model Programs", NeurIPS 2024, section 3: cache-aware scheduling).

Waiting requests with more of their prompt already in the prefix cache go first: they cost less to prefill,
and running them while their prefix is resident keeps it from being evicted by others. The cached length comes
from ``Policy.cached_prefix_len`` (a pure lookup). Plain lpm starves requests that share nothing with the cache
(SGLang users report 20-60 s TTFT tails, sglang#31954), so a request that has waited longer than ``max_wait``
goes ahead of every non-starving one, oldest first: no request waits past the bound while seats free up.

The cached length changes as the cache does, so the waiting queue is re-sorted at every step (``waiting_key =
"dynamic"``: exact, O(n log n) per step). ``waiting_window=W`` bounds that cost the way SGLang does past 128
waiting requests: only the W longest-waiting requests are ranked by prefix each step, the rest wait behind them
in arrival order (an approximation: exact while at most W wait; O(W log n) per step)."""

from __future__ import annotations

import math

from nanovllm import Policy, Request, RequestStatus, register_policy


@register_policy("lpm")
class LongestPrefixMatch(Policy):
    waiting_key = "dynamic"   # the prefix cache changes every step

    def __init__(self, max_wait: float = 10.0, waiting_window: int | None = None) -> None:
        if not (isinstance(max_wait, (int, float)) and max_wait > 0) or math.isnan(max_wait):
            raise ValueError(f"scheduler.max_wait must be > 0 seconds (inf: no aging bound), got {max_wait!r}")
        self.max_wait = max_wait
        if waiting_window is not None and (isinstance(waiting_window, bool) or not isinstance(waiting_window, int)
                                           or waiting_window < 1):
            raise ValueError(f"scheduler.waiting_window must be an integer >= 1 or null, got {waiting_window!r}")
        self.waiting_window = waiting_window

    def priority(self, request: Request, now: float):
        if request.status is RequestStatus.RUNNING:
            # The running batch keeps arrival order (and the latest arrival is preempted first).
            return (1, 0, request.arrival_time)
        if now - request.arrival_time > self.max_wait:
            return (0, 0, request.arrival_time)
        return (1, -self.cached_prefix_len(request), request.arrival_time)
