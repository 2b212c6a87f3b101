"""Multi-level feedback queue with skip-join (after FastServe, Wu et al. 2023): without knowing output lengths,
approximate shortest-remaining-first by demoting requests as they consume service.

A request enters the level its prompt alone would reach (skip-join: long prompts do not block short ones at
the top), and drops one level each time its service (prompt + generated tokens computed) doubles past
``quantum``. Lower levels run first; within a level, arrival order. With ``preempt`` on, a waiting request
in a strictly higher level may preempt the lowest-level running one."""

from __future__ import annotations

import math
from typing import Sequence

from nanovllm import Policy, Request, register_policy


@register_policy("mlfq")
class MultiLevelFeedbackQueue(Policy):
    # A level changes only with service, and a waiting request is not served: fixed while it waits.
    waiting_key = "static"

    def __init__(self, quantum: int = 64, num_levels: int = 8, preempt: bool = False) -> None:
        for key, value in (("quantum", quantum), ("num_levels", num_levels)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"scheduler.{key} must be an integer >= 1, got {value!r}")
        self.quantum = quantum
        self.num_levels = num_levels
        self.preempt = preempt
        self.served: dict[str, int] = {}   # tokens computed per request (survives preemption)

    def level(self, request: Request) -> int:
        service = max(self.served.get(request.request_id, 0), request.num_prompt_tokens)
        return min(self.num_levels - 1, int(math.log2(1 + service / self.quantum)))

    def priority(self, request: Request, now: float):
        return (self.level(request), request.arrival_time)

    def on_step(self, scheduled: Sequence[tuple[Request, int]], now: float) -> None:
        for request, num_tokens in scheduled:
            self.served[request.request_id] = self.served.get(request.request_id, 0) + num_tokens

    def on_finish(self, request: Request, now: float) -> None:
        self.served.pop(request.request_id, None)

    def preempt_for(self, waiting: Request, running: Sequence[Request], now: float) -> Request | None:
        if not self.preempt or not running:
            return None
        victim = max(running, key=lambda r: (self.level(r), r.arrival_time))
        return victim if self.level(victim) > self.level(waiting) else None
