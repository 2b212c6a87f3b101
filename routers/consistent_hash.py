"""Consistent hashing (Karger et al. 1997): the request's key is hashed onto a ring of virtual nodes, each
replica owning ``virtual_nodes`` points; the request goes to the owner of the first point at or after its
hash. The same key always lands on the same replica (so a conversation's turns, or a shared prompt prefix,
find their KV cache there), and a dead replica's keys move to their ring successors while every other key
stays put.

``key="session"`` hashes ``request.session_id`` (requests without one fall back to their prefix);
``key="prefix"`` hashes the first ``prefix_tokens`` prompt tokens."""

from __future__ import annotations

import bisect
import hashlib
from typing import Sequence

from nanovllm import ReplicaView, Request, Router, register_router

KEYS = ("session", "prefix")


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process and run (Python's ``hash`` of a str is salted)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@register_router("consistent_hash")
class ConsistentHash(Router):
    def __init__(self, key: str = "session", prefix_tokens: int = 64, virtual_nodes: int = 64) -> None:
        if key not in KEYS:
            raise ValueError(f"router.key must be one of {', '.join(KEYS)}, got {key!r}")
        if not isinstance(prefix_tokens, int) or prefix_tokens < 1:
            raise ValueError(f"router.prefix_tokens must be an integer >= 1, got {prefix_tokens!r}")
        if not isinstance(virtual_nodes, int) or virtual_nodes < 1:
            raise ValueError(f"router.virtual_nodes must be an integer >= 1, got {virtual_nodes!r}")
        self.key = key
        self.prefix_tokens = prefix_tokens
        self.virtual_nodes = virtual_nodes
        self._ring: list[tuple[int, int]] = []   # (point, replica index), sorted by point
        self._points: list[int] = []

    def key_of(self, request: Request) -> str:
        if self.key == "session" and request.session_id is not None:
            return f"session:{request.session_id}"
        return "prefix:" + ",".join(map(str, request.prompt_token_ids[:self.prefix_tokens]))

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        if len(self._ring) != len(replicas) * self.virtual_nodes:
            self._build_ring(len(replicas))
        start = bisect.bisect_left(self._points, stable_hash(self.key_of(request)))
        for offset in range(len(self._ring)):  # the first live owner clockwise
            index = self._ring[(start + offset) % len(self._ring)][1]
            if replicas[index].alive:
                return index
        return self._ring[start % len(self._ring)][1]  # none alive: the cluster reports it

    def _build_ring(self, num_replicas: int) -> None:
        self._ring = sorted((stable_hash(f"replica:{index}:{node}"), index)
                            for index in range(num_replicas) for node in range(self.virtual_nodes))
        self._points = [point for point, _ in self._ring]
