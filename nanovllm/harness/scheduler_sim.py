"""A model-free driver of the real ``Scheduler`` with a real policy and allocator, stepped as the engine would
step it, on a clock counted in engine steps or in tokens (never wall time). The policy-effect tests and the
policy-library study (``experiments/policy_library.py``) use it: scheduling and memory decisions are exactly
the engine's, only the model is absent (every sampled token is the same id).

``clock="steps"``: each step lasts 1. ``clock="tokens"``: a step lasts ``step_overhead`` plus the tokens it
computes, the first-order cost of a step on any hardware (a long prefill is a long step), so inter-token
latency reflects what a step-count alone would hide; ``time_per_token`` scales it to seconds (e.g. 0.001 with
``step_overhead=16``: a machine computing 1,000 tokens/s with 16 ms of fixed cost per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from nanovllm import ALLOCATORS, POLICIES, Request, SamplingParams
from nanovllm.engine.scheduler import Scheduler


def make_request(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0, **fields) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=arrival,
                   **fields)


@dataclass
class SimResult:
    requests: list[Request]
    num_steps: int
    scheduler: Scheduler
    scheduled_tokens: dict[str, list[tuple[float, int]]] = field(default_factory=dict)  # rid -> (time, tokens)

    def by_id(self) -> dict[str, Request]:
        return {r.request_id: r for r in self.requests}

    def done(self) -> list[Request]:
        return [r for r in self.requests if r.error is None]

    def ttft(self) -> list[float]:
        return [r.first_token_time - r.arrival_time for r in self.done()]

    def e2e(self) -> list[float]:
        return [r.finish_time - r.arrival_time for r in self.done()]

    def queue_waits(self) -> list[float]:
        return [r.first_scheduled_time - r.arrival_time for r in self.done()]

    def itl(self) -> list[float]:
        return [b - a for r in self.done() for a, b in zip(r.token_times, r.token_times[1:])]

    def hit_rate(self) -> float:
        done = self.done()
        return sum(r.num_cached_tokens for r in done) / sum(r.num_prompt_tokens for r in done)


def simulate(policy, requests: list[Request], allocator="paged", num_blocks: int = 256, block_size: int = 8,
             max_num_seqs: int = 4, max_num_batched_tokens: int = 2048, clock: str = "steps",
             step_overhead: int = 16, time_per_token: float = 1.0, max_steps: int = 100_000) -> SimResult:
    """Serve ``requests`` (arrival times on the chosen clock) until every one has ended; returns them."""
    scheduler = Scheduler(POLICIES.build(policy), ALLOCATORS.build(allocator, num_blocks, block_size),
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    result = SimResult(requests, 0, scheduler)
    now = 0.0
    for step in range(max_steps):
        while pending and pending[0].arrival_time <= now:
            scheduler.add(pending.pop(0), now)
        if not scheduler.has_unfinished():
            if not pending:
                result.num_steps = step
                return result
            now = pending[0].arrival_time
            continue
        out = scheduler.schedule(now)
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        for request, n in out.scheduled:
            result.scheduled_tokens.setdefault(request.request_id, []).append((now, n))
        now += 1.0 if clock == "steps" else (step_overhead + out.num_tokens) * time_per_token
        tokens = [7 if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled]
        scheduler.update_from_output(out, tokens, now, max_model_len=10**9)
    raise AssertionError("the simulation did not finish")


def mean(values) -> float:
    return float(np.mean(values))


def p99(values) -> float:
    return float(np.percentile(values, 99))
