"""KV-cost routing, after NVIDIA Dynamo's KV router: each live replica's cost of taking the request is

    overlap_weight * prefill_blocks + decode_blocks

where ``prefill_blocks`` are the KV blocks it would still have to prefill -- its queued prefill work plus this
prompt's blocks its prefix cache does not hold -- and ``decode_blocks`` the blocks its running requests occupy
plus this request's; the cheapest replica wins (ties: the lowest index). A larger ``overlap_weight`` favours
cache hits (TTFT); a smaller one favours spreading decode work (ITL)."""

from __future__ import annotations

import math
from typing import Sequence

from nanovllm import ReplicaView, Request, Router, live_replicas, register_router


@register_router("kv_cost")
class KVCost(Router):
    def __init__(self, overlap_weight: float = 1.0) -> None:
        if not overlap_weight >= 0:
            raise ValueError(f"router.overlap_weight must be >= 0, got {overlap_weight!r}")
        self.overlap_weight = overlap_weight

    def cost(self, request: Request, view: ReplicaView) -> float:
        queued_prefill = max(0, view.num_queued_tokens - view.num_decoding)   # a decode queues one token
        new_prefill = request.num_prompt_tokens - min(view.prefix_match_tokens, request.num_prompt_tokens)
        prefill_blocks = (queued_prefill + new_prefill) / view.block_size
        decode_blocks = view.num_used_blocks + math.ceil(request.num_prompt_tokens / view.block_size)
        return self.overlap_weight * prefill_blocks + decode_blocks

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(live_replicas(replicas), key=lambda view: (self.cost(request, view), view.index)).index
