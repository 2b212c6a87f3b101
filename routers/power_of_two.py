"""Power of two choices (Mitzenmacher 2001): sample two live replicas at random and send the request to the
less loaded of them (``metric`` as for ``least_loaded``). Nearly the balance of ``least_loaded`` while looking
at two replicas only, which is what lets it scale to large clusters with stale load information."""

from __future__ import annotations

import random as _random
from typing import Sequence

from nanovllm import ReplicaView, Request, Router, live_replicas, register_router
from routers.least_loaded import check_metric, load_of


@register_router("power_of_two")
class PowerOfTwo(Router):
    def __init__(self, metric: str = "requests", seed: int = 0) -> None:
        self.metric = check_metric(metric)
        self._rng = _random.Random(seed)

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        alive = live_replicas(replicas)
        pair = self._rng.sample(alive, 2) if len(alive) > 1 else alive
        return min(pair, key=lambda view: (load_of(view, self.metric), view.index)).index
