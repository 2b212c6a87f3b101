"""Uniformly random among the live replicas (seeded, so a run reproduces)."""

from __future__ import annotations

import random as _random
from typing import Sequence

from nanovllm import ReplicaView, Request, Router, live_replicas, register_router


@register_router("random")
class RandomRouter(Router):
    def __init__(self, seed: int = 0) -> None:
        self._rng = _random.Random(seed)

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return self._rng.choice(live_replicas(replicas)).index
