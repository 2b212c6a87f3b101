"""Shortest job first, with the job's length known up front (an oracle bound: prompt + ``max_tokens``).

Classic SJF minimises mean latency when lengths are known; real systems predict them (e.g. learned length
predictors), so treat this as the upper bound such a predictor can reach."""

from __future__ import annotations

from nanovllm import Policy, Request, register_policy


@register_policy("sjf")
class ShortestJobFirst(Policy):
    """Admit the request with the least remaining work first: uncomputed prompt tokens plus tokens still to
    generate. Ties by arrival. Under memory pressure the longest remaining job is preempted."""

    def priority(self, request: Request, now: float):
        remaining_output = request.max_tokens - request.num_output_tokens
        remaining_prompt = max(request.num_prompt_tokens - request.num_computed_tokens, 0)
        return (remaining_prompt + remaining_output, request.arrival_time)
