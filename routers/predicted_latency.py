"""Predicted-latency routing (as llm-d's predicted-latency scheduler): predict the request's TTFT on every live
replica with the cluster's step-time model and pick the smallest.

The prediction: the replica must first compute the prefill tokens queued ahead of the request plus the
prompt tokens its prefix cache does not hold, in steps of at most ``max_num_batched_tokens`` prompt tokens
beside its running decodes; each such step takes what the step-time model says for that batch, and a
replica whose batch is full (``max_num_seqs`` running) adds one more step's wait for a free seat. The
step-time model is the simulator's for simulated replicas (the very model that times their steps) and this
machine's calibrated profile for real ones (``Router.bind_step_time``)."""

from __future__ import annotations

import math
from typing import Sequence

from nanovllm import ReplicaView, Request, Router, RouterError, live_replicas, register_router


@register_router("predicted_latency")
class PredictedLatency(Router):
    def predict_ttft(self, request: Request, view: ReplicaView) -> float:
        """Seconds until ``request``'s first token on the replica ``view`` describes."""
        if self.step_time is None:
            raise RouterError("router 'predicted_latency' needs a step-time model; the cluster binds one "
                              "(Router.bind_step_time) before the first request")
        queued_prefill = max(0, view.num_queued_tokens - view.num_decoding)
        new_prefill = request.num_prompt_tokens - min(view.prefix_match_tokens, request.num_prompt_tokens - 1)
        pending = queued_prefill + new_prefill
        steps = max(1, math.ceil(pending / view.max_num_batched_tokens))
        chunk = min(pending, view.max_num_batched_tokens)
        step = self.step_time({
            "num_prefill_tokens": chunk, "num_prefill_seqs": 1, "num_decode_tokens": view.num_decoding,
            "num_decode_seqs": view.num_decoding, "num_sampled": view.num_decoding + 1,
            "context_tokens": chunk + view.num_decoding, "attn_pairs": chunk * (chunk + 1) // 2 + view.num_decoding,
        })
        seat_wait = step if view.num_running >= view.max_num_seqs else 0.0
        return steps * step + seat_wait

    def route(self, request: Request, replicas: Sequence[ReplicaView], now: float) -> int:
        return min(live_replicas(replicas),
                   key=lambda view: (self.predict_ttft(request, view), view.index)).index
