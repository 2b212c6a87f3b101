"""Fair share across clients with the Virtual Token Counter (VTC; Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024).

Each client has a counter of the service it received: prompt tokens weighted by ``input_weight`` and generated
tokens by ``output_weight``. Requests of the least-served client go first. A client that comes back after
being idle has its counter lifted to the smallest counter among active clients, so idleness cannot be banked
as credit.

Counters change at every step, so the waiting queue is re-sorted at every step (``waiting_key = "dynamic"``:
exact, O(n log n) per step). ``waiting_window=W`` bounds that cost: only the W longest-waiting requests are
ranked by counter each step, the rest wait behind them in arrival order (an approximation: exact while at most W
wait; O(W log n) per step)."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Sequence

from nanovllm import Policy, Request, register_policy


@register_policy("fair")
class VirtualTokenCounter(Policy):
    waiting_key = "dynamic"   # every step's service moves the counters

    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0,
                 waiting_window: int | None = None) -> None:
        for key, weight in (("input_weight", input_weight), ("output_weight", output_weight)):
            # A negative weight would make a client's counter fall as it is served: it would never give way.
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
                raise ValueError(f"scheduler.{key} must be a finite number >= 0, got {weight!r}")
        if waiting_window is not None and (isinstance(waiting_window, bool) or not isinstance(waiting_window, int)
                                           or waiting_window < 1):
            raise ValueError(f"scheduler.waiting_window must be an integer >= 1 or null, got {waiting_window!r}")
        self.waiting_window = waiting_window
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = defaultdict(float)
        self.active: dict[str, int] = defaultdict(int)   # unfinished requests per client

    @staticmethod
    def _client(request: Request) -> str:
        return request.client_id or "default"

    def priority(self, request: Request, now: float):
        return (self.counters[self._client(request)], request.arrival_time)

    def on_arrival(self, request: Request, now: float) -> None:
        client = self._client(request)
        if self.active[client] == 0:
            active = [self.counters[c] for c, n in self.active.items() if n > 0]
            if active:
                self.counters[client] = max(self.counters[client], min(active))
        self.active[client] += 1

    def on_step(self, scheduled: Sequence[tuple[Request, int]], now: float) -> None:
        for request, num_tokens in scheduled:
            # After the step, a decode has computed a token beyond the prompt; prompt chunks have not.
            is_decode = num_tokens == 1 and request.num_computed_tokens > request.num_prompt_tokens
            weight = self.output_weight if is_decode else self.input_weight
            self.counters[self._client(request)] += weight * num_tokens

    def on_finish(self, request: Request, now: float) -> None:
        self.active[self._client(request)] -= 1
