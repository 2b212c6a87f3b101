"""What ``LLM.generate`` returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    """When things happened to one request (``time.perf_counter`` seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int


@dataclass(frozen=True)
class Logprob:
    """One candidate token's log-probability under the model and its rank (1 = most likely), as in vLLM."""

    logprob: float
    rank: int


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]             # generated ids; ends with the EOS id when generation stopped on it
    finish_reason: str | None        # "stop" or "length"
    metrics: RequestMetrics
    # With SamplingParams(logprobs=k): per generated token, {token id: Logprob} for the top k and the chosen one.
    logprobs: list[dict[int, Logprob]] | None = None
