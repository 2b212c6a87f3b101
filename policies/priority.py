"""Priority scheduling with vLLM's semantics: a lower ``priority`` value runs first, ties by arrival."""

from __future__ import annotations

from typing import Sequence

from nanovllm import Policy, Request, register_policy


@register_policy("priority")
class PriorityPolicy(Policy):
    """Admits by (priority, arrival). When memory runs out the victim is the lowest-priority (largest value),
    latest-arrived running request. With ``preempt_for_priority`` (default on), a waiting request of strictly
    higher priority that cannot be admitted preempts the lowest-priority running request."""

    waiting_key = "static"   # (priority, arrival): fixed for as long as a request waits
    decode_stretches = True  # and while it runs: the running batch's order never changes

    def __init__(self, preempt_for_priority: bool = True) -> None:
        self.preempt_for_priority = preempt_for_priority

    def priority(self, request: Request, now: float):
        return (request.priority, request.arrival_time)

    def preempt_for(self, waiting: Request, running: Sequence[Request], now: float) -> Request | None:
        if not self.preempt_for_priority or not running:
            return None
        victim = max(running, key=lambda r: (r.priority, r.arrival_time))
        return victim if victim.priority > waiting.priority else None
