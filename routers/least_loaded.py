"""Least loaded: the live replica with the fewest outstanding requests (``metric="requests"``: running plus
waiting) or the fewest tokens queued (``metric="tokens"``: tokens of its unfinished requests not computed
yet); ties go to the lowest index."""

from __future__ import annotations

from typing import Sequence

from nanovllm import ReplicaView, Request, Router, live_replicas, register_router

METRICS = ("requests", "tokens")


def load_of(view: ReplicaView, metric: str) -> int:
    """A replica's load by ``metric`` (one of ``METRICS``)."""
    return view.num_outstanding if metric == "requests" else view.num_queued_tokens


def check_metric(metric: str) -> str:
    if metric not in METRICS:
        raise ValueError(f"router.metric must be one of {', '.join(METRICS)}, got {metric!r}")
    return metric


@register_router("least_loaded")
class LeastLoaded(Router):
    def __init__(self, metric: str = "requests") -> None:
        self.metric = check_metric(metric)

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(live_replicas(replicas), key=lambda view: (load_of(view, self.metric), view.index)).index
