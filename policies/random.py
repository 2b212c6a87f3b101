"""Random order, the baseline SGLang ships (``--schedule-policy random``): each request draws a random rank
when it arrives, from a generator seeded by ``seed``, so a run is reproducible. Waiting requests are admitted
in rank order; under memory pressure the running request with the largest rank gives way."""

from __future__ import annotations

import random

from nanovllm import Policy, Request, register_policy


@register_policy("random")
class RandomOrder(Policy):
    waiting_key = "static"   # a request's rank is drawn once, when it arrives, and kept until it finishes

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)
        self._rank: dict[str, float] = {}

    def _rank_of(self, request: Request) -> float:
        if request.request_id not in self._rank:
            self._rank[request.request_id] = self._rng.random()
        return self._rank[request.request_id]

    def on_arrival(self, request: Request, now: float) -> None:
        self._rank_of(request)

    def priority(self, request: Request, now: float):
        return (self._rank_of(request), request.arrival_time)

    def on_finish(self, request: Request, now: float) -> None:
        self._rank.pop(request.request_id, None)
