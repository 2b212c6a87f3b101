"""Round robin: each request to the next live replica in turn, whatever their load or caches hold."""

from __future__ import annotations

from typing import Sequence

from nanovllm import ReplicaView, Request, Router, register_router


@register_router("round_robin")
class RoundRobin(Router):
    def __init__(self) -> None:
        self._next = 0

    def upcoming_routes(self, count: int, num_replicas: int) -> list[int]:
        return [(self._next + k) % num_replicas for k in range(count)]

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        for offset in range(len(replicas)):  # skip dead replicas, keeping the cycle's order
            index = (self._next + offset) % len(replicas)
            if replicas[index].alive:
                self._next = index + 1
                return index
        return self._next % len(replicas)  # none alive: the cluster reports it
